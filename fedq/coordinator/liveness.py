"""Who holds a training task, and whether it still lives: a dead worker costs seconds.

A training task, and an inference shard, claims itself when it starts and beats while
it runs (fedq/worker/heartbeat.py: ``STARTED`` with the worker's name and a counter, in
the result backend under the task id the coordinator chose; a lost worker's shard is
sent again the same way: fedq/coordinator/watchdog.py ``_rescue_shards``). Each
watchdog pass reads the claims of the tasks a round, a buffered job or an inference job
still waits for (:func:`observe`) and copies them to the ``claims`` table with the
time *it* saw the counter move: no worker's clock is trusted, and a worker can only say
what it holds, never when.

A claim whose counter has not moved for ``FEDQ_WORKER_LOST_S`` is lost
(:func:`fedq.coordinator.policy.lost_clients`): the worker died, hangs, was paused or
lost its link. Its client is sent again at once: a synchronous round re-dispatches
those clients as its next attempt (while attempts remain: ``max_redispatch``), a
buffered job re-sends the task. The round's deadline stays the backstop for a task that
never started (still queued, or prefetched by a worker that died) and for a round out
of attempts. A lost worker that comes back and reports is recorded late, or its result
is the one used if it arrives first; a client is never counted twice
(fedq/coordinator/policy.py ``pick_results``).

What a worker writes there is untrusted: a claim is read with bounds
(:func:`fedq.protocol.envelope.read_claim`), and the worst a lying worker can do is have
its own client sent again, at most ``max_redispatch`` times.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select

from fedq.coordinator import roster
from fedq.db import Claim, Job, session_scope
from fedq.db.models import InferenceJob, aware, utcnow
from fedq.engine.app import app
from fedq.engine.backend import task_metas
from fedq.protocol.envelope import read_claim
from fedq.settings import Settings
from fedq.status import JobStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    """A started task as the coordinator sees it."""

    task_id: str
    client: int
    host: str
    silent_s: float  # since the coordinator last saw its heartbeat move
    resent: bool  # already sent again because of this claim


def observe(settings: Settings, job_id: str, tasks: Mapping[str, int],
            now: datetime | None = None,
            meta: Callable[[str], Any] | None = None) -> list[Holder]:
    """Read the claims of ``tasks`` (task id -> client) that a job still waits for,
    record when each heartbeat moved, forget the job's other claims; the started ones.
    ``meta``: a task id's result-backend meta (default: the app's backend)."""
    now = now or utcnow()
    if meta is None:  # one MGET per 1,000 tasks, not a GET each (10,000 in a wide round)
        ids = list(tasks)
        meta = dict(zip(ids, task_metas(app.backend, ids), strict=True)).__getitem__
    beats = {tid: b for tid in tasks if (b := read_claim(meta(tid))) is not None}
    holders, moved = [], set()
    with session_scope(settings.database_url) as s:
        known = {c.task_id: c for c in s.scalars(select(Claim).where(Claim.job_id == job_id))}
        gone = [tid for tid in known if tid not in tasks]
        if gone:
            s.execute(delete(Claim).where(Claim.task_id.in_(gone)))
        for tid, b in beats.items():
            row = known.get(tid)
            if row is None:
                row = Claim(task_id=tid, job_id=job_id, client=tasks[tid], host=b.host,
                            beat=b.beat, moved_at=now)
                s.add(row)
                moved.add(b.host)
            elif (row.host, row.beat) != (b.host, b.beat):
                row.host, row.beat, row.moved_at = b.host, b.beat, now
                moved.add(b.host)
            holders.append(Holder(tid, tasks[tid], row.host,
                                  (now - aware(row.moved_at)).total_seconds(),
                                  row.resent_at is not None))
        if moved:  # a site worker recorded lost whose heartbeat moves again is back
            roster.back(s, moved)
    return holders


def mark_resent(settings: Settings, task_ids: list[str]) -> None:
    """These lost claims' clients were sent again: never again for the same claim."""
    if not task_ids:
        return
    with session_scope(settings.database_url) as s:
        for row in s.scalars(select(Claim).where(Claim.task_id.in_(task_ids))):
            row.resent_at = utcnow()


def forget_stopped(settings: Settings) -> None:
    """Drop the claims of jobs (training or inference) that no longer run."""
    with session_scope(settings.database_url) as s:
        running = select(Job.id).where(Job.status == JobStatus.RUNNING).union(
            select(InferenceJob.id).where(InferenceJob.status == JobStatus.RUNNING))
        s.execute(delete(Claim).where(Claim.job_id.not_in(running)))


def held(settings: Settings, job_id: str) -> list[Holder]:
    """The claims recorded for a job's open tasks (for `fedq watch` and `fedq status`)."""
    now = utcnow()
    with session_scope(settings.database_url) as s:
        return [Holder(c.task_id, c.client, c.host,
                       (now - aware(c.moved_at)).total_seconds(), c.resent_at is not None)
                for c in s.scalars(select(Claim).where(Claim.job_id == job_id)
                                   .order_by(Claim.client, Claim.task_id))]


def describe(holder: Holder, lost_s: float, unit: str = "client",
             doing: str = "training") -> str:
    """One line: "client 3 on cpu@host-2: heartbeat lost 18 s ago, re-dispatched"
    (an inference job's: ``unit="shard", doing="running"``)."""
    if holder.silent_s < lost_s and not holder.resent:
        state = f"{doing}, heartbeat {max(0.0, holder.silent_s):.0f} s ago"
    else:
        state = f"heartbeat lost {holder.silent_s:.0f} s ago" + \
            (", re-dispatched" if holder.resent else ", re-dispatch due")
    return f"{unit} {holder.client} on {holder.host}: {state}"
