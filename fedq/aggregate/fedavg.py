"""Federated averaging (McMahan et al. 2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data", arXiv:1602.05629).

Clients send deltas (local - global). The server adds the sample-weighted mean of the
deltas to the global model:  w' = w + sum_i n_i * d_i / sum_i n_i.

The mean streams: it holds one float32 accumulator the size of the model and one
update at a time, so memory is O(model), not O(clients x model). An ``Accumulator``
keeps that memory from one round to the next: a fresh model-sized accumulator pays a
page fault per 4 kB page every round.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import torch

from fedq.aggregate.types import Weights


def weighted_mean(updates: Iterable[tuple[float, Mapping[str, torch.Tensor]]],
                  out: Weights | None = None) -> Weights:
    """Sum_i w_i * u_i / sum_i w_i over an iterable of (weight, update), streamed.

    Every update must have the same names and shapes as the first (verify before).
    Accumulates in float32 (float64 for float64 tensors); the result is float32/64.
    ``out``: tensors to accumulate into when their names, shapes and dtypes are those
    the result would have (the result is then ``out`` itself, overwritten); otherwise
    new ones are allocated.
    Raises ValueError when there is no update or the weights sum to zero or less.
    """
    acc: Weights | None = None
    total = 0.0
    for weight, update in updates:
        if weight < 0:
            raise ValueError(f"negative weight {weight}")
        if acc is None:  # the first update, scaled, starts the accumulator (one pass)
            acc = _start(update, weight, out)
        else:
            for name, tensor in update.items():
                acc[name].add_(tensor.to(acc[name].dtype), alpha=weight)  # in place
        total += weight
    if acc is None:
        raise ValueError("no updates to average")
    if total <= 0:
        raise ValueError("update weights sum to zero")
    for tensor in acc.values():
        tensor.div_(total)
    return acc


class Accumulator(threading.local):
    """The memory of a mean, kept from one ``mean`` call to the next (one per thread).

    ``mean`` returns tensors that the next ``mean`` call in the same thread overwrites
    when the model's shapes are unchanged: use the result (or copy it) before then.
    ``release`` lets the memory go (a job is over).
    """

    def __init__(self) -> None:
        self.weights: Weights | None = None

    def mean(self, updates: Iterable[tuple[float, Mapping[str, torch.Tensor]]]) -> Weights:
        """``weighted_mean(updates)``, in the memory of the previous call where it fits."""
        out, self.weights = self.weights, None  # nothing kept if the mean raises
        self.weights = weighted_mean(updates, out=out)
        return self.weights

    def release(self) -> None:
        self.weights = None


def apply_delta(weights: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> Weights:
    """weights + delta, each result in the dtype of ``weights`` (integers rounded).
    A tensor ``delta`` does not name is kept as it is (a Streaming DiLoCo fragment's
    step names only the fragment's tensors)."""
    out: Weights = {}
    for name, value in weights.items():
        step = delta.get(name)
        if step is None:
            out[name] = value
            continue
        if value.dtype.is_floating_point:
            out[name] = (value.to(step.dtype) + step).to(value.dtype)
        else:  # integer buffers, e.g. BatchNorm's num_batches_tracked
            out[name] = (value.to(torch.float64) + step.to(torch.float64)).round().to(value.dtype)
    return out


def fedavg(weights: Mapping[str, torch.Tensor],
           deltas: Iterable[tuple[float, Mapping[str, torch.Tensor]]]) -> Weights:
    """The new global model: ``weights`` plus the weighted mean of ``deltas``."""
    return apply_delta(weights, weighted_mean(deltas))


def _start(update: Mapping[str, torch.Tensor], weight: float, out: Weights | None) -> Weights:
    """The accumulator holding ``weight * update``: ``out`` where it fits, else new."""
    fits = out is not None and out.keys() == update.keys() and all(
        out[k].shape == v.shape and out[k].dtype == acc_dtype(v.dtype)
        and out[k].is_contiguous() for k, v in update.items())
    if out is None or not fits:
        return {k: v.to(acc_dtype(v.dtype)).mul(weight) for k, v in update.items()}
    for name, tensor in update.items():
        torch.mul(tensor.to(out[name].dtype), weight, out=out[name])
    return out


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
