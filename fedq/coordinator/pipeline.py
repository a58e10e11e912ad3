"""How a round's updates become the next global model, as the job spec chooses.

read -> verify -> clip -> reduce -> (DP noise) -> server optimizer:

1. Each update blob is read (digest checked), zstd-decompressed if it is a zstd frame,
   decoded from its codec (fp16, int8) to float32, and verified against the global
   model (names, shapes, dtypes, finite, ``max_update_norm``).
2. With ``clip_norm`` (or DP) it is clipped to that L2 norm.
3. The reducer (a plug-in from fedq/aggregate/reducers/) combines the accepted
   updates: stream reducers (mean, FedNova) take one update at a time; source reducers
   (median, trimmed mean, Krum, multi-Krum, Bulyan; unweighted) read the updates slice
   by slice from a scratch folder (fedq/coordinator/spill.py).
4. With ``dp``, the mean of the clipped updates uses the fixed denominator
   clients_per_round and gets Gaussian noise (fedq/aggregate/dp.py).
5. The server optimizer (fedq/aggregate/server/) turns the delta into the new model
   and optimizer state.
6. With ``compression: {downlink: int8}`` the new model is published as the previous
   one plus an int8 step (fedq/aggregate/downlink.py), stored beside the full model;
   with Streaming DiLoCo the step carries the round's fragment alone (whole, in fp32,
   without the int8 downlink).

The math lives in fedq/aggregate/ (pure functions); this module feeds it from the
blob store and records what happened to each update as an :class:`UpdateRecord`
(finalize writes them as rows).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from fedq.aggregate import Accumulator, check_update
from fedq.aggregate.clip import clip_update
from fedq.aggregate.compression import decode, maybe_decompress
from fedq.aggregate.downlink import RESIDUAL, compress_step, split_state
from fedq.aggregate.dp import add_gaussian_noise
from fedq.aggregate.reducers import Contribution, SourceReducer, StreamReducer, make_reducer
from fedq.aggregate.server import ServerOptimizer, make_server
from fedq.aggregate.types import Weights
from fedq.blobs import BlobRef, BlobStore, global_key, state_key, step_key
from fedq.coordinator.receive import Received, receive, streams
from fedq.coordinator.spill import DiskSource
from fedq.errors import BlobError, UpdateRejected
from fedq.phases import phase
from fedq.protocol.training import StepRef, UpdateRef
from fedq.redaction import redact_text
from fedq.spec import JobSpec
from fedq.status import UpdateStatus, failed_status
from fedq.weights import dump_parts, loads_with_meta, raw_size

T = TypeVar("T")


@dataclass(frozen=True)
class UpdateRecord:
    """What happened to one client's result: ok (averaged), rejected, error, late."""

    ref: UpdateRef
    status: str
    error: str | None = None
    norm: float | None = None  # L2 norm of the delta as sent (before any clipping)
    raw_bytes: int = 0  # float32 size of the decoded delta


@dataclass
class Outcome:
    """What happened to a round's updates: one record each, and the totals."""

    records: list[UpdateRecord] = field(default_factory=list)
    accepted: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    raw_bytes: int = 0
    throughput: list[tuple[str, int, float]] = field(default_factory=list)

    def record(self, ref: UpdateRef, status: str, error: str | None = None,
               norm: float | None = None, raw: int = 0) -> None:
        self.records.append(UpdateRecord(ref, status, redact_text(error) if error else None,
                                         norm, raw))

    @property
    def rejected(self) -> list[int]:
        """Clients whose ok result failed verification."""
        return [r.ref.client for r in self.records
                if r.ref.status == "ok" and r.status != "ok"]


def update_limit(reference: Weights, chunk: int) -> int:
    """The most bytes an update of ``reference`` can take, stored or decompressed: its
    float32 size (wider dtypes as they are), int8 scales of ``chunk``, and the
    safetensors header with slack. Larger blobs are refused before they are read."""
    data = sum(t.numel() * max(4, t.element_size()) for t in reference.values())
    scales = sum(4 * -(-t.numel() // chunk) for t in reference.values())
    return data + scales + 256 * len(reference) + (64 << 10)


def read_update(store: BlobStore, ref: UpdateRef, reference: Weights, spec: JobSpec,
                data: bytes | None = None) -> Weights:
    """The float32 delta behind ``ref``: digest-checked, decompressed, decoded, each
    step bounded by :func:`update_limit`. ``data``: the blob's bytes, when already
    read (and checked) by the caller."""
    limit = update_limit(reference, spec.compression.chunk)
    data = maybe_decompress(store.get(ref.blob, limit=limit) if data is None else data, limit)
    stored, meta = loads_with_meta(data, what=f"blob {ref.key}")
    shapes = {k: tuple(v.shape) for k, v in reference.items()}
    return decode(stored, meta, shapes, spec.compression.chunk)


def verified(store: BlobStore, refs: Sequence[UpdateRef], reference: Weights, spec: JobSpec,
             outcome: Outcome, scratch: Path | None = None
             ) -> Iterator[tuple[UpdateRef, Weights | Received]]:
    """Stream (ref, delta) of each update that passes verification, clipped if the spec
    says so; record every update in ``outcome``. Whatever goes wrong while one update
    is read — its bytes, size, compression, codec, shapes, values — rejects that
    update alone, with the reason; it never escapes to the round.

    ``scratch``: where a big update may be received (fedq/coordinator/receive.py; the
    caller's reducer takes pieces, and there is no DP): its delta is then a
    :class:`Received`, valid until the next item is asked for."""
    clip = spec.dp.clip_norm if spec.dp else spec.clip_norm
    limit = update_limit(reference, spec.compression.chunk)
    folder = scratch if spec.dp is None else None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)

    def fetch(index: int, ref: UpdateRef) -> bytes | Received | Exception | None:
        if not _has_blob(ref):
            return None
        try:
            if folder is not None and streams(store, ref):
                got = receive(store, ref, reference, limit, spec.max_update_norm, folder,
                              spec.compression.chunk)
                if got is not None:
                    return got
            return store.get(ref.blob, limit=limit)
        except Exception as exc:  # noqa: BLE001 - the update's rejection, not the round's
            return exc

    blobs = prefetched(store, refs, limit, fetch)
    while True:
        with phase("read wait"):  # the background read of this blob not done yet
            item = next(blobs, None)
        if item is None:
            break
        ref, data = item
        if not _has_blob(ref):
            outcome.record(ref, failed_status(ref.status), ref.error or "task failed")
            continue
        delta: Weights | Received
        try:
            if isinstance(data, Exception):
                raise data
            if isinstance(data, Received):  # checked as it arrived
                delta, norm = data, data.norm
            else:
                with phase("decode"):
                    delta = read_update(store, ref, reference, spec, data)
                with phase("verify"):
                    norm = check_update(delta, reference, spec.max_update_norm)
            if ref.samples <= 0:
                raise UpdateRejected(f"reported {ref.samples} samples")
        except Exception as exc:  # noqa: BLE001 - a hostile blob may raise anything
            outcome.record(ref, UpdateStatus.REJECTED, _reason(exc))
            if isinstance(data, Received):
                data.discard()
            continue
        if clip is not None:
            if isinstance(delta, Received):
                delta.clip(clip)
            else:
                delta, _ = clip_update(delta, clip)
        raw = delta.raw if isinstance(delta, Received) else raw_size(delta)
        outcome.record(ref, "ok", norm=norm, raw=raw)
        outcome.accepted += 1
        outcome.raw_bytes += raw
        outcome.samples += ref.samples
        outcome.loss_sum += (ref.loss or 0.0) * ref.samples
        outcome.throughput.append((ref.worker, ref.stats.seen or ref.samples,
                                   ref.stats.train_seconds or ref.seconds))
        try:
            yield ref, delta
        finally:
            if isinstance(delta, Received):
                delta.discard()


def _reason(exc: BaseException) -> str:
    """One line for a rejected update: fedq's own errors say what they checked;
    anything else is named by its type (the check that did not anticipate it)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    if isinstance(exc, (BlobError, UpdateRejected)):
        return redact_text(text)[:500]
    return redact_text(f"unreadable update: {type(exc).__name__}: {text}")[:500]


def prefetched(store: BlobStore, refs: Sequence[UpdateRef], limit: int | None = None,
               fetch: Callable[[int, UpdateRef], T] | None = None
               ) -> Iterator[tuple[UpdateRef, T | bytes | Exception | None]]:
    """(ref, its blob's checked bytes or the error reading them; or what ``fetch(i,
    ref)`` returns), reading the next blob in a background thread while the caller
    works on this one: network reads, hashing and the tensor arithmetic all release
    the GIL, so on two cores reading overlaps averaging. At most two blobs are held at
    once, each at most ``limit`` bytes (a larger one is refused before it is read)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    def read(index: int, ref: UpdateRef) -> bytes | Exception | None:
        if not _has_blob(ref):
            return None
        try:
            return store.get(ref.blob, limit=limit)
        except Exception as exc:  # noqa: BLE001 - the update's rejection, not the round's
            return exc

    get: Callable[[int, UpdateRef], Any] = fetch if fetch is not None else read
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedq-prefetch") as pool:
        ahead: Future[Any] | None = None
        try:
            for i, ref in enumerate(refs):
                current = ahead if ahead is not None else pool.submit(get, i, ref)
                ahead = pool.submit(get, i + 1, refs[i + 1]) if i + 1 < len(refs) else None
                data = current.result()
                yield ref, data
                del data, current  # let the blob go before the next one is read
        finally:  # a read ahead that nobody will consume: its scratch file goes
            if ahead is not None and isinstance(left := ahead.result(), Received):
                left.discard()


def _has_blob(ref: UpdateRef) -> bool:
    """The task succeeded and named the blob of its update."""
    return ref.status == "ok" and ref.key is not None and ref.sha256 is not None


def update_weight(spec: JobSpec, ref: UpdateRef) -> float:
    """An update's weight in the mean (before a buffered job's staleness factor)."""
    if spec.dp is not None:
        return 1.0  # DP-FedAvg: every clipped update counts alike
    if spec.weight_by == "processed":
        return float(ref.stats.seen or ref.samples)
    return float(ref.samples)


def reduce(spec: JobSpec, store: BlobStore, refs: Sequence[UpdateRef], reference: Weights,
           outcome: Outcome, scratch: Path, acc: Accumulator,
           factors: Mapping[int, float] | None = None) -> Weights | None:
    """The combined delta, or None when fewer than the quorum of updates are usable.

    ``acc``: the memory a stream reducer may reuse for its result (the result is then
    valid until ``acc``'s next use). ``factors``: a buffered job's staleness factor of
    each update, by ``ref.task`` (its task number), multiplying its weight."""
    reducer = make_reducer(spec.reducer.name, spec.reducer.params())
    pieces = isinstance(reducer, StreamReducer) and reducer.takes_pieces
    stream = verified(store, refs, reference, spec, outcome, scratch if pieces else None)
    factor_sum = 0.0

    def weighted(r: UpdateRef) -> float:
        nonlocal factor_sum
        f = 1.0 if factors is None else factors[r.task]
        factor_sum += f
        return update_weight(spec, r) * f

    try:
        if isinstance(reducer, StreamReducer):
            # the weights' sum if every update passes: the mean then skips a pass
            acc.expect(sum(update_weight(spec, r) * (factors or {}).get(r.task, 1.0)
                           for r in refs if _has_blob(r)))
            delta = reducer.reduce(
                (Contribution(weighted(r), r.steps, d) for r, d in stream), acc)
        else:
            assert isinstance(reducer, SourceReducer)
            with DiskSource(scratch) as source:
                for _, d in stream:
                    assert not isinstance(d, Received)  # verified() was given no scratch
                    source.add(d)
                if len(source) < spec.quorum:
                    return None
                delta = reducer.reduce(source)
    except ValueError:  # nothing usable to average
        return None
    if outcome.accepted < spec.quorum:
        return None
    if spec.dp is not None:
        # Fixed denominator: the round's planned size (a buffered job: its buffer K).
        # Every weight is 1 (x a staleness factor <= 1), so the mean times the summed
        # weights over n is sum(w_i d_i) / n, whose sensitivity stays clip_norm / n.
        n = spec.aggregation.buffer if spec.buffered else spec.clients_per_round
        used = factor_sum if isinstance(reducer, StreamReducer) else outcome.accepted
        delta = {k: v * (used / n) for k, v in delta.items()}
        delta = add_gaussian_noise(
            delta, clip_norm=spec.dp.clip_norm, noise_multiplier=spec.dp.noise_multiplier,
            clients_per_round=n,
            generator=torch.Generator().manual_seed(secrets.randbits(63)))
    return delta


def apply_server(spec: JobSpec, weights: Weights, delta: Weights,
                 state: Weights) -> tuple[Weights, Weights]:
    """The new global model and server optimizer state."""
    return make_server_for(spec).step(weights, delta, state)


def make_server_for(spec: JobSpec) -> ServerOptimizer:
    """The job's server optimizer (a buffered job's FedAvg steps K / C unless told)."""
    params = spec.server.params()
    if spec.buffered:
        params["lr"] = spec.aggregation.server_lr(spec.server, spec.clients_per_round)
    return make_server(spec.server.name, params)


@dataclass(frozen=True)
class NextModel:
    """The server's result for one round or version, before it is stored."""

    weights: Weights  # the new global model as workers will see it
    state: Weights  # the server optimizer's state, with the downlink residual
    step: tuple[Weights, dict[str, str]] | None  # the int8 step's tensors and metadata


def server_update(spec: JobSpec, current: Weights, delta: Weights,
                  stored_state: Weights) -> NextModel:
    """The server optimizer's step and, with a compressed downlink, the model as the
    int8 step from ``current`` defines it (the residual carried in the state)."""
    own, residual = split_state(stored_state)
    new, new_state = apply_server(spec, current, delta, own)
    quantize = spec.compression.downlink == "int8"
    if not quantize and spec.streaming is None:
        return NextModel(new, new_state, None)
    # with Streaming DiLoCo the step carries the round's fragment alone (exact in fp32)
    published, left, stored, meta = compress_step(current, new, residual,
                                                  spec.compression.chunk, quantize=quantize)
    state = {**new_state, **{RESIDUAL + k: v for k, v in left.items()}}
    return NextModel(published, state, (stored, meta))


def put_model(store: BlobStore, job_id: str, number: int, model: NextModel, base: str,
              tag: str = "") -> tuple[BlobRef, BlobRef | None, StepRef | None]:
    """Store the new global model, the server state and the step (if any): their refs;
    the step's ref names ``base``, the digest of the global blob it steps from."""
    meta = {"job": job_id, "round": str(number)}
    blob = store.put_parts(global_key(job_id, number, tag), dump_parts(model.weights, meta))
    state = store.put_parts(state_key(job_id, number, tag), dump_parts(model.state, meta)) \
        if model.state else None
    step = None
    if model.step is not None:
        tensors, step_meta = model.step
        step = StepRef(store.put_parts(step_key(job_id, number, tag),
                                       dump_parts(tensors, {**step_meta, **meta})), base)
    return blob, state, step


