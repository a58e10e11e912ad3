"""The watchdog: repairs what a chord cannot. Celery beat runs it on the control queue
every ``FEDQ_WATCHDOG_INTERVAL`` seconds (never a countdown task per round: ETA tasks
longer than Redis' visibility timeout are redelivered again and again).

For each running job it looks at the round after the last committed one:

- no row: the round was never started (the control worker died between a commit and
  the next ``start_round``, or the message was lost): request it;
- training and past its deadline: finalize it (commit with the quorum, or re-dispatch
  the missing clients, or fail the job);
- training, every client has a result, but nothing committed it for a grace period: a
  chord that will never fire (its body was lost with a killed control worker): finalize.

Every repair is idempotent (unique round rows, conditional UPDATEs), so two watchdogs
running at once, or a watchdog racing a chord, do no harm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from fedq.db import Job, Round, session_scope
from fedq.db.models import utcnow
from fedq.db.session import ensure_schema
from fedq.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Next:
    """A running job and the round after its last committed one."""

    job: str
    number: int
    job_updated: datetime
    round: "_RoundState | None"


@dataclass(frozen=True)
class _RoundState:
    status: str
    started: datetime
    deadline: datetime | None
    task_ids: dict[int, list[str]]
    gen: int
    attempt: int


def _scan(settings: Settings) -> list[_Next]:
    from fedq.finalize import _aware
    from fedq.rounds import round_task_ids

    with session_scope(settings.database_url) as s:
        out = []
        for job in s.scalars(select(Job).where(Job.status == "running")):
            number = job.committed_round + 1
            rnd = s.scalar(select(Round).where(Round.job_id == job.id, Round.number == number))
            state = None if rnd is None else _RoundState(
                rnd.status, _aware(rnd.started_at),
                _aware(rnd.deadline) if rnd.deadline else None, round_task_ids(job.id, rnd),
                rnd.id, rnd.attempt)
            out.append(_Next(job.id, number, _aware(job.updated_at), state))
        return out


def run_watchdog(settings: Settings) -> list[dict[str, Any]]:
    """One pass over the running jobs; returns what it did, one dict per action."""
    from fedq.finalize import collect_results, finalize_round, pick_results, unsettled
    from fedq.rounds import request_round

    ensure_schema(settings.database_url)
    grace = timedelta(seconds=max(2 * settings.watchdog_interval, 5.0))
    now = utcnow()
    actions: list[dict[str, Any]] = []
    for item in _scan(settings):
        rnd = item.round
        if rnd is None:
            if now - item.job_updated > grace:
                request_round(item.job, item.number)
                actions.append({"job": item.job, "round": item.number, "action": "start"})
            continue
        if rnd.status != "training":
            continue
        if rnd.deadline is not None and now >= rnd.deadline:
            why = "deadline"
        elif now - rnd.started > grace and not unsettled(
                pick_results(collect_results(rnd.task_ids), item.job, item.number, rnd.gen,
                             list(rnd.task_ids)), list(rnd.task_ids), rnd.attempt):
            why = "stuck"
        else:
            continue
        result = finalize_round(settings, [], item.job, item.number)
        actions.append({"job": item.job, "round": item.number, "action": f"finalize ({why})",
                        "result": result.get("status")})
    for action in actions:
        log.warning("fedq watchdog: %s", action)
    return actions
