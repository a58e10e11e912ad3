"""FedAdagrad (Reddi et al. 2021, arXiv:2003.00295): v += d^2. Defaults follow
Flower's strategy (eta 0.1, tau 1e-9)."""

from __future__ import annotations

import torch

from fedq.aggregate.server.base import Adaptive, ServerOpts


class FedAdagrad(Adaptive):
    name = "fedadagrad"
    defaults = ServerOpts(lr=0.1, momentum=0.0, beta2=0.0, tau=1e-9)

    def second_moment(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return v + sq
