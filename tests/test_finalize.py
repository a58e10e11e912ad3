"""finalize_round delivered twice commits once; a tampered update is rejected by key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from fedq.app import FINALIZE_ROUND_TASK
from fedq.blobs import global_key, open_store
from fedq.client import run_training
from fedq.db import ClientUpdate, Job, Round, session_scope, upgrade
from fedq.rounds import initial_weights, plan_round
from fedq.spec import parse_spec
from fedq.weights import dumps
from tests.cluster import DIGITS, Cluster, base_env


@pytest.fixture
def control_pair(tmp_path: Path, redis_db: str, pg_url: str) -> Iterator[Cluster]:
    """Two control workers on Redis + PostgreSQL (Redis blobs): deliveries can race."""
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
    results = [run_training({"job": job_id, "round": 1, "client": a.client, "queue": a.queue,
                             "spec": spec.to_json(), "model": blob.to_json(), "gen": gen},
                            store, "inproc")
               for a in plan]
    assert all(r["status"] == "ok" for r in results), results
    return results, [a.client for a in plan]


@pytest.mark.slow
def test_finalize_delivered_twice_commits_once(control_pair: Cluster) -> None:
    results, clients = _open_round_with_results(control_pair, "dup1")
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
    app = control_pair.client_app()
    outcome = app.send_task(FINALIZE_ROUND_TASK, args=(results, "tamp1", 1),
                            queue="control").get(timeout=120)
    assert outcome["status"] == "committed"
    with session_scope(control_pair.settings.database_url) as s:
        rows = {r.client: r for r in s.scalars(select(ClientUpdate).where(
            ClientUpdate.job_id == "tamp1"))}
        rnd = s.scalar(select(Round).where(Round.job_id == "tamp1"))
    assert rows[bad["client"]].status == "rejected"
    assert f"blob {bad['key']}: sha256 mismatch" in (rows[bad["client"]].error or "")
    assert sorted(c for c, r in rows.items() if r.status == "ok") == sorted(
        c for c in clients if c != bad["client"])
    assert rnd is not None and rnd.participants == 2
