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

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
                          "wire.ResultModel: the field bounds"),
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


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture(scope="module", params=["redis+postgresql", "embedded"])
def attacked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[Run]:
    """Every attack job and an honest one, run to the end on one cluster."""
    home = tmp_path_factory.mktemp(f"security-{request.param.replace('+', '-')}")
    if request.param == "embedded":
        env = base_env(home)
        yield from _run(request.param, home, env)
        return
    from tests.conftest import pg_database, redis_database

    with redis_database() as redis_url, pg_database() as pg_url:
        env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                       FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=redis_url)
        yield from _run(request.param, home, env)


def _run(backend: str, home: Path, env: dict[str, str]) -> Iterator[Run]:
    env = {**env, "FEDQ_WATCHDOG_INTERVAL": "3"}
    cluster = Cluster(home, env)
    upgrade(cluster.settings.database_url)
    hostile = cluster.worker("hostile", ["gpu_new"])
    hostile.app = "tests.hostile"
    from fedq.testing.procs import start_workers

    start_workers([hostile])
    cluster.workers.append(hostile)
    cluster.start(control=["control"], honest1=["cpu"], honest2=["cpu"])
    cluster.start_beat()
    try:
        base = {**DIGITS, "rounds": 1, "clients_per_round": 3, "min_clients": 2,
                "queues": {"cpu": 2, "gpu_new": 1}, "round_timeout_s": 120,
                "max_update_norm": 1000.0}
        specs = [{**base, "name": "honest"}] + [
            {**base, "name": f"attack-{name}", "rounds": max(sc.rounds)}
            for name, sc in SCENARIOS.items()]
        ids = dict(zip([s["name"] for s in specs], cluster.submit_many(specs), strict=True))
        jobs = {name: cluster.wait(job, timeout=600) for name, job in ids.items()}
        control = cluster.by_name("control")
        assert control.proc is not None
        peak = _peak_rss(control.proc.pid)
        crafted = _send_crafted(cluster, ids["honest"])
        yield Run(backend, cluster, jobs, ids, peak, crafted)
    finally:
        cluster.stop()


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
    from fedq.refs import TrainRef
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
    """Delete ``check_task(data)`` in TrainRef.from_json (fedq/refs.py) and the job id
    and hash reach a path: this fails."""
    assert not Path("/tmp/fedq-evil").exists()
    for what, result in attacked.crafted:
        assert result["status"] == "error", (what, result)
        assert "malformed task" in result["error"], (what, result["error"])
    reasons = {what: r["error"] for what, r in attacked.crafted}
    assert "is not a fedq job id" in reasons["job id"]
    assert "is not a sha256" in reasons["model sha256"]
    assert "is not a model key of job" in reasons["model key"]
    if attacked.backend == "redis+postgresql":
        for what, result in attacked.crafted:
            record("security", scenario=f"crafted task: {what}",
                   did=f"a task whose {what} walks out of the worker's folders (`../`)",
                   fedq=f"refused by the worker: {result['error'][:90]}",
                   guard="wire.check_task before any path or key is built",
                   outcome="no file outside the worker's folders; an error result")


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
