"""FedAdagrad (Reddi et al. 2021, arXiv:2003.00295): v += d^2. Defaults follow
Flower's strategy (eta 0.1, tau 1e-9)."""

from __future__ import annotations

import torch
from pydantic import Field

from fedq.aggregate.server.base import SERVER_OPTIMIZERS, Adaptive


@SERVER_OPTIMIZERS.register("fedadagrad")
class FedAdagrad(Adaptive):
    class Params(Adaptive.Params):
        momentum: float = Field(default=0.0, ge=0, lt=1, description="beta_1")

    opts: Params

    def second_moment(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return v + sq
