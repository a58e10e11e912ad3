"""Which torch device a process computes on (both sides of the wire use it)."""

from __future__ import annotations

import torch


def pick_device() -> torch.device:
    """CUDA if this torch can drive a GPU here, else Apple's MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
