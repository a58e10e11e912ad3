"""The training task, run on a ``gpu_new``, ``gpu_sm61`` or ``cpu`` worker."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

import fedq.identity as identity
from fedq.blobs.presigned import PresignedStore
from fedq.engine.app import app
from fedq.engine.names import TRAIN_SOFT_TIME_LIMIT, TRAIN_TASK, TRAIN_TIME_LIMIT
from fedq.process import PROCESS
from fedq.settings import get_settings
from fedq.testing import hold
from fedq.worker import owner
from fedq.worker.heartbeat import claim, claim_unless_revoked

log = logging.getLogger(__name__)


@app.task(name=TRAIN_TASK, bind=True, soft_time_limit=TRAIN_SOFT_TIME_LIMIT,
          time_limit=TRAIN_TIME_LIMIT)
def train(self: Task, ref: dict[str, Any]) -> dict[str, Any]:
    """Train one client for one round; returns an UpdateRef (never raises)."""
    # Deferred: torch and the model zoo load once per worker process (worker_init).
    from fedq.worker.update import refusal, run_training

    settings = get_settings()
    worker = self.request.hostname or "unknown"
    task_id = self.request.id
    # A worker that joined a coordinator (fedq worker join) takes only tasks sealed by
    # it for this task id, and signs what it returns (fedq/identity.py).
    me = identity.joined(settings.keys_dir)
    if me is not None:
        try:
            ref = identity.check_sealed(ref, task_id, me.coordinator)
        except identity.Refused as exc:
            log.warning("%s", exc)
            return me.sign_result(refusal(ref, worker, str(exc)), task_id)
    # a task revoked before this worker started (its job ended, its slot moved) waited
    # in the queue: answered at once, untrained (fedq/engine/revoke.py); else its claim
    # is stored, in the same round trip
    why = claim_unless_revoked(self.backend, task_id, worker)
    if why is not None:
        log.warning("not trained: task %s was revoked (%s)", task_id, why)
        result = refusal(ref, worker, f"revoked before it started: {why}")
        return result if me is None else me.sign_result(result, task_id)
    delivered = (self.request.delivery_info or {}).get("routing_key")
    if delivered:
        ref = {**ref, "queue": delivered}
    # a task with presigned URLs reads and writes its blobs only through them
    links = ref.get("links") if isinstance(ref, dict) else None
    store = PresignedStore(links) if isinstance(links, dict) else \
        PROCESS.blobs(settings)
    # the claim's heartbeat (fedq/worker/heartbeat.py): a dead worker's task is sent
    # again in seconds, not at the round's deadline; and a task whose job was cancelled
    # or ended stops at its next step
    with claim(self.backend, task_id, worker, settings.heartbeat_s, written=True) as beat:
        hold.at("training", task_id, worker)  # fault tests only (FEDQ_TEST_HOLD)
        result = run_training(ref, store, worker, beat.stopped)
    if result.get("status") == "yielded":  # take nothing more until the owner is done
        owner.stepped_aside()
    return result if me is None else me.sign_result(result, task_id)
