"""A client's own copy of the model, kept on the worker between rounds (Streaming DiLoCo).

With ``streaming: {fragments: F}`` (fedq/aggregate/streaming.py) each round
synchronises one fragment; between synchronisations a client's replica keeps training
its own values of the other fragments. After training, the worker writes the client's
whole local model to ``FEDQ_HOME/inner/JOB/cCLIENT.model.safetensors`` with the round it
was trained in (safetensors, written to a temporary name and renamed: a crash leaves the
old file or the new one, never half of one). The next round that trains the client on
this machine starts from that file, with every fragment synchronised since then taken
from the global model (with ``mixing: alpha``, a synchronised fragment becomes
alpha x the replica's value + (1 - alpha) x the global one, the paper's merge; torchft
rejects alpha != 0). The replica starts again from the global model (as a new
replica would) when there is no file, when it is F or more rounds old (every fragment
has been synchronised since), or when it is from this round or a later one (a retried
or resumed round: training on from it would count those steps twice). The coordinator
never sees the file; a client trained on another machine starts from the global model
there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from fedq.aggregate.streaming import fragments, synced_between
from fedq.aggregate.types import Weights
from fedq.errors import BlobError, UpdateRejected
from fedq.weights import dumps, loads_with_meta
from fedq.worker.inner import client_folder


def replica_path(home: Path, job: str, client: int) -> Path:
    return client_folder(home, job, client) / f"c{client:06d}.model.safetensors"


def start_from(global_weights: Mapping[str, torch.Tensor], path: Path, number: int,
               count: int, mixing: float = 0.0) -> tuple[Weights, int]:
    """The weights round ``number`` trains from, and how many fragments came from the
    kept replica (0: all from the global model); fragments synchronised since the
    replica was saved are ``mixing`` x its value + (1 - mixing) x the global one."""
    fresh = dict(global_weights)
    if not path.exists():
        return fresh, 0
    try:
        kept, meta = loads_with_meta(path.read_bytes(), what=str(path))
        saved = int(meta.get("round", "0"))
    except (BlobError, UpdateRejected, ValueError):
        return fresh, 0  # unreadable: a fresh replica
    if not 0 < saved < number or number - saved >= count or set(kept) != set(fresh) or \
            any(kept[k].shape != v.shape or kept[k].dtype != v.dtype
                for k, v in fresh.items()):
        return fresh, 0
    parts = fragments(global_weights, count)
    synced = synced_between(saved, number - 1, count)
    local = {name for i, part in enumerate(parts) if i not in synced for name in part}
    return {k: kept[k] if k in local else _mix(kept[k], v, mixing)
            for k, v in fresh.items()}, count - len(synced)


def _mix(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    if alpha == 0 or not global_.dtype.is_floating_point:
        return global_
    return torch.lerp(global_, local, alpha)  # alpha x local + (1 - alpha) x global


def save(weights: Mapping[str, torch.Tensor], path: Path, number: int) -> None:
    """Write the client's local model after round ``number``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(dumps({k: v.detach().cpu() for k, v in weights.items()},
                          {"round": str(number)}))
    os.replace(tmp, path)
