"""A task revoked while it waited in its queue (its job cancelled, failed or completed,
or its slot moved to another site) is refused, untrained, by a worker that starts after
the revocation was broadcast and so never heard it: fedq marks each revoked task in the
result backend, where the task's worker reads it before it claims the task
(fedq/engine/revoke.py, fedq/tasks/train.py)."""

from __future__ import annotations

import json

import pytest
from celery import Celery, states
from kombu import Connection

from fedq.engine.revoke import _mark_redis, revoked
from fedq.status import JobStatus, UpdateStatus
from fedq.testing.cluster import DIGITS, Cluster
from fedq.testing.hold import Holds
from fedq.testing.wait import wait_until


def _waiting(broker_url: str, queue: str) -> int:
    with Connection(broker_url) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def test_revoking_many_tasks_on_redis_stores_what_celery_would_and_keeps_successes(
        redis_db: str) -> None:
    """The batched marks (two round trips for any number of ids) are what Celery's
    ``mark_as_revoked`` stores, a task that already succeeded keeps its result, and a
    waiting subscriber hears each mark as it would Celery's."""
    app = Celery("revoke-test", backend=redis_db, set_as_current=False)
    backend = app.backend
    backend.mark_as_revoked("t-celery", reason="its job was cancelled")
    backend.store_result("t-done", {"status": "ok"}, states.SUCCESS)
    pubsub = backend.client.pubsub()
    pubsub.subscribe(backend.get_key_for_task("t-0"))
    backend.client.set(backend.get_key_for_task("t-junk"), b"\xff not json")  # a worker's
    backend.client.set(backend.get_key_for_task("t-list"), b"[1, 2]")
    ids = [f"t-{i}" for i in range(300)] + ["t-done", "t-junk", "t-list"]
    _mark_redis(backend, ids, "its job was cancelled")
    ours, celerys = (json.loads(backend.get(backend.get_key_for_task(t)))
                     for t in ("t-0", "t-celery"))
    for meta in (ours, celerys):
        meta.pop("date_done")
        meta.pop("task_id")
    assert ours == celerys and ours["status"] == "REVOKED", (ours, celerys)
    assert [revoked(backend, t) for t in ("t-0", "t-299", "t-junk", "t-list", "t-done",
                                          "t-never")] == ["its job was cancelled"] * 4 + [None] * 2
    assert backend.get_task_meta("t-done")["result"] == {"status": "ok"}
    assert 0 < backend.client.ttl(backend.get_key_for_task("t-7")) <= backend.expires
    heard = [m for m in iter(lambda: pubsub.get_message(timeout=1.0), None)
             if m["type"] == "message"]
    assert len(heard) == 1 and b"REVOKED" in heard[0]["data"], heard
    pubsub.close()


@pytest.mark.slow
def test_a_worker_started_after_a_cancel_trains_none_of_the_jobs_tasks(
        redis_cluster: Cluster) -> None:
    cluster = redis_cluster
    cluster.start(control=["control"])  # no training worker yet: the tasks wait
    sync = cluster.submit({**DIGITS, "name": "revoked-sync", "num_clients": 3,
                           "clients_per_round": 3, "rounds": 2})
    buffered = cluster.submit({**DIGITS, "name": "revoked-buffered", "num_clients": 4,
                               "clients_per_round": 2, "rounds": 3,
                               "aggregation": {"mode": "buffered", "buffer": 2}})
    broker = cluster.env["FEDQ_BROKER_URL"]
    wait_until(lambda: _waiting(broker, "cpu") == 3 + 2, 60,
               what=lambda: f"{_waiting(broker, 'cpu')} tasks waiting in cpu")
    for job in (sync, buffered):
        cluster.fedq("cancel", job)
    worker = cluster.add("late", ["cpu"])
    wait_until(lambda: worker.log_path.read_bytes().count(b"not trained: task") == 5, 60,
               what=worker.tail)
    log = worker.log_path.read_text()
    assert "training: client" not in log, log
    assert log.count("(its job was cancelled)") == 5, log
    for job in (sync, buffered):
        assert cluster.wait(job, timeout=30).status == JobStatus.CANCELLED
        assert not [u for u in cluster.updates(job) if u.status == UpdateStatus.OK]
    # the same worker trains a job that runs
    live = cluster.submit({**DIGITS, "name": "not-revoked", "num_clients": 2,
                           "clients_per_round": 2, "rounds": 1})
    assert cluster.wait(live, timeout=120).status == JobStatus.COMPLETED
    assert worker.log_path.read_text().count("training: client") == 2


@pytest.mark.slow
def test_a_rounds_straggler_still_queued_when_it_commits_is_never_trained(
        redis_cluster: Cluster) -> None:
    """Site b has no worker while a synchronous job runs: each round commits at its
    deadline with site a's two clients, and b's task, still in site.b's queue, is
    revoked. The worker b starts afterwards refuses both rounds' tasks, untrained."""
    cluster = redis_cluster
    cluster.env.update(FEDQ_WATCHDOG_INTERVAL="1")
    cluster.start(control=["control"], a=["site.a"])
    # a's first task loads the data and builds the model: 13 s once on a busy machine,
    # past round 1's deadline (the round was then sent again). A job first warms it.
    warm = cluster.submit({**DIGITS, "name": "warm", "num_clients": 1,
                           "clients_per_round": 1, "rounds": 1, "sites": {"a": [0]}})
    assert cluster.wait(warm, timeout=120).status == JobStatus.COMPLETED
    cluster.start_beat()
    job = cluster.submit({**DIGITS, "name": "straggler", "num_clients": 3,
                          "clients_per_round": 3, "rounds": 2, "min_clients": 2,
                          "round_timeout_s": 8, "sites": {"a": [0, 1], "b": [2]}})
    assert cluster.wait(job, timeout=120).status == JobStatus.COMPLETED
    missing = [(u.round_number, u.client) for u in cluster.updates(job)
               if u.status == UpdateStatus.MISSING]
    assert missing == [(1, 2), (2, 2)], missing
    assert _waiting(cluster.env["FEDQ_BROKER_URL"], "site.b") == 2
    b = cluster.add("b", ["site.b"])
    wait_until(lambda: b.log_path.read_bytes().count(b"not trained: task") == 2, 60,
               what=b.tail)
    log = b.log_path.read_text()
    assert "training: client" not in log, log
    assert "(round 1 committed without it)" in log and "(round 2 committed without it)" in log


@pytest.mark.slow
def test_a_buffered_jobs_task_still_queued_when_it_completes_is_never_trained(
        redis_cluster: Cluster) -> None:
    """A buffered job keeps one task on gpu_new, which no worker consumes, while the cpu
    worker makes every version: the job completes with that task still queued and
    revokes it. A gpu_new worker started afterwards refuses it, untrained."""
    cluster = redis_cluster
    cluster.start(control=["control"], a=["cpu"])
    job = cluster.submit({**DIGITS, "name": "completed-buffered", "num_clients": 4,
                          "clients_per_round": 2, "rounds": 2,
                          "queues": {"cpu": 1, "gpu_new": 1},
                          "aggregation": {"mode": "buffered", "buffer": 1}})
    assert cluster.wait(job, timeout=120).status == JobStatus.COMPLETED
    assert _waiting(cluster.env["FEDQ_BROKER_URL"], "gpu_new") == 1
    late = cluster.add("late", ["gpu_new"])
    wait_until(lambda: b"not trained: task" in late.log_path.read_bytes(), 60, what=late.tail)
    log = late.log_path.read_text()
    assert "training: client" not in log, log
    assert log.count("(its job completed)") == 1, log


@pytest.mark.slow
def test_a_task_training_when_its_job_is_cancelled_stops_at_its_next_step(
        redis_cluster: Cluster) -> None:
    """A cancel marks the job's tasks ``stop``: one already claimed (held at the start of
    its training, fedq.testing.hold) reads the mark at its next heartbeat and stops
    before its next step, answered as revoked, instead of training a 100× slowed
    round to the end."""
    cluster = redis_cluster
    holds = Holds(cluster.home / "holds")
    cluster.env.update(FEDQ_HEARTBEAT_S="1", **holds.env("training", r"-r1-c0-a1$"))
    cluster.start(control=["control"])
    worker = cluster.add("slow", ["cpu"], FEDQ_TEST_SLOWDOWN="100")
    try:
        job = cluster.submit({**DIGITS, "name": "stopped", "num_clients": 1,
                              "clients_per_round": 1, "rounds": 2, "local_epochs": 5})
        held = wait_until(lambda: holds.waiting(rf"^fedq-{job}-g\d+-r1-c0-a1$"), 60,
                          what=worker.tail)
        cluster.fedq("cancel", job)
        wait_until(lambda: b"(its job was cancelled): it stops" in worker.log_path.read_bytes(),
                   30, what=worker.tail)
        holds.let_go("")
        wait_until(lambda: b"stopped: revoked while it trained" in worker.log_path.read_bytes(),
                   30, what=worker.tail)
    finally:
        holds.close()
    log = worker.log_path.read_text()
    assert "after 0 of " in log and "trained:" not in log, log
    assert len(held) == 1
    assert cluster.wait(job, timeout=30).status == JobStatus.CANCELLED
    assert not [u for u in cluster.updates(job) if u.status == UpdateStatus.OK]
