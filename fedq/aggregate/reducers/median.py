"""Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning:
Towards Optimal Statistical Rates", arXiv:1803.01498); for even n, the mean of the
two middle values."""

from __future__ import annotations

import torch

from fedq.aggregate.reducers.base import (
    DEFAULT_CHUNK,
    REDUCERS,
    SourceReducer,
    UpdateSource,
    coordinatewise,
)
from fedq.aggregate.types import Weights


def median(source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
    def reduce(block: torch.Tensor) -> torch.Tensor:  # (n, c) -> (c,)
        ordered, _ = torch.sort(block, dim=0)
        n = ordered.shape[0]
        return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2

    return coordinatewise(source, range(len(source)), chunk, reduce)


@REDUCERS.register("median")
class Median(SourceReducer):
    paper = "Yin et al. 2018, arXiv:1803.01498"

    def reduce(self, source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
        self.check(len(source))
        return median(source, chunk)
