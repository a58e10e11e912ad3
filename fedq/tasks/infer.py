"""Batch inference tasks: one shard on a hardware queue, and its answer's callback on
the control queue (fedq/inference/)."""

from __future__ import annotations

import logging
from typing import Any

from fedq.engine.app import app
from fedq.engine.names import (
    ABSORB_SHARD_TASK,
    CONTROL_TIME_LIMIT,
    INFER_TASK,
    SERVE_TASK,
    STREAM_STATE,
    TRAIN_SOFT_TIME_LIMIT,
    TRAIN_TIME_LIMIT,
)
from fedq.process import PROCESS
from fedq.settings import get_settings
from fedq.tasks.base import WorkerTask
from fedq.worker import owner

log = logging.getLogger(__name__)


@app.task(name=INFER_TASK, bind=True, base=WorkerTask,
          soft_time_limit=TRAIN_SOFT_TIME_LIMIT, time_limit=TRAIN_TIME_LIMIT)
def infer_shard(self: WorkerTask, ref: Any) -> dict[str, Any]:
    """Run one shard; returns a shard result (never raises). The preamble (seal,
    revocation, claim, heartbeat, signature) is fedq/tasks/base.py's."""
    from fedq.inference.run import run_shard

    head = ref if isinstance(ref, dict) else {}
    base = {"job": head.get("job"), "shard": head.get("shard"), "attempt": head.get("attempt"),
            "worker": self.worker, "queue": str(head.get("queue", ""))[:32]}
    ref, refused = self.unseal(ref, lambda why: {**base, "status": "error", "error": why})
    if refused is not None:
        return refused
    if (why := self.revoked_else_claim()) is not None:
        log.warning("not run: task %s was revoked (%s)", self.request.id, why)
        result = {**base, "status": "error", "error": f"revoked before it started: {why}"}
    elif (reason := owner.away()) is not None:  # the owner is back: not started
        owner.stepped_aside()
        result = {**base, "status": "yielded", "error": f"not started: {reason}"}
    else:
        me = self.me()
        with self.beating():
            result = run_shard(ref, PROCESS.blobs(self.settings), self.worker,
                               self.delivered_to, me.name if me else None)
    return self.signed(result)


@app.task(name=ABSORB_SHARD_TASK, time_limit=CONTROL_TIME_LIMIT)
def absorb_shard(result: Any, job_id: str, shard: int, attempt: int) -> dict[str, Any]:
    """A shard's answer came back (the task's ``link``, naming the shard and attempt
    it was sent as)."""
    from fedq.coordinator.enrol import registry_if_required
    from fedq.inference.jobs import absorb

    settings = get_settings()
    return absorb(settings, result, job_id, shard, attempt, registry_if_required(settings))


@app.task(name=SERVE_TASK, bind=True, base=WorkerTask,
          soft_time_limit=TRAIN_SOFT_TIME_LIMIT, time_limit=TRAIN_TIME_LIMIT, send_events=False)
def serve_batch(self: WorkerTask, batch: Any) -> dict[str, Any]:
    """One batch of ``fedq serve`` requests (never raises). It sends no task events
    (received, started, succeeded: three publishes on the request's path, and hundreds
    a second under load); the gateway's /metrics counts the batches instead. No claim
    or heartbeat: the gateway waits on the batch itself (fedq/serve/batcher.py)."""
    from fedq.inference.run import serve_batch as run_batch

    batch, refused = self.unseal(batch, lambda why: {"status": "error", "error": why,
                                                     "worker": self.worker})
    if refused is not None:
        return refused

    def progress(texts: list[str]) -> None:  # read by the gateway for streamed answers
        try:
            self.update_state(state=STREAM_STATE, meta=self.signed({"stream": texts}))
        except Exception as exc:  # noqa: BLE001 - a stream falls behind; the answer stands
            log.warning("serve batch: progress not written (%s)", exc)

    return self.signed(run_batch(batch, PROCESS.blobs(self.settings), self.worker, progress))
