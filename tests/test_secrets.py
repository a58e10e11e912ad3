"""No password leaves in text (docs/security.md): a job on a password-protected Redis
(broker, results, blobs) and a PostgreSQL URL with a password, one of whose workers
cannot reach its blob store (its error names the store's URL). Afterwards every table,
every log file, every value in Redis and the CLI's output are searched for the
password: it is nowhere.

Make ``redact`` and ``redact_text`` (fedq/redaction.py) return their input and the
error rows carry the password: this fails. (Either alone is backed by the other: a
store names itself by its redacted URL, and every error text is also searched for
the secrets the process was configured with.)
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, inspect, text

from fedq.db import upgrade
from fedq.testing.cluster import DIGITS, Cluster, base_env, record
from tests.conftest import free_port, missing, pg_database

SECRET = "Hunter2@pw"  # '@' in a password: the old redact() missed it
MARK = "Hunter2"


@pytest.fixture
def protected_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server of its own with ``requirepass``; yields the URL without db."""
    port = free_port()
    try:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--requirepass", SECRET, "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        missing("redis-server", exc)
    url = f"redis://:{SECRET}@127.0.0.1:{port}"
    client = redis.Redis.from_url(f"{url}/0")
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.RedisError:
            time.sleep(0.05)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.timeout(600)
def test_no_password_anywhere(tmp_path: Path, protected_redis: str) -> None:
    with pg_database() as admin_url:
        # trust authentication ignores the password, but every URL carries it
        pg_url = admin_url.replace("postgres@", "postgres:Hunter2%40pg@")
        _run_and_search(tmp_path, protected_redis, pg_url)


def _run_and_search(home: Path, redis_url: str, pg_url: str) -> None:
    url = f"{redis_url}/0"
    env = base_env(home, FEDQ_BROKER_URL=url, FEDQ_RESULT_BACKEND=url, FEDQ_DATABASE_URL=pg_url,
                   FEDQ_BLOB_URL=url)
    upgrade(pg_url)
    cluster = Cluster(home, env)
    # the gpu_new worker's blob store is unreachable: its error names the store's URL
    cluster.start(control=["control"], cpu1=["cpu"])
    cluster.add("broken", ["gpu_new"], FEDQ_BLOB_URL=f"redis://:{SECRET}@127.0.0.1:1/0")
    try:
        job = cluster.submit({**DIGITS, "rounds": 1, "clients_per_round": 3, "min_clients": 2,
                              "queues": {"cpu": 2, "gpu_new": 1}, "round_timeout_s": 120})
        view = cluster.wait(job, timeout=300)
        assert view.status == "completed", view.error
        errors = [u.error or "" for u in cluster.updates(job) if u.queue == "gpu_new"]
        assert errors and all("blob store redis://:***@127.0.0.1:1/0" in e for e in errors), errors
        runs = [cluster.fedq(*args) for args in (
            ("results", job), ("results", job, "--json"), ("status",), ("workers",),
            ("status", job, "--json"))]
        outputs = [run.stdout + run.stderr for run in runs]
    finally:
        cluster.stop()
    found: list[str] = []
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                if MARK in str(tuple(row)):
                    found.append(f"table {table}: {str(tuple(row))[:200]}")
    engine.dispose()
    for log in (home / "logs").iterdir():
        for line in log.read_text(errors="replace").splitlines():
            if MARK in line:
                found.append(f"log {log.name}: {line[:200]}")
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        value = client.get(key) if kind == b"string" else \
            str(client.lrange(key, 0, -1) if kind == b"list" else client.hgetall(key)
                if kind == b"hash" else "").encode()
        if value and MARK.encode() in value and not key.startswith(b"fedq:blob:"):
            found.append(f"redis {key!r}: {value[:200]!r}")
    found += [f"CLI output: {line}" for out in outputs for line in out.splitlines()
              if MARK in line]
    assert not found, "\n".join(found)
    record("security", scenario="a password in every URL",
           did="its blob store unreachable: its errors name the store's URL",
           fedq="URLs redacted with a URL parser (a password may hold '@' or '/'); "
                "configured secrets masked in every log line",
           guard="redaction.redact / redact_text at each place a URL reaches text",
           outcome="the password is in no table, log, Redis value or CLI output")
