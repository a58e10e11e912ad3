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
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select, update

from fedq.aggregate.dp import epsilon
from fedq.aggregate.types import Weights
from fedq.app import app
from fedq.blobs import BlobRef, BlobStore, global_key, open_store, state_key
from fedq.blobs.keys import updates_prefix
from fedq.db import ClientUpdate, Job, Round, session_scope
from fedq.db.models import utcnow
from fedq.refs import UpdateRef
from fedq.registry import record_throughput
from fedq.rounds import (
    evaluate_weights,
    redispatch,
    request_round,
    round_task_ids,
    start_round,
)
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.strategy import MEAN, Outcome, apply_server, reduce
from fedq.weights import dump_parts, dumps, loads

log = logging.getLogger(__name__)


def collect_results(task_ids: dict[int, list[str]]) -> list[Any]:
    """Every finished training result in the result backend for these task ids."""
    found = []
    for ids in task_ids.values():
        for tid in ids:
            meta = app.backend.get_task_meta(tid)
            if meta.get("status") == "SUCCESS" and isinstance(meta.get("result"), dict):
                found.append(meta["result"])
    return found


def pick_results(results: Sequence[Any], job_id: str, round_number: int, gen: int,
                 clients: Sequence[int]) -> dict[int, UpdateRef]:
    """One result per planned client of this round: an ok one if any (earliest attempt
    first), else the latest error. Results of other rounds or generations are ignored."""
    chosen: dict[int, UpdateRef] = {}
    wanted = set(clients)
    for raw in results:
        ref = UpdateRef.from_json(raw)
        if (ref.job, ref.round, ref.gen) != (job_id, round_number, gen) or \
                ref.client not in wanted:
            continue
        have = chosen.get(ref.client)
        if have is None or (have.status != "ok" and (ref.status == "ok"
                                                     or ref.attempt > have.attempt)) or \
                (have.status == ref.status == "ok" and ref.attempt < have.attempt):
            chosen[ref.client] = ref
    return dict(sorted(chosen.items()))


def unsettled(chosen: dict[int, UpdateRef], clients: Sequence[int], attempt: int) -> list[int]:
    """Clients still owed a result: none yet, or only a failure from an earlier attempt
    (the re-dispatched task has not reported)."""
    return [c for c in clients
            if c not in chosen or (chosen[c].status != "ok" and chosen[c].attempt < attempt)]


@dataclass(frozen=True)
class _OpenRound:
    spec: JobSpec
    model: BlobRef
    id: int
    started_at: datetime
    deadline: datetime | None
    attempt: int
    clients: list[int]
    queues: list[str]
    task_ids: dict[int, list[str]]
    state: BlobRef | None  # the server optimizer's state after the previous round


def _open_round(settings: Settings, job_id: str, round_number: int) -> _OpenRound | None:
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        rnd = s.scalar(select(Round).where(Round.job_id == job_id, Round.number == round_number))
        if job is None or rnd is None or rnd.status != "training" or job.status != "running":
            return None
        return _OpenRound(JobSpec.model_validate(job.spec),
                          BlobRef(job.global_key, job.global_sha256, job.global_size), rnd.id,
                          _aware(rnd.started_at), _aware(rnd.deadline) if rnd.deadline else None,
                          rnd.attempt, list(rnd.planned["clients"]),
                          list(rnd.planned["queues"]), round_task_ids(job_id, rnd),
                          BlobRef(job.state_key, job.state_sha256 or "", job.state_size or 0)
                          if job.state_key else None)


def finalize_round(settings: Settings, results: Sequence[Any], job_id: str,
                   round_number: int) -> dict[str, Any]:
    """Decide round ``round_number``: wait, commit, re-dispatch or fail (see module doc).

    Safe to call any number of times, from any number of processes."""
    started = time.perf_counter()
    rnd = _open_round(settings, job_id, round_number)
    if rnd is None:
        late = record_late(settings, results, job_id, round_number)
        return {"status": "skipped", "reason": "round not open", "late": late}
    chosen = pick_results([*results, *collect_results(rnd.task_ids)], job_id, round_number,
                          rnd.id, rnd.clients)
    pending = unsettled(chosen, rnd.clients, rnd.attempt)
    past_deadline = rnd.deadline is not None and utcnow() >= rnd.deadline
    if pending and not past_deadline:
        return {"status": "waiting", "pending": pending}
    log.info("finalizing job %s round %d (attempt %d, %d results)", job_id, round_number,
             rnd.attempt, len(chosen))
    if settings.finalize_delay:  # fault injection: widen the window for crash tests
        time.sleep(settings.finalize_delay)

    store = open_store(settings.blob_url, settings.s3_endpoint_url)
    current = _current_model(store, rnd.model)
    outcome = Outcome(job_id)
    delta = reduce(rnd.spec, store, list(chosen.values()), current, outcome,
                   settings.home / "scratch")
    if delta is None:
        return _below_quorum(settings, job_id, round_number, rnd, outcome)

    queue_of = dict(zip(rnd.clients, rnd.queues, strict=True))
    for client in rnd.clients:
        if client not in chosen:
            outcome.rows.append(ClientUpdate(
                job_id=job_id, round_number=round_number, client=client, status="missing",
                queue=queue_of[client],
                error=f"no result by the deadline (attempt {rnd.attempt})"))
    state = loads(store.get(rnd.state), what=f"blob {rnd.state.key}") if rnd.state else {}
    new, new_state = apply_server(rnd.spec, current, delta, state)
    every = rnd.spec.eval_every
    accuracy, eval_loss = evaluate_weights(rnd.spec, new) \
        if every and (round_number % every == 0 or round_number >= rnd.spec.rounds) \
        else (None, None)
    meta = {"job": job_id, "round": str(round_number)}
    blob = store.put_parts(global_key(job_id, round_number), dump_parts(new, meta))
    state_blob = store.put(state_key(job_id, round_number), dumps(new_state, meta)) \
        if new_state else None
    seconds = (utcnow() - rnd.started_at).total_seconds()
    dp = rnd.spec.dp
    metrics = {
        "participants": outcome.accepted, "samples": outcome.samples,
        "train_loss": outcome.loss_sum / max(outcome.samples, 1), "eval_loss": eval_loss,
        "accuracy": accuracy, "seconds": seconds,
        "bytes_up": sum(r.bytes_up or 0 for r in outcome.rows),
        "raw_bytes_up": outcome.raw_bytes,
        "bytes_down": sum(r.bytes_down or 0 for r in outcome.rows),
        "global_key": blob.key, "global_sha256": blob.sha256,
        "epsilon": epsilon(round_number, noise_multiplier=dp.noise_multiplier,
                           sample_rate=rnd.spec.clients_per_round / rnd.spec.num_clients,
                           delta=dp.delta) if dp else None,
    }
    committed, done = _commit(settings, job_id, rnd.id, outcome.rows,
                              throughput=outcome.throughput, metrics=metrics, blob=blob,
                              state=state_blob, round_number=round_number,
                              total=rnd.spec.rounds)
    if not committed:
        return {"status": "skipped", "reason": "round committed by another delivery"}
    _LAST_MODEL.clear()
    _LAST_MODEL[blob.sha256] = new  # the next round's finalize starts from it
    if rnd.spec.keep_updates is not None and round_number > rnd.spec.keep_updates:
        _drop_updates(store, job_id, round_number - rnd.spec.keep_updates)
    if done:
        MEAN.release()
    else:
        _start_next(settings, job_id, round_number + 1)
    log.info("job %s round %d committed: accuracy %s, %d clients, %.2fs (finalize %.2fs)",
             job_id, round_number, "-" if accuracy is None else f"{accuracy:.4f}",
             outcome.accepted, seconds, time.perf_counter() - started)
    return {"status": "committed", "round": round_number, "accuracy": accuracy}


def _drop_updates(store: BlobStore, job_id: str, round_number: int) -> None:
    """Delete round ``round_number``'s update blobs (``keep_updates``); the rows that
    describe them stay. A failure is logged, never fatal: it only costs space."""
    try:
        store.delete_prefix(updates_prefix(job_id, round_number))
    except Exception:
        log.exception("job %s: could not delete round %d's update blobs", job_id,
                      round_number)


def _start_next(settings: Settings, job_id: str, round_number: int) -> None:
    """Start the next round here and now (one broker hop less than sending start_round
    to the control queue); if that fails, leave it to a start_round task."""
    try:
        start_round(settings, job_id, round_number)
    except Exception:  # the database or broker hiccupped: a control worker retries
        log.exception("job %s: starting round %d in finalize failed; queued instead",
                      job_id, round_number)
        request_round(job_id, round_number)


#: The model this process committed last, by sha256: finalize reads the global model
#: from the blob store only when another process committed it.
_LAST_MODEL: dict[str, Weights] = {}


def _current_model(store: BlobStore, ref: BlobRef) -> Weights:
    if ref.sha256 in _LAST_MODEL:
        return _LAST_MODEL[ref.sha256]
    return loads(store.get(ref), what=f"blob {ref.key}")


def _below_quorum(settings: Settings, job_id: str, round_number: int, rnd: _OpenRound,
                  outcome: Outcome) -> dict[str, Any]:
    retry = [c for c in rnd.clients if c not in outcome.usable]
    if rnd.attempt <= rnd.spec.max_redispatch:
        if redispatch(settings, job_id, round_number, rnd.attempt, retry):
            return {"status": "redispatched", "clients": retry, "attempt": rnd.attempt + 1}
        return {"status": "skipped", "reason": "re-dispatched by another delivery"}
    queue_of = dict(zip(rnd.clients, rnd.queues, strict=True))
    queues = sorted({queue_of[c] for c in retry})
    live = _live_consumers()
    idle = [q for q in queues if live is not None and q not in live]
    errors = sorted({r.error for r in outcome.rows if r.error})
    reason = (f"round {round_number}: {outcome.accepted} usable update(s) of "
              f"{len(rnd.clients)} after {rnd.attempt} attempt(s); quorum is {rnd.spec.quorum}. "
              f"Clients without an update: {', '.join(map(str, retry))} on queue(s) "
              f"{', '.join(queues)}"
              + (f" (no live worker consumes {', '.join(idle)}: start one with "
                 f"`celery -A fedq worker -Q {idle[0]}`)" if idle else "")
              + (f"; errors: {'; '.join(errors)[:1000]}" if errors else "")
              + ". Fix that, then `fedq resume JOB`.")
    for client in rnd.clients:
        if all(r.client != client for r in outcome.rows):
            outcome.rows.append(ClientUpdate(job_id=job_id, round_number=round_number,
                                             client=client, status="missing",
                                             queue=queue_of[client], error="no result"))
    _commit(settings, job_id, rnd.id, outcome.rows, failed=reason.replace("JOB", job_id))
    return {"status": "failed", "reason": reason}


def _live_consumers() -> set[str] | None:
    from fedq.jobs import live_queues

    try:
        return set(live_queues(timeout=1.0))
    except Exception:
        return None


def record_late(settings: Settings, results: Sequence[Any], job_id: str,
                round_number: int) -> int:
    """Record results that reached an already finalized round as ``late`` (their
    updates are never averaged into any model). Returns how many were recorded."""
    late = 0
    refs = [UpdateRef.from_json(r) for r in results]
    refs = [r for r in refs if r.job == job_id and r.round == round_number and r.status == "ok"]
    if not refs:
        return 0
    with session_scope(settings.database_url) as s:
        rows = {r.client: r for r in s.scalars(select(ClientUpdate).where(
            ClientUpdate.job_id == job_id, ClientUpdate.round_number == round_number))}
        for ref in refs:
            row = rows.get(ref.client)
            if row is not None and row.status == "missing":
                fresh = Outcome(job_id)
                fresh.row(ref, "late", "arrived after the round was finalized")
                for column in ("worker", "samples", "processed", "steps", "seconds", "loss",
                               "bytes_up", "bytes_down", "blob_key", "blob_sha256", "error"):
                    setattr(row, column, getattr(fresh.rows[0], column))
                row.status = "late"
                late += 1
    return late


def _commit(settings: Settings, job_id: str, round_id: int, rows: list[ClientUpdate], *,
            throughput: Sequence[tuple[str, int, float]] = (),
            failed: str | None = None, metrics: dict[str, Any] | None = None,
            blob: BlobRef | None = None, state: BlobRef | None = None,
            round_number: int = 0, total: int = 0) -> tuple[bool, bool]:
    """One transaction: claim the round, write client rows, move the job. Returns
    (committed, job_done); (False, _) when another delivery got there first."""
    now = utcnow()
    with session_scope(settings.database_url) as s:
        values: dict[str, Any] = {"status": "failed" if failed else "committed",
                                  "finished_at": now, "error": failed}
        values.update(metrics or {})
        claimed = s.execute(update(Round).where(Round.id == round_id,
                                                Round.status == "training").values(**values))
        if claimed.rowcount != 1:  # type: ignore[attr-defined]
            s.rollback()
            return False, False
        s.add_all(rows)
        record_throughput(s, throughput)
        job = s.get(Job, job_id)
        assert job is not None
        done = True
        if failed:
            job.status, job.error, job.finished_at = "failed", failed, now
        else:
            assert blob is not None
            job.committed_round = round_number
            job.global_key, job.global_sha256, job.global_size = blob.key, blob.sha256, blob.size
            if state is not None:
                job.state_key, job.state_sha256, job.state_size = (state.key, state.sha256,
                                                                   state.size)
            done = round_number >= total
            if done:
                job.status, job.finished_at = "completed", now
    return True, done


def _aware(ts: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written as UTC."""
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
