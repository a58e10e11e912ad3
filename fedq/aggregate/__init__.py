"""Aggregation math: pure functions over tensors. No Celery, database or files here."""

from fedq.aggregate.fedavg import Accumulator, apply_delta, fedavg, weighted_mean
from fedq.aggregate.fednova import fednova_mean
from fedq.aggregate.types import Weights
from fedq.aggregate.verify import check_update

__all__ = ["Accumulator", "Weights", "apply_delta", "check_update", "fedavg", "fednova_mean",
           "weighted_mean"]
