"""The server-optimizer interface: how the aggregated client delta moves the global model.

The pseudo-gradient is g = -d, where d is the aggregated client delta (clients send
local - global). An optimizer updates one floating-point tensor at a time from its
delta and its own state (``m`` and/or ``v``, tensors of the same shape); the state is
stored with every committed round, so a resumed job continues exactly. Integer buffers
(BatchNorm counters) take the plain delta.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch
from pydantic import Field

from fedq.aggregate import plugin
from fedq.aggregate.types import Weights
from fedq.registry import Registry


class ServerOptimizer(ABC):
    """One server optimizer. Subclasses set ``paper``, declare their ``Params`` (the
    hyperparameters a spec's ``server:`` may set, with their defaults) and register
    with ``@SERVER_OPTIMIZERS.register("name")``, which sets ``name``."""

    name: ClassVar[str]
    paper: ClassVar[str]

    class Params(plugin.Params):
        lr: float = Field(default=1.0, gt=0, description="server learning rate")

    def __init__(self, opts: ServerOptimizer.Params | None = None) -> None:
        self.opts = opts if opts is not None else self.Params()

    @abstractmethod
    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the step to add to the weights, the new state) for one float32 tensor's
        delta ``d``; ``state`` holds this tensor's ``m``/``v`` (empty at first)."""

    def step(self, weights: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor],
             state: Mapping[str, torch.Tensor]) -> tuple[Weights, Weights]:
        """The new weights and state. ``state`` maps ``m.<tensor>`` / ``v.<tensor>``.
        ``delta`` may name only some tensors (Streaming DiLoCo's fragment): the others,
        and their state, stay as they are. One tensor's step is made at a time and
        added at once, so no model-sized step is held beside the new model. Pure: the
        inputs are not modified."""
        new_weights: Weights = {}
        new_state: Weights = {k: v for k, v in state.items()
                              if k.partition(".")[2] not in delta}
        for name, value in weights.items():
            d = delta.get(name)
            if d is None:
                new_weights[name] = value
                continue
            if not value.dtype.is_floating_point:  # integer buffers: the plain delta
                new_weights[name] = (value.to(torch.float64) + d.to(torch.float64)
                                     ).round().to(value.dtype)
                continue
            mine = {k: state[f"{k}.{name}"] for k in ("m", "v") if f"{k}.{name}" in state}
            step, after = self.update(d.to(torch.float32), mine)
            new_state.update({f"{k}.{name}": v for k, v in after.items()})
            new_weights[name] = (value.to(step.dtype) + step).to(value.dtype)
            del step
        return new_weights, new_state


#: Every server optimizer, by name; the job spec's ``server.name`` is one of these.
SERVER_OPTIMIZERS: Registry[type[ServerOptimizer]] = Registry("server optimizer")


class Adaptive(ServerOptimizer):
    """Reddi et al. 2021, "Adaptive Federated Optimization" (arXiv:2003.00295),
    Algorithm 2: m = b1 m + (1 - b1) d; v from :meth:`second_moment`;
    step = lr * m / (sqrt(v) + tau)."""

    paper = "Reddi et al. 2021, arXiv:2003.00295"

    class Params(ServerOptimizer.Params):  # defaults follow Flower's strategies
        lr: float = Field(default=0.1, gt=0, description="server learning rate (eta)")
        momentum: float = Field(default=0.9, ge=0, lt=1, description="beta_1")
        tau: float = Field(default=1e-9, gt=0, description="adaptivity (epsilon)")

    opts: Params

    @abstractmethod
    def second_moment(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        """The new v from the previous ``v`` (zeros at first) and ``sq`` = d * d."""

    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        o = self.opts
        m = (1 - o.momentum) * d if "m" not in state else \
            o.momentum * state["m"] + (1 - o.momentum) * d
        v = self.second_moment(state["v"] if "v" in state else torch.zeros_like(d), d * d)
        return o.lr * m / (torch.sqrt(v) + o.tau), {"m": m, "v": v}
