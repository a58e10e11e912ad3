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
from fedq.errors import require_extra

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
        if not value.dtype.is_floating_point or value.dtype == torch.float16:
            out[name] = value
        elif codec == "fp16":
            out[name] = value.to(torch.float16)
        else:
            q, s = quantize_int8(value, chunk)
            out[name + Q_SUFFIX], out[name + S_SUFFIX] = q, s
    return out, {"fedq.codec": codec, "fedq.chunk": str(chunk)}


def decode(stored: Mapping[str, torch.Tensor], meta: Mapping[str, str],
           shapes: Mapping[str, tuple[int, ...]]) -> Weights:
    """The float32 update from what :func:`encode` stored (``shapes``: of the model)."""
    codec = meta.get("fedq.codec", "none")
    if codec == "none":
        return dict(stored)
    out: Weights = {}
    for name, shape in shapes.items():
        if name in stored:
            value = stored[name]
            out[name] = value.to(torch.float32) if value.dtype == torch.float16 else value
        elif name + Q_SUFFIX in stored and name + S_SUFFIX in stored:
            out[name] = dequantize_int8(stored[name + Q_SUFFIX], stored[name + S_SUFFIX],
                                        shape, int(meta.get("fedq.chunk", "256")))
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


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...],
                    chunk: int) -> torch.Tensor:
    n = q.numel()
    if scales.numel() != math.ceil(n / chunk):
        raise ValueError(f"{scales.numel()} scales for {n} values in chunks of {chunk}")
    blocks = torch.nn.functional.pad(q.reshape(-1).to(torch.float32), (0, (-n) % chunk))
    out = blocks.reshape(-1, chunk) * scales.to(torch.float32)[:, None]  # (B, chunk)
    return out.reshape(-1)[:n].reshape(shape)


def zstd_compress(data: bytes, level: int = 3) -> bytes:
    require_extra("zstandard", "zstd", "the +zstd codec")
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(data)


def maybe_decompress(data: bytes) -> bytes:
    """zstd frames are decompressed; anything else is returned as is."""
    if data[:4] != ZSTD_MAGIC:
        return data
    require_extra("zstandard", "zstd", "a zstd-compressed update")
    import zstandard

    return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
