"""FedAdam (Reddi et al. 2021, arXiv:2003.00295): v = b2 v + (1 - b2) d^2. Defaults
follow Flower's strategy (eta 0.1, beta_1 0.9, beta_2 0.99, tau 1e-9)."""

from __future__ import annotations

import torch

from fedq.aggregate.server.base import Adaptive, ServerOpts


class FedAdam(Adaptive):
    name = "fedadam"
    defaults = ServerOpts(lr=0.1, momentum=0.9, beta2=0.99, tau=1e-9)

    def second_moment(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return self.opts.beta2 * v + (1 - self.opts.beta2) * sq
