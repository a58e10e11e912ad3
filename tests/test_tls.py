"""The whole job over mutual TLS (fedq/provision.py; docs/deploy.md, "TLS").

``fedq provision`` makes a CA, the server's certificate and one client certificate per
party; a redis-server of the test's own listens on TLS only and asks every client for
a certificate from that CA (``--tls-auth-clients yes``). The coordinator's services,
``fedq worker add`` / ``join`` and a real worker all speak ``rediss://`` with their own
certificates, and a job completes. A plaintext client and a TLS client without a
certificate are refused.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedq.testing.cluster import DIGITS, Cluster, record
from tests.test_identity import _join, _joined_worker

PASSWORD = "tls-admin-password-for-tests"
SPEC = {**DIGITS, "num_clients": 4, "clients_per_round": 2, "rounds": 2, "min_clients": 2}


def _url(port: int, party: Path, password: str = PASSWORD, host: str = "127.0.0.1") -> str:
    return (f"rediss://:{password}@{host}:{port}/0?ssl_cert_reqs=required"
            f"&ssl_ca_certs={party / 'ca.crt'}&ssl_certfile={party / 'client.crt'}"
            f"&ssl_keyfile={party / 'client.key'}")


@contextlib.contextmanager
def _tls_server(tmp_path: Path, hosts: list[str]) -> Iterator[tuple[Path, int]]:
    """(the provisioned folder, the TLS port) of a redis-server on ``hosts`` (its
    certificate names each) that takes only TLS clients with a certificate from the
    folder's CA."""
    from tests.conftest import free_port, missing

    certs = tmp_path / "pki"
    subprocess.run([sys.executable, "-m", "fedq.cli", "provision", str(certs),
                    *(a for h in hosts for a in ("--host", h)), "--worker", "w1"],
                   check=True, capture_output=True, timeout=60)
    server = shutil.which("redis-server")
    if server is None:
        missing("redis-server", "binary not found")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", "0", "--tls-port", str(port), "--bind", *hosts, "--save", "",
         "--appendonly", "no", "--requirepass", PASSWORD,
         "--tls-cert-file", str(certs / "server" / "server.crt"),
         "--tls-key-file", str(certs / "server" / "server.key"),
         "--tls-ca-cert-file", str(certs / "server" / "ca.crt"), "--tls-auth-clients", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis.from_url(_url(port, certs / "coordinator"))
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.RedisError:
            time.sleep(0.05)
    try:
        yield certs, port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    with _tls_server(tmp_path, ["127.0.0.1"]) as found:
        yield found


@pytest.mark.slow
def test_a_job_runs_over_mutual_tls(tmp_path: Path, tls_redis: tuple[Path, int],
                                    pg_url: str) -> None:
    import redis

    from tests.conftest import migrated_cluster

    certs, port = tls_redis
    coordinator = _url(port, certs / "coordinator")
    cluster: Cluster = migrated_cluster(tmp_path, coordinator, coordinator, pg_url)
    cluster.env.update(FEDQ_IDENTITY="required", FEDQ_KEYS_DIR=str(tmp_path / "coord"),
                       FEDQ_BLOB_URL=coordinator)
    try:
        cluster.start(control=["control"])
        cluster.start_beat()
        worker_url = _url(port, certs / "workers" / "w1", password="replaced")
        cluster.fedq("worker", "add", "w1", "--queues", "cpu", "--out",
                     str(tmp_path / "w1.bundle"), "--broker-url", worker_url,
                     "--result-backend", worker_url, "--blob-url", worker_url)
        services = json.loads((tmp_path / "w1.bundle").read_text())["services"]
        assert all(v.startswith("rediss://fedq-w-w1:") and "workers/w1/client.key" in v
                   for v in services.values()), services
        _join(cluster, "w1", tmp_path / "w1.bundle")
        cluster.add("w1", ["cpu"], **_joined_worker(cluster, "w1"))
        job = cluster.submit({**SPEC, "name": "tls"})
        assert cluster.wait(job).status == "completed"
        rows = [u for u in cluster.updates(job) if u.status == "ok"]
        assert len(rows) == 4 and {u.signer for u in rows} == {"w1"}
        record("security", scenario="tls: a job", did="control worker, beat, join and a "
               "worker over rediss:// with client certificates", fedq="completed",
               guard="fedq provision; redis --tls-auth-clients yes",
               outcome="4 of 4 updates signed by w1")
    finally:
        cluster.stop()

    # refused: a plaintext client, and a TLS client with no certificate of this CA
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=3,
                    socket_timeout=3).ping()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required"
                             f"&ssl_ca_certs={certs / 'ca.crt'}", socket_timeout=3).ping()
    for did in ("a plaintext client (with the password)",
                "a TLS client with the password but no client certificate"):
        record("security", scenario="tls: " + did.split(" (")[0].split(" with")[0], did=did,
               fedq="connection refused by Redis", guard="redis --tls-auth-clients yes",
               outcome="no command ran")


@pytest.mark.slow
def test_a_worker_on_another_host_joins_and_trains_over_tls(tmp_path: Path,
                                                            pg_url: str) -> None:
    """docs/deploy.md's two commands across machines: the coordinator (control worker,
    beat, `fedq worker add`) on this host, and in a network namespace of its own (a
    second machine with its own address, fedq/testing/wan/) `fedq worker join` and
    the worker, which reach Redis only at the coordinator's address over the link,
    with TLS and their own certificate, user and key. A job completes on it."""
    import redis

    from fedq.testing.procs import WorkerProcess, start_workers
    from fedq.testing.wan import Host, Profile, have_netns
    from tests.conftest import migrated_cluster, missing

    why = have_netns()
    if why:
        missing("network namespaces + tbf", why)
    machine = Host("tls", Profile("lan", down_mbit=200, up_mbit=200, rtt_ms=0)).create()
    cluster: Cluster | None = None
    try:
        with _tls_server(tmp_path, ["127.0.0.1", machine.root_ip]) as (certs, port):
            coordinator = _url(port, certs / "coordinator")
            cluster = migrated_cluster(tmp_path, coordinator, coordinator, pg_url)
            cluster.env.update(FEDQ_IDENTITY="required", FEDQ_KEYS_DIR=str(tmp_path / "coord"),
                               FEDQ_BLOB_URL=coordinator)
            cluster.start(control=["control"])
            cluster.start_beat()
            # the worker's certificate travels with its bundle; its URLs name the
            # coordinator's address on the link
            remote = _url(port, certs / "workers" / "w1", password="replaced",
                          host=machine.root_ip)
            cluster.fedq("worker", "add", "w1", "--queues", "cpu", "--out",
                         str(tmp_path / "w1.bundle"), "--broker-url", remote,
                         "--result-backend", remote, "--blob-url", remote)
            away = {**cluster.env, "FEDQ_KEYS_DIR": str(tmp_path / "w1"), "FEDQ_IDENTITY": "",
                    "FEDQ_BROKER_URL": "", "FEDQ_RESULT_BACKEND": "", "FEDQ_BLOB_URL": "",
                    "FEDQ_DATABASE_URL": ""}
            joined = subprocess.run(
                [*machine.exec_prefix(), sys.executable, "-m", "fedq.cli", "worker", "join",
                 str(tmp_path / "w1.bundle"), "--timeout", "30"], env=away,
                capture_output=True, text=True, timeout=120, check=False)
            assert joined.returncode == 0 and "joined as w1" in joined.stdout, \
                joined.stdout + joined.stderr
            worker = WorkerProcess("w1@tls", ["cpu"], tmp_path / "logs" / "w1.log", env=away,
                                   prefix=machine.exec_prefix())
            cluster.workers.append(worker)
            start_workers([worker])
            before = machine.bytes()
            job = cluster.submit({**SPEC, "name": "tls-host"})
            view = cluster.wait(job)
            assert view.status == "completed", f"{view.error}\n{worker.tail(30)}"
            rows = [u for u in cluster.updates(job) if u.status == "ok"]
            assert len(rows) == 4 and {u.signer for u in rows} == {"w1"}
            assert all(u.worker == "w1@tls" for u in rows)
            down, up = (now - then for now, then in zip(machine.bytes(), before, strict=True))
            assert down > 100_000 and up > 100_000, (down, up)  # it crossed the link
            admin = redis.Redis.from_url(coordinator)
            peers = {c["addr"].rsplit(":", 1)[0] for c in admin.client_list()
                     if c.get("user") == "fedq-w-w1"}
            assert peers == {machine.ip}, peers  # its own user, from its own address
            record("security", scenario="tls: a worker on another host",
                   did="`fedq worker add` here, `fedq worker join` and the worker in a "
                       "network namespace of their own, over rediss:// with client "
                       "certificates", fedq="completed",
                   guard="fedq provision; its Redis user; its key",
                   outcome="4 of 4 updates signed by w1, from the other address only")
    finally:
        if cluster is not None:
            cluster.stop()
        machine.destroy()
