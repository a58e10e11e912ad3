"""FedAvgM, server momentum: v = beta v + d; w + lr * v (Hsu et al. 2019, "Measuring
the Effects of Non-Identical Data Distribution for Federated Visual Classification",
arXiv:1909.06335)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedq.aggregate.server.base import ServerOptimizer, ServerOpts


class FedAvgM(ServerOptimizer):
    name = "fedavgm"
    paper = "Hsu et al. 2019, arXiv:1909.06335"
    defaults = ServerOpts(lr=1.0, momentum=0.9, beta2=0.0, tau=0.0)

    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v = d.clone() if "m" not in state else self.opts.momentum * state["m"] + d
        return self.opts.lr * v, {"m": v}
