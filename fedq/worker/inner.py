"""A client's inner optimizer state, kept on the worker from round to round.

DiLoCo (Douillard et al. 2023, arXiv:2311.08105) keeps each replica's inner AdamW
state (its moments and step count) across outer steps; only the model is synchronised.
With ``optimizer.keep_state`` fedq does the same per client: after training, the
optimizer's state and the client's inner step count are written to
``FEDQ_HOME/inner/JOB/cCLIENT.safetensors`` on the worker that trained it (safetensors,
written to a temporary name and renamed, so a crash leaves the old file or the new
one, never half of one); the next round that trains the client on that machine reads
it back. A restarted worker process finds the file where it left it. A client trained
on another machine starts there with fresh state (the file is not moved: it is as
large as two models), which the step count in the round's TrainRef makes up for only
in the lr schedule. The coordinator never sees this state.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fedq.protocol.envelope import FormatError, check_job_id
from fedq.weights import dumps, loads_with_meta


def check_client(job: str, client: int) -> None:
    """A job id of fedq's own shape and a client number, before either names a file."""
    check_job_id(job)
    if not isinstance(client, int) or not 0 <= client < 10**9:
        raise FormatError(f"client {client!r} is not a client number")


def client_folder(home: Path, job: str, client: int) -> Path:
    """This worker's folder for one job's client state: under ``home`` only (the job id
    is checked against fedq's own id shape before the path is built)."""
    check_client(job, client)
    folder = home / "inner" / job
    if not folder.resolve().is_relative_to(home.resolve()):
        raise FormatError(f"job {job!r} names a folder outside {home}")
    return folder


def state_path(home: Path, job: str, client: int) -> Path:
    return client_folder(home, job, client) / f"c{client:06d}.safetensors"


def save(opt: torch.optim.Optimizer, path: Path, step: int) -> None:
    """Write ``opt``'s per-parameter state and the client's inner ``step`` count."""
    tensors = {f"{i}.{k}": v for i, st in opt.state_dict()["state"].items()
               for k, v in st.items() if isinstance(v, torch.Tensor)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(dumps(tensors, {"step": str(step)}))
    os.replace(tmp, path)


def load(opt: torch.optim.Optimizer, path: Path) -> int:
    """Restore ``opt``'s state from ``path``; returns the inner step count (0 when there
    is no file or it does not fit these parameters: the state starts fresh)."""
    if not path.exists():
        return 0
    tensors, meta = loads_with_meta(path.read_bytes(), what=str(path))
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value.clone()
    for i, st in state.items():
        if i >= len(params) or any(v.ndim and v.shape != params[i].shape for v in st.values()):
            return 0
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    return int(meta.get("step", "0"))
