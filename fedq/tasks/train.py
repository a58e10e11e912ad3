"""The training task, run on a ``gpu_new``, ``gpu_sm61`` or ``cpu`` worker."""

from __future__ import annotations

import logging
from typing import Any

from fedq.blobs.presigned import PresignedStore
from fedq.engine.app import app
from fedq.engine.names import TRAIN_SOFT_TIME_LIMIT, TRAIN_TASK, TRAIN_TIME_LIMIT
from fedq.process import PROCESS
from fedq.tasks.base import WorkerTask
from fedq.testing import hold
from fedq.worker import owner

log = logging.getLogger(__name__)


@app.task(name=TRAIN_TASK, bind=True, base=WorkerTask, soft_time_limit=TRAIN_SOFT_TIME_LIMIT,
          time_limit=TRAIN_TIME_LIMIT)
def train(self: WorkerTask, ref: dict[str, Any]) -> dict[str, Any]:
    """Train one client for one round; returns an UpdateRef (never raises). The
    preamble (seal, revocation, claim, heartbeat, signature) is fedq/tasks/base.py's."""
    # Deferred: torch and the model zoo load once per worker process (worker_init).
    from fedq.worker.update import refusal, run_training

    worker = self.worker
    ref, refused = self.unseal(ref, lambda why: refusal(ref, worker, why))
    if refused is not None:
        return refused
    if (why := self.revoked_else_claim()) is not None:
        log.warning("not trained: task %s was revoked (%s)", self.request.id, why)
        return self.signed(refusal(ref, worker, f"revoked before it started: {why}"))
    if self.delivered_to:
        ref = {**ref, "queue": self.delivered_to}
    # a task with presigned URLs reads and writes its blobs only through them
    links = ref.get("links") if isinstance(ref, dict) else None
    store = PresignedStore(links) if isinstance(links, dict) else PROCESS.blobs(self.settings)
    with self.beating() as beat:  # a cancelled job's task stops at its next step
        hold.at("training", self.request.id, worker)  # fault tests only (FEDQ_TEST_HOLD)
        result = run_training(ref, store, worker, beat.stopped)
    if result.get("status") == "yielded":  # take nothing more until the owner is done
        owner.stepped_aside()
    return self.signed(result)
