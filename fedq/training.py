"""The local training loop a client runs, and the evaluation the coordinator runs.

Reads top to bottom: pick the device, shuffle with a seeded generator, step the
optimizer over mini-batches for the epoch or step budget, report what was done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fedq.spec import OptimizerSpec


@dataclass(frozen=True)
class LocalStats:
    samples: int  # size of the client's shard (the FedAvg weight)
    steps: int  # optimizer steps taken
    seen: int  # samples processed, counting repeats
    loss: float  # mean training loss over the steps


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def make_optimizer(params: list[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                optimizer: OptimizerSpec, batch_size: int, epochs: int | None,
                steps: int | None, seed: int, device: torch.device) -> LocalStats:
    """Train ``model`` in place on (x, y) for ``epochs`` passes or exactly ``steps`` steps.

    x: (N, C, H, W) float32, y: (N,) int64, on the CPU; batches move to ``device``.
    Deterministic for a given seed on a given device and thread count.
    """
    n = len(y)
    if n == 0:
        raise ValueError("client shard is empty")
    gen = torch.Generator().manual_seed(seed)
    batches_per_epoch = math.ceil(n / batch_size)
    total_steps = steps if steps is not None else (epochs or 1) * batches_per_epoch
    model.to(device).train()
    opt = make_optimizer(list(model.parameters()), optimizer)
    loss_fn = nn.CrossEntropyLoss()
    loss_sum, seen, step = 0.0, 0, 0
    while step < total_steps:
        order = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            if step >= total_steps:
                break
            idx = order[start:start + batch_size]
            xb, yb = x[idx].to(device), y[idx].to(device)  # (B, C, H, W), (B,)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            loss_sum += float(loss.detach())
            seen += len(idx)
            step += 1
    return LocalStats(samples=n, steps=step, seen=seen, loss=loss_sum / max(step, 1))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
             device: torch.device, batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y)."""
    model.to(device).eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start:start + batch_size].to(device), y[start:start + batch_size].to(device)
        logits = model(xb)  # (B, classes)
        loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        correct += int((logits.argmax(dim=1) == yb).sum())
    return correct / len(y), loss_sum / len(y)
