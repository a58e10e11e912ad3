"""Batch inference tasks: one shard on a hardware queue, and its answer's callback on
the control queue (fedq/inference/)."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

import fedq.identity as identity
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
from fedq.worker import owner
from fedq.worker.heartbeat import claim, claim_unless_revoked

log = logging.getLogger(__name__)


@app.task(name=INFER_TASK, bind=True, soft_time_limit=TRAIN_SOFT_TIME_LIMIT,
          time_limit=TRAIN_TIME_LIMIT)
def infer_shard(self: Task, ref: Any) -> dict[str, Any]:
    """Run one shard; returns a shard result (never raises)."""
    from fedq.inference.run import run_shard

    settings = get_settings()
    worker = self.request.hostname or "unknown"
    head = ref if isinstance(ref, dict) else {}
    base = {"job": head.get("job"), "shard": head.get("shard"), "attempt": head.get("attempt"),
            "worker": worker, "queue": str(head.get("queue", ""))[:32]}
    # A worker that joined a coordinator (fedq worker join) takes only shards sealed by
    # it for this task id, and signs what it returns (fedq/identity.py).
    me = identity.joined(settings.keys_dir)
    task_id = self.request.id
    if me is not None:
        try:
            ref = identity.check_sealed(ref, task_id, me.coordinator)
        except identity.Refused as exc:
            log.warning("%s", exc)
            return me.sign_result({**base, "status": "error", "error": str(exc)}, task_id)
    # a shard revoked before this worker started (its job cancelled or failed) waited
    # in the queue: answered untrained (fedq/engine/revoke.py); else its claim is
    # stored in the same round trip, and beats while the shard runs, so a dead worker's
    # shard is sent again in seconds (fedq/coordinator/watchdog.py), not at its timeout
    if (why := claim_unless_revoked(self.backend, task_id, worker)) is not None:
        log.warning("not run: task %s was revoked (%s)", task_id, why)
        result = {**base, "status": "error", "error": f"revoked before it started: {why}"}
    elif (reason := owner.away()) is not None:  # the owner is back: not started
        owner.stepped_aside()
        result = {**base, "status": "yielded", "error": f"not started: {reason}"}
    else:
        delivered = (self.request.delivery_info or {}).get("routing_key")
        store = PROCESS.blobs(settings)
        with claim(self.backend, task_id, worker, settings.heartbeat_s,
                   written=True):
            result = run_shard(ref, store, worker, delivered, me.name if me else None)
    return result if me is None else me.sign_result(result, task_id)


@app.task(name=ABSORB_SHARD_TASK, time_limit=CONTROL_TIME_LIMIT)
def absorb_shard(result: Any, job_id: str, shard: int, attempt: int) -> dict[str, Any]:
    """A shard's answer came back (the task's ``link``, naming the shard and attempt
    it was sent as)."""
    from fedq.coordinator.enrol import registry_if_required
    from fedq.inference.jobs import absorb

    settings = get_settings()
    return absorb(settings, result, job_id, shard, attempt, registry_if_required(settings))


@app.task(name=SERVE_TASK, bind=True, soft_time_limit=TRAIN_SOFT_TIME_LIMIT,
          time_limit=TRAIN_TIME_LIMIT, send_events=False)
def serve_batch(self: Task, batch: Any) -> dict[str, Any]:
    """One batch of ``fedq serve`` requests (never raises). It sends no task events
    (received, started, succeeded: three publishes on the request's path, and hundreds
    a second under load); the gateway's /metrics counts the batches instead."""
    from fedq.inference.run import serve_batch as run_batch

    settings = get_settings()
    worker = self.request.hostname or "unknown"
    # a joined worker takes only batches sealed by its coordinator, and signs its answer
    me = identity.joined(settings.keys_dir)
    if me is not None:
        try:
            batch = identity.check_sealed(batch, self.request.id, me.coordinator)
        except identity.Refused as exc:
            log.warning("%s", exc)
            return me.sign_result({"status": "error", "error": str(exc), "worker": worker},
                                  self.request.id)
    store = PROCESS.blobs(settings)

    def progress(texts: list[str]) -> None:  # read by the gateway for streamed answers
        meta: dict[str, Any] = {"stream": texts}
        try:
            self.update_state(state=STREAM_STATE, meta=meta if me is None
                              else me.sign_result(meta, self.request.id))
        except Exception as exc:  # noqa: BLE001 - a stream falls behind; the answer stands
            log.warning("serve batch: progress not written (%s)", exc)

    answer = run_batch(batch, store, worker, progress)
    return answer if me is None else me.sign_result(answer, self.request.id)
