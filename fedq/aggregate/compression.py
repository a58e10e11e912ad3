"""Compressed updates: fp16, int8 with per-chunk scales, and zstd over the blob.

int8: the flattened tensor is cut into chunks of ``chunk`` elements; each chunk is
stored as round(x / s) in int8 with s = max|x| / 127 in float32, so the round-trip
error of an element is at most s / 2 and the size is about 1/4 of float32 plus 4 bytes
per chunk. fp16 halves the size (relative error about 2^-11). zstd (level 3) then
compresses the safetensors bytes. A blob says what it is in its safetensors metadata
(``fedq.codec``), and zstd frames start with their magic number, so decoding needs no
outside information.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedq.aggregate.types import Weights
from fedq.errors import UpdateRejected, require_extra

CODECS = ("none", "fp16", "int8")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
Q_SUFFIX, S_SUFFIX = ".__q", ".__s"


def encode(update: Mapping[str, torch.Tensor], codec: str,
           chunk: int = 256) -> tuple[Weights, dict[str, str]]:
    """Tensors to store for ``update`` under ``codec`` and the metadata that names it."""
    if codec == "none":
        return dict(update), {"fedq.codec": "none"}
    out: Weights = {}
    for name, value in update.items():
        out.update(encode_one(name, value, codec, chunk))
    return out, meta_of(codec, chunk)


def meta_of(codec: str, chunk: int) -> dict[str, str]:
    """The safetensors metadata that names ``codec`` (and the int8 chunk)."""
    return {"fedq.codec": "none"} if codec == "none" else \
        {"fedq.codec": codec, "fedq.chunk": str(chunk)}


def encode_one(name: str, value: torch.Tensor, codec: str, chunk: int) -> Weights:
    """The tensors :func:`encode` stores for the one tensor ``name`` of an update."""
    if codec == "none" or not value.dtype.is_floating_point or value.dtype == torch.float16:
        return {name: value}
    if codec == "fp16":
        return {name: value.to(torch.float16)}
    q, s = quantize_int8(value, chunk)
    return {name + Q_SUFFIX: q, name + S_SUFFIX: s}


def encoded_layout(outline: Mapping[str, torch.Tensor], codec: str, chunk: int
                   ) -> dict[str, tuple[str, torch.dtype, tuple[int, ...]]]:
    """For an update shaped like ``outline`` (its tensors' dtypes and shapes; "meta"
    tensors will do), what :func:`encode` stores, in its order: stored name -> (the
    update tensor it encodes, dtype, shape)."""
    out: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
    for name, value in outline.items():
        shape = tuple(value.shape)
        if codec == "none" or not value.dtype.is_floating_point \
                or value.dtype == torch.float16:
            out[name] = (name, value.dtype, shape)
        elif codec == "fp16":
            out[name] = (name, torch.float16, shape)
        else:
            n = math.prod(shape)
            out[name + Q_SUFFIX] = (name, torch.int8, (n,))
            out[name + S_SUFFIX] = (name, torch.float32, (math.ceil(n / chunk),))
    return out


def decode(stored: Mapping[str, torch.Tensor], meta: Mapping[str, str],
           shapes: Mapping[str, tuple[int, ...]], chunk: int | None = None) -> Weights:
    """The float32 update from what :func:`encode` stored (``shapes``: of the model).
    ``chunk``: the int8 chunk the job's spec sets; a blob that says otherwise is
    refused. Raises :class:`~fedq.errors.UpdateRejected` for anything not as
    :func:`encode` writes it."""
    codec = meta.get("fedq.codec", "none")
    if codec not in CODECS:
        raise UpdateRejected(f"codec: unknown codec {codec[:20]!r} (known: {', '.join(CODECS)})")
    if codec == "none":
        return dict(stored)
    said = meta.get("fedq.chunk", "256")
    if not said.isdigit() or int(said) < 1 or (chunk is not None and int(said) != chunk):
        raise UpdateRejected(f"codec: int8 chunk {said[:20]!r}, the job's is {chunk}")
    out: Weights = {}
    for name, shape in shapes.items():
        if name in stored:
            value = stored[name]
            out[name] = value.to(torch.float32) if value.dtype == torch.float16 else value
        elif name + Q_SUFFIX in stored and name + S_SUFFIX in stored:
            out[name] = dequantize_int8(stored[name + Q_SUFFIX], stored[name + S_SUFFIX],
                                        shape, int(said))
    return out


def quantize_int8(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values (N,), float32 scales (ceil(N / chunk),)) for tensor ``x``."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    pad = (-n) % chunk
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, chunk)  # (B, chunk)
    scales = blocks.abs().amax(dim=1) / 127.0  # (B,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n].contiguous(), scales


def dequantize_piece(q: torch.Tensor, scales: torch.Tensor, first: int,
                     chunk: int) -> torch.Tensor:
    """Elements ``first`` .. ``first + q.numel()`` of what :func:`dequantize_int8`
    gives (flat) for a tensor with ``scales``, from those elements' int8 values alone:
    the same float32 values, bit for bit."""
    n = q.numel()
    lo = first // chunk
    hi = (first + n - 1) // chunk + 1 if n else lo
    at = first - lo * chunk
    return q.to(torch.float32) * scales[lo:hi].repeat_interleave(chunk)[at:at + n]


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...],
                    chunk: int) -> torch.Tensor:
    n = q.numel()
    if chunk < 1:
        raise UpdateRejected(f"codec: int8 chunk {chunk}")
    if q.dtype != torch.int8 or scales.dtype != torch.float32:
        raise UpdateRejected(f"codec: int8 values of dtype {q.dtype}, scales {scales.dtype}")
    if n != math.prod(shape):
        raise UpdateRejected(f"codec: {n} int8 values for a tensor of shape {tuple(shape)}")
    if scales.numel() != math.ceil(n / chunk):
        raise UpdateRejected(f"codec: {scales.numel()} scales for {n} values in chunks "
                             f"of {chunk}")
    blocks = torch.nn.functional.pad(q.reshape(-1).to(torch.float32), (0, (-n) % chunk))
    out = blocks.reshape(-1, chunk) * scales.to(torch.float32)[:, None]  # (B, chunk)
    return out.reshape(-1)[:n].reshape(shape)


def zstd_compress(data: bytes, level: int = 3) -> bytes:
    require_extra("zstandard", "zstd", "the +zstd codec")
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(data)


def maybe_decompress(data: bytes, limit: int) -> bytes:
    """zstd frames are decompressed (streaming: at most ``limit`` bytes are ever
    produced, whatever the frame's header claims); anything else is returned as is.
    Raises :class:`~fedq.errors.UpdateRejected` for a frame that is damaged or that
    decompresses to more than ``limit`` bytes."""
    if data[:4] != ZSTD_MAGIC:
        return data
    require_extra("zstandard", "zstd", "a zstd-compressed update")
    import io

    import zstandard

    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as reader:
            out = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise UpdateRejected(f"zstd: damaged frame ({exc})") from None
    if len(out) > limit:
        raise UpdateRejected(f"zstd: the frame decompresses to more than {limit} bytes "
                             f"(the most an update of this model can be)")
    return out
