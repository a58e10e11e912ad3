"""The local training loop a client runs.

Reads top to bottom: restore the kept optimizer state (if any), shuffle with a seeded
generator, step the optimizer over mini-batches for the epoch or step budget (the lr
from the warm-up/cosine schedule, the gradient clipped), keep the optimizer state,
report what was done. Classifiers and language models share it: a model's output
(B, classes) or (B, T, vocab) is scored against targets (B,) or (B, T).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fedq.data.datasets import IGNORE
from fedq.settings import get_settings
from fedq.spec import OptimizerSpec
from fedq.testing import faults
from fedq.worker import inner
from fedq.worker.hardware import amp_mode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalStats:
    samples: int  # size of the client's shard (the FedAvg weight)
    steps: int  # optimizer steps taken
    seen: int  # samples processed, counting repeats
    loss: float  # mean training loss over the steps
    seconds: float  # wall time of the loop
    stopped_by_budget: bool  # the time budget ended training before its steps did
    amp: str  # mixed precision used: bf16 | fp16 | off
    device: str = "cpu"  # where it trained
    gpu_peak_mb: float | None = None  # peak GPU memory torch allocated
    gpu_util: float | None = None  # mean GPU utilisation (%), sampled while training
    inner_step: int = 0  # the client's inner step count after this round (lr schedule)
    planned_steps: int = 0  # the steps it would have taken without a budget or a yield
    yielded: str | None = None  # why it stopped early for the machine's owner
    kept: Kept | None = None  # where it stopped, when it yielded (to go on from there)
    resumed_steps: int = 0  # of ``steps``, those taken before a yield and kept


@dataclass(frozen=True)
class Kept:
    """A task's training where it stopped for the machine's owner, in CPU memory
    (BOINC's "leave in memory"): given back to :func:`local_train` when the same task
    comes back, it goes on from that step with the same batches, model, optimizer and
    generator, as if it had never stopped."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, object]
    generator: torch.Tensor  # the shuffling generator's state after ``order`` was drawn
    order: torch.Tensor  # this epoch's sample order
    start: int  # the next batch's first index in ``order``
    step: int
    seen: int
    loss_sum: float
    seconds: float  # training time before the yield (a time budget counts it)
    first_step: int  # the lr schedule's position at the task's start

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.values())


def _to_cpu(value: object) -> object:
    """A deep copy of an optimizer state_dict with its tensors on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def make_optimizer(params: list[nn.Parameter], spec: OptimizerSpec) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay)
    betas = (0.9, spec.beta2)
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=betas, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, betas=betas, weight_decay=spec.weight_decay)


def lr_at(step: int, spec: OptimizerSpec, horizon: int | None,
          fraction: float | None = None) -> float:
    """The learning rate of inner step ``step`` (0-based, counted over the whole job):
    linear warm-up, then constant or cosine decay to ``final_lr_fraction`` x lr at
    ``horizon`` (as nanoGPT's and DiLoCo's inner schedules). ``fraction``: the cosine's
    position (0 to 1) given instead of derived from ``step`` (a time-budgeted job's
    schedule follows its clock; the warm-up still counts this client's steps)."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return spec.lr
    if fraction is not None:
        progress = min(1.0, max(0.0, fraction))
    elif horizon:
        progress = min(1.0, (step - spec.warmup_steps) / max(1, horizon - spec.warmup_steps))
    else:
        return spec.lr
    floor = spec.final_lr_fraction
    return spec.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def task_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits (B, K) against (B,), or (B, T, V) against (B, T), over
    the targets that are not :data:`fedq.data.datasets.IGNORE` (a batch has one at
    least: a window without one is never made)."""
    return nn.functional.cross_entropy(output.flatten(0, -2), target.flatten(),
                                       ignore_index=IGNORE)


def device_amp(device: torch.device) -> str:
    """The mixed-precision mode for ``device`` (see fedq.worker.hardware.amp_mode), or
    off where FEDQ_AMP says so."""
    if device.type != "cuda":
        return "off"
    return amp_mode(torch.cuda.get_device_capability(device), get_settings().amp)


_AMP: dict[tuple[object, ...], str] = {}  # what was measured -> the faster mode (8 kept)
AMP_PROBE_RUNS = 5  # timed runs of a probe per mode, after one to warm it; the fastest counts


def measured_amp(amp: str, key: tuple[object, ...],
                 make_probe: Callable[[], Callable[[], object]], device: torch.device) -> str:
    """``amp`` (the GPU class's mode, ``device_amp``) or ``off`` (float32), whichever ran
    the probe (a first batch's pass, built by ``make_probe``) faster here: it runs once
    in each to warm up, then :data:`AMP_PROBE_RUNS` times, and the fastest run counts.
    Measured once per ``key`` in a worker process and logged; the probe is built only
    then. Small models lose under AMP, large ones gain (docs/inference.md measured
    both). Nothing is
    measured (nor built) where the class has no mode or FEDQ_AMP=off."""
    if amp == "off":
        return "off"
    if key not in _AMP:
        probe = make_probe()
        best: dict[str, float] = {}
        for mode in (amp, "off"):
            with amp_autocast(mode, device):
                probe()
                runs = []
                for _ in range(AMP_PROBE_RUNS):
                    _sync(device)
                    t0 = time.perf_counter()
                    probe()
                    _sync(device)
                    runs.append(time.perf_counter() - t0)
            best[mode] = min(runs)
        while len(_AMP) >= 8:
            del _AMP[next(iter(_AMP))]
        _AMP[key] = amp if best[amp] < best["off"] else "off"
        log.info("AMP %s on %s: %s %.2f ms, float32 %.2f ms a batch; %s chosen", key[0],
                 device, amp, best[amp] * 1e3, best["off"] * 1e3,
                 "float32" if _AMP[key] == "off" else amp)
    return _AMP[key]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_probe(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                 device: torch.device) -> Callable[[], None]:
    """One training step's forward and backward pass on the first batch, for
    ``measured_amp``: in eval mode (no dropout draws, no batch-norm statistics moved:
    the caller's) and the gradients dropped, so the training that follows is as if it
    had not run."""
    xb, yb = x[:batch_size].to(device), y[:batch_size].to(device)

    def probe() -> None:
        task_loss(model(xb), yb).backward()
        model.zero_grad(set_to_none=True)
    return probe


def amp_autocast(amp: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Run ``device``'s ops in mixed precision ``amp`` (bf16 | fp16), or as they are."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def _measured(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
              device: torch.device, amp: str) -> str:
    """``amp`` or ``off``, whichever trains ``model`` faster on ``device``
    (:func:`measured_amp`, on the first batch's forward and backward pass)."""
    model.eval()
    key = ("train", type(model).__name__, str(device), (min(len(y), batch_size), *x.shape[1:]),
           tuple(tuple(p.shape) for p in model.parameters()))
    amp = measured_amp(amp, key, lambda: _train_probe(model, x, y, batch_size, device), device)
    model.train()
    return amp


def local_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                optimizer: OptimizerSpec, batch_size: int, epochs: int | None,
                steps: int | None, seed: int, device: torch.device,
                time_budget: float | None = None, prox_mu: float = 0.0,
                first_step: int = 0,
                schedule_steps: int | None = None,
                schedule_window: tuple[float, float] | None = None,
                state_path: Path | None = None,
                should_stop: Callable[[], str | None] | None = None,
                resume: Kept | None = None, shard: tuple[int, int] | None = None,
                amp: str | None = None, save_state: bool = True) -> LocalStats:
    """Train ``model`` in place on (x, y) for ``epochs`` passes or exactly ``steps`` steps,
    stopping early once ``time_budget`` seconds have passed (after at least one step).

    x: (N, C, H, W) float32 and y: (N,) int64, or x and y: (N, T) int64 token ids, on
    the CPU; batches move to ``device``. ``first_step``: the client's inner steps before
    this round (the lr schedule's position; over ``schedule_steps``). ``state_path``:
    where the optimizer state is kept between rounds (fedq/worker/inner.py); when that
    file exists, its step count replaces ``first_step``. ``schedule_window`` (a, b): the
    cosine runs from a to b (fractions of the whole schedule) over this round, as the
    round's time passes (its time budget) or its steps do, whichever ends it first, so
    a slow worker is at the same point of the schedule as a fast one at the same moment.
    ``should_stop``: asked before each step; a reason (the owner's machine is needed:
    fedq/worker/owner.py) stops training there, reported as ``yielded``, with where it
    stopped (``kept``, on the CPU); ``resume``: that, to go on from there (``model``
    holds the task's starting weights, the FedProx anchor; the kept ones replace them).
    ``shard`` (rank, world): this process is rank ``rank`` of ``world`` training one
    model data-parallel (``model`` wrapped in DistributedDataParallel: fedq/worker/
    ranks.py): every rank draws the same batches and trains on its slice of each
    (``rank::world``), its loss scaled by its slice's share so that the averaged
    gradient is the whole batch's; ``seen`` counts the whole batches. ``amp``: the
    mixed precision to use, not measured (ranks must agree). ``save_state``: whether
    the optimizer state is written back to ``state_path`` (one rank does).
    Deterministic for a given seed, device and thread count (without a time budget).
    """
    n = len(y)
    if n == 0:
        raise ValueError("client shard is empty")
    gen = torch.Generator().manual_seed(seed)
    batches_per_epoch = math.ceil(n / batch_size)
    total_steps = steps if steps is not None else (epochs or 1) * batches_per_epoch
    model.to(device).train()
    opt = make_optimizer(list(model.parameters()), optimizer)
    if state_path is not None:
        first_step = inner.load(opt, state_path) or first_step
    if amp is None:
        amp = device_amp(device)
        if amp != "off":  # the class's mode or float32, whichever trains it faster here
            amp = _measured(model, x, y, batch_size, device, amp)
    rank, world = shard or (0, 1)
    if world > 1 and batch_size < world:
        raise ValueError(f"batch_size {batch_size} is less than the worker's {world} "
                         "devices: each needs a slice of every batch")
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    autocast = amp_autocast(amp, device)
    anchor = ([p.detach().clone() for p in model.parameters()] if prox_mu > 0 else [])
    sampler = _UtilSampler(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    loss_sum, seen, step, by_budget = 0.0, 0, 0, False
    order, first = None, 0
    if resume is not None:  # go on where the yield stopped it
        model.load_state_dict(resume.model)
        opt.load_state_dict(resume.optimizer)  # (moves its state to the params' device)
        gen.set_state(resume.generator)
        order, first, first_step = resume.order, resume.start, resume.first_step
        step, seen, loss_sum = resume.step, resume.seen, resume.loss_sum
        started -= resume.seconds
    yielded: str | None = None
    start = 0
    while step < total_steps and not by_budget and yielded is None:
        if order is None or first >= n:
            order, first = torch.randperm(n, generator=gen), 0
        for start in range(first, n, batch_size):
            if step >= total_steps:
                break
            if time_budget is not None and step > 0 and \
                    time.perf_counter() - started >= time_budget:
                by_budget = True
                break
            if should_stop is not None and (yielded := should_stop()) is not None:
                break
            step_start = time.perf_counter()
            idx = order[start:start + batch_size]
            mine = idx[rank::world] if world > 1 and len(idx) >= world else idx
            xb, yb = x[mine].to(device), y[mine].to(device)  # (B, C, H, W), (B,)
            opt.zero_grad(set_to_none=True)
            fraction = None
            if schedule_window is not None:
                done = step / total_steps
                if time_budget is not None:
                    done = max(done, (step_start - started) / time_budget)
                fraction = schedule_window[0] + (schedule_window[1] - schedule_window[0]) \
                    * min(1.0, done)
            for group in opt.param_groups:
                group["lr"] = lr_at(first_step + step, optimizer, schedule_steps, fraction)
            with autocast:
                loss = task_loss(model(xb), yb)
                if mine is not idx:  # this rank's share: the ranks' mean is the batch's
                    loss = loss * (len(mine) * world / len(idx))
            if anchor:  # FedProx: (mu / 2) * ||w - w_global||^2
                loss = loss + prox_mu / 2 * sum(
                    ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
            if scaler is not None:
                scaler.scale(loss).backward()
                if optimizer.grad_clip:
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(model.parameters(), optimizer.grad_clip)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                if optimizer.grad_clip:
                    nn.utils.clip_grad_norm_(model.parameters(), optimizer.grad_clip)
                opt.step()
            loss_sum += float(loss.detach())
            seen += len(idx)
            step += 1
            # tests and benchmarks only (fedq/testing/faults.py)
            faults.slow_down(step_start, should_stop)
        else:
            first = n  # the epoch ran out: the next one draws a new order
            continue
        first = start  # stopped inside the epoch (a yield, the budget or the last step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    kept = None
    if yielded is not None and order is not None:
        kept = Kept(model={k: v.detach().to("cpu", copy=True)
                           for k, v in model.state_dict().items()},
                    optimizer=_to_cpu(opt.state_dict()),  # type: ignore[arg-type]
                    generator=gen.get_state(), order=order, start=first, step=step,
                    seen=seen, loss_sum=loss_sum, seconds=seconds, first_step=first_step)
    if state_path is not None and save_state:
        inner.save(opt, state_path, first_step + step)
    return LocalStats(inner_step=first_step + step, samples=n, steps=step, seen=seen,
                      planned_steps=total_steps, yielded=yielded, kept=kept,
                      resumed_steps=resume.step if resume is not None else 0,
                      loss=loss_sum / max(step, 1),
                      seconds=seconds, stopped_by_budget=by_budget, amp=amp, device=str(device),
                      gpu_peak_mb=torch.cuda.max_memory_allocated(device) / 2**20
                      if device.type == "cuda" else None,
                      gpu_util=sampler.stop() if sampler else None)


class _UtilSampler(threading.Thread):
    """Samples the GPU's utilisation (NVML, through torch) every 0.2 s while training."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(daemon=True, name="fedq-gpu-util")
        self.device, self.samples = device, list[float]()
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.2):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)))
            except Exception:  # no NVML on this machine: report nothing
                return

    def stop(self) -> float | None:
        self.done.set()
        self.join(1.0)
        return sum(self.samples) / len(self.samples) if self.samples else None
