"""Partitioners: disjoint, complete, deterministic; Dirichlet skews labels."""

from __future__ import annotations

import numpy as np

from fedq.data import client_indices, load_dataset, partition_indices
from fedq.spec import DirichletPartition, IIDPartition


def _labels(n: int = 1000, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(1).integers(0, classes, n)


def test_iid_covers_every_sample_once() -> None:
    parts = partition_indices(_labels(), IIDPartition(), 7, seed=3)
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(1000))
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_dirichlet_is_deterministic_disjoint_and_skewed() -> None:
    labels = _labels()
    part = DirichletPartition(kind="dirichlet", alpha=0.1, min_samples=5)
    a = partition_indices(labels, part, 10, seed=4)
    b = partition_indices(labels, part, 10, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    joined = np.concatenate(a)
    assert len(joined) == len(set(joined.tolist())) == 1000
    assert min(len(p) for p in a) >= 5
    # alpha=0.1: most clients are dominated by one or two classes
    top_share = [np.bincount(labels[p], minlength=10).max() / len(p) for p in a]
    assert np.median(top_share) > 0.5
    iid_top = [np.bincount(labels[p], minlength=10).max() / len(p)
               for p in partition_indices(labels, IIDPartition(), 10, seed=4)]
    assert np.median(iid_top) < 0.25


def test_client_shard_depends_on_seed() -> None:
    labels = load_dataset("digits").y_train.numpy()
    one = client_indices(labels, IIDPartition(), 10, 3, seed=0)
    same = client_indices(labels, IIDPartition(), 10, 3, seed=0)
    other = client_indices(labels, IIDPartition(), 10, 3, seed=1)
    assert np.array_equal(one, same) and not np.array_equal(one, other)


def test_digits_split_is_real_and_fixed() -> None:
    ds = load_dataset("digits")
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert len(ds.y_train) + len(ds.y_test) == 1797
    assert len(ds.y_test) == 360
