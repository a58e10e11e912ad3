"""Revoking training tasks so that a worker started later refuses them too.

Celery's revoke is a broadcast on the remote-control channel: the workers alive at that
moment remember the ids in memory, and a worker started afterwards never hears of it
(Mingle, which would copy the list at start-up, is off: docs/architecture.md). So a
worker that started after a job was cancelled, failed or completed, or after a closed
site's slot moved elsewhere, took the revoked task still waiting in its queue, trained
it in full and sent an update nobody wanted, while the live tasks behind it waited.

:func:`revoke` therefore also stores each id as ``REVOKED`` in the result backend, and
the training and inference tasks read their own state there before they start
(fedq/tasks/train.py, fedq/tasks/infer.py): a revoked task is answered at once, untrained.
:func:`revoke_quietly` is the same for callers whose tasks may as well run (a job that
ended, a round that committed): it logs a failure instead of raising it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import states

from fedq.engine.app import app

log = logging.getLogger(__name__)


def revoke(ids: Sequence[str], why: str) -> None:
    """Revoke the tasks ``ids``: each is marked ``REVOKED`` in the result backend, then
    the revocation is broadcast to the live workers. Raises what the backend or broker
    raises."""
    for tid in ids:
        app.backend.mark_as_revoked(tid, reason=why[:200])
    if ids:
        app.control.revoke(list(ids))


def revoke_quietly(ids: Sequence[str], why: str, what: str) -> bool:
    """:func:`revoke`, logging instead of raising when the backend or broker fails: the
    tasks then run and their answers are dropped or recorded late, only compute is lost.
    ``what`` names the tasks in that warning ("straggler task(s) of job J round N")."""
    if not ids:
        return True
    try:
        revoke(ids, why)
    except Exception as exc:  # noqa: BLE001 - kombu and redis raise transport-specific errors
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        log.warning("could not revoke %d %s: %s", len(ids), what, first)
        return False
    return True


def revoked(backend: Any, task_id: str) -> str | None:
    """Why task ``task_id`` was revoked, if :func:`revoke` marked it; else None.

    On a key-value backend (Redis) a task nobody wrote yet, nearly every task, costs
    one GET: Celery's ``get_task_meta`` also decodes what it reads and builds its
    answer, several times the GET's cost on a busy worker."""
    if hasattr(backend, "get") and hasattr(backend, "get_key_for_task"):
        if backend.get(backend.get_key_for_task(task_id)) is None:
            return None
    meta = backend.get_task_meta(task_id)
    if not isinstance(meta, dict) or meta.get("status") != states.REVOKED:
        return None
    return str(meta.get("result") or "revoked")[:200]
