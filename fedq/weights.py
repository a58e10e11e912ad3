"""Model weights <-> safetensors bytes. The only weight format fedq reads or writes
(no pickle: ``safetensors`` parses a JSON header and raw tensor bytes)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedq.aggregate.types import Weights
from fedq.errors import UpdateRejected


def dumps(weights: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None = None) -> bytes:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
    return st_save(tensors, metadata=dict(meta or {}))


def loads(data: bytes, what: str = "blob") -> Weights:
    try:
        return dict(st_load(data))
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise UpdateRejected(f"{what}: not a safetensors file ({exc})") from None


def loads_with_meta(data: bytes, what: str = "blob") -> tuple[Weights, dict[str, str]]:
    """Tensors and the safetensors metadata (the JSON header's ``__metadata__``)."""
    import json
    import struct

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
