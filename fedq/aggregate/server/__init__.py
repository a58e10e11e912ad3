"""Server optimizers as plug-ins: one per module, one registry.

``SERVER_OPTIMIZERS`` maps a name to its class; the job spec's allowed ``server.name``
values come from it. ``make_server(name, lr=..., ...)`` fills unset options from the
optimizer's own defaults.
"""

from __future__ import annotations

from dataclasses import replace

from fedq.aggregate.server.base import Adaptive, ServerOptimizer, ServerOpts
from fedq.aggregate.server.diloco import DiLoCo
from fedq.aggregate.server.fedadagrad import FedAdagrad
from fedq.aggregate.server.fedadam import FedAdam
from fedq.aggregate.server.fedavg import FedAvg
from fedq.aggregate.server.fedavgm import FedAvgM
from fedq.aggregate.server.fedyogi import FedYogi

_BUILTIN: tuple[type[ServerOptimizer], ...] = (FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi,
                                               DiLoCo)
SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {cls.name: cls for cls in _BUILTIN}


def make_server(name: str, **overrides: float | None) -> ServerOptimizer:
    """The optimizer registered as ``name``, its defaults replaced by the options that
    are set; KeyError if there is none."""
    cls = SERVER_OPTIMIZERS[name]
    return cls(replace(cls.defaults, **{k: v for k, v in overrides.items() if v is not None}))


__all__ = ["SERVER_OPTIMIZERS", "Adaptive", "ServerOptimizer", "ServerOpts", "make_server"]
