"""Checks an update must pass before it is averaged in."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedq.errors import UpdateRejected


def check_update(update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                 max_norm: float | None = None) -> float:
    """Raise :class:`UpdateRejected` unless ``update`` matches ``reference`` in names,
    shapes and dtypes, is finite everywhere, and (if ``max_norm``) has an L2 norm at
    most ``max_norm``. Returns the update's L2 norm."""
    missing = sorted(set(reference) - set(update))
    extra = sorted(set(update) - set(reference))
    if missing or extra:
        what = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {extra[0]!r}"
        raise UpdateRejected(what)
    sq = 0.0
    for name, ref in reference.items():
        tensor = update[name]
        if tuple(tensor.shape) != tuple(ref.shape):
            raise UpdateRejected(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(ref.shape)}")
        if tensor.dtype != _wire_dtype(ref.dtype):
            raise UpdateRejected(f"tensor {name!r} has dtype {tensor.dtype}, "
                                 f"expected {_wire_dtype(ref.dtype)}")
        if tensor.dtype.is_floating_point:
            # One pass: a NaN or inf anywhere makes the norm non-finite.
            t_norm = float(torch.linalg.vector_norm(tensor, dtype=torch.float32))
            if not math.isfinite(t_norm):
                raise UpdateRejected(f"tensor {name!r} has non-finite values"
                                     if not bool(torch.isfinite(tensor).all())
                                     else f"tensor {name!r}: norm overflows float32")
            sq += t_norm * t_norm
    norm = sq ** 0.5
    if max_norm is not None and norm > max_norm:
        raise UpdateRejected(f"update norm {norm:.4g} exceeds max_update_norm {max_norm:.4g}")
    return norm


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Deltas of float tensors keep their dtype; integer buffers travel as float32."""
    return dtype if dtype.is_floating_point else torch.float32
