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

It applies to uncompressed updates averaged by a reducer that takes pieces (the mean),
without clipping; anything else (zstd frames, the int8 and fp16 codecs, clipping, DP,
the robust reducers, FedNova) is read whole as before.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

import torch

from fedq.aggregate.compression import ZSTD_MAGIC
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
    process dies, so a control worker killed mid-round leaves nothing behind."""

    def __init__(self, fh: IO[bytes], lay: Layout, norm: float) -> None:
        self.fh, self.norm = fh, norm
        self.entries = lay.by_offset()
        self.header = lay.entries
        self.raw = sum(e.hi - e.lo for e in self.entries)

    def layout(self) -> Mapping[str, torch.Tensor]:
        return {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in self.header}

    def pieces(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        self.fh.seek(0)
        blocks = iter(lambda: self.fh.read(PIECE_BYTES), b"")
        for entry, first, values in pieces(self.entries, blocks, PIECE_BYTES):
            yield entry.name, first, values

    def discard(self) -> None:
        self.fh.close()


def streams(store: BlobStore, ref: UpdateRef) -> bool:
    """Whether ``ref``'s blob is larger than what the store reads at once (so worth
    streaming)."""
    return store.piece_bytes is not None and ref.blob.size > store.piece_bytes


def receive(store: BlobStore, ref: UpdateRef, reference: Weights, limit: int,
            max_norm: float | None, folder: Path) -> Received | None:
    """Read ``ref``'s blob once into a scratch file in ``folder`` while checking it
    (module docstring). None when the blob is not an uncompressed safetensors update
    (the caller reads it whole instead). Raises what the checks raise (UpdateRejected,
    BlobError); the scratch file is gone then."""
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
        if lay.meta.get("fedq.codec", "none") != "none":
            parts.close()
            out.close()
            return None
        _check_names(lay, reference)

        def data() -> Iterator[memoryview]:
            for part in body:
                out.write(part)
                yield part

        squares: dict[str, float] = {}
        for entry, _, values in pieces(lay.by_offset(), data(), PIECE_BYTES):
            if not entry.dtype.is_floating_point:
                continue
            norm = float(torch.linalg.vector_norm(values, dtype=torch.float32))
            if not math.isfinite(norm):
                raise UpdateRejected(f"tensor {entry.name!r} has non-finite values"
                                     if not bool(torch.isfinite(values).all())
                                     else f"tensor {entry.name!r}: norm overflows float32")
            squares[entry.name] = squares.get(entry.name, 0.0) + norm * norm
        sq = 0.0
        for name in reference:  # in check_update's order, so a norm is the same either way
            sq += squares.get(name, 0.0)
        norm = sq ** 0.5
        if max_norm is not None and norm > max_norm:
            raise UpdateRejected(f"update norm {norm:.4g} exceeds max_update_norm "
                                 f"{max_norm:.4g}")
        out.flush()
    except BaseException:
        parts.close()
        out.close()
        raise
    return Received(out, lay, norm)


def _check_names(lay: Layout, reference: Weights) -> None:
    """The names, shapes and dtypes of ``check_update``, from the header alone."""
    got: dict[str, Entry] = {e.name: e for e in lay.entries}
    missing = sorted(set(reference) - set(got))
    extra = sorted(set(got) - set(reference))
    if missing or extra:
        raise UpdateRejected(f"missing tensor {missing[0]!r}" if missing
                             else f"unexpected tensor {extra[0]!r}")
    for name, ref in reference.items():
        e = got[name]
        if e.shape != tuple(ref.shape):
            raise UpdateRejected(f"tensor {name!r} has shape {e.shape}, "
                                 f"expected {tuple(ref.shape)}")
        wire = ref.dtype if ref.dtype.is_floating_point else torch.float32
        if e.dtype != wire:
            raise UpdateRejected(f"tensor {name!r} has dtype {e.dtype}, expected {wire}")
