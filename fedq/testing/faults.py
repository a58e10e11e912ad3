"""Slowness and misbehaviour that fedq's tests and benchmarks inject into the processes
they start: the one seam through which production code acts otherwise than it would for
a user.

Each fault is an environment variable that only the tests and benchmarks set
(``FEDQ_TEST_*``: settings pass over them, fedq/settings.py); a job's spec cannot reach
any of them. Unset, each hook below answers "nothing installed" at once and the code
around it runs as it always does.

- ``FEDQ_TEST_SLOWDOWN=F`` (F >= 1): a slower machine, emulated. After each training
  step, inference shard or served batch the worker sleeps F - 1 times that work's wall
  time, so the work takes F times as long.
- ``FEDQ_TEST_ZERO_COMPUTE=REGEX``: a training task of a job whose name matches REGEX
  (``re.search``) loads no data and trains nothing; it sends a small fixed change of
  every floating weight that differs per client (the round machinery alone, for the
  benchmarks). :func:`fedq.testing.cluster.base_env` sets it to
  :data:`ZERO_COMPUTE_JOBS`.
- ``FEDQ_TEST_BYZANTINE=REGEX:CLIENTS:SCALE``: in jobs whose name matches REGEX, the
  clients listed in CLIENTS (comma-separated indices) send their honest update times
  SCALE (robust-aggregation experiments, docs/strategies.md).
- ``FEDQ_TEST_HOLD``: a task held at a named point until the test lets it go
  (:mod:`fedq.testing.hold`).

A malformed value raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from fedq.weights import LazyWeights

SLOWDOWN = "FEDQ_TEST_SLOWDOWN"
ZERO_COMPUTE = "FEDQ_TEST_ZERO_COMPUTE"
BYZANTINE = "FEDQ_TEST_BYZANTINE"
#: The jobs the test and benchmark deployments run with zero compute, by name.
ZERO_COMPUTE_JOBS = "^zero-compute-"



def slowdown() -> float:
    """This process's ``FEDQ_TEST_SLOWDOWN`` (1.0: full speed)."""
    return _slowdown(os.environ.get(SLOWDOWN, ""))


#: How often a slowed step's sleep asks whether its task should stop.
STOP_CHECK_S = 0.1


def slow_down(began: float, stop: Callable[[], object] | None = None) -> None:
    """Sleep ``slowdown() - 1`` times the wall time since ``began`` (``perf_counter``);
    at full speed return at once. With ``stop``, the sleep ends as soon as ``stop()``
    says something (a revocation, the owner back), asked every :data:`STOP_CHECK_S`: a
    process paused (SIGSTOP) inside a step counts the pause in its wall time, and would
    otherwise sleep that long again once resumed before it looked."""
    factor = slowdown()
    if factor <= 1:
        return
    until = time.perf_counter() + (factor - 1) * (time.perf_counter() - began)
    while (left := until - time.perf_counter()) > 0:
        if stop is not None and stop() is not None:
            return
        time.sleep(min(left, STOP_CHECK_S))


def zero_compute(job_name: str) -> bool:
    """Whether this process's training tasks of job ``job_name`` skip the training."""
    pattern = os.environ.get(ZERO_COMPUTE, "")
    return bool(pattern) and re.search(pattern, job_name) is not None


def byzantine_scale(job_name: str, client: int) -> float | None:
    """What client ``client`` of job ``job_name`` multiplies its honest update by, or None
    (an honest client)."""
    pattern, clients, scale = _byzantine(os.environ.get(BYZANTINE, ""))
    if pattern is None or client not in clients or re.search(pattern, job_name) is None:
        return None
    return scale


def zero_delta(shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
               client: int) -> LazyWeights:
    """A zero-compute client's update of weights of ``shapes`` (name, shape, dtype): every
    floating weight moves by 1e-4 times (1 + client mod 7), so that averaging is real
    work. Each tensor is made when it is asked for (as the upload reaches it) and not
    kept, so the update is never whole in memory; filling it is the only compute."""
    import torch

    from fedq.weights import LazyWeights

    step = 1e-4 * (1 + client % 7)
    # (shape, dtype, value): integer buffers move by 0, in float32 as a trained delta's
    made = {k: (shape, dtype, step) if dtype.is_floating_point
            else (shape, torch.float32, 0.0) for k, shape, dtype in shapes}

    def make(name: str) -> torch.Tensor:
        shape, dtype, value = made[name]
        return torch.full(shape, value, dtype=dtype)

    return LazyWeights({k: torch.empty(shape, dtype=dtype, device="meta")
                        for k, (shape, dtype, _) in made.items()}, make)


@lru_cache(maxsize=4)
def _slowdown(raw: str) -> float:
    if not raw:
        return 1.0
    try:
        factor = float(raw)
    except ValueError:
        factor = 0.0
    if not factor >= 1:
        raise ValueError(f"{SLOWDOWN}={raw!r}: want a number >= 1")
    return factor


@lru_cache(maxsize=4)
def _byzantine(raw: str) -> tuple[str | None, frozenset[int], float]:
    if not raw:
        return None, frozenset(), 1.0
    try:
        pattern, clients, scale = raw.rsplit(":", 2)
        re.compile(pattern)
        return pattern, frozenset(int(c) for c in clients.split(",")), float(scale)
    except (ValueError, re.error):
        raise ValueError(f"{BYZANTINE}={raw!r}: want REGEX:CLIENTS:SCALE, "
                         "such as ^attack-:0,1:-10") from None


def byzantine_env(pattern: str, clients: list[int], scale: float) -> dict[str, str]:
    """The environment that makes ``clients`` of the jobs matching ``pattern`` send their
    update times ``scale``."""
    return {BYZANTINE: f"{pattern}:{','.join(map(str, clients))}:{scale:g}"}
