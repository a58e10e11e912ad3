"""Finalizing a round: collect, verify, aggregate, commit exactly once.

``finalize_round`` runs when a round's chord fires and when the watchdog finds a round
past its deadline or stuck. It gathers every result of the round from the result
backend (by the deterministic task ids, all attempts) plus any passed in, one per
client. Then:

- some client has no result yet and the deadline has not passed: wait;
- at least ``quorum`` usable updates: aggregate, evaluate and commit, recording
  clients without a result as ``missing``;
- otherwise re-dispatch the clients without a usable update (at most
  ``max_redispatch`` times), and past that fail the job with a reason.

That choice is :func:`fedq.coordinator.policy.decide`, a pure function; this module
reads the round, calls it, and does what it says.

The commit is ``UPDATE rounds SET status='committed' ... WHERE status='training'`` in
the same transaction as the client rows and the job's new model pointer, so only one
delivery, chord or watchdog, commits. A result that reaches a finalized round is
recorded as ``late`` and used nowhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update

from fedq.blobs import BlobRef
from fedq.coordinator import commit, lean
from fedq.coordinator.enrol import registry_if_required
from fedq.coordinator.intake import Sent, admit, known_limits, task_id, unread
from fedq.coordinator.pipeline import (
    Outcome,
    UpdateRecord,
)
from fedq.coordinator.policy import (
    Commit,
    Fail,
    Redispatch,
    RoundState,
    Wait,
    cap_per_worker,
    decide,
    pick_results,
    yielded_clients,
)
from fedq.coordinator.roster import (
    record_tasks,
    record_throughput,
    task_worker,
    worker_rows,
)
from fedq.coordinator.rounds import redispatch, request_round, start_round
from fedq.db import ClientUpdate, Job, Round, WatchdogAction, session_scope
from fedq.db.models import aware, utcnow
from fedq.db.rows import fill_row, insert_rows, new_row
from fedq.db.session import lock_row
from fedq.engine.app import app
from fedq.engine.backend import UNREAD, task_metas, unread_reason
from fedq.engine.broker import live_queues
from fedq.engine.revoke import revoke_quietly
from fedq.phases import current_times, phase, recording, summary
from fedq.process import PROCESS
from fedq.protocol.training import UpdateRef
from fedq.settings import Settings, get_settings
from fedq.spec import JobSpec
from fedq.status import JobStatus, RoundStatus, UpdateStatus, failed_status
from fedq.testing import hold

log = logging.getLogger(__name__)


def collect(job_id: str, number: int, gen: int, attempts: int,
            queues: dict[int, str], spec: JobSpec) -> list[UpdateRef]:
    """Every finished training result of a round in the result backend, read by the
    task ids this coordinator sent (all attempts so far) and admitted against them
    (fedq/coordinator/intake.py): who a result is for comes from its task id."""
    registry = registry_if_required(get_settings())
    sent = [Sent(job_id, number, client, attempt, gen, queue)
            for client, queue in queues.items() for attempt in range(1, attempts + 1)]
    metas = task_metas(app.backend, [s.task_id for s in sent])  # a batch a round trip
    return [unread(s, why) if (why := unread_reason(meta)) is not None
            else admit(meta.get("result"), s, known_limits(spec, s.client), registry)
            for s, meta in zip(sent, metas, strict=True)
            if meta.get("status") in ("SUCCESS", *UNREAD)]


@dataclass(frozen=True)
class OpenRound:
    """A round in training, as read from the database."""

    spec: JobSpec
    model: BlobRef
    state: RoundState
    started_at: datetime
    queues: dict[int, str]  # client -> queue
    server_state: BlobRef | None  # the server optimizer's state after the previous round


def open_round(settings: Settings, job_id: str, round_number: int) -> OpenRound | None:
    """The round if it is training in a running job, else None."""
    with session_scope(settings.database_url) as s:
        found = s.execute(select(Job, Round).join(Round, Round.job_id == Job.id).where(
            Job.id == job_id, Round.number == round_number)).first()  # one round trip
        if found is None:
            return None
        job, rnd = found
        if rnd.status != RoundStatus.TRAINING or job.status != JobStatus.RUNNING:
            return None
        spec = JobSpec.stored(job.spec)
        clients = tuple(rnd.planned["clients"])
        return OpenRound(
            spec=spec, model=BlobRef(job.global_key, job.global_sha256, job.global_size),
            state=RoundState(job=job_id, number=round_number, gen=rnd.id, attempt=rnd.attempt,
                             clients=clients,
                             deadline=aware(rnd.deadline) if rnd.deadline else None,
                             quorum=spec.quorum, max_redispatch=spec.max_redispatch,
                             sent=dict(zip(clients, rnd.planned["sent"], strict=True))
                             if "sent" in rnd.planned else None,
                             yields=rnd.planned.get("yields", 0)),
            started_at=aware(rnd.started_at),
            queues=dict(zip(clients, rnd.planned["queues"], strict=True)),
            server_state=BlobRef(job.state_key, job.state_sha256 or "", job.state_size or 0)
            if job.state_key else None)


def finalize_round(settings: Settings, job_id: str, round_number: int) -> dict[str, Any]:
    """Decide round ``round_number`` (fedq/coordinator/policy.py) and do what it says:
    wait, commit, re-dispatch or fail. Safe to call any number of times, from any
    number of processes. The results are read from the backend by their task ids:
    what the chord passes its body is a doorbell, never read (a worker could put
    anything there)."""
    with recording():
        return _finalize_round(settings, job_id, round_number)


def _finalize_round(settings: Settings, job_id: str, round_number: int) -> dict[str, Any]:
    started = time.perf_counter()
    with phase("open round"):
        rnd = open_round(settings, job_id, round_number)
    if rnd is None:
        late = record_late(settings, job_id, round_number)
        return {"status": "skipped", "reason": "round not open", "late": late}
    st = rnd.state
    with phase("collect results"):
        chosen = cap_per_worker(pick_results(collect(job_id, round_number, st.gen, st.attempt,
                                                     rnd.queues, rnd.spec), st),
                                rnd.spec.max_updates_per_worker)
    now = utcnow()
    decision = decide(rnd.state, chosen, now)
    if isinstance(decision, Wait):
        # a worker that stepped aside for its owner: its client goes again (watchdog)
        yielded = list(yielded_clients(chosen, st))
        return {"status": "waiting", "pending": list(decision.pending), "attempt": st.attempt,
                "gen": st.gen, "can_redispatch": st.can_redispatch,
                "yielded": yielded}
    log.info("finalizing job %s round %d (attempt %d, %d results): %s", job_id, round_number,
             rnd.state.attempt, len(chosen), type(decision).__name__.lower())
    outcome = Outcome()
    if isinstance(decision, Commit):
        hold.at("finalize", f"{job_id}-r{round_number}", "control")  # fault tests only
        done = _aggregate_and_commit(settings, rnd, chosen, decision, outcome, started)
        if done is not None:
            return done
        # Too few updates passed verification: decide again without the rejected ones.
        decision = decide(rnd.state, chosen, now, rejected=outcome.rejected)
        if isinstance(decision, Commit):  # the reducer found nothing usable after all
            decision = decide(rnd.state, chosen, now, rejected=list(rnd.state.clients))
    else:  # below the quorum without reading a blob: record what arrived as it is
        outcome.records += [UpdateRecord(ref, UpdateStatus.OK) if ref.status == UpdateStatus.OK else
                            UpdateRecord(ref, failed_status(ref.status),
                                         ref.error or "task failed")
                            for ref in chosen.values()]
    if isinstance(decision, Redispatch):
        for_yields = all(c in chosen and chosen[c].status == UpdateStatus.YIELDED
                         for c in decision.clients)
        if redispatch(settings, job_id, round_number, rnd.state.attempt, decision.clients,
                      for_yields=for_yields):
            return {"status": "redispatched", "clients": list(decision.clients),
                    "attempt": decision.attempt}
        return {"status": "skipped", "reason": "re-dispatched by another delivery"}
    assert isinstance(decision, Fail)
    return _fail(settings, rnd, decision, outcome)


def _aggregate_and_commit(settings: Settings, rnd: OpenRound, chosen: dict[int, UpdateRef],
                          decision: Commit, outcome: Outcome,
                          started: float) -> dict[str, Any] | None:
    """Verify, reduce, step the server optimizer, evaluate, write blobs, commit. None when
    fewer than the quorum of updates pass verification (nothing is written then)."""
    spec, job_id, number = rnd.spec, rnd.state.job, rnd.state.number
    store = PROCESS.blobs(settings)
    source = rnd.model if lean.applies(spec, store.piece_bytes, rnd.model.size) else None
    with phase("current model"):
        current = commit.current_model(store, rnd.model) if source is None \
            else lean.outline(store, rnd.model)
    new = commit.aggregate(spec, store, job_id, number, list(chosen.values()), current,
                           rnd.model.sha256, rnd.server_state, outcome,
                           settings.home / "scratch", PROCESS.accumulator, source=source)
    if new is None:
        return None
    rows = _rows(job_id, outcome.records)
    rows += [ClientUpdate(job_id=job_id, round_number=number, client=c, status=UpdateStatus.MISSING,
                          queue=rnd.queues[c],
                          error=f"no result by the deadline (attempt {rnd.state.attempt})")
             for c in decision.missing]
    seconds = (utcnow() - rnd.started_at).total_seconds()
    metrics = commit.metrics(new, outcome, sum(r.bytes_up or 0 for r in rows),
                             sum(r.bytes_down or 0 for r in rows), seconds,
                             time.perf_counter() - started)
    with phase("commit (SQL)"):
        committed, done = _commit(settings, job_id, rnd.state.gen, rows,
                                  throughput=outcome.throughput, metrics=metrics, new=new,
                                  total=spec.rounds)
    if not committed:
        return {"status": "skipped", "reason": "round committed by another delivery"}
    if decision.missing:  # before the next round's tasks queue up behind them
        _revoke_stragglers(rnd, decision.missing)
    if done:
        PROCESS.accumulator.release()
    else:
        with phase("next dispatch"):
            _start_next(settings, job_id, number + 1)
    with phase("settle"):  # after the next round is out: only space waits on it
        commit.settle(settings, store, spec, job_id, new, rows)
    accuracy = new.accuracy
    log.info("job %s round %d committed: accuracy %s, %d clients, %.2fs (finalize %.2fs)",
             job_id, number, "-" if accuracy is None else f"{accuracy:.4f}",
             outcome.accepted, seconds, time.perf_counter() - started)
    log.info("job %s round %d finalize phases: %s", job_id, number, summary(current_times()))
    return {"status": "committed", "round": number, "accuracy": accuracy}


def _revoke_stragglers(rnd: OpenRound, missing: Sequence[int]) -> None:
    """The tasks of clients a committed round went without: one still in its queue is
    refused untrained by the worker that takes it (fedq/engine/revoke.py); one already
    training goes on and is recorded late."""
    st = rnd.state
    ids = [task_id(st.job, st.number, a, c, st.gen) for c in missing
           for a in range(1, st.attempt + 1)]
    revoke_quietly(ids, f"round {st.number} committed without it",
                   f"straggler task(s) of job {st.job} round {st.number}")


def _rows(job_id: str, records: Sequence[UpdateRecord]) -> list[ClientUpdate]:
    """One client_updates row per record."""
    return [new_row(job_id, r.ref.round, r.ref, r.status, r.error, r.norm, r.raw_bytes)
            for r in records]


def _start_next(settings: Settings, job_id: str, round_number: int) -> None:
    """Start the next round here and now (one broker hop less than sending start_round
    to the control queue); if that fails, leave it to a start_round task."""
    try:
        start_round(settings, job_id, round_number)
    except Exception:  # the database or broker hiccupped: a control worker retries
        log.exception("job %s: starting round %d in finalize failed; queued instead",
                      job_id, round_number)
        request_round(job_id, round_number)


def _fail(settings: Settings, rnd: OpenRound, decision: Fail,
          outcome: Outcome) -> dict[str, Any]:
    """Fail the job with a reason a person can act on; record every client's row."""
    number, job_id = rnd.state.number, rnd.state.job
    queues = sorted({rnd.queues[c] for c in decision.clients})
    try:
        live: set[str] | None = set(live_queues(timeout=1.0))
    except Exception:  # no answer: say nothing about consumers
        live = None
    idle = [q for q in queues if live is not None and q not in live]
    errors = sorted({r.error for r in outcome.records if r.error})
    reason = (f"round {number}: {decision.usable} usable update(s) of "
              f"{len(rnd.state.clients)} after {rnd.state.attempt} attempt(s); quorum is "
              f"{rnd.state.quorum}. Clients without an update: "
              f"{', '.join(map(str, decision.clients))} on queue(s) {', '.join(queues)}"
              + (f" (no live worker consumes {', '.join(idle)}: start one with "
                 f"`celery -A fedq worker -Q {idle[0]}`)" if idle else "")
              + (f"; errors: {'; '.join(errors)[:1000]}" if errors else "")
              + f". Fix that, then `fedq resume {job_id}`.")
    rows = _rows(job_id, outcome.records)
    reported = {r.client for r in rows}
    rows += [ClientUpdate(job_id=job_id, round_number=number, client=c, status=UpdateStatus.MISSING,
                          queue=rnd.queues[c], error="no result")
             for c in rnd.state.clients if c not in reported]
    _commit(settings, job_id, rnd.state.gen, rows, failed=reason)
    return {"status": "failed", "reason": reason}


def record_late(settings: Settings, job_id: str, round_number: int) -> int:
    """Record results that reached an already finalized round: a missing client's as
    ``late``, and a copy from an earlier attempt of a client that was re-dispatched and
    trained elsewhere (a worker that was paused, or cut off, past the heartbeat bound)
    as a ``late copy`` action. Neither is ever averaged into any model. Returns how many
    were recorded; safe to call again (nothing is recorded twice)."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        rnd = s.scalar(select(Round).where(Round.job_id == job_id,
                                           Round.number == round_number))
        if job is None or rnd is None or rnd.status == RoundStatus.TRAINING:
            return 0
        waiting = set(s.scalars(select(ClientUpdate.client).where(
            ClientUpdate.job_id == job_id, ClientUpdate.round_number == round_number,
            (ClientUpdate.status == UpdateStatus.MISSING) |
            ((ClientUpdate.status == UpdateStatus.OK) & (ClientUpdate.attempt > 1)))))
        if not waiting:
            return 0
        spec = JobSpec.stored(job.spec)
        queues = {c: q for c, q in zip(rnd.planned["clients"], rnd.planned["queues"],
                                       strict=True) if c in waiting}
        gen, attempts = rnd.id, rnd.attempt
    refs = [r for r in collect(job_id, round_number, gen, attempts, queues, spec)
            if r.status == UpdateStatus.OK]
    if not refs:
        return 0
    late = 0
    with session_scope(settings.database_url) as s:
        rows = {r.client: r for r in s.scalars(select(ClientUpdate).where(
            ClientUpdate.job_id == job_id, ClientUpdate.round_number == round_number))}
        seen = set(s.scalars(select(WatchdogAction.action).where(
            WatchdogAction.job_id == job_id, WatchdogAction.round_number == round_number)))
        for ref in refs:
            row = rows.get(ref.client)
            if row is not None and row.status == UpdateStatus.MISSING:
                fill_row(row, ref)
                row.status, row.error = UpdateStatus.LATE, "arrived after the round was finalized"
                late += 1
            elif row is not None and row.status == UpdateStatus.OK and ref.attempt < row.attempt:
                action = late_copy(ref)
                if action not in seen:
                    s.add(WatchdogAction(job_id=job_id, round_number=round_number,
                                         action=action, result="not used"))
                    seen.add(action)
                    late += 1
    return late


def late_copy(ref: UpdateRef) -> str:
    """How a late copy is recorded: which client, which attempt, whose (64 characters)."""
    return f"late copy of client {ref.client} (attempt {ref.attempt}) from {ref.worker}"[:64]


def _commit(settings: Settings, job_id: str, round_id: int, rows: list[ClientUpdate], *,
            throughput: Sequence[tuple[str, int, float]] = (),
            failed: str | None = None, metrics: dict[str, Any] | None = None,
            new: commit.NewModel | None = None, total: int = 0) -> tuple[bool, bool]:
    """One transaction: claim the round, write client rows, move the job. Returns
    (committed, job_done); (False, _) when another delivery got there first."""
    now = utcnow()
    with session_scope(settings.database_url) as s:
        job = lock_row(s, Job, job_id)  # first, as `fedq cancel` and buffered jobs do
        assert job is not None
        values: dict[str, Any] = {"status": RoundStatus.FAILED if failed
                                  else RoundStatus.COMMITTED,
                                  "finished_at": now, "error": failed}
        values.update(metrics or {})
        claimed = s.execute(update(Round).where(
            Round.id == round_id, Round.status == RoundStatus.TRAINING).values(**values))
        if claimed.rowcount != 1:  # type: ignore[attr-defined]
            s.rollback()
            return False, False
        insert_rows(s, rows)
        workers = worker_rows(s, [h for h, _, _ in throughput] +
                              [w for r in rows if (w := task_worker(r)) is not None])
        record_throughput(s, throughput, workers)
        record_tasks(s, rows, workers)
        done = True
        if failed:
            job.status, job.error, job.finished_at = JobStatus.FAILED, failed, now
        else:
            assert new is not None
            commit.advance(job, new)
            done = new.number >= total
            if done:
                job.status, job.finished_at = JobStatus.COMPLETED, now
    return True, done
