"""Coordinate-wise trimmed mean (Yin et al. 2018, arXiv:1803.01498): per coordinate,
drop floor(beta * n) values at each end and average the rest."""

from __future__ import annotations

import math

import torch
from pydantic import Field

from fedq.aggregate.reducers.base import (
    DEFAULT_CHUNK,
    REDUCERS,
    SourceReducer,
    UpdateSource,
    coordinatewise,
)
from fedq.aggregate.types import Weights


def trimmed_mean(source: UpdateSource, beta: float, chunk: int = DEFAULT_CHUNK) -> Weights:
    n = len(source)
    cut = int(math.floor(beta * n))
    if not 0 <= beta < 0.5 or n - 2 * cut < 1:
        raise ValueError(f"trimmed mean: beta {beta} leaves nothing of {n} updates")

    def reduce(block: torch.Tensor) -> torch.Tensor:
        ordered, _ = torch.sort(block, dim=0)
        return ordered[cut:n - cut].mean(dim=0)

    return coordinatewise(source, range(n), chunk, reduce)


@REDUCERS.register("trimmed_mean")
class TrimmedMean(SourceReducer):
    paper = "Yin et al. 2018, arXiv:1803.01498"

    class Params(SourceReducer.Params):
        beta: float = Field(default=0.1, ge=0, lt=0.5,
                            description="fraction cut at each end, per coordinate")

    params: Params

    def reduce(self, source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
        self.check(len(source))
        return trimmed_mean(source, self.params.beta, chunk)
