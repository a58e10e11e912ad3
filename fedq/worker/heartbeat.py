"""A training task's claim and heartbeat, kept in the result backend while it runs.

When a training task starts it writes ``STARTED`` with ``{"hostname", "pid", "beat"}``
under its own task id, and writes it again with the counter one higher every
``FEDQ_HEARTBEAT_S`` seconds from a thread, so a task that trains in the worker's main
thread (``--pool solo``) beats too. The watchdog reads the counter
(fedq/coordinator/liveness.py): a counter that stopped moving means the process died,
hangs or was paused, and the task is sent again after ``FEDQ_WORKER_LOST_S``.

The thread is stopped and joined before the task returns, so a heartbeat can never
overwrite the task's result. On fedq's Redis backend a beat is written only while the
task is not revoked with ``stop`` (its job was cancelled or ended: fedq/engine/revoke.py);
once it is, the beats end and :attr:`Heartbeat.stopped` says why, so training stops at
its next step (fedq/worker/update.py).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fedq.engine.revoke import revoked_else_claim, revoked_reason
from fedq.protocol.envelope import CLAIM_STATE

log = logging.getLogger(__name__)


class Heartbeat:
    """``with Heartbeat(write, host, interval):`` around the task's work; ``write(meta)``
    stores ``meta`` as the task's STARTED state and returns None, or the reason the task
    must stop (nothing was written, no beat follows; :attr:`stopped` holds it)."""

    def __init__(self, write: Callable[[dict[str, Any]], str | None], host: str,
                 interval: float, written: bool = False) -> None:
        """``written``: the first beat (``beat_meta(host, 0)``) is stored already."""
        self._write, self._host, self._interval = write, host, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 1 if written else 0
        self._failed = False
        self._stopped: str | None = None

    def stopped(self) -> str | None:
        """Why the task must stop now (its job was cancelled or ended), else None."""
        return self._stopped

    def _beat(self) -> None:
        try:
            why = self._write(beat_meta(self._host, self.beats))
            if why is not None:
                log.warning("task revoked while it runs (%s): it stops", why)
                self._stopped = why
                self._stop.set()
                return
            self.beats += 1
        except Exception as exc:  # noqa: BLE001 - a missed beat is the watchdog's business
            if not self._failed:
                log.warning("heartbeat not written (%s: %s); the task goes on",
                            type(exc).__name__, exc)
            self._failed = True

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def __enter__(self) -> Heartbeat:
        if self.beats == 0:
            self._beat()
        self._thread = threading.Thread(target=self._run, name="fedq-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def beat_meta(host: str, beat: int) -> dict[str, Any]:
    """What a heartbeat stores: the worker, its process and the counter."""
    return {"hostname": host, "pid": os.getpid(), "beat": beat}


def claim(backend: Any, task_id: str, host: str, interval: float,
          written: bool = False) -> Heartbeat:
    """The heartbeat of task ``task_id`` in ``backend`` (a Celery result backend): on
    fedq's Redis backend each beat is kept out only by a ``stop`` revocation, which ends
    the beats; on any other it is ``store_result``. ``written``: its first beat,
    ``beat_meta(host, 0)``, is stored already (fedq/engine/revoke.py's
    ``revoked_else_claim``)."""
    store = getattr(backend, "store_unless_revoked", None)
    if store is None or getattr(backend, "serializer", None) != "json":
        def write(meta: dict[str, Any]) -> str | None:
            backend.store_result(task_id, meta, CLAIM_STATE)
            return None
    else:
        def write(meta: dict[str, Any]) -> str | None:
            stored = store(task_id, meta, CLAIM_STATE, stopping_only=True)
            return None if stored is None else revoked_reason(stored)
    return Heartbeat(write, host, interval, written)


def claim_unless_revoked(backend: Any, task_id: str, host: str) -> str | None:
    """Why task ``task_id`` was revoked (then nothing is written), else None with its
    claim, the first beat, stored: one round trip on fedq's Redis result backend
    (fedq/engine/revoke.py). Then ``claim(..., written=True)`` beats on."""
    return revoked_else_claim(backend, task_id, beat_meta(host, 0), CLAIM_STATE)
