"""Reducers as plug-ins: one rule per module, one registry.

``REDUCERS`` maps a name to its class; the job spec's allowed ``reducer.name`` values
and each rule's parameters come from it. A new rule is a module here with a
:class:`Reducer` subclass declaring its ``Params`` and registered with
``@REDUCERS.register("name")``, imported below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedq.aggregate import plugin
from fedq.aggregate.reducers import bulyan, fednova, krum, mean, median, trimmed_mean  # noqa: F401
from fedq.aggregate.reducers.base import (
    DEFAULT_CHUNK,
    REDUCERS,
    Contribution,
    MemorySource,
    Reducer,
    SourceReducer,
    StreamReducer,
    UpdateSource,
)


def make_reducer(name: str, params: Mapping[str, Any] | None = None) -> Reducer:
    """The reducer registered as ``name`` with ``params`` (as a stored spec holds them:
    checked at submit, see :func:`fedq.aggregate.plugin.build`); KeyError if there is
    none."""
    cls = REDUCERS[name]
    return cls(plugin.build(cls.Params, params or {}))


__all__ = ["DEFAULT_CHUNK", "REDUCERS", "Contribution", "MemorySource", "Reducer",
           "SourceReducer", "StreamReducer", "UpdateSource", "make_reducer"]
