"""Krum and multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries:
Byzantine Tolerant Gradient Descent", NeurIPS): score each of n updates by the summed
squared distance to its n - f - 2 nearest others; Krum takes the best one, multi-Krum
averages the best m (default n - f). Needs n > f + 2 (at least one neighbour)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import Field

from fedq.aggregate.reducers.base import (
    DEFAULT_CHUNK,
    REDUCERS,
    SourceReducer,
    UpdateSource,
    chunks,
    mean_of,
    stack,
)
from fedq.aggregate.types import Weights


def pairwise_sq_distances(source: UpdateSource, rows: Sequence[int],
                          chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """(k, k) matrix of squared L2 distances between the updates in ``rows``, in float64."""
    k = len(rows)
    dist = torch.zeros(k, k, dtype=torch.float64)
    for name, start, stop in chunks(source.shapes(), chunk):
        block = stack(source, rows, name, start, stop).to(torch.float64)  # (k, c)
        dist += torch.cdist(block, block) ** 2
    return dist


def krum_scores(dist: torch.Tensor, nearest: int) -> torch.Tensor:
    """Score of each of n updates: summed squared distance to its ``nearest`` closest others."""
    n = dist.shape[0]
    if not 1 <= nearest <= n - 1:
        raise ValueError(f"krum: cannot sum {nearest} nearest of {n - 1} others")
    scores = []
    for i in range(n):
        others = torch.cat([dist[i, :i], dist[i, i + 1:]])
        scores.append(torch.sort(others).values[:nearest].sum())
    return torch.stack(scores)


def multi_krum_select(source: UpdateSource, f: int, m: int,
                      chunk: int = DEFAULT_CHUNK) -> list[int]:
    """Indices of the m updates with the lowest Krum scores (ties: lower index)."""
    n = len(source)
    if n <= f + 2:
        raise ValueError(f"krum needs n > f + 2 (n={n}, f={f})")
    scores = krum_scores(pairwise_sq_distances(source, range(n), chunk), n - f - 2)
    order = sorted(range(n), key=lambda i: (float(scores[i]), i))
    return sorted(order[:m])


def krum(source: UpdateSource, f: int, chunk: int = DEFAULT_CHUNK) -> Weights:
    return mean_of(source, multi_krum_select(source, f, 1, chunk), chunk)


def multi_krum(source: UpdateSource, f: int, m: int, chunk: int = DEFAULT_CHUNK) -> Weights:
    return mean_of(source, multi_krum_select(source, f, m, chunk), chunk)


@REDUCERS.register("krum")
class Krum(SourceReducer):
    paper = "Blanchard et al. 2017, NeurIPS"

    class Params(SourceReducer.Params):
        f: int = Field(default=1, ge=0, description="Byzantine clients tolerated")

    params: Params

    def problem(self, n: int) -> str | None:
        f = self.params.f
        return None if n > f + 2 else f"needs more than f + 2 updates (n {n}, f {f})"

    def reduce(self, source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
        self.check(len(source))
        return krum(source, self.params.f, chunk)


@REDUCERS.register("multi_krum")
class MultiKrum(Krum):
    class Params(Krum.Params):
        m: int | None = Field(default=None, ge=1,
                              description="updates averaged (unset: n - f)")

    params: Params

    def problem(self, n: int) -> str | None:
        f, m = self.params.f, self.params.m
        if m is not None and m > n - f:
            return f"m ({m}) exceeds n - f ({n - f})"
        return super().problem(n)

    def reduce(self, source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
        self.check(len(source))
        n, f = len(source), self.params.f
        return multi_krum(source, f, self.params.m or n - f, chunk)
