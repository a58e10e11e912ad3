"""Robust reducers for Byzantine clients, working through the parameters in chunks.

- median: coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed
  Learning: Towards Optimal Statistical Rates", arXiv:1803.01498).
- trimmed_mean(beta): per coordinate, drop the beta fraction largest and smallest
  values, average the rest (same paper).
- krum(f) / multi_krum(f, m): score each update by the summed squared distance to its
  n - f - 2 nearest others; pick the best one (Krum) or average the best m (Blanchard
  et al. 2017, "Machine Learning with Adversaries", NeurIPS).
- bulyan(f): pick theta = n - 2f updates by repeated Krum, then per coordinate average
  the theta - 2f values closest to the median (El Mhamdi et al. 2018, "The Hidden
  Vulnerability of Distributed Learning in Byzantium", arXiv:1802.07927).
- clip_update: scale an update to L2 norm at most C (per-update clipping).

Updates are read through an :class:`UpdateSource`, one slice of one tensor at a time.
Memory bound (stated here, checked in tests/test_robust.py): besides the output (one
model, float32), a reducer holds at most ``(n + 1) x chunk`` elements of update data at
once (a (n, chunk) block plus the slice being read; float32: 4 (n + 1) chunk bytes),
the temporaries of one sort over that block, and an n x n distance matrix. It never
holds a whole update, so K large updates need not fit in memory together.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from fedq.aggregate.types import Weights

DEFAULT_CHUNK = 1 << 20  # elements per slice: 4 MB per update in float32


class UpdateSource(Protocol):
    """K updates with the same tensor names and shapes, readable by flat slices."""

    def __len__(self) -> int: ...

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, index: int, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of tensor ``name`` of update ``index``, flattened, float32."""
        ...


class MemorySource:
    """An UpdateSource over in-memory updates (tests, small models)."""

    def __init__(self, updates: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self.updates = list(updates)

    def __len__(self) -> int:
        return len(self.updates)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.updates[0].items()}

    def read(self, index: int, name: str, start: int, stop: int) -> torch.Tensor:
        return self.updates[index][name].reshape(-1)[start:stop].to(torch.float32)


def _chunks(shapes: dict[str, tuple[int, ...]], chunk: int):  # type: ignore[no-untyped-def]
    for name, shape in shapes.items():
        size = math.prod(shape)
        for start in range(0, size, chunk):
            yield name, start, min(size, start + chunk)


def _stack(source: UpdateSource, rows: Sequence[int], name: str, start: int,
           stop: int) -> torch.Tensor:
    block = torch.empty(len(rows), stop - start, dtype=torch.float32)  # (k, chunk)
    for j, i in enumerate(rows):
        block[j] = source.read(i, name, start, stop)  # one slice alive at a time
    return block


def _coordinatewise(source: UpdateSource, rows: Sequence[int], chunk: int,
                    reduce) -> Weights:  # type: ignore[no-untyped-def]
    shapes = source.shapes()
    out = {name: torch.empty(math.prod(shape), dtype=torch.float32)
           for name, shape in shapes.items()}
    for name, start, stop in _chunks(shapes, chunk):
        out[name][start:stop] = reduce(_stack(source, rows, name, start, stop))
    return {name: out[name].reshape(shape) for name, shape in shapes.items()}


def median(source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
    """Coordinate-wise median (the mean of the two middle values for even n)."""
    def reduce(block: torch.Tensor) -> torch.Tensor:  # (n, c) -> (c,)
        ordered, _ = torch.sort(block, dim=0)
        n = ordered.shape[0]
        return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2

    return _coordinatewise(source, range(len(source)), chunk, reduce)


def trimmed_mean(source: UpdateSource, beta: float, chunk: int = DEFAULT_CHUNK) -> Weights:
    """Per coordinate, drop floor(beta * n) values at each end and average the rest."""
    n = len(source)
    cut = int(math.floor(beta * n))
    if not 0 <= beta < 0.5 or n - 2 * cut < 1:
        raise ValueError(f"trimmed mean: beta {beta} leaves nothing of {n} updates")

    def reduce(block: torch.Tensor) -> torch.Tensor:
        ordered, _ = torch.sort(block, dim=0)
        return ordered[cut:n - cut].mean(dim=0)

    return _coordinatewise(source, range(n), chunk, reduce)


def pairwise_sq_distances(source: UpdateSource, rows: Sequence[int],
                          chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """(k, k) matrix of squared L2 distances between the updates in ``rows``, in float64."""
    k = len(rows)
    dist = torch.zeros(k, k, dtype=torch.float64)
    for name, start, stop in _chunks(source.shapes(), chunk):
        block = _stack(source, rows, name, start, stop).to(torch.float64)  # (k, c)
        dist += torch.cdist(block, block) ** 2
    return dist


def krum_scores(dist: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score of each of n updates: summed squared distance to its n - f - 2 nearest."""
    n = dist.shape[0]
    nearest = n - f - 2
    if nearest < 1:
        raise ValueError(f"krum needs n > f + 2 (n={n}, f={f})")
    scores = []
    for i in range(n):
        others = torch.cat([dist[i, :i], dist[i, i + 1:]])
        scores.append(torch.sort(others).values[:nearest].sum())
    return torch.stack(scores)


def multi_krum_select(source: UpdateSource, f: int, m: int,
                      chunk: int = DEFAULT_CHUNK) -> list[int]:
    """Indices of the m updates with the lowest Krum scores (ties: lower index)."""
    scores = krum_scores(pairwise_sq_distances(source, range(len(source)), chunk), f)
    order = sorted(range(len(source)), key=lambda i: (float(scores[i]), i))
    return sorted(order[:m])


def mean_of(source: UpdateSource, rows: Sequence[int], chunk: int = DEFAULT_CHUNK) -> Weights:
    """Unweighted mean of the updates in ``rows``."""
    return _coordinatewise(source, rows, chunk, lambda block: block.mean(dim=0))


def krum(source: UpdateSource, f: int, chunk: int = DEFAULT_CHUNK) -> Weights:
    return mean_of(source, multi_krum_select(source, f, 1, chunk), chunk)


def multi_krum(source: UpdateSource, f: int, m: int, chunk: int = DEFAULT_CHUNK) -> Weights:
    return mean_of(source, multi_krum_select(source, f, m, chunk), chunk)


def bulyan_select(dist: torch.Tensor, f: int) -> list[int]:
    """Bulyan's selection: repeatedly take the Krum winner among the remaining updates
    until theta = n - 2f are chosen."""
    n = dist.shape[0]
    theta = n - 2 * f
    if theta - 2 * f < 1 or n < 4 * f + 3:
        raise ValueError(f"bulyan needs n >= 4f + 3 (n={n}, f={f})")
    remaining = list(range(n))
    chosen: list[int] = []
    while len(chosen) < theta:
        sub = dist[remaining][:, remaining]
        scores = krum_scores(sub, f) if len(remaining) > f + 2 else sub.sum(dim=1)
        best = min(range(len(remaining)), key=lambda i: (float(scores[i]), remaining[i]))
        chosen.append(remaining.pop(best))
    return sorted(chosen)


def bulyan(source: UpdateSource, f: int, chunk: int = DEFAULT_CHUNK) -> Weights:
    selected = bulyan_select(pairwise_sq_distances(source, range(len(source)), chunk), f)
    keep = len(selected) - 2 * f

    def reduce(block: torch.Tensor) -> torch.Tensor:  # (theta, c)
        ordered, _ = torch.sort(block, dim=0)
        mid = (ordered[(len(selected) - 1) // 2] + ordered[len(selected) // 2]) / 2
        closest = torch.argsort((block - mid).abs(), dim=0)[:keep]  # (keep, c)
        return torch.gather(block, 0, closest).mean(dim=0)

    return _coordinatewise(source, selected, chunk, reduce)


def clip_update(update: Mapping[str, torch.Tensor], max_norm: float) -> tuple[Weights, float]:
    """``update`` scaled to L2 norm at most ``max_norm``; also returns the original norm.
    Integer tensors are left as they are and not counted."""
    sq = sum(float(torch.linalg.vector_norm(t.float()) ** 2)
             for t in update.values() if t.dtype.is_floating_point)
    norm = math.sqrt(sq)
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return ({k: (v * scale if v.dtype.is_floating_point else v) for k, v in update.items()},
            norm)
