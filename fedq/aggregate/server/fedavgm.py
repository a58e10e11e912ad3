"""FedAvgM, server momentum: v = beta v + d; w + lr * v (Hsu et al. 2019, "Measuring
the Effects of Non-Identical Data Distribution for Federated Visual Classification",
arXiv:1909.06335)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field

from fedq.aggregate.server.base import SERVER_OPTIMIZERS, ServerOptimizer


@SERVER_OPTIMIZERS.register("fedavgm")
class FedAvgM(ServerOptimizer):
    paper = "Hsu et al. 2019, arXiv:1909.06335"

    class Params(ServerOptimizer.Params):
        momentum: float = Field(default=0.9, ge=0, lt=1, description="server momentum beta")

    opts: Params

    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = d.clone() if "m" not in state else self.opts.momentum * state["m"] + d
        return self.opts.lr * v, {"m": v}
