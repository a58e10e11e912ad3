"""A training task's claim and heartbeat, kept in the result backend while it runs.

When a training task starts it writes ``STARTED`` with ``{"hostname", "pid", "beat"}``
under its own task id, and writes it again with the counter one higher every
``FEDQ_HEARTBEAT_S`` seconds from a thread, so a task that trains in the worker's main
thread (``--pool solo``) beats too. The watchdog reads the counter
(fedq/coordinator/liveness.py): a counter that stopped moving means the process died,
hangs or was paused, and the task is sent again after ``FEDQ_WORKER_LOST_S``.

The thread is stopped and joined before the task returns, so a heartbeat can never
overwrite the task's result.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fedq.engine.revoke import revoked_else_claim
from fedq.wire import CLAIM_STATE

log = logging.getLogger(__name__)


class Heartbeat:
    """``with Heartbeat(write, host, interval):`` around the task's work; ``write(meta)``
    stores ``meta`` as the task's STARTED state."""

    def __init__(self, write: Callable[[dict[str, Any]], None], host: str,
                 interval: float, written: bool = False) -> None:
        """``written``: the first beat (``beat_meta(host, 0)``) is stored already."""
        self._write, self._host, self._interval = write, host, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 1 if written else 0
        self._failed = False

    def _beat(self) -> None:
        try:
            self._write(beat_meta(self._host, self.beats))
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


def claim(store_result: Callable[[str, Any, str], Any], task_id: str, host: str,
          interval: float, written: bool = False) -> Heartbeat:
    """The heartbeat of task ``task_id``, written with ``store_result(task_id, meta,
    state)`` (a Celery result backend's); ``written``: its first beat, ``beat_meta(host,
    0)``, is stored already (fedq/engine/revoke.py's ``revoked_else_claim``)."""
    return Heartbeat(lambda meta: store_result(task_id, meta, CLAIM_STATE), host, interval,
                     written)


def claim_unless_revoked(backend: Any, task_id: str, host: str) -> str | None:
    """Why task ``task_id`` was revoked (then nothing is written), else None with its
    claim, the first beat, stored: one round trip on fedq's Redis result backend
    (fedq/engine/revoke.py). Then ``claim(..., written=True)`` beats on."""
    return revoked_else_claim(backend, task_id, beat_meta(host, 0), CLAIM_STATE)
