"""Revoking training tasks so that a worker started later refuses them too.

Celery's revoke is a broadcast on the remote-control channel: the workers alive at that
moment remember the ids in memory, and a worker started afterwards never hears of it
(Mingle, which would copy the list at start-up, is off: docs/architecture.md). So a
worker that started after a job was cancelled, failed or completed, or after a closed
site's slot moved elsewhere, took the revoked task still waiting in its queue, trained
it in full and sent an update nobody wanted, while the live tasks behind it waited.

:func:`revoke` therefore also stores each id as ``REVOKED`` in the result backend, and
the training and inference tasks read their own state there before they start
(fedq/tasks/base.py, the tasks' preamble): a revoked task is answered at once, untrained.
:func:`revoke_quietly` is the same for callers whose tasks may as well run (a job that
ended, a round that committed): it logs a failure instead of raising it.

With ``stop`` (a job cancelled or failed, a buffered task whose site closed and whose
slot went elsewhere: nobody will use the answer) a task already running stops too, on
fedq's Redis backend: its heartbeat reads the mark (fedq/worker/heartbeat.py) and
training ends at its next step, answered as revoked. A straggler of a committed round
is revoked without ``stop``: it trains on and is recorded late.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend
from celery.exceptions import TaskRevokedError
from kombu.exceptions import DecodeError

from fedq.engine.app import app
from fedq.engine.backend import decode_state

log = logging.getLogger(__name__)


def revoke(ids: Sequence[str], why: str, stop: bool = False) -> None:
    """Revoke the tasks ``ids``: each is marked ``REVOKED`` in the result backend, then
    the revocation is broadcast to the live workers; with ``stop`` a running one stops
    at its next heartbeat (on Redis). Raises what the backend or broker raises."""
    if not ids:
        return
    if isinstance(app.backend, RedisBackend):
        _mark_redis(app.backend, ids, why[:200], stop)
    else:
        for tid in ids:
            app.backend.mark_as_revoked(tid, reason=why[:200])
    app.control.revoke(list(ids))


def _mark_redis(backend: RedisBackend, ids: Sequence[str], why: str,
               stop: bool = False) -> None:
    """What ``mark_as_revoked`` stores for each id, in two round trips for all of them
    instead of two each (bench/revoke.py measures both), with ``"stop": true`` added
    when a running task must stop. As Celery's ``store_result`` does, a task whose
    result is already ``SUCCESS`` keeps it: the coordinator may still read that result
    (a lost callback)."""
    keys = [backend.get_key_for_task(tid) for tid in ids]
    with backend.client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.get(key)
        stored = pipe.execute()
    result = backend.encode_result(TaskRevokedError(why), states.REVOKED)
    meta = backend._get_result_meta(result=result, state=states.REVOKED, traceback=None,
                                    request=None)  # one date_done for the batch
    if stop:
        meta["stop"] = True
    with backend.client.pipeline(transaction=False) as pipe:
        for tid, key, now in zip(ids, keys, stored):
            if _succeeded(backend, now):
                continue
            value = backend.encode({**meta, "task_id": tid})
            pipe.set(key, value, ex=backend.expires or None)
            pipe.publish(key, value)  # as RedisBackend.set: a waiting AsyncResult hears it
        pipe.execute()


def _succeeded(backend: RedisBackend, stored: bytes | None) -> bool:
    """Whether a result backend value is a ``SUCCESS``; anything that does not decode
    (a worker can write its task's key) is not, and is overwritten. Only the status is
    read: the value is deserialised, not turned into a result (no exception rebuilt
    from what a worker wrote)."""
    if stored is None:
        return False
    try:
        meta = backend.decode(stored)
    except DecodeError:  # kombu wraps whatever its deserialiser raised
        return False
    return isinstance(meta, dict) and meta.get("status") == states.SUCCESS


def revoke_quietly(ids: Sequence[str], why: str, what: str, stop: bool = False) -> None:
    """:func:`revoke` (``stop`` as there), logging instead of raising when the backend or
    broker fails: the tasks then run and their answers are dropped or recorded late, only
    compute is lost.
    ``what`` names the tasks in that warning ("straggler task(s) of job J round N")."""
    try:
        revoke(ids, why, stop)
    except Exception as exc:  # noqa: BLE001 - kombu and redis raise transport-specific errors
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        log.warning("could not revoke %d %s: %s", len(ids), what, first)


def revoked_else_claim(backend: Any, task_id: str, claim: dict[str, Any],
                       state: str) -> str | None:
    """:func:`revoked`; and when the task was not revoked, ``claim`` stored as its
    ``state`` (a training task's first heartbeat, fedq/worker/heartbeat.py). On
    fedq's Redis backend both are one round trip (``store_unless_revoked``), on any
    other two."""
    store = getattr(backend, "store_unless_revoked", None)
    if store is None or getattr(backend, "serializer", None) != "json":
        why = revoked(backend, task_id)
        if why is None:
            backend.store_result(task_id, claim, state)
        return why
    stored = store(task_id, claim, state)
    return None if stored is None else revoked_reason(stored)


def revoked_reason(meta: Any) -> str:
    """The reason a ``REVOKED`` state names (``TaskRevokedError(why)`` as the backend
    stores an exception: ``exc_message`` a list of one string), read without rebuilding
    the exception. A worker's Redis user can write any task's key, so anything else
    (another shape, a long text, line breaks for the log) reads as plain "revoked" or is
    cut to one line of at most 200 characters."""
    result = meta.get("result") if isinstance(meta, dict) else None
    message = result.get("exc_message") if isinstance(result, dict) else None
    if isinstance(message, list) and len(message) == 1:
        message = message[0]
    if not isinstance(message, str) or not message.strip():
        return "revoked"
    return " ".join(message[:200].split())


def revoked(backend: Any, task_id: str) -> str | None:
    """Why task ``task_id`` was revoked, if :func:`revoke` marked it; else None.

    On a key-value backend (Redis) it is one GET, decoded only when there is a state
    (nearly every task has none yet), by :func:`fedq.engine.backend.decode_state`."""
    if hasattr(backend, "get") and hasattr(backend, "get_key_for_task"):
        raw = backend.get(backend.get_key_for_task(task_id))
        if raw is None:
            return None
        meta = decode_state(backend, raw)  # one that does not decode is no revocation
    else:
        meta = backend.get_task_meta(task_id)
    if not isinstance(meta, dict) or meta.get("status") != states.REVOKED:
        return None
    return str(meta.get("result") or "revoked")[:200]
