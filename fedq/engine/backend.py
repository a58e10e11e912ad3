"""Celery's Redis result backend, without result subscriptions that nobody reads.

Celery's Redis backend subscribes the process to a task's result channel whenever a
``GroupResult`` is built, whether or not anybody will wait on it: a chord builds two
(``RedisBackend.apply_chord`` and the header group), so every chord a fedq worker sent
subscribed it to each training task's channel. fedq reads results by task id and
never waits inside a worker, so the subscriptions (and the result objects Celery kept
for them) only piled up: 400 channels after 100 rounds of 4 clients on the control
worker, whose memory grew with them (docs/benchmarks.md, "Scale"). Unsubscribing
afterwards does not help: redis-py keeps each channel until the confirmation is read,
and nothing reads that connection.

Inside a worker (where Celery says joining a result would block) this backend does
not register results as pending; everywhere else it is Celery's. ``fedq.engine.app`` selects
it for ``redis://`` and ``rediss://`` result backends.
"""

from __future__ import annotations

from typing import Any

from celery._state import task_join_will_block
from celery.backends.redis import RedisBackend as CeleryRedisBackend


class RedisBackend(CeleryRedisBackend):  # type: ignore[misc]
    def _add_pending_result(self, task_id: str, result: Any, weak: bool = False) -> None:
        if task_join_will_block():  # a worker: nobody will wait on this result here
            return
        super()._add_pending_result(task_id, result, weak=weak)
