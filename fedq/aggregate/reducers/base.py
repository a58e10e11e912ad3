"""The reducer interface: how one round's verified updates become one delta.

Two kinds, by what the math needs to see:

- :class:`StreamReducer` (mean, FedNova) folds updates in one at a time, so memory is
  one accumulator plus one update;
- :class:`SourceReducer` (median, trimmed mean, Krum, multi-Krum, Bulyan) needs every
  update at each coordinate, and reads them slice by slice through an
  :class:`UpdateSource` (on the coordinator, a disk-backed one), never whole.

A reducer declares its hyperparameters in a nested ``Params`` (fedq/aggregate/plugin.py)
and registers itself with ``@REDUCERS.register("name")`` (fedq/registry.py).

A reducer states which counts of updates it can work with in :meth:`Reducer.problem`;
the job spec calls it when a spec is parsed (against the round's quorum) and the
reducer calls it again before it runs (against the updates it got): one place.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import ClassVar, NamedTuple, Protocol

import torch

from fedq.aggregate import plugin
from fedq.aggregate.fedavg import Accumulator, Pieces
from fedq.aggregate.types import Weights
from fedq.registry import Registry

DEFAULT_CHUNK = 1 << 20  # elements per slice: 4 MB per update in float32


class Contribution(NamedTuple):
    """One verified update as a stream reducer sees it."""

    weight: float  # samples, samples processed, or 1 (DP)
    steps: int  # local optimizer steps (FedNova's normaliser)
    delta: Mapping[str, torch.Tensor] | Pieces  # Pieces only where ``takes_pieces``


class UpdateSource(Protocol):
    """K updates with the same tensor names and shapes, readable by flat slices."""

    def __len__(self) -> int: ...

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, index: int, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of tensor ``name`` of update ``index``, flattened, float32."""
        ...


class Reducer(ABC):
    """One aggregation rule. Subclasses set ``paper``, declare their ``Params`` and
    register with ``@REDUCERS.register("name")``, which sets ``name``."""

    name: ClassVar[str]
    paper: ClassVar[str]
    #: Whether updates are weighted (by samples); robust reducers treat all alike.
    weighted: ClassVar[bool] = False

    class Params(plugin.Params):
        pass

    def __init__(self, params: Reducer.Params | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def problem(self, n: int) -> str | None:
        """Why ``n`` updates are too few (or the params wrong) for this rule; None if fine."""
        return None if n >= 1 else "needs at least one update"

    def check(self, n: int) -> None:
        """Raise ValueError with :meth:`problem`'s reason, if any."""
        why = self.problem(n)
        if why:
            raise ValueError(f"{self.name}: {why}")


class StreamReducer(Reducer):
    #: Whether :meth:`reduce` takes updates as :class:`~fedq.aggregate.fedavg.Pieces`
    #: (a big update read from a scratch file, never whole in memory).
    takes_pieces: ClassVar[bool] = False

    @abstractmethod
    def reduce(self, updates: Iterable[Contribution], acc: Accumulator) -> Weights:
        """The combined delta. ``acc``: memory that may be reused for the result (then
        valid until ``acc``'s next use). Raises ValueError when nothing is usable."""


class SourceReducer(Reducer):
    @abstractmethod
    def reduce(self, source: UpdateSource, chunk: int = DEFAULT_CHUNK) -> Weights:
        """The combined delta of the updates in ``source`` (unweighted)."""


class MemorySource:
    """An UpdateSource over in-memory updates (tests, small models)."""

    def __init__(self, updates: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self.updates = list(updates)

    def __len__(self) -> int:
        return len(self.updates)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.updates[0].items()}

    def read(self, index: int, name: str, start: int, stop: int) -> torch.Tensor:
        return self.updates[index][name].reshape(-1)[start:stop].to(torch.float32)


#: Every reducer, by name; the job spec's ``reducer.name`` is one of these.
REDUCERS: Registry[type[Reducer]] = Registry("reducer")


def chunks(shapes: dict[str, tuple[int, ...]], chunk: int) -> Iterator[tuple[str, int, int]]:
    """(tensor name, start, stop) slices of at most ``chunk`` elements covering every tensor."""
    for name, shape in shapes.items():
        size = math.prod(shape)
        for start in range(0, size, chunk):
            yield name, start, min(size, start + chunk)


def stack(source: UpdateSource, rows: Sequence[int], name: str, start: int,
          stop: int) -> torch.Tensor:
    """(len(rows), stop - start) block of one slice of the chosen updates."""
    block = torch.empty(len(rows), stop - start, dtype=torch.float32)  # (k, chunk)
    for j, i in enumerate(rows):
        block[j] = source.read(i, name, start, stop)  # one slice alive at a time
    return block


def coordinatewise(source: UpdateSource, rows: Sequence[int], chunk: int,
                   reduce: Callable[[torch.Tensor], torch.Tensor]) -> Weights:
    """Apply ``reduce`` ((k, c) -> (c,)) to every slice of the updates in ``rows``."""
    shapes = source.shapes()
    out = {name: torch.empty(math.prod(shape), dtype=torch.float32)
           for name, shape in shapes.items()}
    for name, start, stop in chunks(shapes, chunk):
        out[name][start:stop] = reduce(stack(source, rows, name, start, stop))
    return {name: out[name].reshape(shape) for name, shape in shapes.items()}


def mean_of(source: UpdateSource, rows: Sequence[int], chunk: int = DEFAULT_CHUNK) -> Weights:
    """Unweighted mean of the updates in ``rows``."""
    return coordinatewise(source, rows, chunk, lambda block: block.mean(dim=0))
