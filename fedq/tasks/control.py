"""Coordination tasks on the ``control`` queue: start and finalize rounds, register
workers, run the watchdog.

Each imports the coordinator inside the task: every worker loads this module (the
app includes it), and a training worker should not load the coordinator's stack
(the database layer, the aggregation pipeline) at start-up for tasks it never runs."""

from __future__ import annotations

from typing import Any

from fedq.engine.app import app
from fedq.engine.names import (
    ABSORB_UPDATE_TASK,
    CONTROL_TIME_LIMIT,
    FINALIZE_ROUND_TASK,
    JOIN_WORKER_TASK,
    REGISTER_WORKER_TASK,
    START_ROUND_TASK,
    WATCHDOG_TASK,
    WORKER_STATE_TASK,
)
from fedq.identity import Refused
from fedq.settings import get_settings


@app.task(name=START_ROUND_TASK, time_limit=CONTROL_TIME_LIMIT)
def start_round(job_id: str, round_number: int) -> dict[str, Any]:
    from fedq.coordinator import rounds

    return rounds.start_round(get_settings(), job_id, round_number)


@app.task(name=FINALIZE_ROUND_TASK, time_limit=CONTROL_TIME_LIMIT)
def finalize_round(results: Any, job_id: str, round_number: int) -> dict[str, Any]:
    """The chord's body: a doorbell. ``results`` is None (the body is immutable:
    fedq/coordinator/rounds.py), or what the header tasks returned in a message of an
    earlier fedq, or what a worker says they returned; it is never read: finalize reads
    each result back by the task id it sent (fedq/coordinator/intake.py)."""
    from fedq.coordinator import finalize

    del results
    return finalize.finalize_round(get_settings(), job_id, round_number)


@app.task(name=ABSORB_UPDATE_TASK, time_limit=CONTROL_TIME_LIMIT)
def absorb_update(result: Any, job_id: str, index: int,
                  attempt: int | None = None) -> dict[str, Any]:
    """A buffered job's training task finished (its ``link`` callback, which names the
    task number and attempt it was sent with)."""
    from fedq.coordinator import buffered

    return buffered.absorb(get_settings(), result, job_id, index, attempt)


@app.task(name=REGISTER_WORKER_TASK, time_limit=CONTROL_TIME_LIMIT)
def register_worker(hostname: Any, queues: Any, hardware: Any, version: Any = None,
                    message_format: Any = None, signed: Any = None) -> str:
    """A worker started (the version handshake: its fedq version and message format;
    a worker from before the handshake sends neither). Checked by the roster; with
    FEDQ_IDENTITY=required it must be ``signed`` by a registered worker."""
    from fedq.coordinator import roster

    settings = get_settings()
    args = (hostname, queues, hardware, version, message_format)
    try:
        signer = roster.message_signer(settings, REGISTER_WORKER_TASK, args, signed)
    except Refused as exc:
        return roster.refused(REGISTER_WORKER_TASK, hostname, exc)
    return roster.record_worker(settings.database_url, *args, signer=signer)


@app.task(name=WORKER_STATE_TASK, time_limit=CONTROL_TIME_LIMIT)
def worker_state(hostname: Any, available: Any, reason: Any = None, signed: Any = None) -> str:
    """A worker with a run policy stepped aside for its owner, or came back
    (fedq/worker/owner.py). Checked by the roster; with FEDQ_IDENTITY=required it must
    be ``signed`` by a registered worker."""
    from fedq.coordinator import roster

    settings = get_settings()
    args = (hostname, available, reason)
    try:
        signer = roster.message_signer(settings, WORKER_STATE_TASK, args, signed)
    except Refused as exc:
        return roster.refused(WORKER_STATE_TASK, hostname, exc)
    return roster.record_availability(settings.database_url, *args, signer=signer)


@app.task(name=WATCHDOG_TASK, time_limit=CONTROL_TIME_LIMIT)
def watchdog() -> list[dict[str, Any]]:
    from fedq.coordinator.watchdog import run_watchdog

    return run_watchdog(get_settings())


@app.task(name=JOIN_WORKER_TASK, time_limit=CONTROL_TIME_LIMIT)
def join_worker(proof: Any) -> dict[str, Any]:
    """A worker machine registers its public key with its one-time token (``fedq worker
    join``; fedq/coordinator/enrol.py checks every field)."""
    from fedq.coordinator import enrol

    return enrol.join(get_settings().database_url, proof)
