"""finalize_round delivered twice commits once; a tampered update is rejected by key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from fedq.blobs import global_key, open_store
from fedq.coordinator.evaluation import initial_weights
from fedq.coordinator.intake import task_id
from fedq.coordinator.planning import plan_round
from fedq.db import ClientUpdate, Job, Round, session_scope, upgrade
from fedq.engine.names import FINALIZE_ROUND_TASK
from fedq.protocol.training import TrainRef
from fedq.spec import parse_spec
from fedq.testing.cluster import DIGITS, Cluster, base_env, record_outcome
from fedq.weights import dumps
from fedq.worker.update import run_training


@pytest.fixture(scope="module")
def control_pair(tmp_path_factory: pytest.TempPathFactory, module_redis_db: str,
                 module_pg_url: str) -> Iterator[Cluster]:
    """Two control workers on Redis + PostgreSQL (Redis blobs): deliveries can race.
    Shared by the module's tests, which use distinct job ids."""
    tmp_path = tmp_path_factory.mktemp("control_pair")
    redis_db, pg_url = module_redis_db, module_pg_url
    env = base_env(tmp_path, FEDQ_BROKER_URL=redis_db, FEDQ_RESULT_BACKEND=redis_db,
                   FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=redis_db)
    cluster = Cluster(tmp_path, env)
    upgrade(pg_url)
    cluster.start(control_a=["control"], control_b=["control"])
    yield cluster
    cluster.stop()


def _open_round_with_results(cluster: Cluster, job_id: str) -> tuple[list[dict], list[int]]:
    """A one-round job with round 1 open and its training done in this process."""
    settings = cluster.settings
    spec = parse_spec({**DIGITS, "rounds": 1, "clients_per_round": 3, "queues": {"cpu": 3}})
    store = open_store(settings.blob_url)
    blob = store.put(global_key(job_id, 0), dumps(initial_weights(spec)))
    plan = plan_round(spec, 1)
    with session_scope(settings.database_url) as s:
        s.add(Job(id=job_id, name="t", spec=spec.to_json(), status="running", total_rounds=1,
                  committed_round=0, global_key=blob.key, global_sha256=blob.sha256,
                  global_size=blob.size))
        s.flush()
        rnd = Round(job_id=job_id, number=1, status="training",
                    planned={"clients": [a.client for a in plan],
                             "queues": [a.queue for a in plan]})
        s.add(rnd)
        s.flush()
        gen = rnd.id
    results = [run_training(TrainRef(job_id, 1, a.client, a.queue, spec.to_json(), blob,
                                     gen=gen).to_json(), store, "inproc")
               for a in plan]
    assert all(r["status"] == "ok" for r in results), results
    return results, [a.client for a in plan]


def _deliver(cluster: Cluster, results: list[dict]) -> None:
    """Store results in the result backend under their tasks' ids, as the workers'
    tasks would: finalize reads them from there (what the chord passes is a doorbell)."""
    app = cluster.client_app()
    for r in results:
        app.backend.store_result(task_id(r["job"], r["round"], r["attempt"], r["client"],
                                         r["gen"]), r, "SUCCESS")



@pytest.mark.slow
def test_finalize_delivered_twice_commits_once(control_pair: Cluster) -> None:
    results, clients = _open_round_with_results(control_pair, "dup1")
    _deliver(control_pair, results)
    app = control_pair.client_app()
    sent = [app.send_task(FINALIZE_ROUND_TASK, args=(results, "dup1", 1), queue="control")
            for _ in range(3)]
    outcomes = sorted(r.get(timeout=120)["status"] for r in sent)
    assert outcomes == ["committed", "skipped", "skipped"]
    with session_scope(control_pair.settings.database_url) as s:
        rounds = s.scalars(select(Round).where(Round.job_id == "dup1")).all()
        rows = s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == "dup1")).all()
        job = s.get(Job, "dup1")
    assert [(r.number, r.status) for r in rounds] == [(1, "committed")]
    assert sorted(r.client for r in rows) == sorted(clients)
    assert job is not None and job.status == "completed" and job.committed_round == 1


@pytest.mark.slow
def test_tampered_update_is_rejected_and_round_proceeds(control_pair: Cluster) -> None:
    results, clients = _open_round_with_results(control_pair, "tamp1")
    store = open_store(control_pair.settings.blob_url)
    bad = results[1]
    store._write(bad["key"], store._read(results[0]["key"]))  # another client's bytes
    _deliver(control_pair, results)
    app = control_pair.client_app()
    outcome = app.send_task(FINALIZE_ROUND_TASK, args=(results, "tamp1", 1),
                            queue="control").get(timeout=120)
    assert outcome["status"] == "committed"
    with session_scope(control_pair.settings.database_url) as s:
        rows = {r.client: r for r in s.scalars(select(ClientUpdate).where(
            ClientUpdate.job_id == "tamp1"))}
        rnd = s.scalar(select(Round).where(Round.job_id == "tamp1"))
    assert rows[bad["client"]].status == "rejected"
    assert f"blob {bad['key']}: digest mismatch" in (rows[bad["client"]].error or "")
    assert sorted(c for c, r in rows.items() if r.status == "ok") == sorted(
        c for c in clients if c != bad["client"])
    assert rnd is not None and rnd.participants == 2


def _rewrite_update(store, result: dict, delta: dict) -> dict:
    """Replace a client's update with ``delta`` and a matching sha256 (a buggy or
    malicious client, not a corrupted blob)."""
    from fedq.weights import dumps as dump_weights

    ref = store.put(result["key"], dump_weights(delta))
    return {**result, "sha256": ref.sha256, "bytes_up": ref.size}


@pytest.mark.slow
def test_nan_and_wrong_shape_updates_are_rejected_and_recorded(control_pair: Cluster) -> None:
    import torch

    from fedq.weights import loads as load_weights

    results, clients = _open_round_with_results(control_pair, "bad1")
    store = open_store(control_pair.settings.blob_url)
    good = load_weights(store._read(results[0]["key"]))
    nan = {k: v.clone() for k, v in good.items()}
    first = next(iter(nan))
    nan[first].view(-1)[0] = float("nan")
    shape = {k: v.clone() for k, v in good.items()}
    shape[first] = torch.zeros(3, 3)
    results[1] = _rewrite_update(store, results[1], nan)
    results[2] = _rewrite_update(store, results[2], shape)
    _deliver(control_pair, results)
    app = control_pair.client_app()
    outcome = app.send_task(FINALIZE_ROUND_TASK, args=(results, "bad1", 1),
                            queue="control").get(timeout=120)
    assert outcome["status"] == "committed"
    rows = {u.client: u for u in control_pair.updates("bad1")}
    assert rows[results[0]["client"]].status == "ok"
    assert rows[results[1]["client"]].status == "rejected"
    assert f"tensor '{first}' has non-finite values" in rows[results[1]["client"]].error
    assert rows[results[2]["client"]].status == "rejected"
    assert "has shape (3, 3), expected" in rows[results[2]["client"]].error
    [rnd] = control_pair.rounds("bad1")
    assert rnd.participants == 1 and rnd.status == "committed"
    record_outcome("a NaN update and a wrong-shape update", "two clients' update blobs "
                   "(valid sha256, bad contents)", "both rejected and recorded; round "
                   "committed with the third", 1, 2)


@pytest.mark.slow
def test_late_and_duplicate_results_count_once_and_never_mix(control_pair: Cluster) -> None:
    from datetime import timedelta

    from fedq.db.models import utcnow

    results, clients = _open_round_with_results(control_pair, "late1")
    settings = control_pair.settings
    with session_scope(settings.database_url) as s:  # quorum 2 and the deadline passed
        job = s.get(Job, "late1")
        job.spec = {**job.spec, "min_clients": 2}
        rnd = s.scalar(select(Round).where(Round.job_id == "late1"))
        rnd.deadline = utcnow() - timedelta(seconds=1)
    app = control_pair.client_app()
    on_time = [results[0], results[1], results[0]]  # client 0 twice: counts once
    _deliver(control_pair, on_time)
    first = app.send_task(FINALIZE_ROUND_TASK, args=(on_time, "late1", 1),
                          queue="control").get(timeout=120)
    assert first["status"] == "committed"
    [rnd] = control_pair.rounds("late1")
    assert rnd.participants == 2 and rnd.samples == results[0]["samples"] + results[1]["samples"]
    model_after = rnd.global_sha256
    rows = {u.client: u.status for u in control_pair.updates("late1")}
    assert rows == {results[0]["client"]: "ok", results[1]["client"]: "ok",
                    results[2]["client"]: "missing"}
    _deliver(control_pair, results)
    second = app.send_task(FINALIZE_ROUND_TASK, args=(results, "late1", 1),
                           queue="control").get(timeout=120)
    assert second["status"] == "skipped" and second["late"] == 1
    rows = {u.client: u.status for u in control_pair.updates("late1")}
    assert rows[results[2]["client"]] == "late"
    [rnd] = control_pair.rounds("late1")
    assert rnd.global_sha256 == model_after and rnd.participants == 2
    record_outcome("a late update and a duplicate result", "one client past the deadline; "
                   "another delivered twice", "late recorded, never averaged; duplicate "
                   "counted once", 1, 1)
