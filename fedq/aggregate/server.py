"""Server optimizers: how the aggregated client delta moves the global model.

The pseudo-gradient is g = -d, where d is the aggregated client delta (clients send
local - global). Each optimizer is a pure function
``step(weights, delta, state, opts) -> (new weights, new state)``; the state (a dict
of tensors) is stored with every committed round, so a resumed job continues exactly.
Only floating-point tensors are optimized; integer buffers (BatchNorm counters) take
the plain delta.

- fedavg: w + lr * d (McMahan et al. 2017, arXiv:1602.05629; lr 1 is plain FedAvg).
- fedavgm: server momentum, v = beta * v + d; w + lr * v (Hsu et al. 2019,
  "Measuring the Effects of Non-Identical Data Distribution", arXiv:1909.06335).
- fedadagrad / fedadam / fedyogi: Reddi et al. 2021, "Adaptive Federated
  Optimization" (arXiv:2003.00295), Algorithm 2: m = b1 m + (1 - b1) d;
  v += d^2 (Adagrad) | v = b2 v + (1 - b2) d^2 (Adam) |
  v = v - (1 - b2) d^2 sign(v - d^2) (Yogi); w + lr * m / (sqrt(v) + tau).
- diloco: the outer step of Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
  Training of Language Models" (arXiv:2311.08105): Nesterov momentum SGD on g with
  outer lr 0.7 and momentum 0.9 (PyTorch's formulation: b = mu b + g;
  w - lr (g + mu b)); the inner optimizer is the client's (AdamW in the paper).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedq.aggregate.fedavg import apply_delta
from fedq.aggregate.types import Weights

SERVER_OPTIMIZERS = ("fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "diloco")

#: Per optimizer: (lr, momentum/beta1, beta2, tau) defaults. FedAdam & co. follow
#: Flower's strategy defaults (eta 0.1, beta_1 0.9, beta_2 0.99, tau 1e-9);
#: DiLoCo's are the paper's (outer lr 0.7, Nesterov momentum 0.9).
DEFAULTS: dict[str, tuple[float, float, float, float]] = {
    "fedavg": (1.0, 0.0, 0.0, 0.0),
    "fedavgm": (1.0, 0.9, 0.0, 0.0),
    "fedadagrad": (0.1, 0.0, 0.0, 1e-9),
    "fedadam": (0.1, 0.9, 0.99, 1e-9),
    "fedyogi": (0.1, 0.9, 0.99, 1e-9),
    "diloco": (0.7, 0.9, 0.0, 0.0),
}


@dataclass(frozen=True)
class ServerOpts:
    name: str = "fedavg"
    lr: float = 1.0
    momentum: float = 0.0  # fedavgm / diloco momentum; beta_1 for the adaptive ones
    beta2: float = 0.99
    tau: float = 1e-9

    @classmethod
    def default(cls, name: str, **overrides: float | None) -> "ServerOpts":
        lr, momentum, beta2, tau = DEFAULTS[name]
        values = {"lr": lr, "momentum": momentum, "beta2": beta2, "tau": tau}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(name=name, **values)


def server_step(weights: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor],
                state: Mapping[str, torch.Tensor], opts: ServerOpts) -> tuple[Weights, Weights]:
    """One server step. ``state`` holds ``m.<name>`` / ``v.<name>`` tensors (empty at
    first); returns the new weights and the new state. Pure: inputs are not modified."""
    if opts.name not in SERVER_OPTIMIZERS:
        raise ValueError(f"unknown server optimizer {opts.name!r}")
    step: Weights = {}
    new_state: Weights = {}
    for name, d in delta.items():
        if not weights[name].dtype.is_floating_point:
            step[name] = d  # integer buffers: the plain averaged delta
            continue
        d = d.to(torch.float32)
        m_prev = state.get(f"m.{name}")
        v_prev = state.get(f"v.{name}")
        if opts.name == "fedavg":
            step[name] = opts.lr * d
        elif opts.name == "fedavgm":
            v = d.clone() if m_prev is None else opts.momentum * m_prev + d
            new_state[f"m.{name}"] = v
            step[name] = opts.lr * v
        elif opts.name == "diloco":
            g = -d
            buf = g.clone() if m_prev is None else opts.momentum * m_prev + g
            new_state[f"m.{name}"] = buf
            step[name] = -opts.lr * (g + opts.momentum * buf)
        else:
            m = (1 - opts.momentum) * d if m_prev is None else \
                opts.momentum * m_prev + (1 - opts.momentum) * d
            v0 = torch.zeros_like(d) if v_prev is None else v_prev
            sq = d * d
            if opts.name == "fedadagrad":
                v = v0 + sq
            elif opts.name == "fedadam":
                v = opts.beta2 * v0 + (1 - opts.beta2) * sq
            else:  # fedyogi
                v = v0 - (1 - opts.beta2) * sq * torch.sign(v0 - sq)
            new_state[f"m.{name}"], new_state[f"v.{name}"] = m, v
            step[name] = opts.lr * m / (torch.sqrt(v) + opts.tau)
    return apply_delta(weights, step), new_state
