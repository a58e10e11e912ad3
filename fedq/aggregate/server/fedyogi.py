"""FedYogi (Reddi et al. 2021, arXiv:2003.00295): v = v - (1 - b2) d^2 sign(v - d^2).
Defaults follow Flower's strategy (eta 0.1, beta_1 0.9, beta_2 0.99, tau 1e-9)."""

from __future__ import annotations

import torch
from pydantic import Field

from fedq.aggregate.server.base import SERVER_OPTIMIZERS, Adaptive


@SERVER_OPTIMIZERS.register("fedyogi")
class FedYogi(Adaptive):
    class Params(Adaptive.Params):
        beta2: float = Field(default=0.99, ge=0, lt=1, description="beta_2")

    opts: Params

    def second_moment(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.opts.beta2) * sq * torch.sign(v - sq)
