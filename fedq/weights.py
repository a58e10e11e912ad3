"""Model weights <-> safetensors bytes. The only weight format fedq reads or writes
(no pickle: a JSON header and raw tensor bytes). Files are written and read here,
with the checks the ``safetensors`` library makes (tests check each reads the
other's files): reading gives views of one buffer, which the mean adds in one call."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from typing import Any, cast

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


def _views(buf: bytearray, what: str) -> Weights:
    """Parse the safetensors layout (8-byte little-endian header length, a JSON header
    of name -> dtype, shape, data_offsets, then the data) with the checks safetensors
    makes: offsets in bounds, sizes matching shapes, tensors tiling the data exactly."""
    def bad(why: str) -> UpdateRejected:
        return UpdateRejected(f"{what}: not a safetensors file ({why})")

    if len(buf) < 8:
        raise bad("shorter than its header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > len(buf) - 8:
        raise bad(f"header length {n} exceeds the file")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except ValueError as exc:
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    start, size = 8 + n, len(buf) - 8 - n
    whole = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    spans, out = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"tensor {name!r}: bad entry ({exc})") from None
        count = math.prod(shape)
        if not 0 <= lo <= hi <= size or hi - lo != count * dtype.itemsize \
                or min(shape, default=0) < 0:
            raise bad(f"tensor {name!r}: offsets {lo}..{hi} do not fit shape {shape}")
        spans.append((lo, hi))
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        elif (start + lo) % dtype.itemsize:  # misaligned: copy rather than view
            out[name] = torch.frombuffer(bytearray(buf[start + lo:start + hi]),
                                         dtype=dtype).view(shape)
        else:  # a view of the one storage: tensors that follow each other in the file
            # are then back to back in memory, which the mean adds in one call
            out[name] = whole[start + lo:start + hi].view(dtype).view(shape)
    spans.sort()
    end = 0
    for lo, hi in spans:
        if lo != end:
            raise bad("tensor data overlaps or leaves gaps")
        end = hi
    if end != size:
        raise bad("tensor data does not fill the file")
    return out


def loads_with_meta(data: bytes | bytearray, what: str = "blob") -> tuple[Weights, dict[str, str]]:
    """Tensors and the safetensors metadata (the JSON header's ``__metadata__``)."""
    tensors = loads(data, what)
    try:
        (length,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + length]).get("__metadata__") or {}
    except (struct.error, ValueError) as exc:
        raise UpdateRejected(f"{what}: bad safetensors header ({exc})") from None
    return tensors, {str(k): str(v) for k, v in meta.items()}


def raw_size(weights: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors' data (what an uncompressed update would carry)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def state_of(model: torch.nn.Module) -> Weights:
    """The model's parameters and buffers, detached, on the CPU."""
    return {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
