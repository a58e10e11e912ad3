"""Split a training set among clients, deterministically from a seed.

- IID: a seeded permutation cut into ``num_clients`` near-equal parts.
- Dirichlet(alpha): per class, client shares drawn from Dir(alpha), the label-skew
  scheme of Hsu et al. 2019, "Measuring the Effects of Non-Identical Data
  Distribution for Federated Visual Classification" (arXiv:1909.06335).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # numpy is imported where a split is made: the spec's models (every
    import numpy as np  # CLI command reads them) need none of it


class IIDPartition(BaseModel):
    """Each client gets an equal, uniformly random share of the training set."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["iid"] = "iid"


class DirichletPartition(BaseModel):
    """Per class, shares drawn from Dirichlet(alpha): small alpha, skewed clients."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["dirichlet"]
    alpha: float = Field(gt=0)
    min_samples: int = Field(default=2, ge=1, description="each client gets at least this many")


class ByGroupPartition(BaseModel):
    """Each client holds whole groups (for text: whole works), the groups dealt largest
    first to the client with the fewest examples so far: the natural non-IID split."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["by_group"]


AnyPartition = IIDPartition | DirichletPartition | ByGroupPartition
Partition = Annotated[AnyPartition, Field(discriminator="kind")]


def partition_indices(labels: np.ndarray, partition: AnyPartition,
                      num_clients: int, seed: int) -> list[np.ndarray]:
    """Indices of ``labels`` for each client; disjoint, together all of them."""
    import numpy as np

    rng = np.random.default_rng([seed, 0x5EED])
    n = len(labels)
    if isinstance(partition, IIDPartition):
        return [np.sort(p) for p in np.array_split(rng.permutation(n), num_clients)]
    if isinstance(partition, ByGroupPartition):
        return _by_group(labels, num_clients)
    shards: list[list[int]] = [[] for _ in range(num_clients)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        shares = rng.dirichlet(np.full(num_clients, partition.alpha))
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
        for client, part in enumerate(np.split(idx, cuts)):
            shards[client].extend(part.tolist())
    # Top up clients below the floor from the largest one, so no client is empty.
    floor = min(partition.min_samples, n // num_clients)
    for client in range(num_clients):
        while len(shards[client]) < floor:
            donor = max(range(num_clients), key=lambda c: len(shards[c]))
            shards[client].append(shards[donor].pop())
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]


@lru_cache(maxsize=8)
def _cached(labels_bytes: bytes, partition: AnyPartition,
            num_clients: int, seed: int) -> tuple[np.ndarray, ...]:
    import numpy as np

    labels = np.frombuffer(labels_bytes, dtype=np.int64)
    return tuple(partition_indices(labels, partition, num_clients, seed))


def client_indices(labels: np.ndarray, partition: AnyPartition,
                   num_clients: int, client: int, seed: int) -> np.ndarray:
    """The training-set indices that belong to ``client`` (0-based)."""
    import numpy as np

    if not 0 <= client < num_clients:
        raise ValueError(f"client {client} out of range 0..{num_clients - 1}")
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    return _cached(labels.tobytes(), partition, num_clients, seed)[client]


def _by_group(groups: np.ndarray, num_clients: int) -> list[np.ndarray]:
    import numpy as np

    ids, sizes = np.unique(groups, return_counts=True)
    if len(ids) < num_clients:
        raise ValueError(f"by_group: {len(ids)} groups cannot cover {num_clients} clients")
    owned: list[list[int]] = [[] for _ in range(num_clients)]
    load = [0] * num_clients
    for g in ids[np.argsort(-sizes, kind="stable")]:
        client = min(range(num_clients), key=lambda c: (load[c], c))
        owned[client].append(int(g))
        load[client] += int(sizes[ids == g][0])
    return [np.sort(np.flatnonzero(np.isin(groups, mine))) for mine in owned]
