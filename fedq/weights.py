"""Model weights <-> safetensors bytes. The only weight format fedq reads or writes
(no pickle: a JSON header and raw tensor bytes). Files are written and read here,
with the checks the ``safetensors`` library makes (tests check each reads the
other's files): reading gives views of one buffer, which the mean adds in one call."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import torch

from fedq.aggregate.types import Weights
from fedq.errors import UpdateRejected


def dumps(weights: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None) -> bytes:
    """The safetensors file of ``weights`` (readable by ``safetensors.torch.load``).

    Written here rather than with ``safetensors.torch.save``, which serializes into one
    buffer and then copies it into the returned bytes: the header and each tensor's
    memory are joined into the result with a single copy."""
    return b"".join(dump_parts(weights, meta))


def dump_parts(weights: Mapping[str, torch.Tensor],
               meta: Mapping[str, str] | None = None) -> list[Any]:
    """The safetensors file of ``weights`` as a list of buffers to be written one after
    the other (the header, then each tensor's own memory, not copied)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    header: dict[str, object] = {"__metadata__": dict(meta)} if meta else {}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # tensor data starts 8-byte aligned
    parts: list[Any] = [struct.pack("<Q", len(head)), head]
    parts += [memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))
              for t in tensors.values()]
    return parts


class LazyWeights(Mapping[str, torch.Tensor]):
    """Tensors made when asked for, never kept: ``outline`` gives their names, shapes
    and dtypes ("meta" tensors), ``make(name)`` a tensor's values."""

    def __init__(self, outline: Mapping[str, torch.Tensor],
                 make: Callable[[str], torch.Tensor]) -> None:
        self.outline, self._make = dict(outline), make

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.outline:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.outline)

    def __len__(self) -> int:
        return len(self.outline)


def encoded_lazily(update: Mapping[str, torch.Tensor], codec: str, chunk: int
                   ) -> Mapping[str, torch.Tensor]:
    """What :func:`~fedq.aggregate.compression.encode` stores for ``update``, as a
    :class:`LazyWeights` that encodes one tensor of ``update`` at a time when asked
    (:func:`dump_stream` then writes the same file as ``dump_parts(encode(...))``
    with no encoded or, for a lazy ``update``, decoded model whole in memory)."""
    from fedq.aggregate.compression import encode_one, encoded_layout

    if codec == "none":
        return update
    outline = update.outline if isinstance(update, LazyWeights) else update
    stored = encoded_layout(outline, codec, chunk)
    made: dict[str, torch.Tensor] = {}

    def make(name: str) -> torch.Tensor:
        if name not in made:
            made.clear()
            source = stored[name][0]
            made.update(encode_one(source, update[source], codec, chunk))
        return made.pop(name)

    return LazyWeights({name: torch.empty(shape, dtype=dtype, device="meta")
                        for name, (_, dtype, shape) in stored.items()}, make)


def dump_stream(weights: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None
                ) -> tuple[int, Iterator[Any]]:
    """The safetensors file of ``weights`` as :func:`dump_parts` writes it: its size in
    bytes, and its bytes as parts made one tensor at a time as they are written (a
    :class:`LazyWeights` makes each tensor only then, so one is held at a time)."""
    outline = weights.outline if isinstance(weights, LazyWeights) else weights
    value = weights.__getitem__
    header: dict[str, object] = {"__metadata__": dict(meta)} if meta else {}
    offset = 0
    for name, t in outline.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)

    def parts() -> Iterator[Any]:
        yield struct.pack("<Q", len(head))
        yield head
        for name, t in outline.items():
            made = value(name).detach().to("cpu").contiguous()
            if made.shape != t.shape or made.dtype != t.dtype:
                raise ValueError(f"tensor {name!r}: made {made.dtype} {tuple(made.shape)}, "
                                 f"outlined {t.dtype} {tuple(t.shape)}")
            yield memoryview(cast(Any, made.reshape(-1).view(torch.uint8).numpy()))

    return 8 + len(head) + offset, parts()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


def loads(data: bytes | bytearray, what: str = "blob") -> Weights:
    """Tensors from safetensors bytes, as views of one buffer in the file's order. A
    ``bytearray`` (what the Redis blob store reads into) is parsed in place, no copy
    is made; ``bytes`` are copied once into a bytearray first (as
    ``safetensors.torch.load`` would copy them, tensor by tensor)."""
    return _views(data if isinstance(data, bytearray) else bytearray(data), what)


class Entry(NamedTuple):
    """One tensor of a safetensors file: where its bytes are in the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    lo: int
    hi: int

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


class Layout(NamedTuple):
    """A safetensors file's header, checked: its tensors in header order, its
    metadata, and where the data section starts."""

    entries: list[Entry]
    meta: dict[str, str]
    start: int

    def by_offset(self) -> list[Entry]:
        return sorted(self.entries, key=lambda e: e.lo)


def header_length(head: bytes | bytearray | memoryview, total: int, what: str) -> int:
    """The JSON header's length from a file's first 8 bytes (``total``: the file's size)."""
    if total < 8 or len(head) < 8:
        raise _bad(what, "shorter than its header length")
    (n,) = struct.unpack_from("<Q", head, 0)
    if n > total - 8:
        raise _bad(what, f"header length {n} exceeds the file")
    return int(n)


def layout(head: bytes | bytearray | memoryview, total: int, what: str = "blob") -> Layout:
    """Parse and check the header of a safetensors file of ``total`` bytes from its
    first bytes ``head`` (at least the header), with the checks safetensors makes:
    offsets in bounds, sizes matching shapes, tensors tiling the data exactly."""
    n = header_length(head, total, what)
    if len(head) < 8 + n:
        raise _bad(what, "header cut short")
    try:
        header = json.loads(bytes(head[8:8 + n]))
    except ValueError as exc:
        raise _bad(what, f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _bad(what, "header is not a JSON object")
    size = total - 8 - n
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            lo, hi = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad(what, f"tensor {name!r}: bad entry ({exc})") from None
        if not 0 <= lo <= hi <= size or hi - lo != math.prod(shape) * dtype.itemsize \
                or min(shape, default=0) < 0:
            raise _bad(what, f"tensor {name!r}: offsets {lo}..{hi} do not fit shape "
                             f"{list(shape)}")
        entries.append(Entry(name, dtype, shape, lo, hi))
    end = 0
    for e in sorted(entries, key=lambda e: e.lo):
        if e.lo != end:
            raise _bad(what, "tensor data overlaps or leaves gaps")
        end = e.hi
    if end != size:
        raise _bad(what, "tensor data does not fill the file")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise _bad(what, "metadata is not a JSON object")
    return Layout(entries, {str(k): str(v) for k, v in meta.items()}, 8 + n)


def _bad(what: str, why: str) -> UpdateRejected:
    return UpdateRejected(f"{what}: not a safetensors file ({why})")


def _views(buf: bytearray, what: str) -> Weights:
    """The tensors of the safetensors file in ``buf`` (:func:`layout`'s checks), as
    views of it."""
    lay = layout(buf, len(buf), what)
    whole = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    out = {}
    for e in lay.entries:
        lo, hi = lay.start + e.lo, lay.start + e.hi
        if e.elements == 0:
            out[e.name] = torch.empty(e.shape, dtype=e.dtype)
        elif lo % e.dtype.itemsize:  # misaligned: copy rather than view
            out[e.name] = torch.frombuffer(bytearray(buf[lo:hi]), dtype=e.dtype).view(e.shape)
        else:  # a view of the one storage: tensors that follow each other in the file
            # are then back to back in memory, which the mean adds in one call
            out[e.name] = whole[lo:hi].view(e.dtype).view(e.shape)
    return out


def split_header(parts: Iterator[Any], total: int, what: str = "blob"
                 ) -> tuple[Layout, Iterator[memoryview]]:
    """A safetensors file of ``total`` bytes arriving as ``parts`` (bytes-like, in
    order): its checked :func:`layout`, and its data section as the rest of the parts
    (views of them: only the header's bytes are copied)."""
    got: list[memoryview] = []
    size = 0
    need = 8
    for part in parts:
        got.append(memoryview(part).cast("B"))
        size += got[-1].nbytes
        if size >= 8 and need == 8:
            need = 8 + header_length(b"".join(v[:8] for v in got)[:8], total, what)
        if size >= need:
            break
    head = bytearray()
    for view in got:  # the header's bytes alone
        head += view[:need - len(head)]
        if len(head) == need:
            break
    lay = layout(head, total, what)

    def data() -> Iterator[memoryview]:
        at = 0
        for view in got:
            if at + view.nbytes > lay.start:
                yield view[max(lay.start - at, 0):]
            at += view.nbytes
        got.clear()
        for part in parts:
            yield memoryview(part).cast("B")

    return lay, data()


def pieces(entries: list[Entry], data: Iterable[Any], most: int = 16 << 20
           ) -> Iterator[tuple[Entry, int, torch.Tensor]]:
    """(tensor, first element, a flat piece of its values) for the data section of a
    safetensors file arriving as ``data`` (bytes-like pieces of any sizes, in order;
    ``entries``: :meth:`Layout.by_offset`), each piece at most ``most`` bytes, copied
    out of ``data``. Every element of every tensor is in exactly one piece, in order.
    Raises UpdateRejected when ``data`` ends early."""
    it = iter(entries)
    entry = next(it, None)
    carry = b""  # bytes of an element split across two pieces of ``data``
    at = 0  # bytes of ``entry`` emitted so far
    for part in data:
        view = memoryview(part).cast("B")
        while view.nbytes:
            while entry is not None and at == entry.hi - entry.lo:
                entry, at = next(it, None), 0
            if entry is None:
                raise UpdateRejected("tensor data runs past its last tensor")
            size = entry.dtype.itemsize
            take = min(view.nbytes, entry.hi - entry.lo - at - len(carry),
                       max(most - len(carry), 1))
            chunk = carry + bytes(view[:take]) if carry else bytearray(view[:take])
            view = view[take:]
            whole = len(chunk) // size * size
            if whole:
                first = at // size
                yield entry, first, torch.frombuffer(bytearray(chunk[:whole]) if carry else
                                                     chunk, dtype=entry.dtype, count=whole // size)
                at += whole
            carry = bytes(chunk[whole:])
    while entry is not None and at == entry.hi - entry.lo:
        entry, at = next(it, None), 0
    if entry is not None or carry:
        raise UpdateRejected("tensor data ends before its last tensor")


def loads_with_meta(data: bytes | bytearray, what: str = "blob") -> tuple[Weights, dict[str, str]]:
    """Tensors and the safetensors metadata (the JSON header's ``__metadata__``)."""
    buf = data if isinstance(data, bytearray) else bytearray(data)
    return _views(buf, what), layout(buf, len(buf), what).meta


def raw_size(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors' data (what an uncompressed update would carry)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def state_of(model: torch.nn.Module) -> Weights:
    """The model's parameters and buffers, detached, on the CPU."""
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
