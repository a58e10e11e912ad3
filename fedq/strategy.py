"""How a round's updates become the next global model, as the job spec chooses.

read -> verify -> clip -> reduce -> (DP noise) -> server optimizer:

1. Each update blob is read (sha256 checked), zstd-decompressed if it is a zstd frame,
   decoded from its codec (fp16, int8) to float32, and verified against the global
   model (names, shapes, dtypes, finite, ``max_update_norm``).
2. With ``clip_norm`` (or DP) it is clipped to that L2 norm.
3. The reducer combines the accepted updates: ``mean`` (weighted by samples or samples
   processed) and ``fednova`` stream one update at a time; the robust reducers
   (median, trimmed mean, Krum, multi-Krum, Bulyan; unweighted) read the updates slice
   by slice from a scratch folder (fedq/spill.py).
4. With ``dp``, the mean of the clipped updates uses the fixed denominator
   clients_per_round and gets Gaussian noise (fedq/aggregate/dp.py).
5. The server optimizer turns the delta into the new model and optimizer state.

The math lives in fedq/aggregate/ (pure functions); this module feeds it from the
blob store and records what happened to each update.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedq.aggregate import Accumulator, check_update, fednova_mean, robust
from fedq.aggregate.compression import decode, maybe_decompress
from fedq.aggregate.dp import add_gaussian_noise
from fedq.aggregate.server import ServerOpts, server_step
from fedq.aggregate.types import Weights
from fedq.blobs import BlobStore
from fedq.db import ClientUpdate
from fedq.errors import BlobError, UpdateRejected
from fedq.refs import UpdateRef
from fedq.spec import JobSpec
from fedq.spill import DiskSource
from fedq.weights import loads_with_meta, raw_size


@dataclass
class Outcome:
    """What happened to a round's updates: one row each, and the totals."""

    job_id: str
    rows: list[ClientUpdate] = field(default_factory=list)
    accepted: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    raw_bytes: int = 0
    usable: set[int] = field(default_factory=set)
    throughput: list[tuple[str, int, float]] = field(default_factory=list)

    def row(self, ref: UpdateRef, status: str, error: str | None = None,
            norm: float | None = None, raw: int = 0) -> None:
        self.rows.append(ClientUpdate(
            job_id=self.job_id, round_number=ref.round, client=ref.client, status=status,
            queue=ref.queue, worker=ref.worker, samples=ref.samples,
            processed=int(ref.extra.get("seen", 0)), steps=ref.steps, seconds=ref.seconds,
            loss=ref.loss, bytes_up=ref.bytes_up, raw_bytes=raw, bytes_down=ref.bytes_down,
            update_norm=norm, blob_key=ref.key, blob_sha256=ref.sha256, error=error))


def read_update(store: BlobStore, ref: UpdateRef, reference: Weights,
                data: bytes | None = None) -> Weights:
    """The float32 delta behind ``ref``: sha256-checked, decompressed, decoded.
    ``data``: the blob's bytes, when already read (and checked) by the caller."""
    data = maybe_decompress(store.get(ref.blob) if data is None else data)
    stored, meta = loads_with_meta(data, what=f"blob {ref.key}")
    shapes = {k: tuple(v.shape) for k, v in reference.items()}
    return decode(stored, meta, shapes)


def verified(store: BlobStore, refs: Sequence[UpdateRef], reference: Weights, spec: JobSpec,
             outcome: Outcome) -> Iterator[tuple[UpdateRef, Weights]]:
    """Stream (ref, delta) of each update that passes verification, clipped if the spec
    says so; record every update in ``outcome``."""
    clip = spec.dp.clip_norm if spec.dp else spec.clip_norm
    for ref, data in prefetched(store, refs):
        if not _has_blob(ref):
            outcome.row(ref, "error", ref.error or "task failed")
            continue
        try:
            if isinstance(data, Exception):
                raise data
            delta = read_update(store, ref, reference, data)
            norm = check_update(delta, reference, spec.max_update_norm)
            if ref.samples <= 0:
                raise UpdateRejected(f"reported {ref.samples} samples")
        except (BlobError, UpdateRejected, ValueError) as exc:
            outcome.row(ref, "rejected", str(exc))
            continue
        if clip is not None:
            delta, _ = robust.clip_update(delta, clip)
        raw = raw_size(delta)
        outcome.row(ref, "ok", norm=norm, raw=raw)
        outcome.accepted += 1
        outcome.raw_bytes += raw
        outcome.usable.add(ref.client)
        outcome.samples += ref.samples
        outcome.loss_sum += (ref.loss or 0.0) * ref.samples
        outcome.throughput.append((ref.worker, int(ref.extra.get("seen", ref.samples)),
                                   float(ref.extra.get("train_seconds", ref.seconds))))
        yield ref, delta


def prefetched(store: BlobStore, refs: Sequence[UpdateRef]
               ) -> Iterator[tuple[UpdateRef, bytes | BlobError | None]]:
    """(ref, its blob's checked bytes or the error reading them), reading the next
    blob in a background thread while the caller works on this one: network reads,
    sha256 and the tensor arithmetic all release the GIL, so on two cores reading
    overlaps averaging. At most two blobs are held at once."""
    from concurrent.futures import Future, ThreadPoolExecutor

    def fetch(ref: UpdateRef) -> bytes | BlobError | None:
        if not _has_blob(ref):
            return None
        try:
            return store.get(ref.blob)
        except BlobError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedq-prefetch") as pool:
        ahead: Future[bytes | BlobError | None] | None = None
        for i, ref in enumerate(refs):
            current = ahead if ahead is not None else pool.submit(fetch, ref)
            ahead = pool.submit(fetch, refs[i + 1]) if i + 1 < len(refs) else None
            data = current.result()
            yield ref, data
            del data, current  # let the blob go before the next one is read


def _has_blob(ref: UpdateRef) -> bool:
    """The task succeeded and named the blob of its update."""
    return ref.status == "ok" and ref.key is not None and ref.sha256 is not None


def _weight(spec: JobSpec, ref: UpdateRef) -> float:
    if spec.dp is not None:
        return 1.0  # DP-FedAvg: every clipped update counts alike
    if spec.weight_by == "processed":
        return float(ref.extra.get("seen") or ref.samples)
    return float(ref.samples)


#: The memory of FedAvg's mean in this process, kept from round to round (a fresh
#: model-sized accumulator pays its page faults every round). ``reduce``'s result for
#: the mean reducer lives in it until the next ``reduce`` in the same thread.
MEAN = Accumulator()


def reduce(spec: JobSpec, store: BlobStore, refs: Sequence[UpdateRef], reference: Weights,
           outcome: Outcome, scratch: Path) -> Weights | None:
    """The combined delta, or None when fewer than the quorum of updates are usable.

    With the mean reducer the delta is ``MEAN``'s memory: use it before the next call.
    """
    stream = verified(store, refs, reference, spec, outcome)
    name = spec.reducer.name
    try:
        if name == "mean":
            delta = MEAN.mean((_weight(spec, r), d) for r, d in stream)
        elif name == "fednova":
            delta = fednova_mean((_weight(spec, r), r.steps, d) for r, d in stream)
        else:
            with DiskSource(scratch) as source:
                for _, d in stream:
                    source.add(d)
                if len(source) < spec.quorum:
                    return None
                delta = _robust(spec, source)
    except ValueError:  # nothing usable to average
        return None
    if outcome.accepted < spec.quorum:
        return None
    if spec.dp is not None:  # fixed denominator: the round's planned size
        delta = {k: v * (outcome.accepted / spec.clients_per_round) for k, v in delta.items()}
        delta = add_gaussian_noise(
            delta, clip_norm=spec.dp.clip_norm, noise_multiplier=spec.dp.noise_multiplier,
            clients_per_round=spec.clients_per_round,
            generator=torch.Generator().manual_seed(secrets.randbits(63)))
    return delta


def _robust(spec: JobSpec, source: DiskSource) -> Weights:
    r = spec.reducer
    if r.name == "median":
        return robust.median(source)
    if r.name == "trimmed_mean":
        return robust.trimmed_mean(source, r.beta)
    if r.name == "krum":
        return robust.krum(source, r.f)
    if r.name == "multi_krum":
        return robust.multi_krum(source, r.f, r.m or len(source) - r.f)
    return robust.bulyan(source, r.f)


def server_opts(spec: JobSpec) -> ServerOpts:
    s = spec.server
    return ServerOpts.default(s.name, lr=s.lr, momentum=s.momentum, beta2=s.beta2, tau=s.tau)


def apply_server(spec: JobSpec, weights: Weights, delta: Weights,
                 state: Weights) -> tuple[Weights, Weights]:
    """The new global model and server optimizer state."""
    return server_step(weights, delta, state, server_opts(spec))
