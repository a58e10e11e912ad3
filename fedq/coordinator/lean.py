"""A commit that never holds the global model whole, only the accumulator.

For a model larger than its blob store reads at once (``BlobStore.piece_bytes``: a
Redis chunk, or a piece of a file or an S3 object), the control worker's finalize
reads the global model's header alone (its outline: names, shapes, dtypes) to check
the updates against, streams the updates into the accumulator
(fedq/coordinator/receive.py), and then steps the server optimizer piece by piece:
each piece of the stored global model is read and the new value is written into the
accumulator's own memory (server optimizers work element by element, so the result is
the whole-model step's, bit for bit). The server optimizer's state (DiLoCo's
momentum, Adam's moments) goes through the same way, one tensor at a time: each
tensor's stored state is read as its pieces are stepped, and the new state is written
to the store as it is made. The stored model's and state's digests are checked after
their last pieces, before any new blob is complete (the new state's last part waits for
them); a mismatch fails the commit, and the next try starts from a new accumulator. The
new model is then the accumulator; nothing else model-sized is held. The process does
not keep the new model for the next round either: that round reads its outline again.

It applies where :func:`applies` says: a synchronous round, a reducer that takes
pieces, no DP, no int8 downlink and no Streaming DiLoCo fragments; any
other job keeps the whole-model commit (fedq/coordinator/commit.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from fedq.aggregate.downlink import split_state
from fedq.aggregate.reducers import StreamReducer, make_reducer
from fedq.aggregate.server.base import ServerOptimizer
from fedq.aggregate.types import Weights
from fedq.blobs import BlobRef, BlobStore
from fedq.coordinator.pipeline import NextModel, make_server_for
from fedq.errors import UpdateRejected
from fedq.spec import JobSpec
from fedq.weights import (
    Entry,
    Layout,
    LazyWeights,
    dump_stream,
    loads,
    pieces,
    split_header,
)

#: Bytes of the stored model read at a time by the server step.
PIECE_BYTES = 4 << 20


def applies(spec: JobSpec, piece_bytes: int | None, model_bytes: int) -> bool:
    """Whether round commits of ``spec``'s job go the lean way (module docstring) with
    a global model of ``model_bytes`` on a store that reads at most ``piece_bytes`` at
    once (``BlobStore.piece_bytes``)."""
    if piece_bytes is None or model_bytes <= piece_bytes:
        return False
    reducer = make_reducer(spec.reducer.name, spec.reducer.params())
    return (isinstance(reducer, StreamReducer) and reducer.takes_pieces
            and spec.dp is None and not spec.buffered
            and spec.streaming is None and spec.compression.downlink != "int8")


def _stream(store: BlobStore, model: BlobRef) -> tuple[Layout, Iterator[memoryview]]:
    """The stored model's checked header, and its data section in pieces."""
    return split_header(store.stream(model), model.size, f"blob {model.key}")


def outline(store: BlobStore, model: BlobRef) -> Weights:
    """The stored model's names, shapes and dtypes as empty ("meta") tensors, in its
    order: what updates are checked against."""
    lay, data = _stream(store, model)
    data.close()  # type: ignore[attr-defined]
    return {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in lay.entries}


def server_step(spec: JobSpec, store: BlobStore, model: BlobRef, delta: Weights,
                stored_state: BlobRef | None, state_key: str, meta: Mapping[str, str],
                after_piece: Callable[[int], None] | None = None
                ) -> tuple[NextModel, BlobRef | None]:
    """The server optimizer's step from the stored model ``model``, read piece by
    piece, written into ``delta`` (the caller gives it up) where the dtypes allow it
    (float32: a model in another dtype gets new tensors for those), and the new server
    state, written to ``state_key`` (with ``meta``) as it is made: (the new model, with
    no state in it; the state's ref, None for an optimizer without state).

    The state is read and written one tensor at a time (each tensor's ``m`` and ``v``),
    so no model-sized state is held; a stored state in another order than the one
    written here is read whole. Both stored blobs' digests are checked after their last
    piece, before the new state's last piece is written: a mismatch leaves no new
    state. ``after_piece(n)``: called once piece ``n`` (from 1) is stepped."""
    server = make_server_for(spec)
    kinds = _kinds(server)
    lay, data = _stream(store, model)
    floats = [e for e in lay.by_offset() if e.dtype.is_floating_point]
    outline = {f"{k}.{e.name}": torch.empty(e.shape, dtype=torch.float32, device="meta")
               for e in floats for k in kinds}
    before = _stored(store, stored_state, outline)
    weights: Weights = {}
    steps = _steps(server, kinds, lay, data, delta, weights, before, after_piece)
    state = None
    if kinds and floats:
        made: dict[str, torch.Tensor] = {}

        def make(name: str) -> torch.Tensor:
            if outline[name].numel() == 0:  # an empty tensor has no pieces to step
                return torch.empty(outline[name].shape)
            if name not in made:
                made.clear()
                entry, values = next(steps)
                made.update({f"{k}.{entry.name}": v for k, v in values.items()})
            return made.pop(name)

        size, parts = dump_stream(LazyWeights(outline, make), meta)
        state = store.put_stream(state_key, size, parts)
    for _ in steps:  # FedAvg: no state; or the tensors after the last float one
        pass
    for e in lay.entries:  # empty tensors have no pieces
        weights.setdefault(e.name, torch.empty(e.shape, dtype=e.dtype))
    return NextModel({e.name: weights[e.name] for e in lay.entries}, {}, None), state


def _kinds(server: ServerOptimizer) -> list[str]:
    """The state the server keeps per tensor (``m``, ``v``), in the order it gives them."""
    state: dict[str, torch.Tensor] = {}
    for _ in range(2):
        _, state = server.update(torch.zeros(1), state)
    return list(state)


def _steps(server: ServerOptimizer, kinds: list[str], lay: Layout, data: Iterator[memoryview],
           delta: Weights, weights: Weights, before: _Before,
           after_piece: Callable[[int], None] | None
           ) -> Iterator[tuple[Entry, dict[str, torch.Tensor]]]:
    """Step the stored model's pieces into ``weights``; each float tensor's new state
    once its last piece is stepped. The last one comes only once both stored blobs are
    read to their end (their digests checked)."""
    flat = {name: t.view(-1) for name, t in delta.items()}
    held: tuple[Entry, dict[str, torch.Tensor]] | None = None
    first_step = False  # the held tensor had no stored state: each piece's is new
    for count, (entry, first, values) in enumerate(pieces(lay.by_offset(), data, PIECE_BYTES)):
        if after_piece is not None and count:
            after_piece(count)
        name, n = entry.name, values.numel()
        d = flat[name][first:first + n]
        if name not in weights:
            weights[name] = delta[name] if entry.dtype == delta[name].dtype \
                and entry.dtype.is_floating_point else torch.empty(entry.shape, dtype=entry.dtype)
        out = weights[name].view(-1)[first:first + n]
        if not entry.dtype.is_floating_point:  # integer buffers: the plain delta
            out.copy_((values.to(torch.float64) + d.to(torch.float64)).round().to(entry.dtype))
            continue
        if held is None or held[0].name != name:
            if held is not None:
                yield held
            held = entry, before.take(entry, kinds)
            first_step = not held[1]
        mine = {} if first_step else {k: v.view(-1)[first:first + n] for k, v in held[1].items()}
        step, after = server.update(d.to(torch.float32), mine)
        for k, v in after.items():
            if k not in held[1]:
                held[1][k] = torch.empty(entry.shape, dtype=torch.float32)
            held[1][k].view(-1)[first:first + n].copy_(v)
        if out.dtype == step.dtype:
            torch.add(values, step, out=out)
        else:
            out.copy_((values.to(step.dtype) + step).to(out.dtype))
    before.finish()
    if held is not None:
        yield held


class _Before:
    """The stored server state, given one tensor's ``m`` and ``v`` at a time: read in
    the order :func:`server_step` writes (or whole, from a state in another order)."""

    def __init__(self, lay: Layout | None, data: Iterator[memoryview] | None,
                 whole: Weights | None = None) -> None:
        self.whole = whole
        self.pieces = pieces(lay.by_offset(), data, PIECE_BYTES) \
            if lay is not None and data is not None else None
        self.next: tuple[Entry, int, torch.Tensor] | None = None

    def take(self, entry: Entry, kinds: list[str]) -> dict[str, torch.Tensor]:
        if self.whole is not None:
            return {k: self.whole[f"{k}.{entry.name}"] for k in kinds
                    if f"{k}.{entry.name}" in self.whole}
        if self.pieces is None:  # a first step
            return {}
        out = {}
        for k in kinds:
            t = out[k] = torch.empty(entry.shape, dtype=torch.float32)
            flat, filled = t.view(-1), 0
            while filled < flat.numel():
                _, first, values = next(self.pieces)
                flat[first:first + values.numel()].copy_(values)
                filled += values.numel()
        return out

    def finish(self) -> None:
        """Read the stored state to its end (its digest is checked there)."""
        if self.pieces is not None:
            for _ in self.pieces:
                raise UpdateRejected("server state: tensor data past its last tensor")


def _stored(store: BlobStore, ref: BlobRef | None, outline: Weights) -> _Before:
    """The stored state ``ref``, streamed if its tensors are ``outline``'s in order."""
    if ref is None:
        return _Before(None, None)
    lay, data = _stream(store, ref)
    got = [(e.name, e.shape, e.dtype) for e in lay.by_offset()]
    if got == [(k, tuple(t.shape), t.dtype) for k, t in outline.items()]:
        return _Before(lay, data)
    data.close()  # type: ignore[attr-defined]
    own, _ = split_state(loads(store.get_buffer(ref), what=f"blob {ref.key}"))
    return _Before(None, None, own)
