"""DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv:2311.08105): Nesterov momentum SGD on the
pseudo-gradient g = -d with the paper's outer lr 0.7 and momentum 0.9, in PyTorch's
formulation: b = mu b + g; w - lr (g + mu b). The inner optimizer is the client's
(AdamW in the paper)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pydantic import Field

from fedq.aggregate.server.base import SERVER_OPTIMIZERS, ServerOptimizer


@SERVER_OPTIMIZERS.register("diloco")
class DiLoCo(ServerOptimizer):
    paper = "Douillard et al. 2023, arXiv:2311.08105"

    class Params(ServerOptimizer.Params):
        lr: float = Field(default=0.7, gt=0, description="outer learning rate")
        momentum: float = Field(default=0.9, ge=0, lt=1, description="Nesterov momentum")

    opts: Params

    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mu, g = self.opts.momentum, -d
        buf = g.clone() if "m" not in state else mu * state["m"] + g
        return -self.opts.lr * (g + mu * buf), {"m": buf}
