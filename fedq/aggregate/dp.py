"""Central differential privacy for federated averaging (DP-FedAvg, McMahan et al. 2018,
"Learning Differentially Private Recurrent Language Models", arXiv:1710.06963).

Each client update is clipped to L2 norm C; the server averages the clipped updates
with a fixed denominator (the number of clients sampled) and adds Gaussian noise of
standard deviation noise_multiplier * C / clients_per_round. The privacy spent after
each round is computed by Opacus's RDP accountant for the subsampled Gaussian
mechanism, with sampling rate clients_per_round / num_clients.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedq.aggregate.types import Weights
from fedq.errors import require_extra


def add_gaussian_noise(mean: Mapping[str, torch.Tensor], *, clip_norm: float,
                       noise_multiplier: float, clients_per_round: int,
                       generator: torch.Generator) -> Weights:
    """``mean`` (of clipped updates) plus N(0, (z C / n)^2) on every float coordinate."""
    std = noise_multiplier * clip_norm / clients_per_round
    out: Weights = {}
    for name, value in mean.items():
        if value.dtype.is_floating_point:
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
            out[name] = value + std * noise.to(value.dtype)
        else:
            out[name] = value
    return out


def epsilon(rounds: int, *, noise_multiplier: float, sample_rate: float,
            delta: float) -> float:
    """(epsilon, delta)-DP epsilon after ``rounds`` rounds (Opacus RDP accountant)."""
    require_extra("opacus", "dp", "the differential-privacy accountant")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, rounds)]
    return float(accountant.get_epsilon(delta=delta))
