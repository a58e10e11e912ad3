"""FedAvg's server step: w + lr * d (McMahan et al. 2017, arXiv:1602.05629; lr 1 is
plain FedAvg)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedq.aggregate.server.base import ServerOptimizer, ServerOpts


class FedAvg(ServerOptimizer):
    name = "fedavg"
    paper = "McMahan et al. 2017, arXiv:1602.05629"
    defaults = ServerOpts(lr=1.0, momentum=0.0, beta2=0.0, tau=0.0)

    def update(self, d: torch.Tensor, state: Mapping[str, torch.Tensor]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.opts.lr * d, {}
