"""Does a training task fit this worker's device? Checked once the model is built and
before the first step, so that a model too large for a GTX 1080's 8 GB, or a laptop the
owner lends 2 GB of, is refused in one line with its numbers instead of failing out of
memory in the middle of a step.

What is counted is what training holds for its whole length: the weights, a gradient of
each trainable weight, and the optimizer's state (SGD with momentum: one tensor per
trainable weight; Adam and AdamW: two). Activations come on top and depend on the batch;
``FEDQ_TRAIN_MEMORY_MB`` leaves room for them where a worker sets it below the device's
memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedq.errors import FedqError
from fedq.spec import OptimizerSpec

MB = 2**20


class TrainingDoesNotFit(FedqError):
    """A training task needs more memory than this worker's device has or may use."""


@dataclass(frozen=True)
class Need:
    """What training ``model`` holds from its first step to its last, in bytes."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def need(model: nn.Module, optimizer: OptimizerSpec) -> Need:
    """The bytes of ``model``'s weights and buffers, a gradient per trainable parameter,
    and ``optimizer``'s state (per trainable parameter, in its dtype, as torch keeps it)."""
    weights = sum(t.numel() * t.element_size() for t in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters()
                    if p.requires_grad)
    states = 2 if optimizer.name in ("adam", "adamw") else (1 if optimizer.momentum else 0)
    return Need(weights=weights, gradients=trainable, optimizer=states * trainable)


def budget(device: torch.device, limit_mb: float | None, fraction: float | None,
           resident: int) -> tuple[int | None, str]:
    """The most bytes a task may hold on ``device``, and a line saying so (``{}`` for the
    MB); None where neither the setting nor the device says. ``resident``: bytes of the model
    already in this process's memory (counted as free on the CPU, where they are)."""
    options: list[tuple[int, str]] = []
    if limit_mb is not None:
        options.append((int(limit_mb * MB), "this worker allows {} MB (FEDQ_TRAIN_MEMORY_MB)"))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        options.append((free, f"{device} has {{}} MB free"))
        if fraction is not None:
            options.append((int(fraction * total),
                            f"FEDQ_GPU_MEMORY_FRACTION allows {{}} MB of {device}"))
    elif device.type == "cpu" and (available := _mem_available()) is not None:
        options.append((available + resident, "this machine has {} MB free"))
    if not options:
        return None, ""
    return min(options)


def check(model: nn.Module, optimizer: OptimizerSpec, device: torch.device,
          limit_mb: float | None, fraction: float | None) -> Need:
    """``model``'s :class:`Need`; raises :class:`TrainingDoesNotFit` with one line of
    numbers when it is over :func:`budget` (the model is still on the CPU)."""
    got = need(model, optimizer)
    resident = got.weights if device.type == "cpu" else 0
    most, source = budget(device, limit_mb, fraction, resident)
    if most is not None and got.total > most:
        raise TrainingDoesNotFit(
            f"training needs {_mb(got.total)} MB before activations (weights "
            f"{_mb(got.weights)}, gradients {_mb(got.gradients)}, {optimizer.name} state "
            f"{_mb(got.optimizer)}) and {source.format(_mb(most))}: use a smaller model, "
            "LoRA (model_args.lora), or a worker with more memory")
    return got


def _mb(size: int) -> str:
    """``size`` bytes in MB as the refusal shows them: whole MB, two figures below 10."""
    return f"{size / MB:,.0f}" if size >= 10 * MB else f"{size / MB:.2g}"


def _mem_available() -> int | None:
    """Linux's estimate of the memory available to a new allocation (MemAvailable), or
    None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
