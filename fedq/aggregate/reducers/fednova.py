"""FedNova: normalised averaging for clients that took unequal numbers of local steps
(Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", arXiv:2007.07481).

For plain local SGD, client i's normaliser is its step count tau_i. With weights w_i
(p_i = w_i / W, W = sum_i w_i):
    delta = tau_eff * sum_i p_i * d_i / tau_i,   tau_eff = sum_i p_i * tau_i
A client that did a quarter of the steps contributes its per-step direction at full
weight instead of a quarter-length update, so a slow machine does not drag the
average toward the old model. Streams like FedAvg: one accumulator the size of the
model plus one update at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fedq.aggregate.fedavg import Accumulator, Pieces, acc_dtype
from fedq.aggregate.reducers.base import REDUCERS, Contribution, StreamReducer
from fedq.aggregate.types import Weights


@REDUCERS.register("fednova")
class FedNova(StreamReducer):
    paper = "Wang et al. 2020, arXiv:2007.07481"
    weighted = True

    def reduce(self, updates: Iterable[Contribution], acc: Accumulator) -> Weights:
        return fednova_mean((c.weight, c.steps, _whole(c.delta)) for c in updates)


def _whole(delta: Mapping[str, torch.Tensor] | Pieces) -> Mapping[str, torch.Tensor]:
    if isinstance(delta, Pieces):
        raise TypeError("fednova reads whole updates (takes_pieces is False)")
    return delta


def fednova_mean(updates: Iterable[tuple[float, int, Mapping[str, torch.Tensor]]]) -> Weights:
    """The FedNova aggregate delta of (weight, local steps, delta) triples, streamed.

    Raises ValueError for no updates, a non-positive step count or zero total weight."""
    acc: Weights | None = None
    total_weight, weighted_steps = 0.0, 0.0
    for weight, steps, delta in updates:
        if steps <= 0:
            raise ValueError(f"local steps must be positive, got {steps}")
        if acc is None:
            acc = {k: torch.zeros(v.shape, dtype=acc_dtype(v.dtype)) for k, v in delta.items()}
        for name, tensor in delta.items():
            acc[name].add_(tensor.to(acc[name].dtype), alpha=weight / steps)
        total_weight += weight
        weighted_steps += weight * steps
    if acc is None:
        raise ValueError("no updates to average")
    if total_weight <= 0:
        raise ValueError("update weights sum to zero")
    tau_eff = weighted_steps / total_weight
    for tensor in acc.values():
        tensor.mul_(tau_eff / total_weight)
    return acc
