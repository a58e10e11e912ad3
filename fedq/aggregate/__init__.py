"""Aggregation math: pure functions over tensors. No Celery, database or files here.

- fedavg.py: the streamed weighted mean and its kept accumulator;
- reducers/: how a round's updates combine (mean, FedNova, robust rules), plug-ins;
- server/: how the combined delta moves the global model (FedAvg ... DiLoCo), plug-ins;
- clip.py, dp.py, compression.py, verify.py: per-update clipping, central DP,
  update codecs, update checks.
"""

from fedq.aggregate.fedavg import Accumulator, apply_delta, fedavg, weighted_mean
from fedq.aggregate.reducers.fednova import fednova_mean
from fedq.aggregate.types import Weights
from fedq.aggregate.verify import check_update

__all__ = ["Accumulator", "Weights", "apply_delta", "check_update", "fedavg", "fednova_mean",
           "weighted_mean"]
