"""Server optimizers as plug-ins: one per module, one registry.

``SERVER_OPTIMIZERS`` maps a name to its class; the job spec's allowed ``server.name``
values and each optimizer's parameters (with its defaults) come from it. A new one is
a module here with a :class:`ServerOptimizer` subclass declaring its ``Params`` and
registered with ``@SERVER_OPTIMIZERS.register("name")``, imported below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedq.aggregate import plugin
from fedq.aggregate.server import (  # noqa: F401
    diloco,
    fedadagrad,
    fedadam,
    fedavg,
    fedavgm,
    fedyogi,
)
from fedq.aggregate.server.base import SERVER_OPTIMIZERS, Adaptive, ServerOptimizer


def make_server(name: str, params: Mapping[str, Any] | None = None) -> ServerOptimizer:
    """The optimizer registered as ``name``; unset options take its own defaults
    (:func:`fedq.aggregate.plugin.build`). KeyError if there is none."""
    cls = SERVER_OPTIMIZERS[name]
    return cls(plugin.build(cls.Params, params or {}))


__all__ = ["SERVER_OPTIMIZERS", "Adaptive", "ServerOptimizer", "make_server"]
