"""FedAvg's server step: w + lr * d (McMahan et al. 2017, arXiv:1602.05629; lr 1 is
plain FedAvg)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedq.aggregate.server.base import SERVER_OPTIMIZERS, ServerOptimizer


@SERVER_OPTIMIZERS.register("fedavg")
class FedAvg(ServerOptimizer):
    paper = "McMahan et al. 2017, arXiv:1602.05629"

    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.opts.lr * d, {}
