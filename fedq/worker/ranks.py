"""One training task over several devices of one machine (``FEDQ_DEVICES``): an island
of 4 or 8 GPUs trains a client as one worker.

The task's own process is rank 0; it starts one helper process a further device
(``python -m fedq.worker.ranks``, its orders on stdin as JSON), and the ranks train the
same model data-parallel: PyTorch's DistributedDataParallel over a process group
(NCCL between GPUs, gloo on the CPU), every rank drawing the same batches and training
on its slice of each (fedq/worker/loop.py, ``shard``), so that the gradient averaged
across ranks is the whole batch's and the update the one a single process would send.
Rank 0 sends it, counted for the samples every rank saw.

A rank that dies fails the task at once: its peers' next collective raises (its
connection closed), rank 0's task reports the error and the task is sent again like
any lost task; helpers whose rank 0 dies stop the same way. Every collective has
:data:`TIMEOUT_S` to complete.

What one process does that ranks do not (yet): a time budget (``time_budget_s``: the
ranks would stop at different steps), measuring the mixed precision (each uses its GPU
class's), and keeping a yielded task to resume (a yield stops every rank and the task
starts again from the round's model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedq.worker.loop import LocalStats, device_amp, local_train

#: Seconds a collective (and the group's forming) may take before it fails.
TIMEOUT_S = 120.0
#: Seconds rank 0 waits for a helper to exit once training is over.
EXIT_WAIT_S = 30.0


def devices(setting: str | None, cuda_count: int | None = None) -> list[torch.device]:
    """The devices ``FEDQ_DEVICES`` names on this machine: unset or ``1``, one (fedq's
    usual device); ``all``, every GPU (one device without any); ``N``, the first N GPUs
    (N processes on the CPU without a GPU); ``0,2,3``, those GPUs. ValueError with one
    line for a GPU this machine does not have, or anything else."""
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    text = (setting or "").strip().lower()
    if text in ("", "1"):
        return [torch.device("cuda", 0) if count else torch.device("cpu")]
    if text == "all":
        return [torch.device("cuda", i) for i in range(count)] or [torch.device("cpu")]
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise ValueError("FEDQ_DEVICES: at least 1")
        if not count:
            return [torch.device("cpu")] * n
        if n > count:
            raise ValueError(f"FEDQ_DEVICES={n}: this machine has {count} GPU(s)")
        return [torch.device("cuda", i) for i in range(n)]
    try:
        chosen = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"FEDQ_DEVICES={setting!r}: all, a count, or GPU indices such as "
                         "0,1,2,3") from None
    wrong = [i for i in chosen if not 0 <= i < count]
    if wrong or len(set(chosen)) != len(chosen):
        raise ValueError(f"FEDQ_DEVICES={setting!r}: GPU {wrong[0] if wrong else chosen[0]} "
                         f"is not one of this machine's {count} (or is named twice)")
    return [torch.device("cuda", i) for i in chosen]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train_rank(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int,
               device: torch.device, init: str, optimizer: Any, kwargs: dict[str, Any],
               should_stop: Callable[[], str | None] | None = None) -> LocalStats:
    """Rank ``rank`` of ``world``: join the process group at ``init``, train ``model``
    (on ``device``) wrapped for data parallelism, with ``optimizer`` and ``local_train``'s
    other arguments ``kwargs`` (as JSON: :func:`train`), on this rank's slice of each
    batch, and leave the group. The trained weights are ``model``'s (the same on every
    rank)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from fedq.testing import hold

    args = {k: v for k, v in kwargs.items() if k != "task"}
    if args.get("state_path"):
        args["state_path"] = Path(args["state_path"])
    if args.get("schedule_window"):
        args["schedule_window"] = tuple(args["schedule_window"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    try:
        model.to(device)
        wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        # fault tests only (FEDQ_TEST_HOLD): a rank held with the group formed
        hold.at("rank", f"{kwargs.get('task', '')}-rank{rank}", f"pid {os.getpid()}")
        stats = local_train(wrapped, x, y, optimizer=optimizer, device=device,
                            shard=(rank, world), amp=device_amp(device),
                            save_state=rank == 0, should_stop=should_stop, **args)
        if stats.yielded is None:  # the batches' mean loss: the mean of the ranks' shares
            loss = torch.tensor([stats.loss], dtype=torch.float64,
                                device=device if backend == "nccl" else "cpu")
            dist.all_reduce(loss)
            stats = dataclasses.replace(stats, loss=float(loss[0]) / world)
        return stats
    finally:
        dist.destroy_process_group()


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, where: list[torch.device],
          orders: dict[str, Any], optimizer: Any, kwargs: dict[str, Any],
          should_stop: Callable[[], str | None] | None = None) -> LocalStats:
    """Rank 0's side: start a helper for each device of ``where`` after the first,
    handing it ``orders`` (what it needs to build the same model and data: the job's
    spec, the client, its seed), ``kwargs`` and the model's starting weights, train
    with them (:func:`train_rank`), and wait for them. RuntimeError with one line when
    a rank failed (a helper's exit and last line, else rank 0's own error)."""
    from fedq.weights import dumps, state_of

    world = len(where)
    init = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="fedq-ranks-") as tmp:
        start = Path(tmp) / "start.safetensors"
        start.write_bytes(dumps(state_of(model)))
        helpers = []
        for rank in range(1, world):
            log = open(Path(tmp) / f"rank{rank}.log", "wb")
            proc = subprocess.Popen([sys.executable, "-m", "fedq.worker.ranks"],
                                    stdin=subprocess.PIPE, stdout=log, stderr=log)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({**orders, "rank": rank, "world": world,
                                         "device": str(where[rank]), "init": init,
                                         "weights": str(start), "kwargs": kwargs}).encode())
            proc.stdin.close()
            helpers.append((proc, log))
        trained = False
        try:
            stats = train_rank(model, x, y, 0, world, where[0], init, optimizer, kwargs,
                               should_stop)
            trained = True
        except (RuntimeError, ValueError) as exc:
            _wait(helpers, 5)
            raise RuntimeError(_failed(helpers, tmp) or
                               f"rank 0: {str(exc).strip().splitlines()[0][:300]}") from None
        finally:
            _wait(helpers, EXIT_WAIT_S if trained else 5)
        if stats.yielded is None and (problem := _failed(helpers, tmp)):
            raise RuntimeError(problem)
        return dataclasses.replace(stats, kept=None)  # a yield starts again from the round


def _wait(helpers: list[tuple[subprocess.Popen[bytes], Any]], seconds: float) -> None:
    """Each helper's exit, within ``seconds`` (then it is killed)."""
    for proc, log in helpers:
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _failed(helpers: list[tuple[subprocess.Popen[bytes], Any]], tmp: str) -> str | None:
    """The first helper that exited with an error, and its last line."""
    for rank, (proc, _) in enumerate(helpers, 1):
        code = proc.poll()
        if code not in (None, 0):
            assert code is not None
            lines = (Path(tmp) / f"rank{rank}.log").read_text(errors="replace").strip() \
                .splitlines()
            last = lines[-1][:300] if lines else "no output"
            how = f"killed by signal {-code}" if code < 0 else f"exited {code}"
            return f"rank {rank} of {len(helpers) + 1} {how}: {last}"
    return None


def main() -> None:
    """A helper rank: its orders from stdin (:func:`train`), the same model and client
    data rank 0 has, trained as its rank; exits non-zero on any error."""
    orders = json.loads(sys.stdin.read())
    from fedq.data import client_indices, load_dataset
    from fedq.models import build_model
    from fedq.settings import get_settings
    from fedq.spec import JobSpec
    from fedq.weights import loads

    threads = get_settings().torch_threads
    if threads:
        torch.set_num_threads(threads)
    spec = JobSpec.stored(orders["spec"])
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    idx = torch.from_numpy(client_indices(ds.partition_labels(), spec.partition,
                                          spec.num_clients, orders["client"], spec.seed))
    torch.manual_seed(orders["seed"])
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    model.load_state_dict(loads(Path(orders["weights"]).read_bytes()))
    train_rank(model, ds.x_train[idx], ds.y_train[idx], orders["rank"], orders["world"],
               torch.device(orders["device"]), orders["init"], spec.optimizer,
               orders["kwargs"])


if __name__ == "__main__":
    main()
