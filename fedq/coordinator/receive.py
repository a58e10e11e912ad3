"""A big update received in bounded memory: read once, checked, then added from disk.

An update blob larger than what its store reads at once (``BlobStore.piece_bytes``:
a Redis chunk, fedq/blobs/chunks.py, or a piece of a file or an S3 object) is read
piece by piece (``BlobStore.stream``). Each piece (a chunk once its digest holds) is
appended to a scratch file, and its tensors are
checked as they arrive: the header first (names, shapes and dtypes against the global
model), then every value (finite, and the L2 norm against ``max_update_norm``); the
whole blob's digest is checked after the last piece. Only an update that passed all
of that is added to the mean, piece by piece from the scratch file, which no worker
can write: the control worker holds a piece or two of the update, never the
update, and nothing of a refused update ever reaches the accumulator.

It applies to updates averaged by a reducer that takes pieces (the mean), without DP:
uncompressed, fp16 or int8 (decoded piece by piece, bit for bit as a whole read
decodes them; an int8 update's values are checked once their scales are in, from the
scratch file), clipped as they are added where the job clips. Anything else (zstd
frames, DP, the robust reducers, FedNova) is read whole.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import torch

from fedq.aggregate.compression import (
    CODECS,
    Q_SUFFIX,
    S_SUFFIX,
    ZSTD_MAGIC,
    dequantize_piece,
    encoded_layout,
)
from fedq.aggregate.fedavg import Pieces
from fedq.aggregate.types import Weights
from fedq.blobs import BlobStore
from fedq.errors import UpdateRejected
from fedq.protocol.training import UpdateRef
from fedq.weights import Entry, Layout, pieces, split_header

#: Bytes read from a scratch file at a time when an update is added.
PIECE_BYTES = 4 << 20


class Received(Pieces):
    """A checked update in a scratch file (its data section, tensors by offset). The
    file has no name (``tempfile.TemporaryFile``): it goes when it is closed or its
    process dies, so a control worker killed mid-round leaves nothing behind.

    An fp16 or int8 update is given decoded, as :func:`~fedq.aggregate.compression.decode`
    gives it whole (float32, in the model's order), piece by piece: its int8 scales are
    held (1/64 of the float32 update at the default chunk), its values read from the
    file. :meth:`clip` scales the values as they are given."""

    def __init__(self, fh: IO[bytes], lay: Layout, norm: float, stored: Stored) -> None:
        self.fh, self.norm, self.stored = fh, norm, stored
        self.entries = lay.by_offset()
        self.header = lay.entries
        self.scale = 1.0
        decoded = self.layout()
        self.raw = sum(t.numel() * t.element_size() for t in decoded.values())

    def layout(self) -> Mapping[str, torch.Tensor]:
        if self.stored.codec == "none":
            return {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta")
                    for e in self.header}
        return {name: torch.empty(shape, dtype=torch.float32, device="meta")
                for name, shape in self.stored.shapes.items()}

    def pieces(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        self.fh.seek(0)
        blocks = iter(lambda: self.fh.read(PIECE_BYTES), b"")
        for entry, first, values in self.stored.decoded(self.entries, blocks):
            if self.scale != 1.0 and values.dtype.is_floating_point:
                values = values * self.scale
            yield entry, first, values

    def clip(self, max_norm: float) -> None:
        """Scale the update to L2 norm at most ``max_norm`` (as ``clip_update``)."""
        self.scale = min(1.0, max_norm / self.norm) if self.norm > 0 else 1.0

    def discard(self) -> None:
        self.fh.close()


class Stored:
    """What a worker stores for an update shaped like the model under a codec
    (fedq/aggregate/compression.py): each stored tensor's name, dtype and shape, which
    update tensor it is part of, and the int8 scales once read."""

    def __init__(self, reference: Weights, codec: str, chunk: int) -> None:
        self.codec, self.chunk = codec, chunk
        wire = {name: torch.empty(ref.shape, device="meta", dtype=ref.dtype
                                  if ref.dtype.is_floating_point else torch.float32)
                for name, ref in reference.items()}
        self.shapes = {name: tuple(ref.shape) for name, ref in reference.items()}
        self.expected = encoded_layout(wire, codec, chunk)
        self.scales: dict[str, torch.Tensor] = {}  # update tensor -> its int8 scales

    def is_scales(self, name: str) -> bool:
        return self.codec == "int8" and name.endswith(S_SUFFIX) \
            and self.expected[name][0] != name

    def is_quantized(self, name: str) -> bool:
        return self.codec == "int8" and name.endswith(Q_SUFFIX) \
            and self.expected[name][0] != name

    def keep_scales(self, entry: Entry, first: int, values: torch.Tensor) -> None:
        """Hold a piece of an int8 tensor's scales (checked finite)."""
        source = self.expected[entry.name][0]
        if not bool(torch.isfinite(values).all()):
            raise UpdateRejected(f"tensor {source!r} has non-finite values")
        held = self.scales.setdefault(source, torch.empty(entry.elements))
        held[first:first + values.numel()].copy_(values)

    def decoded(self, entries: list[Entry], data: Iterator[bytes]
                ) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(update tensor, first element, flat values as ``decode`` gives them) from the
        stored data section ``data``; int8 values need their scales kept first."""
        for entry, first, values in pieces(entries, data, PIECE_BYTES):
            if self.codec == "none":
                yield entry.name, first, values
            elif self.is_scales(entry.name):
                continue
            elif self.is_quantized(entry.name):
                source = self.expected[entry.name][0]
                yield source, first, dequantize_piece(values, self.scales[source], first,
                                                      self.chunk)
            else:
                yield entry.name, first, values.to(torch.float32) \
                    if values.dtype == torch.float16 else values


def streams(store: BlobStore, ref: UpdateRef) -> bool:
    """Whether ``ref``'s blob is larger than what the store reads at once (so worth
    streaming)."""
    return store.piece_bytes is not None and ref.blob.size > store.piece_bytes


def receive(store: BlobStore, ref: UpdateRef, reference: Weights, limit: int,
            max_norm: float | None, folder: Path, chunk: int = 256) -> Received | None:
    """Read ``ref``'s blob once into a scratch file in ``folder`` while checking it
    (module docstring). None when the blob is a zstd frame (the caller reads it whole
    instead). ``chunk``: the job's int8 chunk, which an int8 update must say. Raises
    what the checks raise (UpdateRejected, BlobError); the scratch file is gone then."""
    parts = store.stream(ref.blob, limit=limit)
    out = tempfile.TemporaryFile(dir=folder, prefix="update-")  # noqa: SIM115 - Received's
    try:
        first = next(parts, b"")
        if bytes(first[:4]) == ZSTD_MAGIC:  # a zstd frame: read whole
            parts.close()
            out.close()
            return None
        lay, body = split_header(itertools.chain([first], parts), ref.blob.size,
                                 f"blob {ref.key}")
        del first
        stored = Stored(reference, _codec(lay.meta, chunk), chunk)
        _check_names(lay, stored.expected)

        def data() -> Iterator[memoryview]:
            for part in body:
                out.write(part)
                yield part

        squares: dict[str, float] = {}
        for entry, start, values in pieces(lay.by_offset(), data(), PIECE_BYTES):
            if stored.is_scales(entry.name):
                stored.keep_scales(entry, start, values)
            elif entry.dtype.is_floating_point:  # (int8 values: below, with their scales)
                _measure(entry.name, values, squares)
        out.flush()
        received = Received(out, lay, 0.0, stored)
        if stored.codec == "int8":  # the dequantized values, read back from the file
            for name, _, values in stored.decoded(received.entries, _blocks(out)):
                if name in stored.scales:
                    _measure(name, values, squares)
        sq = 0.0
        for name in reference:  # in check_update's order, so a norm is the same either way
            sq += squares.get(name, 0.0)
        received.norm = norm = sq ** 0.5
        if max_norm is not None and norm > max_norm:
            raise UpdateRejected(f"update norm {norm:.4g} exceeds max_update_norm "
                                 f"{max_norm:.4g}")
    except BaseException:
        parts.close()
        out.close()
        raise
    return received


def _blocks(fh: IO[bytes]) -> Iterator[bytes]:
    fh.seek(0)
    return iter(lambda: fh.read(PIECE_BYTES), b"")


def _codec(meta: Mapping[str, str], chunk: int) -> str:
    """The update's codec from its metadata, checked as ``decode`` checks it."""
    codec = meta.get("fedq.codec", "none")
    if codec not in CODECS:
        raise UpdateRejected(f"codec: unknown codec {codec[:20]!r} (known: {', '.join(CODECS)})")
    said = meta.get("fedq.chunk", "256")
    if codec != "none" and (not said.isdigit() or int(said) != chunk):
        raise UpdateRejected(f"codec: int8 chunk {said[:20]!r}, the job's is {chunk}")
    return codec


def _measure(name: str, values: torch.Tensor, squares: dict[str, float]) -> None:
    """Add the piece's squared L2 norm to its tensor's; refuse non-finite values."""
    norm = float(torch.linalg.vector_norm(values, dtype=torch.float32))
    if not math.isfinite(norm):
        raise UpdateRejected(f"tensor {name!r} has non-finite values"
                             if not bool(torch.isfinite(values).all())
                             else f"tensor {name!r}: norm overflows float32")
    squares[name] = squares.get(name, 0.0) + norm * norm


def _check_names(lay: Layout, expected: Mapping[str, tuple[str, torch.dtype, tuple[int, ...]]]
                 ) -> None:
    """The names, shapes and dtypes of ``check_update``, from the header alone, against
    what the update's codec stores (``Stored.expected``)."""
    got: dict[str, Entry] = {e.name: e for e in lay.entries}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise UpdateRejected(f"missing tensor {missing[0]!r}" if missing
                             else f"unexpected tensor {extra[0]!r}")
    for name, (_, dtype, shape) in expected.items():
        e = got[name]
        if e.shape != shape:
            raise UpdateRejected(f"tensor {name!r} has shape {e.shape}, expected {shape}")
        if e.dtype != dtype:
            raise UpdateRejected(f"tensor {name!r} has dtype {e.dtype}, expected {dtype}")
