"""What every task a worker runs for the coordinator does before and after its work, once
(Celery's way to share it: a base ``Task`` class, ``@app.task(base=WorkerTask)``).

A task on a training or inference queue carries a body the coordinator sealed for its
task id, and its answer is read by the coordinator, which trusts nothing it did not
check (docs/security.md). So, in this order:

1. :meth:`WorkerTask.unseal`: a worker that joined a coordinator (``fedq worker join``)
   takes only bodies sealed by it for this task id (fedq/identity.py); anything else
   is answered at once with the task's refusal, signed, never run.
2. :meth:`WorkerTask.revoked_else_claim`: a task revoked while it waited in its queue
   (its job cancelled or ended) is answered untrained; else its claim, the first
   heartbeat, is stored in the same round trip (fedq/engine/revoke.py).
3. :meth:`WorkerTask.beating`: the claim's heartbeat while the work runs, so a dead
   worker's task is sent again in seconds, and a task revoked with ``stop`` learns it
   (fedq/worker/heartbeat.py).
4. :meth:`WorkerTask.signed`: the answer, signed by a joined worker for this task id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import Task

import fedq.identity as identity
from fedq.settings import Settings, get_settings
from fedq.worker.heartbeat import Heartbeat, claim, claim_unless_revoked

log = logging.getLogger(__name__)


class WorkerTask(Task):  # type: ignore[misc]
    """The base of the tasks that run on a worker's hardware queue."""

    _me: tuple[str | None, identity.Joined | None] = (None, None)

    @property
    def settings(self) -> Settings:
        return get_settings()

    @property
    def worker(self) -> str:
        """This worker's name as Celery gives it (``name@host``)."""
        return str(self.request.hostname or "unknown")

    def me(self) -> identity.Joined | None:
        """This machine's worker identity, if it joined a coordinator (read once a
        task)."""
        if self._me[0] != self.request.id:
            self._me = (self.request.id, identity.joined(self.settings.keys_dir))
        return self._me[1]

    def unseal(self, body: Any, refusal: Callable[[str], dict[str, Any]]
               ) -> tuple[Any, dict[str, Any] | None]:
        """(the body without its seal, None), or, for a joined worker given a body its
        coordinator did not seal for this task id, (body, ``refusal(why)`` signed)."""
        me = self.me()
        if me is None:
            return body, None
        try:
            return identity.check_sealed(body, self.request.id, me.coordinator), None
        except identity.Refused as exc:
            log.warning("%s", exc)
            return body, me.sign_result(refusal(str(exc)), self.request.id)

    def revoked_else_claim(self) -> str | None:
        """Why this task was revoked before it started (nothing is written), else None
        with its claim stored."""
        return claim_unless_revoked(self.backend, self.request.id, self.worker)

    def beating(self) -> Heartbeat:
        """``with self.beating() as beat:`` around the work, after
        :meth:`revoked_else_claim` stored the first beat; ``beat.stopped()`` says why
        the task must stop, once its job was cancelled or ended."""
        return claim(self.backend, self.request.id, self.worker, self.settings.heartbeat_s,
                     written=True)

    def signed(self, result: dict[str, Any]) -> dict[str, Any]:
        """``result`` as this worker answers: signed for this task id when it joined a
        coordinator."""
        me = self.me()
        return result if me is None else me.sign_result(result, self.request.id)

    @property
    def delivered_to(self) -> str | None:
        """The queue the broker delivered this task from (its routing key)."""
        return (self.request.delivery_info or {}).get("routing_key") or None
