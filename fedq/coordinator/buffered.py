"""Buffered asynchronous aggregation (FedBuff, Nguyen et al., AISTATS 2022): no barrier.

A buffered job keeps ``clients_per_round`` training tasks in flight at all times. Each
finished task's result is *absorbed* on the control queue (the task's ``link``
callback): its update joins the model version being filled, and a new task goes out
on the same queue, from the newest model. When a version holds ``aggregation.buffer``
(K) updates it is *applied*: the staleness-weighted mean of its updates goes through
the same pipeline as a synchronous round (verify, clip, reduce, DP, server optimizer;
fedq/coordinator/pipeline.py), and the new model is committed as that version.

Everything lives in SQL, one ``client_updates`` row per task:

    training --absorb--> buffered --apply--> ok | rejected
             \\-> error | stale | late        (and missing | cancelled, see below)

- A row is written, with the job row locked, *before* its task is sent, so a task is
  never in flight unrecorded; its id is ``fedq-<job>-b<task>-a<attempt>``.
- Absorbing is a conditional move of the row out of ``training``: a second delivery
  of the same result finds it moved and does nothing (no update counts twice, no
  second replacement task goes out). The version an update joins is fixed there, under
  the job lock: the lowest not yet full. Its staleness is fixed with it:
  ``(version - 1) - base_version``; past ``max_staleness`` the row is ``stale``.
- Applying a full version reads exactly its K rows, so every attempt to apply it
  computes the same mean; the commit is ``UPDATE rounds SET status='committed' WHERE
  status='training'``, in one transaction with the rows' final status and the job's
  new model, so a version is committed once. Each attempt writes its model under a key
  of its own, so a losing attempt never overwrites the committed blob.
- The watchdog (:func:`repair`) applies a version left full (a control worker killed
  mid-apply), absorbs a result whose callback was lost (read back from the result
  backend), re-sends a task past ``round_timeout_s`` (at most ``max_redispatch`` times,
  then its row is ``missing`` and another client's task replaces it).

Versions are the job's rounds: ``rounds`` in the spec is the number of versions, a
version's row in ``rounds`` carries its metrics, and ``fedq results`` shows them.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from fedq.aggregate.staleness import staleness_factor
from fedq.blobs import BlobRef
from fedq.coordinator import commit, liveness, policy
from fedq.coordinator.enrol import registry_if_required
from fedq.coordinator.intake import Sent, admit, known_limits, task_id
from fedq.coordinator.pipeline import Outcome, update_weight
from fedq.coordinator.planning import open_clients, queue_counts
from fedq.coordinator.roster import (
    gone_sites,
    live_throughput,
    mark_lost,
    open_sites,
    record_tasks,
    record_throughput,
)
from fedq.coordinator.steps import step_of
from fedq.db import ClientUpdate, Job, Round, session_scope
from fedq.db.models import aware, utcnow
from fedq.db.rows import fill_row, row_ref
from fedq.db.session import lock_row
from fedq.engine.app import app, broker_errors, refusal, sending
from fedq.engine.backend import task_metas
from fedq.engine.names import ABSORB_UPDATE_TASK, CONTROL_QUEUE, TRAIN_TASK, site_queue
from fedq.engine.revoke import revoke_quietly
from fedq.process import PROCESS
from fedq.protocol.training import StepRef
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.status import FAILED_UPDATES, JobStatus, RoundStatus, UpdateStatus
from fedq.testing import hold

log = logging.getLogger(__name__)
BUFFERED_TASKS = "task(s) of a buffered job"  # as revoke_quietly's warning names them


@dataclass(frozen=True)
class Dispatch:
    """One task to send once the transaction that recorded it has committed."""

    index: int
    attempt: int
    client: int
    queue: str
    version: int  # the model version it trains from, plus one
    model: BlobRef
    step: StepRef | None = None  # the model as a step from the previous version


def _lock(s: Session, job_id: str) -> Job | None:
    """Lock the job row for this transaction (fedq.db.session.lock_row)."""
    return lock_row(s, Job, job_id)


def _model(job: Job) -> BlobRef:
    return BlobRef(job.global_key, job.global_sha256, job.global_size)


def _new_tasks(s: Session, job: Job, spec: JobSpec, queues: Sequence[str],
               closed: str | None = None) -> list[Dispatch]:
    """Record one new training task per entry of ``queues`` (the job row is locked):
    the next task numbers, each for a client not training now (a pure function of the
    seed and the task number, given who is training and which sites are open). With
    ``sites`` a task goes to its client's site queue, and clients of sites that can
    train now come first; ``closed``: a site queue just handed a task back (its
    worker stepped aside, perhaps before its report of that arrived)."""
    top = s.scalar(select(func.max(ClientUpdate.task_index))
                   .where(ClientUpdate.job_id == job.id)) or 0
    busy = set(s.scalars(select(ClientUpdate.client).where(
        ClientUpdate.job_id == job.id, ClientUpdate.status == UpdateStatus.TRAINING)))
    opened = None
    if spec.sites is not None:
        opened = open_clients(spec, frozenset(
            n for n in open_sites(s, spec.sites) if site_queue(n) != closed))
    out = []
    for i, queue in enumerate(queues, start=top + 1):
        client = pick_client(spec, i, busy, opened)
        busy.add(client)
        queue = spec.site_queue_of(client) or queue
        s.add(ClientUpdate(job_id=job.id, round_number=0, client=client,
                           status=UpdateStatus.TRAINING,
                           queue=queue, task_index=i, attempt=1,
                           base_version=job.committed_round, created_at=utcnow()))
        out.append(Dispatch(i, 1, client, queue, job.committed_round + 1, _model(job),
                            step_of(job)))
    return out


def pick_client(spec: JobSpec, task: int, busy: set[int],
                opened: frozenset[int] | None = None) -> int:
    """The client task number ``task`` trains: the first of a permutation seeded by
    (seed, task) not training now and, when ``opened`` is given, at a site that can
    train now (none such: the first not training; all busy: the first)."""
    order = [int(c) for c in np.random.default_rng([spec.seed, task])
             .permutation(spec.num_clients)]
    free = [c for c in order if c not in busy]
    return next((c for c in free if opened is None or c in opened),
                free[0] if free else order[0])


def _send(settings: Settings, job_id: str, spec: JobSpec, tasks: Sequence[Dispatch]) -> None:
    """Send ``tasks`` (recorded as training); when the broker refuses them, each is made
    due at once (:func:`_unsend`) instead of at its deadline."""
    if not tasks:
        return
    spec_json = spec.to_json()
    try:
        with sending() as events:  # one Redis round trip for all, events included
            for t in tasks:
                sent = Sent(job_id, t.version, t.client, t.attempt, 0, t.queue, task=t.index)
                app.send_task(TRAIN_TASK, args=(sent.message(spec_json, t.model, t.step,
                                                             spec.round_timeout_s),),
                              queue=t.queue, task_id=sent.task_id, argsrepr=sent.shown,
                              kwargsrepr="{}", event_dispatcher=events,
                              link=app.signature(ABSORB_UPDATE_TASK,
                                                 args=(job_id, t.index, t.attempt),
                                                 queue=CONTROL_QUEUE))
    except broker_errors() as exc:
        _unsend(settings, job_id, spec, tasks)
        log.warning("job %s: task(s) %s could not be sent (%s); the watchdog sends them "
                    "at its next pass", job_id, [t.index for t in tasks],
                    refusal(exc))


def _unsend(settings: Settings, job_id: str, spec: JobSpec, tasks: Sequence[Dispatch]) -> None:
    """Tasks the broker refused: each still training as that attempt is dated back
    past its deadline, so the watchdog's next pass takes it as overdue (:func:`_overdue`:
    sent again as the next attempt, or its slot given to another client after
    ``max_redispatch``). A refusal is paid as one of those re-sends; in exchange the
    next send always has a new task id, never one a pipeline that did reach the broker
    before the refusal may have used."""
    due = utcnow() - timedelta(seconds=spec.round_timeout_s + 1)
    with session_scope(settings.database_url) as s:
        for t in tasks:
            s.execute(update(ClientUpdate).where(
                ClientUpdate.job_id == job_id, ClientUpdate.task_index == t.index,
                ClientUpdate.attempt == t.attempt,
                ClientUpdate.status == UpdateStatus.TRAINING).values(created_at=due))


def _ensure_version(s: Session, job: Job, spec: JobSpec, version: int) -> Round:
    rnd = s.scalar(select(Round).where(Round.job_id == job.id, Round.number == version))
    if rnd is None:
        rnd = Round(job_id=job.id, number=version, status=RoundStatus.TRAINING, attempt=1,
                    planned={"clients": [], "queues": [], "buffer": spec.aggregation.buffer})
        s.add(rnd)
        s.flush()
    return rnd


def start(settings: Settings, job_id: str) -> dict[str, Any]:
    """Fill the job's slots: send tasks until ``clients_per_round`` are training (on
    submit and resume; idempotent, a second call finds them training)."""
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return {"status": "skipped", "reason": "job not running"}
        spec = JobSpec.stored(job.spec)
        live = live_throughput(settings) if spec.queues == "auto" else None
        wanted = Counter(q for q, n in queue_counts(spec, live).items() for _ in range(n))
        tasks_out = s.execute(select(ClientUpdate.client, ClientUpdate.queue).where(
            ClientUpdate.job_id == job_id,
            ClientUpdate.status == UpdateStatus.TRAINING)).tuples().all()
        if spec.sites is not None:  # slots, not queues: each task goes to its client's site
            wanted = Counter({"site": site_room(s, spec, tasks_out)})
        else:
            wanted.subtract(q or "" for _, q in tasks_out)
        full = _filling(s, job, spec) > spec.rounds
        tasks = [] if full else _new_tasks(s, job, spec, sorted(wanted.elements()))
        _ensure_version(s, job, spec, job.committed_round + 1)
    _send(settings, job_id, spec, tasks)
    return {"status": "started", "version": job.committed_round + 1, "tasks": len(tasks)}


def site_room(s: Session, spec: JobSpec, training: Sequence[tuple[int, str | None]]) -> int:
    """New tasks a job with ``sites`` may send now: its ``clients_per_round`` slots
    follow the machines that can train. A task waiting at a site whose machine is away
    (its owner back at it, unplugged; fedq/worker/owner.py) holds no slot: it trains
    when the machine is back, and meanwhile a client of an open site takes the slot.
    New tasks go only to clients of open sites not training now (at most one task a
    client), so the tasks left waiting at away sites are those queued when they went
    away, never more. With no site open every task holds its slot (nothing could be
    sent anywhere better). ``training``: (client, queue) of the job's training tasks."""
    opened = open_sites(s, spec.sites or {})
    if not opened:
        return spec.clients_per_round - len(training)
    queues = {site_queue(n) for n in opened}
    holding = sum(1 for _, q in training if q in queues)
    free = (open_clients(spec, opened) or frozenset()) - {c for c, _ in training}
    return min(spec.clients_per_round - holding, len(free))


def _filling(s: Session, job: Job, spec: JobSpec) -> int:
    """The lowest version after the committed one that is not yet full."""
    counts = {v: n for v, n in s.execute(
        select(ClientUpdate.round_number, func.count())
        .where(ClientUpdate.job_id == job.id, ClientUpdate.status == UpdateStatus.BUFFERED)
        .group_by(ClientUpdate.round_number)).tuples()}
    v = job.committed_round + 1
    while counts.get(v, 0) >= spec.aggregation.buffer:
        v += 1
    return v


def _failing(s: Session, job: Job, spec: JobSpec) -> str | None:
    """:func:`fedq.coordinator.policy.failing` over the job's newest settled tasks (an
    update refused by ``max_updates_per_worker`` is the cap at work, not a failing job)."""
    window = spec.clients_per_round * (spec.max_redispatch + 1)
    last = s.execute(select(ClientUpdate.status, ClientUpdate.error, ClientUpdate.queue)
                     .where(ClientUpdate.job_id == job.id,
                            ClientUpdate.status.in_((UpdateStatus.OK, UpdateStatus.BUFFERED,
                                                     UpdateStatus.STALE, *FAILED_UPDATES)),
                            or_(ClientUpdate.error.is_(None),
                                ~ClientUpdate.error.startswith(policy.CAP_PREFIX)))
                     .order_by(ClientUpdate.task_index.desc()).limit(window)).tuples().all()
    return policy.failing(list(last), window, job.id)


def _full(s: Session, job_id: str, version: int) -> int:
    return s.scalar(select(func.count()).where(
        ClientUpdate.job_id == job_id, ClientUpdate.round_number == version,
        ClientUpdate.status == UpdateStatus.BUFFERED)) or 0


def absorb(settings: Settings, result: Any, job_id: str, index: int,
           attempt: int | None = None) -> dict[str, Any]:
    """Take task ``index``'s result (of dispatch ``attempt``, as its callback was
    sent; None: a callback from before attempts were named, taken as the result's
    own, within those sent) into the version being filled, send its replacement, and
    apply the version when it is full. Safe to call any number of times. The result
    is admitted against the task as it was recorded (fedq/coordinator/intake.py)."""
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        row = s.scalar(select(ClientUpdate).where(ClientUpdate.job_id == job_id,
                                                  ClientUpdate.task_index == index))
        if job is None or row is None or row.status != UpdateStatus.TRAINING:
            return {"status": "skipped", "reason": "absorbed already"}
        spec = JobSpec.stored(job.spec)
        if attempt is None:
            said = result.get("attempt") if isinstance(result, dict) else None
            attempt = said if isinstance(said, int) and 1 <= said <= row.attempt \
                else row.attempt
        sent = Sent(job_id, (row.base_version or 0) + 1, row.client,
                    min(attempt, row.attempt), 0, row.queue or "cpu", task=index)
        ref = admit(result, sent, known_limits(spec, row.client), registry_if_required(settings))
        if attempt > row.attempt:  # a callback for an attempt never sent
            ref = dataclasses.replace(ref, status=UpdateStatus.REJECTED, error=(
                f"identity: a result for attempt {attempt}, task {index} was sent "
                f"{row.attempt} time(s)"))
        cap = spec.max_updates_per_worker
        if cap is not None and ref.status == UpdateStatus.OK and \
                job.status == JobStatus.RUNNING:
            who = policy.counted_as(ref)
            column = ClientUpdate.signer if ref.signer else ClientUpdate.worker
            counted = s.scalar(select(func.count()).where(
                ClientUpdate.job_id == job_id,
                ClientUpdate.round_number == _filling(s, job, spec),
                ClientUpdate.status == UpdateStatus.BUFFERED, column == who)) or 0
            if counted >= cap:  # this version has its share of this worker's updates
                ref = dataclasses.replace(ref, status=UpdateStatus.REJECTED,
                                          error=policy.over_cap(who, cap))
        fill_row(row, ref)
        tasks: list[Dispatch] = []
        revoke: list[str] = []
        version, full = 0, False
        running = job.status == JobStatus.RUNNING
        if running:
            version = _filling(s, job, spec)
            row.round_number = version
            row.staleness = (version - 1) - (row.base_version or 0)
        status, why = policy.absorb_status(
            ref.status, ref.key is not None and ref.sha256 is not None, running, version,
            spec.rounds, row.staleness or 0, spec.aggregation.max_staleness)
        row.status, row.error = status, why or row.error
        if status in FAILED_UPDATES:
            row.error = ref.error or "task failed"
            failing = _failing(s, job, spec)
            if failing:  # every recent task failed: stop instead of spinning
                job.status, job.error, job.finished_at = JobStatus.FAILED, failing, utcnow()
                revoke = _close_training(s, job_id, "the job failed")
        elif status == UpdateStatus.BUFFERED:
            rnd = _ensure_version(s, job, spec, version)
            if _full(s, job_id, version) >= spec.aggregation.buffer:  # (autoflush)
                rnd.full_since = utcnow()  # the watchdog's clock
                full = version == job.committed_round + 1
        if running:
            # The replacement trains from the newest model: when this update fills the
            # next version, only once that version is applied (below, by start()).
            if not full and job.status == JobStatus.RUNNING and \
                    _filling(s, job, spec) <= spec.rounds:
                tasks = _new_tasks(s, job, spec, [row.queue or "cpu"],
                                   closed=row.queue if status == UpdateStatus.YIELDED
                                   or ref.stats.yielded
                                   else None)
        record_tasks(s, [row])
        status = row.status
    _send(settings, job_id, spec, tasks)
    if revoke:
        revoke_quietly(revoke, "its job failed", BUFFERED_TASKS, stop=True)
    out: dict[str, Any] = {"status": status, "version": version}
    if full:
        out["applied"] = apply_ready(settings, job_id)
        out["refill"] = start(settings, job_id)
    return out


def apply_ready(settings: Settings, job_id: str) -> list[dict[str, Any]]:
    """Apply versions while the next one is full (a version can fill while the one
    before it is applied); one result per attempt."""
    done: list[dict[str, Any]] = []
    while True:
        with session_scope(settings.database_url) as s:
            job = s.get(Job, job_id)
            if job is None or job.status != JobStatus.RUNNING:
                return done
            spec = JobSpec.stored(job.spec)
            version = job.committed_round + 1
            if _full(s, job_id, version) < spec.aggregation.buffer:
                return done
        result = apply_version(settings, job_id, version)
        done.append(result)
        if result["status"] != "committed":
            return done


def _still_signed(settings: Settings, rows: list[ClientUpdate],
                  version: int) -> list[ClientUpdate]:
    """``rows`` (buffered updates) less those whose signer was revoked since they were
    absorbed: those are rejected now, saying so (with FEDQ_IDENTITY=required; the
    version then waits for as many more)."""
    registry = registry_if_required(settings)
    if registry is None:
        return rows
    kept = []
    for row in rows:
        if row.signer is not None and row.signer not in registry.active:
            row.status = UpdateStatus.REJECTED
            row.error = (f"signature: signed by {row.signer}, which was revoked before "
                         f"version {version} was applied")
        else:
            kept.append(row)
    return kept


def apply_version(settings: Settings, job_id: str, version: int) -> dict[str, Any]:
    """Aggregate version ``version``'s K buffered updates and commit it (exactly once)."""
    started = time.perf_counter()
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != JobStatus.RUNNING or job.committed_round != version - 1:
            return {"status": "skipped", "reason": "version not next"}
        spec = JobSpec.stored(job.spec)
        rows = s.scalars(select(ClientUpdate).where(
            ClientUpdate.job_id == job_id, ClientUpdate.round_number == version,
            ClientUpdate.status == UpdateStatus.BUFFERED).order_by(ClientUpdate.task_index)).all()
        rows = _still_signed(settings, list(rows), version)[:spec.aggregation.buffer]
        if len(rows) < spec.aggregation.buffer:
            return {"status": "waiting", "buffered": len(rows)}
        model = _model(job)
        state = BlobRef(job.state_key, job.state_sha256 or "", job.state_size or 0) \
            if job.state_key else None
        previous = s.scalar(select(Round.finished_at).where(
            Round.job_id == job_id, Round.number == version - 1)) or job.created_at
    log.info("applying job %s version %d (%d updates)", job_id, version, len(rows))
    factors = staleness_factors(spec, {r.task_index: r.staleness or 0 for r in rows})
    store = PROCESS.blobs(settings)
    current = commit.current_model(store, model)
    outcome = Outcome()
    hold.at("apply", f"{job_id}-v{version}", "control")  # fault tests only
    new = commit.aggregate(spec, store, job_id, version, [row_ref(r) for r in rows], current,
                           model.sha256, state, outcome, settings.home / "scratch",
                           PROCESS.accumulator, factors, tag=secrets.token_hex(4))
    if new is None:  # verification took the version below one usable update
        _reject(settings, job_id, version, outcome)
        return {"status": "rejected", "version": version, "rejected": outcome.rejected}
    records = {r.ref.task: r for r in outcome.records}
    weights = {r.task_index: update_weight(spec, row_ref(r)) * factors[r.task_index]
               for r in rows}
    total = sum(weights[i] for i, r in records.items() if r.status == UpdateStatus.OK) or 1.0
    now = utcnow()
    revoke: list[str] = []
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        assert job is not None
        claimed = s.execute(update(Round).where(
            Round.job_id == job_id, Round.number == version, Round.status == RoundStatus.TRAINING,
        ).values(
            status=RoundStatus.COMMITTED, finished_at=now,
            **commit.metrics(new, outcome, sum(r.bytes_up for r in rows),
                             sum(r.bytes_down for r in rows),
                             (now - aware(previous)).total_seconds(),
                             time.perf_counter() - started),
            planned={"clients": [r.client for r in rows], "queues": [r.queue for r in rows],
                     "buffer": spec.aggregation.buffer}))
        if claimed.rowcount != 1 or job.committed_round != version - 1:  # type: ignore[attr-defined]
            s.rollback()
            return {"status": "skipped", "reason": "version committed by another attempt"}
        for row in s.scalars(select(ClientUpdate).where(
                ClientUpdate.job_id == job_id,
                ClientUpdate.task_index.in_([r.task_index for r in rows]))):
            rec = records[row.task_index]
            row.status, row.error = rec.status, rec.error
            row.update_norm, row.raw_bytes = rec.norm, rec.raw_bytes
            row.weight = weights[row.task_index] / total if rec.status == UpdateStatus.OK else 0.0
        record_throughput(s, outcome.throughput)
        commit.advance(job, new)
        done = version >= spec.rounds
        if done:
            job.status, job.finished_at = JobStatus.COMPLETED, now
            revoke = _close_training(s, job_id, "the job completed first")
        else:
            _ensure_version(s, job, spec, version + 1)
    commit.settle(settings, store, spec, job_id, new)
    if revoke:
        revoke_quietly(revoke, "its job completed", BUFFERED_TASKS)
    accuracy = new.accuracy
    log.info("job %s version %d committed: accuracy %s, %d updates, staleness %s, "
             "apply %.2fs", job_id, version, "-" if accuracy is None else f"{accuracy:.4f}",
             outcome.accepted, sorted(r.staleness or 0 for r in rows),
             time.perf_counter() - started)
    return {"status": "committed", "version": version, "accuracy": accuracy}


def staleness_factors(spec: JobSpec, staleness: Mapping[int, int]) -> dict[int, float]:
    """Each update's weight factor by task number, from its staleness
    (``aggregation.staleness``, fedq/aggregate/staleness.py)."""
    st = spec.aggregation.staleness
    return {task: staleness_factor(st.kind, s, a=st.a, b=st.b) for task, s in staleness.items()}


def _reject(settings: Settings, job_id: str, version: int, outcome: Outcome) -> None:
    """Mark the updates that failed verification; the version fills up again."""
    bad = {r.ref.task: r for r in outcome.records if r.status != UpdateStatus.OK}
    revoke: list[str] = []
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        for row in s.scalars(select(ClientUpdate).where(
                ClientUpdate.job_id == job_id, ClientUpdate.task_index.in_(list(bad)),
                ClientUpdate.status == UpdateStatus.BUFFERED)):
            row.status, row.error = UpdateStatus.REJECTED, bad[row.task_index].error
        s.flush()
        failing = _failing(s, job, JobSpec.stored(job.spec)) \
            if job is not None and job.status == JobStatus.RUNNING else None
        if job is not None and failing:  # every recent update rejected: stop, not spin
            job.status, job.error, job.finished_at = JobStatus.FAILED, failing, utcnow()
            revoke = _close_training(s, job_id, "the job failed")
    if revoke:
        revoke_quietly(revoke, "its job failed", BUFFERED_TASKS, stop=True)


def _close_training(s: Session, job_id: str, why: str) -> list[str]:
    """Mark the job's training rows cancelled; the task ids to revoke."""
    ids = []
    for row in s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job_id,
                                                    ClientUpdate.status == UpdateStatus.TRAINING)):
        ids += [task_id(job_id, row.task_index, a) for a in range(1, row.attempt + 1)]
        row.status, row.error = UpdateStatus.CANCELLED, why
    return ids


def cancel_ids(s: Session, job_id: str) -> list[str]:
    """For ``fedq cancel``: close the job's training rows; their task ids."""
    return _close_training(s, job_id, "cancelled")


def repair(settings: Settings, job_id: str, grace: timedelta) -> list[dict[str, Any]]:
    """The watchdog's pass over one running buffered job; what it did."""
    now = utcnow()
    actions: list[dict[str, Any]] = []
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return actions
        spec = JobSpec.stored(job.spec)
        version = job.committed_round + 1
        rnd = s.scalar(select(Round).where(Round.job_id == job_id, Round.number == version))
        full_since = aware(rnd.full_since) if rnd is not None and rnd.full_since else None
        in_flight = list(s.scalars(select(ClientUpdate).where(
            ClientUpdate.job_id == job_id, ClientUpdate.status == UpdateStatus.TRAINING)))
        overdue = [(r.task_index, r.attempt) for r in in_flight
                   if aware(r.created_at) < now - timedelta(seconds=spec.round_timeout_s)]
        tasks = {task_id(job_id, r.task_index, r.attempt): r.client for r in in_flight}
        by_task = {task_id(job_id, r.task_index, r.attempt): (r.task_index, r.attempt)
                   for r in in_flight}
        queue_of = {task_id(job_id, r.task_index, r.attempt): r.queue for r in in_flight}
        training = len(in_flight)
    if rnd is None or training < spec.clients_per_round and aware(job.updated_at) < now - grace:
        # a lost start (no version row), or a replacement never recorded
        result = start(settings, job_id)
        actions.append({"job": job_id, "action": "start", "result": result})
    if full_since is not None and now - full_since > grace:
        for result in apply_ready(settings, job_id):
            actions.append({"job": job_id, "version": result.get("version", version),
                            "action": "apply (stuck)", "result": result["status"]})
    for index, attempt in overdue:
        actions.append(_overdue(settings, job_id, spec, index, attempt))
    # a task whose worker is lost (its heartbeat stopped: fedq/coordinator/liveness.py)
    # is overdue now, not at its deadline
    holders = liveness.observe(settings, job_id, tasks, now)
    lost = {h.task_id: h.host for h in holders
            if policy.lost_clients([(h.client, h.silent_s, h.resent)], [h.client],
                                   settings.worker_lost_s)}
    stranded: dict[str, str] = {}
    if spec.sites is not None:
        # a site whose worker is lost closes (roster.mark_lost); a task waiting at a
        # site whose workers are all lost or stopped, not started or its worker lost,
        # gives its slot to an open site's client
        with session_scope(settings.database_url) as s:
            mark_lost(s, [(host, queue_of[tid] or "") for tid, host in lost.items()])
            gone = {site_queue(n) for n in gone_sites(s, spec.sites)}
            opened = open_sites(s, spec.sites)
        beating = {h.task_id for h in holders} - set(lost)
        if opened:
            stranded = {tid: q or "" for tid, q in queue_of.items()
                        if q in gone and tid not in beating and by_task[tid] not in overdue}
    for tid, host in sorted(lost.items()):
        if by_task[tid] in overdue or tid in stranded:
            continue
        action = _overdue(settings, job_id, spec, *by_task[tid])
        action["action"] = f"{action['action']} (lost {host})"
        actions.append(action)
    for tid, queue in sorted(stranded.items()):
        action = _overdue(settings, job_id, spec, *by_task[tid], closed=queue)
        action["action"] = f"{action['action']} ({queue} closed)"
        actions.append(action)
    liveness.mark_resent(settings, sorted(lost))
    return actions


def _overdue(settings: Settings, job_id: str, spec: JobSpec, index: int,
             attempt: int, closed: str | None = None) -> dict[str, Any]:
    """A task past its deadline: absorb its result if the backend has one (its callback
    was lost), else send it again, or after ``max_redispatch`` give its slot to
    another client. ``closed``: the task waits at a site queue whose workers are all
    lost or stopped: its slot goes to another client now, of an open site, and the task
    is revoked."""
    # read up to STATE_BYTES each: a longer result is no answer (fedq.engine.backend)
    metas = task_metas(app.backend, [task_id(job_id, index, a) for a in range(attempt, 0, -1)])
    for a, meta in zip(range(attempt, 0, -1), metas, strict=True):
        if meta.get("status") == "SUCCESS" and isinstance(meta.get("result"), dict):
            result = absorb(settings, meta["result"], job_id, index, a)
            return {"job": job_id, "task": index, "action": "absorb (lost callback)",
                    "result": result["status"]}
    tasks: list[Dispatch] = []
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        row = s.scalar(select(ClientUpdate).where(ClientUpdate.job_id == job_id,
                                                  ClientUpdate.task_index == index))
        if job is None or job.status != JobStatus.RUNNING or row is None or \
                row.status != UpdateStatus.TRAINING or row.attempt != attempt:
            return {"job": job_id, "task": index, "action": "none (moved on)"}
        if closed is None and policy.overdue(attempt, spec.max_redispatch) == "resend":
            row.attempt, row.created_at = attempt + 1, utcnow()
            row.base_version = job.committed_round
            tasks = [Dispatch(index, attempt + 1, row.client, row.queue or "cpu",
                              job.committed_round + 1, _model(job), step_of(job))]
            action = f"resend (attempt {attempt + 1})"
        else:
            row.status, row.round_number = UpdateStatus.MISSING, job.committed_round + 1
            row.error = f"no result after {attempt} attempt(s)" if closed is None else \
                f"the workers of {closed} are lost or stopped: its slot went to another site"
            tasks = _new_tasks(s, job, spec, [row.queue or "cpu"], closed=closed)
            action = "replace"
    if closed is not None:  # a worker of the site that wakes stops it: its slot moved
        revoke_quietly([task_id(job_id, index, attempt)],
                       f"the workers of {closed} are lost or stopped: its slot went elsewhere",
                       BUFFERED_TASKS, stop=True)
    _send(settings, job_id, spec, tasks)
    log.warning("fedq watchdog: job %s task %d: %s", job_id, index, action)
    return {"job": job_id, "task": index, "action": action}
