"""The round engine on the coordinator: plan and dispatch a round, then finalize it.

``start_round`` writes the round row, then dispatches a chord of training tasks
whose body is ``finalize_round``. ``finalize_round`` aggregates and commits the
round exactly once: the commit is ``UPDATE rounds SET status='committed' ... WHERE
status='training'`` in the same transaction as the per-client rows and the job's
new model pointer, so a second delivery of the same callback commits nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from fedq.aggregate import apply_delta, check_update, fednova_mean, weighted_mean
from fedq.aggregate.types import Weights
from fedq.app import CONTROL_QUEUE, FINALIZE_ROUND_TASK, START_ROUND_TASK, TRAIN_TASK, app
from fedq.blobs import BlobRef, BlobStore, global_key, open_store
from fedq.db import ClientUpdate, Job, Round, session_scope
from fedq.db.models import utcnow
from fedq.errors import BlobError, UpdateRejected
from fedq.refs import TrainRef, UpdateRef
from fedq.registry import record_throughput
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.weights import dumps, loads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    client: int
    queue: str


def plan_round(spec: JobSpec, round_number: int,
               live_throughput: dict[str, float] | None = None) -> list[Assignment]:
    """Which clients train in ``round_number`` and on which queue; a pure function of
    (spec, round, live throughput), so a re-planned round picks the same clients."""
    rng = np.random.default_rng([spec.seed, round_number])
    clients = sorted(int(c) for c in rng.choice(spec.num_clients, spec.clients_per_round,
                                                replace=False))
    queues = [q for q, n in spec.queue_counts(live_throughput).items() for _ in range(n)]
    return [Assignment(c, q) for c, q in zip(clients, queues, strict=True)]


def start_round(settings: Settings, job_id: str, round_number: int) -> dict[str, Any]:
    """Write round ``round_number``'s row and dispatch its chord. Idempotent: if the row
    exists (a duplicate delivery), nothing is dispatched."""
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != "running":
            return {"status": "skipped", "reason": "job not running"}
        if job.committed_round != round_number - 1:
            return {"status": "skipped", "reason": f"job is at round {job.committed_round}"}
        spec = JobSpec.model_validate(job.spec)
        model = BlobRef(job.global_key, job.global_sha256, job.global_size)
        plan = plan_round(spec, round_number,
                          _live_throughput(settings) if spec.queues == "auto" else None)
        s.add(Round(job_id=job_id, number=round_number, status="training",
                    planned={"clients": [a.client for a in plan],
                             "queues": [a.queue for a in plan]}))
        try:
            s.flush()
        except IntegrityError:
            s.rollback()
            return {"status": "skipped", "reason": "round already started"}
    dispatch_round(job_id, round_number, spec, model, plan)
    return {"status": "started", "round": round_number, "clients": len(plan)}


def _live_throughput(settings: Settings) -> dict[str, float]:
    """Queue -> summed measured throughput of its live consumers (for ``queues: auto``)."""
    from fedq.jobs import live_queues
    from fedq.registry import queue_throughput

    try:
        live = live_queues(timeout=1.0)
    except Exception:  # no answer: plan as if nothing is measured
        return {}
    return queue_throughput(settings.database_url, live)


def dispatch_round(job_id: str, round_number: int, spec: JobSpec, model: BlobRef,
                   plan: Sequence[Assignment]) -> str:
    """Send the chord: one ``train`` per assignment on its queue, ``finalize_round`` after."""
    from celery import chord

    spec_json = spec.to_json()
    header = [
        app.signature(TRAIN_TASK, args=(TrainRef(job_id, round_number, a.client, a.queue,
                                                 spec_json, model).to_json(),),
                      queue=a.queue)
        for a in plan
    ]
    body = app.signature(FINALIZE_ROUND_TASK, args=(job_id, round_number), queue=CONTROL_QUEUE)
    result = chord(header)(body)
    return str(result.id)


def request_round(job_id: str, round_number: int) -> None:
    """Ask the control queue to start ``round_number`` (used after a commit and on submit)."""
    app.send_task(START_ROUND_TASK, args=(job_id, round_number), queue=CONTROL_QUEUE)


@dataclass
class _Outcome:
    rows: list[ClientUpdate]
    accepted: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    throughput: list[tuple[str, int, float]] = field(default_factory=list)


def _dedupe(results: Sequence[Any], job_id: str, round_number: int) -> list[UpdateRef]:
    """One result per client (the first), for this job and round only, by client id."""
    seen: dict[int, UpdateRef] = {}
    for raw in results:
        ref = UpdateRef.from_json(raw)
        if ref.job != job_id or ref.round != round_number:
            continue
        seen.setdefault(ref.client, ref)
    return [seen[c] for c in sorted(seen)]


def _row(job_id: str, ref: UpdateRef, status: str, error: str | None = None,
         norm: float | None = None) -> ClientUpdate:
    return ClientUpdate(job_id=job_id, round_number=ref.round, client=ref.client, status=status,
                        queue=ref.queue, worker=ref.worker, samples=ref.samples,
                        processed=int(ref.extra.get("seen", 0)), steps=ref.steps,
                        seconds=ref.seconds, loss=ref.loss, bytes_up=ref.bytes_up,
                        bytes_down=ref.bytes_down, update_norm=norm, blob_key=ref.key,
                        blob_sha256=ref.sha256, error=error)


def _verified(store: BlobStore, refs: Sequence[UpdateRef], reference: Weights,
              spec: JobSpec, job_id: str, outcome: _Outcome) -> Iterator[tuple[UpdateRef, Weights]]:
    """Stream (ref, delta) of each update that passes verification; record every one."""
    for ref in refs:
        if ref.status != "ok" or ref.key is None or ref.sha256 is None:
            outcome.rows.append(_row(job_id, ref, "error", ref.error or "task failed"))
            continue
        try:
            delta = loads(store.get(ref.blob), what=f"blob {ref.key}")
            norm = check_update(delta, reference, spec.max_update_norm)
            if ref.samples <= 0:
                raise UpdateRejected(f"reported {ref.samples} samples")
        except (BlobError, UpdateRejected) as exc:
            outcome.rows.append(_row(job_id, ref, "rejected", str(exc)))
            continue
        outcome.rows.append(_row(job_id, ref, "ok", norm=norm))
        outcome.accepted += 1
        outcome.samples += ref.samples
        outcome.loss_sum += (ref.loss or 0.0) * ref.samples
        outcome.throughput.append((ref.worker, int(ref.extra.get("seen", ref.samples)),
                                   float(ref.extra.get("train_seconds", ref.seconds))))
        yield ref, delta


def _weight(spec: JobSpec, ref: UpdateRef) -> float:
    if spec.weight_by == "processed":
        return float(ref.extra.get("seen") or ref.samples)
    return float(ref.samples)


def aggregate(spec: JobSpec, stream: Iterator[tuple[UpdateRef, Weights]]) -> Weights:
    """The aggregate delta of the verified stream, by the spec's aggregator."""
    if spec.aggregator == "fednova":
        return fednova_mean((_weight(spec, r), r.steps, d) for r, d in stream)
    return weighted_mean((_weight(spec, r), d) for r, d in stream)


def finalize_round(settings: Settings, results: Sequence[Any], job_id: str,
                   round_number: int) -> dict[str, Any]:
    """Aggregate, evaluate and commit round ``round_number`` once; then start the next.

    Safe to call twice for the same round: the second call finds the round no longer
    in 'training' (or loses the conditional UPDATE) and commits nothing.
    """
    started = time.perf_counter()
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        rnd = s.scalar(select(Round).where(Round.job_id == job_id, Round.number == round_number))
        if job is None or rnd is None or rnd.status != "training" or job.status != "running":
            return {"status": "skipped", "reason": "round not open"}
        spec = JobSpec.model_validate(job.spec)
        model_ref = BlobRef(job.global_key, job.global_sha256, job.global_size)
        round_id, round_started = rnd.id, rnd.started_at
    store = open_store(settings.blob_url, settings.s3_endpoint_url)
    current = loads(store.get(model_ref), what=f"blob {model_ref.key}")
    refs = _dedupe(results, job_id, round_number)
    outcome = _Outcome(rows=[])
    try:
        mean = aggregate(spec, _verified(store, refs, current, spec, job_id, outcome))
    except ValueError:
        mean = None
    if mean is None or outcome.accepted < spec.min_clients:
        reasons = sorted({r.error for r in outcome.rows if r.error})
        reason = (f"round {round_number}: {outcome.accepted} usable update(s), "
                  f"min_clients is {spec.min_clients}"
                  + (f"; errors: {'; '.join(reasons)[:1500]}" if reasons else ""))
        _commit(settings, job_id, round_id, outcome.rows, failed=reason)
        return {"status": "failed", "reason": reason}

    new = apply_delta(current, mean)
    accuracy, eval_loss = evaluate_weights(spec, new)
    blob = store.put(global_key(job_id, round_number),
                     dumps(new, {"job": job_id, "round": str(round_number)}))
    seconds = (utcnow() - _aware(round_started)).total_seconds()
    metrics = {
        "participants": outcome.accepted, "samples": outcome.samples,
        "train_loss": outcome.loss_sum / max(outcome.samples, 1), "eval_loss": eval_loss,
        "accuracy": accuracy, "seconds": seconds,
        "bytes_up": sum(r.bytes_up for r in outcome.rows),
        "bytes_down": sum(r.bytes_down for r in outcome.rows),
        "global_key": blob.key, "global_sha256": blob.sha256,
    }
    committed, done = _commit(settings, job_id, round_id, outcome.rows,
                              throughput=outcome.throughput, metrics=metrics,
                              blob=blob, round_number=round_number, total=spec.rounds)
    if not committed:
        return {"status": "skipped", "reason": "round committed by another delivery"}
    if not done:
        request_round(job_id, round_number + 1)
    log.info("job %s round %d committed: accuracy %.4f, %d clients, %.2fs (finalize %.2fs)",
             job_id, round_number, accuracy, outcome.accepted, seconds,
             time.perf_counter() - started)
    return {"status": "committed", "round": round_number, "accuracy": accuracy}


def _commit(settings: Settings, job_id: str, round_id: int, rows: list[ClientUpdate], *,
            throughput: list[tuple[str, int, float]] = (),  # type: ignore[assignment]
            failed: str | None = None, metrics: dict[str, Any] | None = None,
            blob: BlobRef | None = None, round_number: int = 0,
            total: int = 0) -> tuple[bool, bool]:
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
            done = round_number >= total
            if done:
                job.status, job.finished_at = "completed", now
    return True, done


def evaluate_weights(spec: JobSpec, weights: Weights) -> tuple[float, float]:
    """(accuracy, loss) of ``weights`` on the dataset's held-out test split."""
    from fedq.data import load_dataset
    from fedq.models import build_model
    from fedq.training import evaluate, pick_device

    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    model.load_state_dict(weights)
    return evaluate(model, ds.x_test, ds.y_test, device=pick_device())


def initial_weights(spec: JobSpec) -> Weights:
    """The round-0 global model, a function of (model, dataset shape, seed)."""
    from fedq.data import load_dataset
    from fedq.models import build_model
    from fedq.weights import state_of

    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    torch.manual_seed(spec.seed)
    return state_of(build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args))


def _aware(ts: Any) -> Any:
    """SQLite hands back naive datetimes; they were written as UTC."""
    from datetime import timezone

    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
