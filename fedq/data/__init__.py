"""Datasets and partitioners. A training task derives its own shard from
(dataset, partition, client, seed); raw data never crosses the network.

The data sets import torch; they load on first use (PEP 562), so the job spec can
name a partition without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DATASETS", "Dataset", "load_dataset", "shape_of", "client_indices", "partition_indices"]


def __getattr__(name: str) -> Any:
    if name in ("DATASETS", "Dataset", "load_dataset", "shape_of"):
        from fedq.data import datasets

        return getattr(datasets, name)
    if name in ("client_indices", "partition_indices"):
        from fedq.data import partition

        return getattr(partition, name)
    raise AttributeError(f"module 'fedq.data' has no attribute {name!r}")
