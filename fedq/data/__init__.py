"""Datasets and partitioners. A training task derives its own shard from
(dataset, partition, client, seed); raw data never crosses the network."""

from fedq.data.datasets import DATASETS, Dataset, load_dataset
from fedq.data.partition import client_indices, partition_indices

__all__ = ["DATASETS", "Dataset", "load_dataset", "client_indices",
           "partition_indices"]
