"""Reducers as plug-ins: one rule per module, one registry.

``REDUCERS`` maps a name to its class; the job spec's allowed ``reducer.name`` values
come from it. A new rule is a module here with a :class:`Reducer` subclass, listed in
``_BUILTIN``.
"""

from __future__ import annotations

from fedq.aggregate.reducers.base import (
    DEFAULT_CHUNK,
    Contribution,
    MemorySource,
    Reducer,
    ReducerParams,
    SourceReducer,
    StreamReducer,
    UpdateSource,
)
from fedq.aggregate.reducers.bulyan import Bulyan
from fedq.aggregate.reducers.fednova import FedNova
from fedq.aggregate.reducers.krum import Krum, MultiKrum
from fedq.aggregate.reducers.mean import Mean
from fedq.aggregate.reducers.median import Median
from fedq.aggregate.reducers.trimmed_mean import TrimmedMean

_BUILTIN: tuple[type[Reducer], ...] = (Mean, FedNova, Median, TrimmedMean, Krum, MultiKrum,
                                       Bulyan)
REDUCERS: dict[str, type[Reducer]] = {cls.name: cls for cls in _BUILTIN}


def make_reducer(name: str, params: ReducerParams = ReducerParams()) -> Reducer:
    """The reducer registered as ``name`` with ``params``; KeyError if there is none."""
    return REDUCERS[name](params)


__all__ = ["DEFAULT_CHUNK", "REDUCERS", "Contribution", "MemorySource", "Reducer",
           "ReducerParams", "SourceReducer", "StreamReducer", "UpdateSource", "make_reducer"]
