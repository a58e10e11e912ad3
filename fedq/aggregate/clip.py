"""Per-update L2 clipping (the clip of DP-FedAvg, McMahan et al. 2018, arXiv:1710.06963,
and of plain norm-bounded aggregation)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedq.aggregate.types import Weights


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over the floating-point tensors of ``update``."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.float()) ** 2)
                         for t in update.values() if t.dtype.is_floating_point))


def clip_update(update: Mapping[str, torch.Tensor], max_norm: float) -> tuple[Weights, float]:
    """``update`` scaled to L2 norm at most ``max_norm``; also returns the original norm.
    Integer tensors are left as they are and not counted."""
    norm = update_norm(update)
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return ({k: (v * scale if v.dtype.is_floating_point else v) for k, v in update.items()},
            norm)
