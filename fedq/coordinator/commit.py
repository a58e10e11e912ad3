"""The one commit sequence, for a synchronous round and a buffered version alike.

Both modes call :func:`aggregate` (the updates reduced by fedq/coordinator/pipeline.py
``reduce``; a buffered version weighs each by its staleness factor), which ends in

1. :func:`build` — the server optimizer's step from the stored state, the evaluation
   when it is due, the new model, state and step written to the blob store, and the
   privacy spent so far (DP-FedAvg with an RDP accountant);
2. the mode's own claim transaction (``UPDATE rounds ... WHERE status='training'``:
   one delivery wins), which writes :func:`metrics` into the round row and calls
   :func:`advance` to move the job's pointers;
3. :func:`settle` — after the claim: the new model kept in this process for the next
   round, and the update blobs older than ``keep_updates`` deleted.

A spec option the sequence cannot honour in a mode is refused by the spec for that
mode (``JobSpec.problems``), never ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from fedq.aggregate.dp import epsilon
from fedq.aggregate.fedavg import Accumulator
from fedq.aggregate.streaming import fragment_names
from fedq.aggregate.types import Weights
from fedq.blobs import BlobRef, BlobStore, state_key, update_key
from fedq.coordinator import lean
from fedq.coordinator.evaluation import evaluate_weights
from fedq.coordinator.pipeline import Outcome, put_model, reduce, server_update
from fedq.coordinator.steps import set_step
from fedq.db import ClientUpdate, Job, session_scope
from fedq.phases import phase
from fedq.process import PROCESS
from fedq.protocol.training import StepRef, UpdateRef
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.testing import hold
from fedq.weights import loads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewModel:
    """A round's or version's new global model: stored and evaluated, not yet claimed."""

    number: int  # the round or version it commits
    weights: Weights
    blob: BlobRef
    state: BlobRef | None  # the server optimizer's state (with the downlink residual)
    step: StepRef | None  # the model as a step from the previous one
    accuracy: float | None
    eval_loss: float | None
    epsilon: float | None  # DP: the privacy spent after this round
    keep: bool = True  # whether the process keeps ``weights`` for the next round


def current_model(store: BlobStore, ref: BlobRef) -> Weights:
    """The global model: the one this process committed last, else read from the store."""
    kept = PROCESS.model(ref.sha256)
    return kept if kept is not None else loads(store.get(ref), what=f"blob {ref.key}")


def aggregate(spec: JobSpec, store: BlobStore, job_id: str, number: int,
              refs: Sequence[UpdateRef], current: Weights, current_sha256: str,
              server_state: BlobRef | None, outcome: Outcome, scratch: Path,
              acc: Accumulator, factors: Mapping[int, float] | None = None,
              tag: str = "", source: BlobRef | None = None) -> NewModel | None:
    """Round or version ``number``'s new model from ``refs``: verified and reduced
    (each update's weight times its ``factors`` entry, by ``ref.task``: a buffered
    version's staleness), then :func:`build`. With ``streaming``, the updates carry
    this round's fragment only. ``source``: the stored global model when ``current``
    is its outline alone (fedq/coordinator/lean.py). None when fewer than the quorum
    pass verification (nothing is written then)."""
    reference = current if spec.streaming is None else \
        {k: current[k] for k in fragment_names(current, number, spec.streaming.fragments)}
    with phase("updates"):  # read, decode, verify and reduce, streamed
        delta = reduce(spec, store, refs, reference, outcome, scratch, acc, factors)
    if source is not None:  # the lean server step writes the new model into it
        acc.release()
    if delta is None:
        return None
    return build(spec, store, job_id, number, current, current_sha256, delta, server_state,
                 tag=tag, source=source)


def build(spec: JobSpec, store: BlobStore, job_id: str, number: int, current: Weights,
          current_sha256: str, delta: Weights, server_state: BlobRef | None,
          tag: str = "", source: BlobRef | None = None) -> NewModel:
    """Step the server optimizer, evaluate if due, store the results (``tag``: a key of
    this attempt's own, for commits that may race; ``source``: as for
    :func:`aggregate`)."""
    lean_state = None
    with phase("server step"):
        if source is None:
            state = loads(store.get_buffer(server_state), what=f"blob {server_state.key}") \
                if server_state else {}
            nxt = server_update(spec, current, delta, state)
        else:  # the new state is written as it is made
            nxt, lean_state = lean.server_step(
                spec, store, source, delta, server_state,
                state_key(job_id, number, tag), {"job": job_id, "round": str(number)},
                lambda n: hold.at("server step", f"{job_id}-r{number}", "control")
                if n == 1 else None)
    every = spec.eval_every
    with phase("evaluate"):
        accuracy, eval_loss = evaluate_weights(spec, nxt.weights) \
            if every and (number % every == 0 or number >= spec.rounds) else (None, None)
    with phase("encode + write model"):
        blob, state_blob, step = put_model(store, job_id, number, nxt, current_sha256,
                                           tag=tag)
    return NewModel(number, nxt.weights, blob, state_blob or lean_state, step, accuracy,
                    eval_loss, privacy_spent(spec, number), keep=source is None)


def privacy_spent(spec: JobSpec, number: int) -> float | None:
    """epsilon after ``number`` rounds of DP-FedAvg: the RDP accountant for the sampled
    Gaussian mechanism, each round sampling clients_per_round of num_clients
    (fedq/aggregate/dp.py). None without DP. Synchronous rounds only: the spec refuses
    DP for buffered jobs, whose versions take the updates that arrive first."""
    dp = spec.dp
    if dp is None:
        return None
    return epsilon(number, noise_multiplier=dp.noise_multiplier,
                   sample_rate=spec.clients_per_round / spec.num_clients, delta=dp.delta)


def metrics(new: NewModel, outcome: Outcome, bytes_up: int, bytes_down: int,
            seconds: float, finalize_seconds: float) -> dict[str, Any]:
    """The round row's columns for a commit."""
    return {
        "participants": outcome.accepted, "samples": outcome.samples,
        "train_loss": outcome.loss_sum / max(outcome.samples, 1), "eval_loss": new.eval_loss,
        "accuracy": new.accuracy, "seconds": seconds, "bytes_up": bytes_up,
        "raw_bytes_up": outcome.raw_bytes, "bytes_down": bytes_down,
        "global_key": new.blob.key, "global_sha256": new.blob.sha256,
        "finalize_seconds": finalize_seconds, "epsilon": new.epsilon,
    }


def advance(job: Job, new: NewModel) -> None:
    """Point the job at the new model (inside the claim's transaction)."""
    job.committed_round = new.number
    job.global_key, job.global_sha256, job.global_size = (new.blob.key, new.blob.sha256,
                                                          new.blob.size)
    set_step(job, new.step)
    if new.state is not None:
        job.state_key, job.state_sha256, job.state_size = (new.state.key, new.state.sha256,
                                                           new.state.size)


def settle(settings: Settings, store: BlobStore, spec: JobSpec, job_id: str,
           new: NewModel, rows: Sequence[ClientUpdate] | None = None) -> int:
    """After the claim: keep the new model in this process (the next round's finalize
    starts from it) and delete the update blobs of the round or version
    ``keep_updates`` before this one. ``rows``: the client rows the claim wrote; with
    ``keep_updates: 0`` they name this round's blobs, so the database is not asked
    again. Returns how many blobs were deleted."""
    if new.keep:
        PROCESS.keep_model(new.blob.sha256, new.weights, only=True)
    else:  # the next round reads its outline again (fedq/coordinator/lean.py)
        PROCESS.models.clear()
    if spec.keep_updates is None or new.number <= spec.keep_updates:
        return 0
    tasks = None if rows is None or spec.keep_updates else \
        [(r.round_number, r.task_index, r.client, r.attempt, r.signer) for r in rows]
    return drop_updates(settings, store, job_id, new.number - spec.keep_updates, tasks)


def drop_updates(settings: Settings, store: BlobStore, job_id: str, number: int,
                 tasks: Sequence[Sequence[Any]] | None = None) -> int:
    """Delete every update blob of round or version ``number`` — each task's key for
    every attempt it was sent, whatever became of it; the rows that describe them stay.
    ``tasks``: (round, task index, client, attempts, signer) of each of its rows, when
    the caller has them; else they are read. A failure is logged, never fatal: it only
    costs space."""
    if tasks is None:
        with session_scope(settings.database_url) as s:
            tasks = s.execute(select(ClientUpdate.round_number, ClientUpdate.task_index,
                                     ClientUpdate.client, ClientUpdate.attempt,
                                     ClientUpdate.signer)
                              .where(ClientUpdate.job_id == job_id,
                                     ClientUpdate.round_number == number)).all()
    signers = {None} | {signer for *_, signer in tasks if signer}  # registered workers' folders
    keys = {update_key(job_id, index or rnd, client, a, who)
            for rnd, index, client, attempts, _ in tasks
            for a in range(1, (attempts or 1) + 1) for who in signers}
    try:
        store.delete_keys(sorted(keys))
    except Exception:  # noqa: BLE001 - space, not correctness
        log.exception("job %s: could not delete the update blobs of %d", job_id, number)
    return len(keys)
