"""Whole jobs on real worker processes: Redis + PostgreSQL + S3, and the embedded default."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from fedq.blobs import BlobRef, open_store
from fedq.db import ClientUpdate, Job, Round, session_scope
from fedq.errors import BlobNotFound
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.weights import loads

TWO_QUEUES = {**DIGITS, "queues": {"cpu": 2, "gpu_new": 2}}


def _check_job(cluster: Cluster, job_id: str, rounds: int, per_round: int,
               evaluated: set[int] | None = None) -> None:
    """Every round committed once, one row per planned client, run on its planned queue."""
    consumers = {w.hostname: set(w.queues) for w in cluster.workers}
    with session_scope(cluster.settings.database_url) as s:
        rows = s.scalars(select(Round).where(Round.job_id == job_id)
                         .order_by(Round.number)).all()
        assert [(r.number, r.status) for r in rows] == [(n, "committed")
                                                        for n in range(1, rounds + 1)]
        for rnd in rows:
            planned = dict(zip(rnd.planned["clients"], rnd.planned["queues"]))
            updates = s.scalars(select(ClientUpdate).where(
                ClientUpdate.job_id == job_id, ClientUpdate.round_number == rnd.number)).all()
            assert sorted(u.client for u in updates) == sorted(planned)
            assert len(updates) == per_round
            for u in updates:
                assert u.status == "ok", u.error
                assert u.queue == planned[u.client]
                assert u.queue in consumers[u.worker], (u.worker, u.queue)
                assert u.samples > 0 and u.steps > 0 and u.bytes_up > 0
            assert rnd.participants == per_round
            if evaluated is None or rnd.number in evaluated:
                assert rnd.accuracy is not None
            else:
                assert rnd.accuracy is None


@pytest.fixture
def production(tmp_path: Path, redis_db: str, pg_url: str,
               s3_env: dict[str, str]) -> Iterator[Cluster]:
    env = base_env(tmp_path, FEDQ_BROKER_URL=redis_db, FEDQ_RESULT_BACKEND=redis_db,
                   FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=f"s3://fedq/{tmp_path.name}")
    env.update(s3_env)
    cluster = Cluster(tmp_path, env)
    cluster.fedq("db", "upgrade")
    cluster.start(cpu=["cpu"], gpu=["gpu_new"], control=["control"])
    yield cluster
    cluster.stop()


@pytest.mark.slow
def test_three_rounds_on_redis_postgres_s3_two_queues(production: Cluster) -> None:
    # Also: evaluate every 2nd round (and the last); keep only the last round's updates.
    job_id = production.submit({**TWO_QUEUES, "eval_every": 2, "keep_updates": 1})
    view = production.wait(job_id)
    assert view.status == "completed", view.error
    _check_job(production, job_id, rounds=3, per_round=4, evaluated={2, 3})
    # Workers hold no result subscriptions (fedq.engine.backend; Celery's kept one per task).
    import redis

    assert redis.Redis.from_url(production.env["FEDQ_RESULT_BACKEND"]).pubsub_channels(
        "celery-task-meta-*") == []
    store = open_store(production.settings.blob_url, production.settings.s3_endpoint_url)
    for u in production.updates(job_id):
        ref = BlobRef(u.blob_key, u.blob_sha256, u.bytes_up)
        if u.round_number < 3:
            with pytest.raises(BlobNotFound):
                store.get(ref)
        else:
            assert store.get(ref)
    data = production.results_json(job_id)
    assert [r["round"] for r in data["rounds"]] == [1, 2, 3]
    assert len(data["clients"]) == 12
    assert {c["queue"] for c in data["clients"]} == {"cpu", "gpu_new"}
    table = list(csv.DictReader(io.StringIO(production.fedq("results", job_id, "--csv").stdout)))
    assert [int(r["round"]) for r in table] == [1, 2, 3]
    assert float(table[-1]["accuracy"]) == pytest.approx(view.accuracy)


@pytest.mark.slow
def test_three_rounds_embedded_is_deterministic(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(cpu=["cpu"], gpu=["gpu_new"], control=["control"])
    try:
        first, second = cluster.submit_many([TWO_QUEUES, TWO_QUEUES])  # run side by side
        a = cluster.wait(first)
        b = cluster.wait(second)
    finally:
        cluster.stop()
    assert a.status == b.status == "completed", (a.error, b.error)
    _check_job(cluster, first, rounds=3, per_round=4)
    _check_job(cluster, second, rounds=3, per_round=4)
    # Same spec and seed: the same model, bit for bit, whichever worker ran which client.
    assert a.accuracy == b.accuracy
    store = open_store(cluster.settings.blob_url)
    with session_scope(cluster.settings.database_url) as s:
        finals = [loads(store.get(BlobRef(j.global_key, j.global_sha256, j.global_size)))
                  for j in (s.get(Job, first), s.get(Job, second))]
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    status = cluster.fedq("status", first)
    assert first in status.stdout and "completed" in status.stdout


def test_a_rounds_chord_names_its_tasks_and_its_body_carries_no_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``dispatch`` hands Celery: each training task's headers show who it is for
    (``argsrepr``); the body, ``finalize_round``, is immutable, so the chord's last
    worker sends it without the header's results (Celery clones it with them when the
    chord fires: an immutable signature keeps its own arguments). At 1,000 clients
    those results made a message of a megabyte that nobody read."""
    from fedq.coordinator import rounds
    from fedq.coordinator.planning import Assignment
    from fedq.spec import JobSpec

    sent: list[tuple[list, object]] = []
    monkeypatch.setattr(rounds, "chord", lambda header: lambda body: sent.append((header, body)))
    spec = JobSpec.model_validate({**DIGITS, "name": "chord"})
    model = BlobRef("jobs/j1/r00000/global.safetensors", "0" * 64, 10)
    rounds.dispatch("j1", 3, spec, model, [Assignment(0, "cpu"), Assignment(2, "gpu_new")],
                    attempt=1, gen=7)
    (header, body), = sent
    assert [t.options["argsrepr"] for t in header] == [
        "job j1 round 3 client 0 attempt 1", "job j1 round 3 client 2 attempt 1"]
    assert [t.options["queue"] for t in header] == ["cpu", "gpu_new"]
    assert body.immutable and body.options["queue"] == "control"
    fired = body.clone(args=([{"status": "ok", "client": 0}, {"status": "ok"}],))
    assert tuple(fired.args) == (None, "j1", 3)
    assert body.options["argsrepr"] == "job j1 round 3"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"compression": {"codec": "int8"},
                                        "server": {"name": "diloco"}}],
                         ids=["fedavg", "int8-diloco"])
def test_a_job_on_chunked_redis_blobs_is_bit_for_bit_the_unchunked_one(
        tmp_path: Path, redis_db: str, pg_url: str, extra: dict[str, Any]) -> None:
    """The same job on a Redis blob store twice: with 2 KB chunks (every model and
    update a manifest and its chunks: fedq/blobs/chunks.py; the commits lean, int8
    updates decoded piece by piece, DiLoCo's momentum streamed) and without (chunks of
    512 MiB: one value each). The final models are equal bit for bit."""
    import redis

    from tests.conftest import migrated_cluster

    spec = {**DIGITS, "name": "chunked", "num_clients": 3, "clients_per_round": 3,
            "rounds": 2, **extra}
    finals, chunk_keys = [], []
    for chunk_mb in ("0.002", "512"):
        home = tmp_path / f"c{chunk_mb}"
        home.mkdir()
        cluster = migrated_cluster(home, redis_db, redis_db, pg_url)
        cluster.env.update(FEDQ_BLOB_URL=redis_db, FEDQ_BLOB_CHUNK_MB=chunk_mb)
        cluster.start(cpu=["cpu"], control=["control"])
        try:
            job_id = cluster.submit(spec)
            done = cluster.wait(job_id, timeout=180)
        finally:
            cluster.stop()
        assert done.status == "completed", done.error
        store = open_store(redis_db, chunk_bytes=cluster.settings.blob_chunk_bytes)
        with session_scope(pg_url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            finals.append(loads(store.get(BlobRef(job.global_key, job.global_sha256,
                                                  job.global_size))))
        chunk_keys.append(len(redis.Redis.from_url(redis_db).keys(
            f"fedq:blob:jobs/{job_id}/*.chunk*")))
    assert chunk_keys[0] > 0 and chunk_keys[1] == 0, chunk_keys
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
