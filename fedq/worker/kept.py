"""A yielded task's training on the worker's disk (``FEDQ_LEAVE_ON_DISK=1``).

Leave in memory (fedq/worker/loop.py ``Kept``) lets a task that stepped aside for the
machine's owner go on from where it stopped when it comes back, in the same worker
process. BOINC also checkpoints such a task to disk, so that it survives the machine's
restart; this is that for fedq: the ``Kept`` record is written to
``FEDQ_HOME/kept/JOB-cCLIENT-SHA12.safetensors`` (the model, the optimizer's tensors,
the batch order and the generator as tensors; the optimizer's other values and the
loop's counters as JSON in the file's metadata; no pickle), to a temporary name and
renamed, so a crash leaves the old file or the new one. A restarted worker that is sent
the same task (job, client and global model) reads it back and goes on; a file that
does not fit the model or cannot be read is dropped, and the task starts over. The
folder keeps the last :data:`KEEP_FILES` files. The file is the worker's own: it is
never sent anywhere.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, cast

import torch

import fedq.digest as digests
from fedq.errors import FedqError
from fedq.weights import dumps, loads_with_meta
from fedq.worker.inner import check_client
from fedq.worker.loop import Kept

log = logging.getLogger(__name__)

#: Kept files a worker's folder holds at most (the oldest go first).
KEEP_FILES = 2
_COUNTERS = ("start", "step", "seen", "loss_sum", "seconds", "first_step")


def path_for(home: Path, key: tuple[str, int, str]) -> Path:
    """The file of one task (job, client, global model digest), under ``home`` only."""
    job, client, sha = key
    check_client(job, client)
    if not digests.is_digest(sha):
        raise FedqError(f"{sha!r} is not a blob digest")
    return home / "kept" / f"{job}-c{client:06d}-{digests.short(sha)}.safetensors"


def save(home: Path, key: tuple[str, int, str], kept: Kept) -> Path:
    """Write ``kept`` as this task's file."""
    tensors: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in kept.model.items()}
    values: dict[str, dict[str, Any]] = {}
    states = cast(dict[int, dict[str, Any]], kept.optimizer["state"])
    for index, state in states.items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value
            else:
                values.setdefault(str(index), {})[name] = value
    tensors["generator"], tensors["order"] = kept.generator, kept.order
    meta = {"counters": json.dumps({k: getattr(kept, k) for k in _COUNTERS}),
            "optimizer": json.dumps({"values": values,
                                     "param_groups": kept.optimizer["param_groups"]}),
            "key": json.dumps(list(key))}
    path = path_for(home, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(dumps({k: v.contiguous() for k, v in tensors.items()}, meta))
    os.replace(tmp, path)
    older = sorted(path.parent.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    for stale in older[:-KEEP_FILES]:
        stale.unlink(missing_ok=True)
    return path


def load(home: Path, key: tuple[str, int, str]) -> Kept | None:
    """The ``Kept`` record of this task from its file, or None (no file, or one that
    cannot be read: it is dropped, and the task starts over). The file is removed
    either way: the task goes on from it once."""
    path = path_for(home, key)
    if not path.exists():
        return None
    try:
        views, meta = loads_with_meta(path.read_bytes(), what=str(path))
        tensors = {k: v.clone() for k, v in views.items()}  # owning their memory
        if json.loads(meta["key"]) != list(key):
            raise FedqError("written for another task")
        counters = json.loads(meta["counters"])
        optimizer = json.loads(meta["optimizer"])
        state: dict[int, dict[str, Any]] = {
            int(i): dict(v) for i, v in optimizer["values"].items()}
        model = {}
        for name, value in tensors.items():
            part, _, rest = name.partition(".")
            if part == "model":
                model[rest] = value
            elif part == "optimizer":
                index, _, field = rest.partition(".")
                state.setdefault(int(index), {})[field] = value
        kept = Kept(model=model, optimizer={"state": state,
                                            "param_groups": optimizer["param_groups"]},
                    generator=tensors["generator"], order=tensors["order"],
                    **{k: counters[k] for k in _COUNTERS})
    except (FedqError, KeyError, ValueError, TypeError) as exc:
        log.warning("fedq: the kept training in %s cannot be read (%s): starting over",
                    path, exc)
        kept = None
    path.unlink(missing_ok=True)
    return kept


def drop(home: Path, key: tuple[str, int, str]) -> None:
    """Remove this task's file, if any (it finished, or went on from memory)."""
    path_for(home, key).unlink(missing_ok=True)
