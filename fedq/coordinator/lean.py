"""A commit that never holds the global model whole, only the accumulator.

For a model larger than its blob store reads at once (``BlobStore.piece_bytes``: a
Redis chunk, or a piece of a file or an S3 object), the control worker's finalize
reads the global model's header alone (its outline: names, shapes, dtypes) to check
the updates against, streams the updates into the accumulator
(fedq/coordinator/receive.py), and then steps the server optimizer piece by piece:
each piece of the stored global model is read and the new value is written into the
accumulator's own memory (server optimizers work element by element, so the result is
the whole-model step's, bit for bit). The stored model's digest is checked after its
last piece, before anything is written; a mismatch fails the commit, and the next try
starts from a new accumulator. The new model is then the accumulator; nothing else
model-sized is held, except the server optimizer's state (DiLoCo's momentum is
updated in the memory it was read into). The process does not keep the new model for
the next round either: that round reads its outline again.

It applies where :func:`applies` says: a synchronous round, a reducer that takes
pieces, no clipping or DP, no int8 downlink and no Streaming DiLoCo fragments; any
other job keeps the whole-model commit (fedq/coordinator/commit.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from fedq.aggregate.downlink import split_state
from fedq.aggregate.reducers import StreamReducer, make_reducer
from fedq.aggregate.types import Weights
from fedq.blobs import BlobRef, BlobStore
from fedq.coordinator.pipeline import NextModel, make_server_for
from fedq.spec import JobSpec
from fedq.weights import Entry, Layout, pieces, split_header

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
            and spec.clip_norm is None and spec.dp is None and not spec.buffered
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
                stored_state: Weights, after_piece: Callable[[int], None] | None = None
                ) -> NextModel:
    """The server optimizer's step from the stored model ``model``, read piece by
    piece, written into ``delta`` (the caller gives it up) where the dtypes allow it
    (float32: a model in another dtype gets new tensors for those). The state's
    tensors are updated in the memory of ``stored_state`` where it has them.
    ``after_piece(n)``: called once piece ``n`` (from 1) is stepped."""
    own, _ = split_state(stored_state)
    server = make_server_for(spec)
    lay, data = _stream(store, model)
    weights: Weights = {}
    state: Weights = {}
    flat = {name: t.view(-1) for name, t in delta.items()}
    fresh = _Fresh(lay)
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
        mine = {k: own[f"{k}.{name}"].view(-1)[first:first + n]
                for k in ("m", "v") if f"{k}.{name}" in own}
        step, after = server.update(d.to(torch.float32), mine)
        for k, v in after.items():
            key = f"{k}.{name}"
            if key not in state:
                held = own.get(key)
                state[key] = held if held is not None and held.dtype == v.dtype \
                    and held.is_contiguous() else fresh.view(k, entry)
            state[key].view(-1)[first:first + n].copy_(v)
        if out.dtype == step.dtype:
            torch.add(values, step, out=out)
        else:
            out.copy_((values.to(step.dtype) + step).to(out.dtype))
    for e in lay.entries:  # empty tensors have no pieces
        weights.setdefault(e.name, torch.empty(e.shape, dtype=e.dtype))
    return NextModel({e.name: weights[e.name] for e in lay.entries}, state, None)


class _Fresh:
    """New state tensors (a first step's ``m`` and ``v``): for each kind, views of one
    float32 buffer the size of the model's float tensors, made when first asked for
    (one allocation of the model's size, not one per tensor, which the allocator
    would keep in its heap after they are freed)."""

    def __init__(self, lay: Layout) -> None:
        self.offsets: dict[str, int] = {}
        at = 0
        for e in lay.by_offset():
            if e.dtype.is_floating_point:
                self.offsets[e.name] = at
                at += e.elements
        self.size = at
        self.buffers: dict[str, torch.Tensor] = {}

    def view(self, kind: str, entry: Entry) -> torch.Tensor:
        buffer = self.buffers.get(kind)
        if buffer is None:
            buffer = self.buffers[kind] = torch.empty(self.size, dtype=torch.float32)
        at = self.offsets[entry.name]
        return buffer[at:at + entry.elements].view(entry.shape)
