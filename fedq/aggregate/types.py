"""Domain shapes, named once."""

from __future__ import annotations

import torch

#: A model's tensors by name (a state dict), or an update of the same shape.
Weights = dict[str, torch.Tensor]
