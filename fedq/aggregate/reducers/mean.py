"""FedAvg's weighted mean (McMahan et al. 2017, "Communication-Efficient Learning of
Deep Networks from Decentralized Data", arXiv:1602.05629): sum_i w_i d_i / sum_i w_i,
streamed into one accumulator (fedq/aggregate/fedavg.py)."""

from __future__ import annotations

from collections.abc import Iterable

from fedq.aggregate.fedavg import Accumulator
from fedq.aggregate.reducers.base import REDUCERS, Contribution, StreamReducer
from fedq.aggregate.types import Weights


@REDUCERS.register("mean")
class Mean(StreamReducer):
    paper = "McMahan et al. 2017, arXiv:1602.05629"
    weighted = True
    takes_pieces = True

    def reduce(self, updates: Iterable[Contribution], acc: Accumulator) -> Weights:
        return acc.mean((c.weight, c.delta) for c in updates)
