"""A hostile worker never stops a job (docs/security.md).

One real ``celery worker`` runs tests/hostile (fedq's app with one attack per job,
chosen by the job's name) on the ``gpu_new`` queue beside two honest ``cpu`` workers,
a control worker and beat, on Redis + PostgreSQL and on the embedded default. Every
attack job has one of its three clients per round on the hostile worker; an honest
job runs beside them. For each attack: the job completes, the hostile update is
``rejected`` with a reason naming the check, the honest updates are averaged, no other
job is disturbed, and the control worker's peak memory stays under ``MEMORY_BOUND``.
Each scenario records a row of docs/security.md's table (``python -m bench.security``).

Each scenario names the line whose removal makes it fail.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from fedq.coordinator.jobs import JobView
from fedq.db import ClientUpdate, Round, upgrade
from fedq.testing.cluster import DIGITS, Cluster, base_env, record

#: The control worker's peak resident memory while it reads every attack (a 2 GiB
#: zstd bomb among them); torch and the digits model alone take about 400 MB.
MEMORY_BOUND = 1 << 30


@dataclass(frozen=True)
class Scenario:
    did: str  # what the hostile worker did
    status: str  # what its update's row must say
    reason: str | None  # text its row's error must contain
    guard: str  # the check that catches it (delete it and the test fails)
    rounds: tuple[int, ...] = (1,)  # rounds checked (the job runs max(rounds) rounds)


SCENARIOS: dict[str, Scenario] = {
    "int8_chunk0": Scenario("an int8 update whose metadata says `fedq.chunk: 0`", "rejected",
                            "codec: int8 chunk '0'",
                            "compression.decode: the chunk check"),
    "int8_length": Scenario("an int8 update one quantized value short", "rejected",
                            "int8 values for a tensor of shape",
                            "compression.dequantize_int8: the length check"),
    "zstd_garbage": Scenario("zstd's magic number, then garbage", "rejected",
                             "zstd: damaged frame",
                             "compression.maybe_decompress: ZstdError caught"),
    "zstd_bomb": Scenario("a 64 KiB zstd frame that expands to 2 GiB", "rejected",
                          "decompresses to more than",
                          "compression.maybe_decompress: the streaming limit"),
    "oversize": Scenario("its update padded with 32 MiB", "rejected", "not read",
                         "BlobStore.get: the size check before the read"),
    "nan": Scenario("a NaN in its update", "rejected", "non-finite values",
                    "aggregate/verify.check_update"),
    "huge_norm": Scenario("its update times 1e6 (max_update_norm 1000)", "rejected",
                          "exceeds max_update_norm", "aggregate/verify.check_update"),
    "samples": Scenario("`samples: 1000000000` (FedAvg weight)", "rejected",
                        "weight: reports 1000000000 samples",
                        "intake._beyond: samples above the shard size"),
    "other_client": Scenario("a result naming another client", "rejected",
                             "identity: the result names client",
                             "intake.admit: the identity loop"),
    "finished_round": Scenario("a result naming the round before", "rejected",
                               "identity: the result names round",
                               "intake.admit: the identity loop"),
    "replay": Scenario("its result points at another client's update of the round before",
                       "rejected", "key: the update is at",
                       "intake.admit: the key check", rounds=(2,)),  # round 1 is honest
    "version": Scenario("a result in message format 999 (another fedq)", "rejected",
                        "version: worker", "intake.admit: the format check"),
    "malformed": Scenario("`bytes_up: -1`, `gpu_util: 1e9`", "rejected",
                          "malformed result: bytes_up",
                          "training.UpdateRef: the field bounds"),
    "huge_result": Scenario("a result of 16 MiB (its error text padded)", "rejected",
                            "bytes in the result backend, more than",
                            "engine.backend.task_metas: the bound on a state's size"),
    "undecodable": Scenario("its own task's final state replaced by one Celery cannot "
                            "decode (round r: the r-th of six forms: not JSON, a list, no "
                            "status, nested 100,000 deep, a bad kombu marker, an exception "
                            "naming os.system)", "rejected", "the stored state does not decode",
                            "engine.backend.decode_state: the guard around decode_result",
                            rounds=(1, 2, 3, 4, 5, 6)),
    "never_sent": Scenario("planted results for tasks never sent (attempt 2 of every "
                           "client) and rang finalize with made-up results", "ok", None,
                           "finalize.collect: results read by the task ids sent, "
                           "the doorbell's arguments never"),
}


@dataclass
class Run:
    backend: str
    cluster: Cluster
    jobs: dict[str, JobView]
    ids: dict[str, str]
    control_peak: int  # bytes
    crafted: list[tuple[str, dict[str, Any]]]  # (what was crafted, the worker's result)
    leaks: list[str]  # where the password was found


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module", params=["redis+postgresql", "embedded"])
def attacked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Run]:
    """Every attack job, an honest one and one with a worker whose blob store is
    unreachable, run to the end on one cluster. On Redis + PostgreSQL every URL holds
    the password (a redis-server of its own with ``requirepass``); on the embedded
    default only the broken worker's blob store URL does."""
    home = tmp_path_factory.mktemp(f"security-{request.param.replace('+', '-')}")
    if request.param == "embedded":
        yield from _run(request.param, home, base_env(home))
        return
    from tests.conftest import pg_database

    with protected_redis(home) as redis_url, pg_database() as admin_url:
        # trust authentication ignores the password, but every URL carries it
        pg_url = admin_url.replace("postgres@", f"postgres:{quote(SECRET)}@")
        url = f"{redis_url}/0"
        env = base_env(home, FEDQ_BROKER_URL=url, FEDQ_RESULT_BACKEND=url,
                       FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=url)
        yield from _run(request.param, home, env)


#: The password of every URL (its '@' is what the old redact() missed).
SECRET = "Hunter2@pw"
MARK = "Hunter2"


@contextmanager
def protected_redis(folder: Path) -> Iterator[str]:
    """A redis-server of its own with ``requirepass SECRET``; yields its URL (no db)."""
    import redis

    from tests.conftest import free_port, missing

    port = free_port()
    try:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--requirepass", SECRET, "--dir", str(folder)],
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
        client.close()
        proc.terminate()
        proc.wait(10)


def _run(backend: str, home: Path, env: dict[str, str]) -> Iterator[Run]:
    env = {**env, "FEDQ_WATCHDOG_INTERVAL": "3"}
    cluster = Cluster(home, env)
    upgrade(cluster.settings.database_url)
    hostile = cluster.worker("hostile", ["gpu_new"])
    hostile.app = "tests.hostile"
    # a worker whose blob store is unreachable: its errors name the store's URL
    broken = cluster.worker("broken", ["gpu_sm61"],
                            FEDQ_BLOB_URL=f"redis://:{SECRET}@127.0.0.1:1/0")
    from fedq.testing.procs import start_workers

    start_workers([hostile, broken])
    cluster.workers += [hostile, broken]
    cluster.start(control=["control"], honest1=["cpu"], honest2=["cpu"])
    cluster.start_beat()
    try:
        base = {**DIGITS, "rounds": 1, "clients_per_round": 3, "min_clients": 2,
                "queues": {"cpu": 2, "gpu_new": 1}, "round_timeout_s": 120,
                "max_update_norm": 1000.0}
        specs = [{**base, "name": "honest"},
                 {**base, "name": "secrets", "queues": {"cpu": 2, "gpu_sm61": 1}}] + [
            {**base, "name": f"attack-{name}", "rounds": max(sc.rounds)}
            for name, sc in SCENARIOS.items()]
        ids = dict(zip([s["name"] for s in specs], cluster.submit_many(specs), strict=True))
        jobs = {name: cluster.wait(job, timeout=600) for name, job in ids.items()}
        control = cluster.by_name("control")
        assert control.proc is not None
        peak = _peak_rss(control.proc.pid)
        crafted = _send_crafted(cluster, ids["honest"])
        outputs = [cluster.fedq(*args) for args in (
            ("results", ids["secrets"]), ("results", ids["secrets"], "--json"), ("status",),
            ("workers",), ("status", ids["secrets"], "--json"))]
        cluster.stop()
        leaks = _search(cluster, [o.stdout + o.stderr for o in outputs])
        yield Run(backend, cluster, jobs, ids, peak, crafted, leaks)
    finally:
        cluster.stop()


def _search(cluster: Cluster, outputs: list[str]) -> list[str]:
    """Every place the password shows: tables, log files, the result backend (Redis
    values or the embedded default's result files), CLI output."""
    from sqlalchemy import create_engine, inspect, text

    found: list[str] = []
    engine = create_engine(cluster.settings.database_url)
    with engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                if MARK in str(tuple(row)):
                    found.append(f"table {table}: {str(tuple(row))[:200]}")
    engine.dispose()
    files = [*(cluster.home / "logs").iterdir()]
    backend = cluster.settings.result_backend
    if backend.startswith("redis://"):
        found += _search_redis(backend)
    else:
        files += [p for p in (cluster.settings.home / "results").rglob("*") if p.is_file()]
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            if MARK in line:
                found.append(f"file {path.name}: {line[:200]}")
    found += [f"CLI output: {line}" for out in outputs for line in out.splitlines()
              if MARK in line]
    return found


def _search_redis(url: str) -> list[str]:
    import redis

    found = []
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(count=1000):
        if key.startswith(b"fedq:blob:"):
            continue  # weights, not text
        kind = client.type(key)
        value = client.get(key) if kind == b"string" else str(
            client.lrange(key, 0, -1) if kind == b"list" else
            client.hgetall(key) if kind == b"hash" else "").encode()
        if value and MARK.encode() in value:
            found.append(f"redis {key!r}: {value[:200]!r}")
    client.close()
    return found


#: Tasks a compromised broker (or coordinator) could send: each names a path outside
#: the worker's folders through a field fedq builds a path or a key from.
CRAFTED = {
    "job id": {"job": "../../../../tmp/fedq-evil"},
    "model sha256": {"model": {"key": "{key}", "sha256": "../../../../tmp/fedq-evil",
                               "size": 10}},
    "model key": {"model": {"key": "jobs/other/../../etc/passwd", "sha256": "0" * 64,
                            "size": 10}},
}


def _send_crafted(cluster: Cluster, job: str) -> list[tuple[str, dict[str, Any]]]:
    """Send an honest worker tasks with a path-traversal in one field each; their
    results. A well-formed task of the finished honest job is the base."""
    from fedq.blobs import BlobRef, global_key
    from fedq.engine.names import TRAIN_TASK
    from fedq.protocol.training import TrainRef
    from fedq.spec import parse_spec

    spec = parse_spec({**DIGITS, "rounds": 1, "clients_per_round": 3})
    base = TrainRef(job, 2, 0, "cpu", spec.to_json(),
                    BlobRef(global_key(job, 1), "0" * 64, 10)).to_json()
    app = cluster.client_app()
    out = []
    for what, change in CRAFTED.items():
        task = {**base, **change}
        if "model" in change and change["model"]["key"] == "{key}":
            task["model"] = {**change["model"], "key": global_key(job, 1)}
        result = app.send_task(TRAIN_TASK, args=(task,), queue="cpu").get(timeout=120)
        out.append((what, result))
    return out


def _rows(run: Run, name: str) -> list[ClientUpdate]:
    return run.cluster.updates(run.ids[name])


def _rounds(run: Run, name: str) -> list[Round]:
    return run.cluster.rounds(run.ids[name])


@pytest.mark.timeout(900)
def test_honest_job_undisturbed(attacked: Run) -> None:
    assert attacked.jobs["honest"].status == "completed", attacked.jobs["honest"].error
    rows = _rows(attacked, "honest")
    assert len(rows) == 3 and {r.status for r in rows} == {"ok"}
    assert [r.participants for r in _rounds(attacked, "honest")] == [3]


def test_crafted_tasks_build_no_path(attacked: Run) -> None:
    """Delete ``check_task(data)`` in TrainRef.from_json (fedq/protocol/training.py) and the job id
    and hash reach a path: this fails."""
    assert not Path("/tmp/fedq-evil").exists()
    for what, result in attacked.crafted:
        assert result["status"] == "error", (what, result)
        assert "malformed task" in result["error"], (what, result["error"])
    reasons = {what: r["error"] for what, r in attacked.crafted}
    assert "is not a fedq job id" in reasons["job id"]
    assert "is not a blob digest" in reasons["model sha256"]
    assert "is not a model key of job" in reasons["model key"]
    if attacked.backend == "redis+postgresql":
        for what, result in attacked.crafted:
            record("security", scenario=f"crafted task: {what}",
                   did=f"a task whose {what} walks out of the worker's folders (`../`)",
                   fedq=f"refused by the worker: {result['error'][:90]}",
                   guard="training.check_task before any path or key is built",
                   outcome="no file outside the worker's folders; an error result")


def test_no_password_anywhere(attacked: Run) -> None:
    """Make ``redact`` and ``redact_text`` (fedq/redaction.py) return their input and
    the broken worker's error rows carry the password: this fails. (Either alone is
    backed by the other: a store names itself by its redacted URL, and every error
    text is also searched for the secrets the process was configured with.)"""
    errors = [u.error or "" for u in attacked.cluster.updates(attacked.ids["secrets"])
              if u.queue == "gpu_sm61"]
    assert errors and all("blob store redis://:***@127.0.0.1:1/0" in e for e in errors), \
        errors
    assert attacked.jobs["secrets"].status == "completed"
    assert not attacked.leaks, "\n".join(attacked.leaks)
    if attacked.backend == "redis+postgresql":
        record("security", scenario="a password in every URL",
               did="its blob store unreachable: its errors name the store's URL (with the "
                   "password)",
               fedq="URLs redacted by a URL parser (a password may hold '@' or '/'); the "
                    "configured secrets masked in any error text and log line",
               guard="redaction.redact / redact_text wherever a URL reaches text",
               outcome="the password is in no table, log, result or CLI output")


def test_control_worker_memory_stays_bounded(attacked: Run) -> None:
    """Delete the limit in maybe_decompress (fedq/aggregate/compression.py) and the
    2 GiB bomb is decompressed in the control worker: this fails."""
    assert 0 < attacked.control_peak < MEMORY_BOUND, attacked.control_peak
    record("security-memory", backend=attacked.backend, peak=attacked.control_peak,
           bound=MEMORY_BOUND)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_attack(attacked: Run, name: str) -> None:
    sc = SCENARIOS[name]
    job = attacked.jobs[f"attack-{name}"]
    assert job.status == "completed", job.error
    rows = _rows(attacked, f"attack-{name}")
    hostile = [r for r in rows if r.queue == "gpu_new" and r.round_number in sc.rounds]
    honest = [r for r in rows if r.queue == "cpu"]
    assert len(hostile) == len(sc.rounds) and len(honest) == 2 * max(sc.rounds)
    assert {r.status for r in honest} == {"ok"}, [(r.status, r.error) for r in honest]
    for row in hostile:
        assert row.status == sc.status, (row.status, row.error)
        if sc.reason is not None:
            assert sc.reason in (row.error or ""), row.error
    rounds = _rounds(attacked, f"attack-{name}")
    expected = 3 if sc.status == "ok" else 2
    assert [r.participants for r in rounds if r.number in sc.rounds] == \
        [expected] * len(sc.rounds)
    if name == "samples":  # the weight stayed the shards' sizes
        for rnd in rounds:
            used = [r for r in rows if r.round_number == rnd.number and r.status == "ok"]
            assert rnd.samples == sum(r.samples for r in used) < 10_000
    if name == "never_sent":  # nothing forged reached a row
        assert not any(r.worker == "forged" or r.attempt != 1 for r in rows)
    if attacked.backend == "redis+postgresql":
        outcome = "completed" if job.status == "completed" else job.status
        record("security", scenario=name.replace("_", " "), did=sc.did,
               fedq=(f"rejected: {(hostile[0].error or '')[:90]}" if sc.status == "rejected"
                     else "ignored: no row names a forged result"),
               guard=sc.guard, outcome=f"job {outcome}, {expected} of 3 updates averaged")
