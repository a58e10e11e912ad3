"""Starting rounds on the coordinator: plan, write the round row, dispatch the chord.

``start_round`` writes the round row (unique per job and number: a duplicate delivery
writes nothing and dispatches nothing), then dispatches a chord of training tasks
whose body is ``finalize_round`` (fedq/coordinator/finalize.py). When the broker
refuses the tasks (down, out of memory, a permission), the row is withdrawn again, so
that the watchdog starts the round afresh once the broker answers (its ``start``
repair, a few seconds), not at the round's deadline. ``redispatch`` sends a round's
missing clients again, once per attempt, however many watchdogs ask; an attempt the
broker refuses is undone, so the watchdog's next pass tries it again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from celery import chord
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from fedq.blobs import BlobRef
from fedq.coordinator.intake import Sent, task_id
from fedq.coordinator.planning import Assignment, plan_round, sized_queues
from fedq.coordinator.roster import live_view, open_sites
from fedq.coordinator.steps import step_of
from fedq.db import Job, Round, session_scope
from fedq.db.models import utcnow
from fedq.engine.app import app, broker_errors, refusal, sending
from fedq.engine.names import CONTROL_QUEUE, FINALIZE_ROUND_TASK, START_ROUND_TASK, TRAIN_TASK
from fedq.phases import phase
from fedq.protocol.training import StepRef
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.status import JobStatus, RoundStatus

log = logging.getLogger(__name__)

#: Re-dispatches a round may make for workers that stepped aside before they count
#: against ``max_redispatch`` like any other.
MAX_YIELDS = 100


def round_task_ids(job_id: str, rnd: Round) -> dict[int, list[str]]:
    """Client -> task ids of every attempt so far, oldest first."""
    return {c: [task_id(job_id, rnd.number, a, c, rnd.id) for a in range(1, rnd.attempt + 1)]
            for c in rnd.planned["clients"]}


def start_round(settings: Settings, job_id: str, round_number: int) -> dict[str, Any]:
    """Write round ``round_number``'s row and dispatch its chord (idempotent). A
    buffered job has no rounds: its training slots are filled instead."""
    with phase("next: round row"), session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return {"status": "skipped", "reason": "job not running"}
        if JobSpec.stored(job.spec).buffered:
            from fedq.coordinator import buffered

            return buffered.start(settings, job_id)
        if job.committed_round != round_number - 1:
            return {"status": "skipped", "reason": f"job is at round {job.committed_round}"}
        spec = JobSpec.stored(job.spec)
        model, step = BlobRef(job.global_key, job.global_sha256, job.global_size), step_of(job)
        view = live_view(settings) \
            if spec.queues == "auto" or spec.clients_per_worker is not None else None
        available = view.available(sized_queues(spec)) \
            if view is not None and spec.clients_per_worker is not None else None
        opened = open_sites(s, spec.sites) if spec.sites is not None else None
        plan = plan_round(spec, round_number,
                          view.throughput if view is not None and spec.queues == "auto"
                          else None, available, opened)
        if available is not None:
            log.info("job %s round %d: %d worker slot(s) available: %d client(s) (of %d)",
                     job_id, round_number, available, len(plan), spec.clients_per_round)
        rnd = Round(job_id=job_id, number=round_number, status=RoundStatus.TRAINING, attempt=1,
                    deadline=utcnow() + timedelta(seconds=spec.round_timeout_s),
                    planned={"clients": [a.client for a in plan],
                             "queues": [a.queue for a in plan],
                             "sent": [1 for _ in plan]})
        s.add(rnd)
        try:
            s.flush()
        except IntegrityError:
            s.rollback()
            return {"status": "skipped", "reason": "round already started"}
        gen = rnd.id
    with phase("next: send tasks"):
        try:
            dispatch(job_id, round_number, spec, model, plan, attempt=1, gen=gen, step=step)
        except broker_errors() as exc:  # the watchdog starts the round again
            withdraw(settings, gen)
            why = refusal(exc)
            log.warning("job %s round %d: its tasks could not be sent (%s); the round is "
                        "withdrawn and the watchdog starts it again", job_id, round_number, why)
            return {"status": "unsent", "round": round_number, "error": why}
    return {"status": "started", "round": round_number, "clients": len(plan)}


def withdraw(settings: Settings, gen: int) -> None:
    """Delete the row of a round whose chord the broker refused (nothing of it is in SQL
    yet but the row). Tasks of a pipeline that went out before the refusal (64 a
    pipeline: fedq.engine.redis_transport) carry the withdrawn row's id in their task
    ids: their results are never read, and an update one stores under the key of the
    round started again (the same attempt's) can only replace it with bytes that fail
    the new result's digest, which are refused."""
    with session_scope(settings.database_url) as s:
        s.execute(delete(Round).where(Round.id == gen, Round.status == RoundStatus.TRAINING,
                                      Round.attempt == 1))


def redispatch(settings: Settings, job_id: str, round_number: int, from_attempt: int,
               clients: Sequence[int], for_yields: bool = False) -> bool:
    """Send ``clients`` of an open round again as attempt ``from_attempt + 1`` with a new
    deadline. Only one caller wins per attempt (a conditional UPDATE); returns whether
    this one did. ``for_yields``: every one of them was handed back by a worker that
    stepped aside for its owner, so this re-dispatch does not count against
    ``max_redispatch``, up to :data:`MAX_YIELDS` a round."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return False
        spec = JobSpec.stored(job.spec)
        deadline = s.scalar(select(Round.deadline).where(
            Round.job_id == job_id, Round.number == round_number))
        won = s.execute(
            update(Round)
            .where(Round.job_id == job_id, Round.number == round_number,
                   Round.status == RoundStatus.TRAINING, Round.attempt == from_attempt)
            .values(attempt=from_attempt + 1,
                    deadline=utcnow() + timedelta(seconds=spec.round_timeout_s)))
        if won.rowcount != 1:  # type: ignore[attr-defined]
            return False
        rnd = s.query(Round).filter_by(job_id=job_id, number=round_number).one()
        before = (rnd.planned, deadline)
        queue_of = dict(zip(rnd.planned["clients"], rnd.planned["queues"], strict=True))
        if "sent" in rnd.planned:  # each client's last attempt (policy.RoundState.sent)
            again = set(clients)
            yields = rnd.planned.get("yields", 0)
            rnd.planned = {**rnd.planned, "sent": [
                from_attempt + 1 if c in again else a
                for c, a in zip(rnd.planned["clients"], rnd.planned["sent"], strict=True)],
                "yields": yields + 1 if for_yields and yields < MAX_YIELDS else yields}
        model, step = BlobRef(job.global_key, job.global_sha256, job.global_size), step_of(job)
        gen = rnd.id
    plan = [Assignment(c, queue_of[c]) for c in clients]
    try:
        dispatch(job_id, round_number, spec, model, plan, attempt=from_attempt + 1, gen=gen,
                 step=step)
    except broker_errors():  # as if never tried: the next watchdog pass tries again
        planned, deadline = before
        with session_scope(settings.database_url) as s:
            s.execute(update(Round).where(Round.id == gen, Round.status == RoundStatus.TRAINING,
                                          Round.attempt == from_attempt + 1)
                      .values(attempt=from_attempt, planned=planned, deadline=deadline))
        log.warning("job %s round %d: clients %s could not be sent again; attempt %d is "
                    "undone and the watchdog tries again", job_id, round_number,
                    list(clients), from_attempt + 1)
        raise
    log.warning("job %s round %d: re-dispatched clients %s (attempt %d)", job_id,
                round_number, list(clients), from_attempt + 1)
    return True


def dispatch(job_id: str, round_number: int, spec: JobSpec, model: BlobRef,
             plan: Sequence[Assignment], *, attempt: int, gen: int,
             step: StepRef | None = None) -> None:
    """Send the chord: one ``train`` per assignment on its queue, ``finalize_round`` after."""
    spec_json = spec.to_json()
    # the train messages, then their task-sent events (one message, for the
    # dashboard), go out together: one Redis round trip, not one per client
    with sending() as events:
        header = [
            app.signature(TRAIN_TASK, args=(sent.message(spec_json, model, step,
                                                         spec.round_timeout_s),),
                          queue=a.queue, task_id=sent.task_id, argsrepr=sent.shown,
                          kwargsrepr="{}", event_dispatcher=events)
            for a in plan
            for sent in [Sent(job_id, round_number, a.client, attempt, gen, a.queue)]
        ]
        # immutable: the chord's last worker sends the body without the header's
        # results (finalize reads each result by its task id; tasks/control.py), so the
        # message stays small at any number of clients and carries nothing a worker
        # returned
        body = app.signature(FINALIZE_ROUND_TASK, args=(None, job_id, round_number),
                             queue=CONTROL_QUEUE, immutable=True,
                             argsrepr=f"job {job_id} round {round_number}", kwargsrepr="{}")
        chord(header)(body)


def request_round(job_id: str, round_number: int) -> None:
    """Ask the control queue to start ``round_number`` (after a commit, on submit, resume)."""
    app.send_task(START_ROUND_TASK, args=(job_id, round_number), queue=CONTROL_QUEUE)

