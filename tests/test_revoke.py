"""A task revoked while it waited in its queue (its job cancelled, failed or completed,
or its slot moved to another site) is refused, untrained, by a worker that starts after
the revocation was broadcast and so never heard it: fedq marks each revoked task in the
result backend, where the task's worker reads it before it claims the task
(fedq/engine/revoke.py, fedq/tasks/train.py)."""

from __future__ import annotations

import pytest
from kombu import Connection

from fedq.status import JobStatus, UpdateStatus
from fedq.testing.cluster import DIGITS, Cluster
from fedq.testing.wait import wait_until


def _waiting(broker_url: str, queue: str) -> int:
    with Connection(broker_url) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


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
