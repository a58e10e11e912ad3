"""Inference jobs as the coordinator runs them: submit, dispatch by throughput, absorb
each shard's answer once, repair, cancel, resume, and the merged outputs.

Who does how much: each queue of the job keeps shards out (``in_flight``; unset, two
for each worker consuming the queue: :func:`queue_limits`); when one comes back, the
next queued shard goes to the same queue. A queue whose workers are faster returns
sooner and so takes more shards (with ``worker_prefetch_multiplier`` 1, a worker holds
one shard at a time, and the next waits in the broker for whichever is free first).
The job's end does not wait on a slow machine: once no shard waits, a free slot runs a
backup copy of the shard out longest (:func:`_backups`), or, with ``backups: false``,
the last shards are smaller (:func:`plan_shards`).

Exactly once: a shard's row moves to ``done`` once, under the job's row lock; a
re-sent shard's second answer (or a straggler's) is dropped. A shard's output is
written under a key per attempt, so a straggler cannot overwrite the blob the
done row points at. Every answer is checked before it counts (its format, its blob's
digest and size bound, each line: :func:`fedq.protocol.inference.check_output`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session

import fedq.identity as identity
from fedq.blobs import BlobRef, store_for
from fedq.blobs.keys import job_prefix
from fedq.db import Job, session_scope
from fedq.db.models import InferenceJob, InferenceShard, Worker, aware, utcnow, worker_time
from fedq.db.session import ensure_schema, lock_row
from fedq.engine.app import app, broker_errors, refusal, sending
from fedq.engine.backend import task_metas, unread_reason
from fedq.engine.broker import check_broker, registered_slots
from fedq.engine.names import ABSORB_SHARD_TASK, CONTROL_QUEUE, INFER_TASK
from fedq.engine.revoke import revoke_quietly
from fedq.errors import BlobError, FedqError, JobNotFound, SpecError, require_extra
from fedq.inference.spec import InferenceSpec, Inputs, ModelSource
from fedq.process import PROCESS
from fedq.protocol.envelope import MESSAGE_FORMAT, FormatError
from fedq.protocol.inference import (
    check_output,
    inputs_key,
    line_bytes,
    model_key,
    output_key,
    parse_result,
)
from fedq.redaction import redact_text
from fedq.settings import Settings, get_settings
from fedq.status import JobStatus, ShardStatus

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = (
    ShardStatus.QUEUED, ShardStatus.RUNNING, ShardStatus.DONE, ShardStatus.FAILED,
    ShardStatus.CANCELLED)
#: Yields to an owner a shard may take before they count as failures.
MAX_YIELDS = 100


def plan_shards(items: int, size: int, tail: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each shard: ``size`` items each, then the last ``tail``
    shards' worth of items cut into ``tail`` shards of half the size, ``tail`` of a
    quarter, ... down to one item (about ``tail * log2(size)`` short shards), so the
    job's last shards are short and the tail does not wait on one slow machine."""
    cuts: list[tuple[int, int]] = []
    body = max(0, items - tail * size)
    lo = 0
    while lo < body:
        cuts.append((lo, min(lo + size, body)))
        lo = cuts[-1][1]
    step = size
    while lo < items:  # ``tail`` shards of each size: size/2, size/4, ..., 1
        step = max(1, step // 2)
        for _ in range(tail):
            n = min(step, items - lo)
            if n > 0:
                cuts.append((lo, lo + n))
                lo += n
    return cuts


def task_id(job: str, shard: int, attempt: int) -> str:
    """A shard's Celery task id; with FEDQ_IDENTITY=required a tag only the coordinator
    can compute follows (as a training task's: fedq/coordinator/intake.py)."""
    base = f"fedq-{job}-i{shard}-a{attempt}"
    return base + identity.task_tag(base, sealing_keys())


def sealing_keys() -> Path | None:
    """The coordinator's keys folder when it seals its tasks (FEDQ_IDENTITY=required)."""
    settings = get_settings()
    return settings.keys_dir if settings.identity == "required" else None


def _lock(s: Session, job_id: str) -> InferenceJob | None:
    """Lock the job row for this transaction (fedq.db.session.lock_row)."""
    return lock_row(s, InferenceJob, job_id)


# -- submit -----------------------------------------------------------------------

def _read_prompts(path: Path, limit: int) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"inputs.prompts: cannot read {path}: {exc}") from None
    prompts: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if path.suffix == ".jsonl":
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise SpecError(f"{path}:{n}: not a JSON line") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise SpecError(f"{path}:{n}: expected an object with a \"prompt\" string")
            prompts.append(row["prompt"])
        elif line:
            prompts.append(line)
    if limit:
        prompts = prompts[:limit]
    if not prompts:
        raise SpecError(f"inputs.prompts: {path} holds no prompts")
    return prompts


def model_source(settings: Settings, src: ModelSource, base: Path,
                 fits: Inputs | None = None) -> tuple[dict[str, Any], BlobRef | None, bytes | None]:
    """The model's arch and its blob (from a training job) or bytes (from a file).
    ``latest``: the newest completed training job whose model ``fits`` the inputs (any,
    when None)."""
    if src.job is not None:
        with session_scope(settings.database_url) as s:
            job = s.get(Job, src.job) if src.job != "latest" else _latest(s, fits)
            if job is None and src.job == "latest":
                raise JobNotFound("model.job: latest: no completed training job "
                                  + ("" if fits is None else f"on {fits.dataset}"
                                     if fits.dataset else "of a language model") + " yet")
            if job is None:
                raise JobNotFound(f"model.job: no training job {src.job}")
            if job.status != JobStatus.COMPLETED:
                raise SpecError(f"model.job: job {src.job} is {job.status}, not completed: "
                                "its final model is not there yet")
            trained = job.spec
            arch = {"name": trained["model"], "dataset": trained["dataset"],
                    "args": trained.get("model_args") or {},
                    "dataset_args": _tokenizer_path(trained.get("dataset_args") or {},
                                                    trained.get("data_dir"))}
            return _here(settings, arch), BlobRef(job.global_key, job.global_sha256,
                                                  job.global_size), None
    if src.hf is not None:
        return _checkpoint(src.hf, base, src.dataset_args)
    path = Path(src.weights or "")
    path = path if path.is_absolute() else base / path
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecError(f"model.weights: cannot read {path}: {exc.strerror}") from None
    arch = {"name": src.name, "dataset": src.dataset, "args": src.args,
            "dataset_args": src.dataset_args}
    return arch, None, data


#: The window of score and embed for a checkpoint run as it is (``model.hf``) when its
#: ``dataset_args`` set no ``block_size``: its config's positions, at most this.
HF_BLOCK = 2048


def _checkpoint(folder: str, base: Path, dataset_args: dict[str, Any]
                ) -> tuple[dict[str, Any], None, bytes]:
    """The arch and weights of the Hugging Face checkpoint in ``folder`` run as it is:
    ``hf_causal_lm`` built from the folder (its digest pinned, so every worker runs the
    same one), its tokenizer the folder's, and its whole ``state_dict`` the weights.
    SpecError with one line for a folder that is not one."""
    from fedq.models.hf import hidden_size, pin, positions
    from fedq.weights import dumps, state_of

    path = Path(folder).expanduser()
    path = (path if path.is_absolute() else base / path).absolute()
    try:
        args = pin({"path": str(path)})
        hidden_size(args)  # config.json reads
        block = dataset_args.get("block_size") or min(positions(args), HF_BLOCK)
        arch = {"name": "hf_causal_lm", "dataset": "text_files", "args": args,
                "dataset_args": {**dataset_args, "tokenizer": str(path), "block_size": block}}
        from fedq.data import shape_of
        from fedq.models import build_model

        shape = shape_of("text_files", arch["dataset_args"])
        model = build_model("hf_causal_lm", shape.input_shape, shape.num_classes, **args)
    except (FedqError, ValueError, OSError) as exc:
        raise SpecError(f"model.hf: {exc}") from None
    return arch, None, dumps(state_of(model))


def _here(settings: Settings, arch: dict[str, Any]) -> dict[str, Any]:
    """``arch`` with paths that hold, on this machine, the checkpoint and tokenizer its
    training job stores beside it (fetched once into FEDQ_HOME: fedq/models/stored.py),
    for the checks made here; each worker finds its own."""
    from fedq.models.stored import beside

    if not beside(arch["args"], arch["dataset_args"]):
        return arch  # no store opened for a job that keeps nothing beside it
    from fedq.inference.run import localize

    return localize(arch, PROCESS.blobs(settings))


def _tokenizer_path(dataset_args: dict[str, Any], data_dir: str | None) -> dict[str, Any]:
    """A training job's ``dataset_args`` with a tokenizer folder named relative to its
    ``data_dir`` made absolute: an inference job reads no data folder of its own."""
    name = dataset_args.get("tokenizer")
    if not isinstance(name, str) or name == "bytes" or not data_dir or \
            Path(name).expanduser().is_absolute():
        return dataset_args
    return {**dataset_args, "tokenizer": str(Path(data_dir).expanduser() / name)}


def _latest(s: Session, fits: Inputs | None) -> Job | None:
    """The newest completed training job whose model fits ``fits``: one on its
    ``dataset``, or (prompts) a language model; any when None."""
    for job in s.scalars(select(Job).where(Job.status == JobStatus.COMPLETED)
                         .order_by(Job.created_at.desc())):
        dataset = job.spec.get("dataset")
        if fits is None or ((dataset == fits.dataset) if fits.dataset
                            else dataset == "shakespeare"):
            return job
    return None



def embedding_width(arch: dict[str, Any]) -> int:
    """The width of ``arch``'s embeddings (its ``n_embd``, given or the model's default):
    what every line of an embed job's output must hold (kept as the job's ``classes``)."""
    import inspect

    from fedq.models import MODELS

    if arch["name"] == "hf_causal_lm":  # a transformers model: its config's hidden_size
        from fedq.models.hf import hidden_size

        try:
            return hidden_size(arch.get("args") or {})
        except ValueError as exc:
            raise SpecError(f"model.args: {exc}") from None
    factory = MODELS.get(arch["name"])
    default = None if factory is None else \
        inspect.signature(factory).parameters.get("n_embd")
    if default is None:
        raise SpecError(f"op: embed needs a model with embeddings (gpt); {arch['name']} "
                        f"has none")
    width = (arch.get("args") or {}).get("n_embd", default.default)
    if not isinstance(width, int) or isinstance(width, bool) or not 0 < width <= 8192:
        raise SpecError(f"model.args.n_embd: {width!r} is not a width in 1..8192")
    return width


def submit(settings: Settings, spec: InferenceSpec, base: Path = Path(".")) -> str:
    """Check the spec against what it names, write the job and its shards, and send the
    first shards; the job id. Nothing is left behind when a check fails."""
    check_broker()
    store = store_for(settings)
    store.check()
    ensure_schema(settings.database_url)
    arch, blob, weights_bytes = model_source(settings, spec.model, base, spec.inputs)

    # Deferred: torch (the check that the model can be built and fits its weights).
    from fedq.data import load_dataset, shape_of
    from fedq.inference.run import load_model
    from fedq.weights import loads

    try:
        ds = shape_of(arch["dataset"], arch["dataset_args"])
    except FedqError as exc:
        raise SpecError(f"model.dataset: {exc}") from None
    if spec.op == "classify" and ds.is_text:
        raise SpecError(f"op: classify needs an image classifier; {arch['name']} on "
                        f"{arch['dataset']} is a language model (score, generate or embed)")
    if spec.op != "classify" and not ds.is_text:
        raise SpecError(f"op: {spec.op} needs a language model; {arch['name']} on "
                        f"{arch['dataset']} is a classifier (classify)")
    if spec.op == "embed":
        embedding_width(arch)  # a model that has one
    if weights_bytes is not None:
        import torch

        try:
            load_model(arch, loads(weights_bytes, what=str(spec.model.weights)),
                       torch.device("cpu"))
        except (FedqError, TypeError, ValueError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SpecError(f"model.weights: {spec.model.weights} is not a {arch['name']} for "
                            f"{arch['dataset']}: {first[:300]}") from None
    prompts: list[str] | None = None
    if spec.inputs.prompts is not None:
        path = Path(spec.inputs.prompts)
        prompts = _read_prompts(path if path.is_absolute() else base / path, spec.inputs.limit)
        items = len(prompts)
    else:
        if spec.inputs.dataset != arch["dataset"]:
            raise SpecError(f"inputs.dataset: {spec.inputs.dataset}, but the model reads "
                            f"{arch['dataset']}")
        try:
            data = load_dataset(arch["dataset"], None, arch["dataset_args"])
        except FedqError as exc:
            raise SpecError(f"inputs.dataset: {exc}") from None
        x = data.x_test if spec.inputs.split == "test" else data.x_train
        items = min(len(x), spec.inputs.limit) if spec.inputs.limit else len(x)
    # with backup copies the job's end does not wait on a slow machine's shard, and
    # short shards would only add their overhead (docs/inference.md, "The tail")
    if spec.backups:
        tail = 0
    else:
        with session_scope(settings.database_url) as s:
            tail = sum(out for out, _ in queue_limits(s, spec.to_json()).values())
    shards = plan_shards(items, spec.shard_size, tail=tail)
    job_id = uuid.uuid4().hex[:12]
    try:
        if weights_bytes is not None:
            blob = store.put(model_key(job_id), weights_bytes)
        assert blob is not None
        inputs = store.put(inputs_key(job_id), json.dumps(prompts).encode()) \
            if prompts is not None else None
        with session_scope(settings.database_url) as s:
            s.add(InferenceJob(
                id=job_id, name=spec.name, spec=spec.to_json(), status=JobStatus.RUNNING,
                items=items, shards=len(shards), model_key=blob.key,
                model_sha256=blob.sha256, model_size=blob.size, arch=arch,
                classes=embedding_width(arch) if spec.op == "embed" else ds.num_classes,
                inputs_key=inputs.key if inputs else None,
                inputs_sha256=inputs.sha256 if inputs else None,
                inputs_size=inputs.size if inputs else None))
            s.flush()
            s.add_all(InferenceShard(job_id=job_id, shard=n, start=lo, stop=hi, status=QUEUED,
                                     attempt=0, spared=0) for n, (lo, hi) in enumerate(shards))
    except BaseException:
        _remove(settings, job_id)
        raise
    _refill(settings, job_id, quiet=True)  # a refusal: fedq infer says it (REFUSED)
    return job_id


def _remove(settings: Settings, job_id: str) -> None:
    try:
        with session_scope(settings.database_url) as s:
            for row in s.scalars(select(InferenceShard).where(InferenceShard.job_id == job_id)):
                s.delete(row)
            s.flush()
            job = s.get(InferenceJob, job_id)
            if job is not None:
                s.delete(job)
    finally:
        store_for(settings).delete_prefix(job_prefix(job_id))


#: the start of a queued shard's error when the broker refused to send it (fedq infer
#: tells the person)
REFUSED = "the broker refused to send it"

# -- dispatch ---------------------------------------------------------------------

def _message(job: InferenceJob, row: InferenceShard) -> dict[str, Any]:
    spec = job.spec
    msg: dict[str, Any] = {
        "format": MESSAGE_FORMAT, "job": job.id, "shard": row.shard, "attempt": row.attempt,
        "queue": row.queue, "op": spec["op"], "start": row.start, "stop": row.stop,
        "batch_size": spec["batch_size"],
        "model": {"key": job.model_key, "sha256": job.model_sha256, "size": job.model_size},
        "arch": job.arch}
    if job.inputs_key is not None:
        msg["inputs"] = {"key": job.inputs_key, "sha256": job.inputs_sha256,
                         "size": job.inputs_size}
    else:
        msg["split"] = spec["inputs"]["split"]
    if spec["op"] == "generate":
        msg["sampling"] = dict(spec["generate"])
    return msg


class Take(NamedTuple):
    """A shard marked sent (:func:`_take`), to be sent by :func:`_send`."""
    queue: str
    task_id: str
    message: dict[str, Any]
    shard: int
    backup: bool  # a backup copy: the shard's earlier copy is still out


def _take(job: InferenceJob, row: InferenceShard, queue: str, backup: bool = False) -> Take:
    """Mark ``row`` sent to ``queue``: its task id and message, sealed for that id by
    the coordinator's key with FEDQ_IDENTITY=required (valid twice the shard's timeout:
    it is sent again after one)."""
    row.status, row.queue, row.attempt = RUNNING, queue, row.attempt + 1
    row.sent_at, row.error = utcnow(), None
    tid = task_id(job.id, row.shard, row.attempt)
    msg = identity.seal(_message(job, row), tid, 2 * job.spec["shard_timeout_s"],
                        sealing_keys())
    return Take(queue, tid, msg, row.shard, backup)


#: A worker counts for an inference queue's shards out if seen this recently (a worker
#: busy with one shard longer than this is not counted: the queue then keeps fewer out).
SEEN_WITHIN_S = 600.0


def queue_limits(s: Session, spec: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Queue -> (shards it keeps out, its slots for backup copies). A spec's
    ``in_flight`` is both. Unset: the workers registered on the queue that have not
    stepped aside and were seen in the last :data:`SEEN_WITHIN_S` (SQL, cheap enough
    for every answer; an idle worker says it is here every ``FEDQ_PRESENCE_S``, so one
    killed without its shutdown drops out), at least one, are its slots, and it keeps
    twice that out: each worker's next shard waits in the broker, so a worker that
    answers takes it at once instead of idling while its answer reaches the control
    worker and the next shard comes back (with two workers on one queue and one
    shard each out, the batch table's job ran about 13% slower on 2 cores:
    docs/inference.md, "Who does how much"). A worker started with ``-c N`` counts
    ``N`` times (the concurrency it registered with:
    :func:`fedq.engine.broker.registered_slots`). A copy is
    sent only to a free slot."""
    fixed = spec.get("in_flight")
    if fixed:
        return {q: (fixed, fixed) for q in spec["queues"]}
    workers: dict[str, int] = defaultdict(int)
    seen = utcnow() - timedelta(seconds=SEEN_WITHIN_S)
    for queues, available, hardware in s.execute(select(
            Worker.queues, Worker.available, Worker.hardware).where(
            Worker.last_seen >= seen)).tuples():
        if available is not False:  # away, lost or stopped: it takes nothing now
            for q in set(queues or ()):
                workers[q] += registered_slots(hardware)
    return {q: (2 * max(1, workers[q]), max(1, workers[q])) for q in spec["queues"]}


def _fill(s: Session, job: InferenceJob, queues: list[str] | None = None
          ) -> list[Take] | None:
    """Shards to send so that each queue has its :func:`queue_limits` out (lowest
    first), then backup copies on its free slots; None when no shard is out or waiting
    (the job's every shard is done). Reads the shards out as a count per queue and only
    as many waiting rows as the queues have room for (and one more, to know whether any
    is left): an answer costs the same in a job of ten shards and of ten thousand."""
    spec = job.spec
    queues = queues or spec["queues"]
    limits = queue_limits(s, spec)
    running: dict[str, int] = defaultdict(int)
    for q, n in s.execute(select(InferenceShard.queue, func.count()).where(
            InferenceShard.job_id == job.id, InferenceShard.status == RUNNING)
            .group_by(InferenceShard.queue)).tuples():
        running[q or ""] += n
    room = sum(max(0, limits[q][0] - running[q]) for q in dict.fromkeys(queues))
    waiting = list(s.scalars(select(InferenceShard).where(
        InferenceShard.job_id == job.id, InferenceShard.status == QUEUED)
        .order_by(InferenceShard.shard).limit(room + 1)))
    if not waiting and not any(running.values()):
        return None
    out = []
    for queue in queues:
        while waiting and running[queue] < limits[queue][0]:
            out.append(_take(job, waiting.pop(0), queue))
            running[queue] += 1
    if not waiting and spec.get("backups", True):  # jobs before 0018 have no field
        out += _backups(s, job, queues, running,
                        {q: slots for q, (_, slots) in limits.items()})
    return out


#: A shard is overdue (a straggler, perhaps lost) once it has been out this many times
#: its expected time, plus STRAGGLER_SLACK_S for sending and loading the model.
STRAGGLER_FACTOR, STRAGGLER_SLACK_S = 2.0, 1.0


def queue_rates(s: Session, job_id: str) -> dict[str, float]:
    """Items a second per queue, from the job's done shards (their workers' seconds).
    A shard that had a copy is left out: its row names the last copy's queue, which
    need not be the one that answered."""
    items: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    for queue, start, stop, secs in s.execute(select(
            InferenceShard.queue, InferenceShard.start, InferenceShard.stop,
            InferenceShard.seconds).where(InferenceShard.job_id == job_id,
                                          InferenceShard.status == DONE,
                                          InferenceShard.copies == 0)):
        if queue and secs and secs > 0:
            items[queue] += stop - start
            seconds[queue] += secs
    return {q: items[q] / seconds[q] for q in items}


def backup_choice(alone: list[InferenceShard], queue: str, rates: dict[str, float],
                  now: float) -> InferenceShard | None:
    """Which running shard (with no copy yet; ``alone``, the longest out first) a free
    slot of ``queue`` copies, given each queue's measured speed (:func:`queue_rates`;
    ``now`` in epoch seconds). The longest out first, as MapReduce does: within a
    hardware class that is the best sign of a slow or lost machine, which a class's
    rate cannot show. A shard of another class is passed over when a copy here is
    expected to end later than the shard itself (sent plus its items at its class's
    rate) and the shard is not overdue (out :data:`STRAGGLER_FACTOR` times that plus
    :data:`STRAGGLER_SLACK_S`): a slow class's free slot then does not spend its
    owner's machine on a shard a fast class is about to finish. Without a rate for
    either class (nothing done there yet), any shard may be copied."""
    for row in alone:
        mine, theirs = rates.get(queue), rates.get(row.queue or "")
        if row.queue == queue or mine is None or theirs is None or row.sent_at is None:
            return row
        items = row.stop - row.start
        took = items / theirs
        out = now - aware(row.sent_at).timestamp()
        if out > STRAGGLER_FACTOR * took + STRAGGLER_SLACK_S or items / mine < took - out:
            return row
    return None


def _backups(s: Session, job: InferenceJob, queues: list[str], running: dict[str, int],
             slots: dict[str, int]) -> list[Take]:
    """Backup copies for the job's end (MapReduce's backup tasks, Dean and Ghemawat
    2004, section 3.6): with no shard waiting, each free slot of ``queues`` runs a
    second copy of a shard out that has none (:func:`backup_choice`: the longest out,
    passing over another class's shard that a copy here would not beat; a queue's slot
    is free while fewer than ``slots[queue]`` of its shards are out), so the job
    does not end waiting on a slow or lost machine. Whichever copy answers first
    counts (a shard is done once); the other is revoked and its answer dropped. A copy
    is not a failure: ``backups`` keeps it out of ``max_redispatch``'s count."""
    alone = list(s.scalars(select(InferenceShard).where(
        InferenceShard.job_id == job.id, InferenceShard.status == RUNNING,
        InferenceShard.backups == 0).order_by(InferenceShard.sent_at, InferenceShard.shard)))
    if not alone:
        return []
    rates, now = queue_rates(s, job.id), time.time()
    out = []
    for queue in queues:
        while alone and running[queue] < slots[queue]:
            row = backup_choice(alone, queue, rates, now)
            if row is None:
                break
            alone.remove(row)
            row.backups += 1
            row.copies += 1
            out.append(_take(job, row, queue, backup=True))
            running[queue] += 1
    return out


def _send(settings: Settings, job_id: str, tasks: list[Take], quiet: bool = False
          ) -> str | None:
    """Send ``tasks`` (taken by :func:`_take`); None, or why the broker refused them
    (logged unless ``quiet``). A refused shard goes back to the queue (:func:`_unsend`)
    for the next fill: the watchdog's pass, or the next answer of the job."""
    if not tasks:
        return None
    try:
        with sending() as events:  # one Redis round trip for all, events included
            for queue, tid, msg, shard, _ in tasks:
                app.send_task(INFER_TASK, args=(msg,), queue=queue, task_id=tid,
                              argsrepr=f"job {job_id} shard {shard} attempt {msg['attempt']}",
                              kwargsrepr="{}", event_dispatcher=events,
                              link=app.signature(ABSORB_SHARD_TASK,
                                                 args=(job_id, shard, msg["attempt"]),
                                                 queue=CONTROL_QUEUE))
    except broker_errors() as exc:
        why = refusal(exc)
        _unsend(settings, job_id, tasks, why)
        if not quiet:
            log.warning("inference job %s: shard(s) %s could not be sent (%s); they wait "
                        "for the next fill", job_id, [t.shard for t in tasks], why)
        return why
    return None


def _unsend(settings: Settings, job_id: str, tasks: list[Take], why: str) -> None:
    """Undo the sending of shards the broker refused: each that is still out as that
    attempt goes back to the queue, and the attempt is ``spared`` (a refusal is not a
    failure of the shard). Its next send is a new attempt, with a new task id, so a
    task of a pipeline that did reach the broker before the refusal is never confused
    with it; if that one answers, its answer is checked and counts like any other
    attempt's. A refused backup copy stays as it is (its shard's first copy is out,
    and a copy is not counted as a failure)."""
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return
        for take in tasks:
            row = s.scalar(select(InferenceShard).where(InferenceShard.job_id == job_id,
                                                        InferenceShard.shard == take.shard))
            if take.backup or row is None or row.status != RUNNING or \
                    row.attempt != take.message["attempt"]:
                continue
            row.status, row.spared = QUEUED, row.spared + 1
            row.error = f"{REFUSED}: {why}"


def fill(settings: Settings, job_id: str) -> int:
    """Send queued shards until each queue has its :func:`queue_limits` out; how many were sent
    (0 when the broker refused them: they stay queued)."""
    sent, refused = _refill(settings, job_id)
    return 0 if refused else sent


def _refill(settings: Settings, job_id: str, quiet: bool = False) -> tuple[int, str | None]:
    """:func:`fill`: how many shards it took, and why the broker refused them, if so."""
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return 0, None
        tasks = _fill(s, job) or []
    return len(tasks), _send(settings, job_id, tasks, quiet)


# -- absorb -----------------------------------------------------------------------

@dataclass
class Verdict:
    status: str  # ok | error | yielded | rejected
    error: str | None = None
    result: Any = None


class JobFacts(NamedTuple):
    """What an answer is checked against that never changes once its job is submitted:
    the spec, the classes (or embedding width), each shard's items, and for a generate
    job the most characters a token of its model's tokenizer decodes to."""
    spec: dict[str, Any]
    classes: int
    shards: dict[int, tuple[int, int]]  # shard -> (start, stop)
    token_chars: int = 1


#: Jobs whose facts the control worker keeps (each a few bytes a shard).
FACTS_KEPT = 8


@lru_cache(maxsize=FACTS_KEPT)
def job_facts(database_url: str, job_id: str) -> JobFacts | None:
    """The job's :class:`JobFacts` (None when there is no such job), read once per
    process: an answer is checked against them before any lock is taken, without a
    transaction of its own (settle then decides, under the job's lock, whether the
    shard still wants it)."""
    with session_scope(database_url) as s:
        job = s.get(InferenceJob, job_id)
        if job is None:
            return None
        shards = {n: (start, stop) for n, start, stop in s.execute(select(
            InferenceShard.shard, InferenceShard.start, InferenceShard.stop).where(
            InferenceShard.job_id == job_id)).tuples()}
        chars = token_chars(job.arch) if job.spec.get("op") == "generate" else 1
        return JobFacts(job.spec, job.classes, shards, chars)


def token_chars(arch: dict[str, Any]) -> int:
    """The most characters one token of ``arch``'s tokenizer decodes to (1 for bytes):
    what a generated text of ``max_tokens`` tokens is bounded by, times that."""
    from fedq.inference.run import arch_tokenizer

    return arch_tokenizer(arch.get("dataset_args")).token_chars()


def _verify(settings: Settings, data: Any, job_id: str, facts: JobFacts, shard: int,
            attempt: int, registry: identity.Registry | None) -> Verdict:
    """What a worker's answer for (shard, attempt) is worth, checked to the last line;
    with ``registry`` (FEDQ_IDENTITY=required) it must be signed for its task id by an
    active registered worker, its output in that worker's folder."""
    try:
        r = parse_result(data)
    except FormatError as exc:
        return Verdict("rejected", str(exc))
    if (r.job, r.shard, r.attempt) != (job_id, shard, attempt):
        return Verdict("rejected", f"a result for job {r.job} shard {r.shard} attempt "
                       f"{r.attempt}, sent as shard {shard} attempt {attempt}")
    if registry is not None:
        # a shard's copies may go to any of the job's queues (backups elsewhere)
        problem = identity.result_problem(data, r.signer, r.sig, r.worker,
                                          task_id(job_id, shard, attempt), registry,
                                          facts.spec["queues"])
        if problem:
            return Verdict("rejected", f"signature: {problem}", r)
    if r.status != "ok":
        return Verdict(r.status, redact_text(r.error or r.status), r)
    expected = output_key(job_id, shard, attempt, r.signer if registry is not None else None)
    if r.key != expected or r.sha256 is None:
        return Verdict("rejected", f"output key {str(r.key)[:120]!r} is not {expected}", r)
    start, stop = facts.shards[shard]
    op = facts.spec["op"]
    max_tokens = facts.spec["generate"]["max_tokens"] if op == "generate" else 0
    bound = line_bytes(op, max_tokens, facts.token_chars) * (stop - start)
    if r.items != stop - start or not 0 < r.size <= bound:
        return Verdict("rejected", f"{r.items} item(s) in {r.size} bytes for a shard of "
                       f"{stop - start} (at most {bound} bytes)", r)
    store = PROCESS.blobs(settings)
    try:
        body = store.get(BlobRef(r.key, r.sha256, r.size), limit=bound)
        check_output(body, op, start, stop, facts.classes, max_tokens, facts.token_chars)
    except (BlobError, FormatError) as exc:
        return Verdict("rejected", f"output of shard {shard}: {exc}", r)
    return Verdict("ok", None, r)


def absorb(settings: Settings, data: Any, job_id: str, shard: int, attempt: int,
           registry: identity.Registry | None = None) -> dict[str, Any]:
    """A shard's answer: counted once if it checks out, else the shard is sent again
    (or, after ``max_redispatch`` failures, the job fails with the reason). ``registry``:
    the registered workers when FEDQ_IDENTITY=required (the caller reads them).

    The answer is checked against the job's :func:`job_facts` (kept in this process)
    with no transaction of its own; :func:`settle` then takes the job's lock and drops
    it if the shard is done, the job not running or the attempt not one sent
    (docs/inference.md, "What an answer costs the control worker")."""
    facts = job_facts(settings.database_url, job_id)
    if facts is None or shard not in facts.shards or attempt < 1:
        return {"status": "dropped", "reason": "no such shard or attempt"}
    return settle(settings, job_id, shard, attempt,
                  _verify(settings, data, job_id, facts, shard, attempt, registry))


def settle(settings: Settings, job_id: str, shard: int, attempt: int, verdict: Verdict
           ) -> dict[str, Any]:
    """Record what (shard, attempt) came to, under the job's lock."""
    revoke: list[str] = []
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        row = None if job is None else s.scalar(select(InferenceShard).where(
            InferenceShard.job_id == job_id, InferenceShard.shard == shard))
        if job is None or row is None or not 0 < attempt <= row.attempt:
            return {"status": "dropped", "reason": "no such shard or attempt"}
        if row.status == DONE or job.status != JobStatus.RUNNING:
            return {"status": "dropped", "reason": f"shard {row.status}, job {job.status}"}
        tasks: list[Take] = []
        if verdict.status == "ok":
            r = verdict.result
            row.status, row.key, row.sha256, row.size = DONE, r.key, r.sha256, r.size
            row.worker, row.seconds, row.device = r.worker, r.seconds, r.device
            row.started_at = worker_time(r.started)
            row.done_at, row.error = utcnow(), None
            if row.backups:  # the other copies of this shard are no longer needed
                revoke = [task_id(job_id, shard, a)
                          for a in copies_out(row.attempt, row.backups) if a != attempt]
            more = _fill(s, job, [row.queue or job.spec["queues"][0]])
            if more is None:  # none out, none waiting: this was the last
                job.status, job.finished_at = JobStatus.COMPLETED, utcnow()
            else:
                tasks = more
        elif attempt != row.attempt:  # an older attempt failed; a newer one is out
            return {"status": "dropped", "reason": f"attempt {attempt} failed, "
                    f"{row.attempt} is out", "error": verdict.error}
        else:
            if verdict.status == "yielded" and row.spared < MAX_YIELDS:
                row.spared += 1
            row.error = verdict.error
            failed = row.attempt - row.spared - row.backups
            if failed > job.spec["max_redispatch"]:
                row.status = FAILED
                job.status, job.finished_at = JobStatus.FAILED, utcnow()
                job.error = (f"shard {row.shard} (items {row.start}..{row.stop - 1}) failed "
                             f"{failed} time(s), last on {row.queue}: {verdict.error}")[:2000]
                revoke = _close(s, job_id, CANCELLED, "the job failed")
            else:
                row.status = QUEUED
                tasks = _fill(s, job, [row.queue or job.spec["queues"][0]]) or []
        status = row.status
    _send(settings, job_id, tasks)
    if revoke:
        revoke_quietly(revoke, "its shard is done" if verdict.status == "ok"
                       else "its job failed", "inference task(s)")
    return {"status": status if verdict.status == "ok" else verdict.status, "shard": shard,
            "error": verdict.error}


def _close(s: Session, job_id: str, status: str, why: str) -> list[str]:
    ids = []
    for row in s.scalars(select(InferenceShard).where(InferenceShard.job_id == job_id,
                                                      InferenceShard.status == RUNNING)):
        ids += [task_id(job_id, row.shard, a) for a in range(1, row.attempt + 1)]
        row.status, row.error = status, why
    return ids


# -- repair, cancel, resume ---------------------------------------------------------

def copies_out(attempt: int, backups: int) -> range:
    """The attempts of a running shard that may still be out: its latest and the
    ``backups`` before it (a backup copy is sent while the earlier one runs)."""
    return range(max(1, attempt - backups), attempt + 1)


def running_tasks(settings: Settings) -> list[tuple[str, dict[str, int], dict[int, int]]]:
    """Each running job's shards out now: (job, task id -> shard for every copy still
    out, shard -> its latest attempt). The watchdog reads their claims' heartbeats
    (fedq/coordinator/liveness.py) and sends a dead worker's shard again
    (:func:`settle` with an error) without waiting for ``shard_timeout_s``."""
    with session_scope(settings.database_url) as s:
        rows = s.execute(select(InferenceShard.job_id, InferenceShard.shard,
                                InferenceShard.attempt, InferenceShard.backups)
                         .join(InferenceJob, InferenceJob.id == InferenceShard.job_id)
                         .where(InferenceJob.status == JobStatus.RUNNING,
                                InferenceShard.status == RUNNING)).all()
    out: dict[str, tuple[dict[str, int], dict[int, int]]] = {}
    for job_id, shard, attempt, backups in rows:
        tasks, latest = out.setdefault(job_id, ({}, {}))
        latest[shard] = attempt
        for a in copies_out(attempt, backups):
            tasks[task_id(job_id, shard, a)] = shard
    return [(job_id, tasks, latest) for job_id, (tasks, latest) in sorted(out.items())]


def repair(settings: Settings, registry: identity.Registry | None = None
           ) -> list[dict[str, Any]]:
    """The watchdog's pass over running inference jobs: a shard out longer than
    ``shard_timeout_s`` is absorbed from the result backend (its callback was lost) or
    sent again; queues short of their shards out are filled (a lost dispatch)."""
    now = utcnow()
    actions: list[dict[str, Any]] = []
    with session_scope(settings.database_url) as s:
        jobs = [(j.id, j.spec) for j in s.scalars(select(InferenceJob).where(
            InferenceJob.status == JobStatus.RUNNING))]
        late = {j: [(r.shard, r.attempt) for r in s.scalars(select(InferenceShard).where(
            InferenceShard.job_id == j, InferenceShard.status == RUNNING))
            if r.sent_at is not None and
            aware(r.sent_at) < now - timedelta(seconds=spec["shard_timeout_s"])]
            for j, spec in jobs}
    for job_id, _ in jobs:
        try:
            actions += _repair_job(settings, job_id, late[job_id], registry)
        except Exception as exc:  # noqa: BLE001 - one job's error never stops the others
            log.exception("fedq watchdog: repairing inference job %s failed", job_id)
            actions.append({"job": job_id, "action": "error (repair)", "result": "error",
                            "error": redact_text(f"{type(exc).__name__}: {exc}"
                                                 .splitlines()[0])[:500]})
    return actions


def _repair_job(settings: Settings, job_id: str, late: list[tuple[int, int]],
                registry: identity.Registry | None) -> list[dict[str, Any]]:
    """:func:`repair` of one job: its ``late`` shards (shard, attempt) absorbed or sent
    again, its queues filled."""
    actions: list[dict[str, Any]] = []
    for shard, attempt in late:
        # read up to STATE_BYTES: a longer or undecodable state is no answer
        # (fedq.engine.backend)
        meta = task_metas(app.backend, [task_id(job_id, shard, attempt)])[0]
        if meta.get("status") == "SUCCESS":
            out = absorb(settings, meta.get("result"), job_id, shard, attempt, registry)
            actions.append({"job": job_id, "shard": shard, "action": "absorb (lost callback)",
                            "result": out["status"]})
            continue
        why = unread_reason(meta)
        out = settle(settings, job_id, shard, attempt, Verdict(
            "error", "no answer within shard_timeout_s" if why is None else f"result: {why}"))
        actions.append({"job": job_id, "shard": shard, "action": "resend (timeout)",
                        "result": out["status"]})
    sent, refused = _refill(settings, job_id)
    if sent:
        actions.append({"job": job_id, "action": "fill", "result": f"{sent} sent"
                        if refused is None else f"{sent} refused: {refused}"})
    return actions


def cancel(settings: Settings, job_id: str) -> int:
    """Stop a running inference job; how many task ids were revoked."""
    check_broker()
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        if job is None:
            raise JobNotFound(f"no inference job {job_id}")
        if job.status != JobStatus.RUNNING:
            raise FedqError(f"job {job_id} is {job.status}, not running")
        job.status, job.error, job.finished_at = JobStatus.CANCELLED, "cancelled by user", utcnow()
        ids = _close(s, job_id, QUEUED, "cancelled")
    revoke_quietly(ids, "its job was cancelled", "inference task(s)", stop=True)
    return len(ids)


def resume(settings: Settings, job_id: str) -> int:
    """Run a failed or cancelled inference job's unfinished shards again (each with
    ``max_redispatch`` fresh tries); how many shards are left."""
    check_broker()
    with session_scope(settings.database_url) as s:
        job = _lock(s, job_id)
        if job is None:
            raise JobNotFound(f"no inference job {job_id}")
        if job.status not in (JobStatus.FAILED, JobStatus.CANCELLED):
            raise FedqError(f"job {job_id} is {job.status}: only a failed or cancelled job "
                            "resumes")
        left = 0
        for row in s.scalars(select(InferenceShard).where(InferenceShard.job_id == job_id,
                                                          InferenceShard.status != DONE)):
            row.status, row.spared, row.backups, row.error = QUEUED, row.attempt, 0, None
            left += 1
        job.status, job.error, job.finished_at = JobStatus.RUNNING, None, None
    fill(settings, job_id)
    return left


# -- what a person reads ------------------------------------------------------------

@dataclass
class WorkerLine:
    worker: str
    device: str
    shards: int = 0
    items: int = 0
    seconds: float = 0.0

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0


@dataclass
class InferenceView:
    id: str
    name: str
    status: str
    op: str
    items: int
    done_items: int
    shards: int
    done_shards: int
    resent: int
    elapsed_s: float
    error: str | None
    workers: list[WorkerLine] = field(default_factory=list)
    backups: int = 0  # backup copies sent, before a resume too (not counted in ``resent``)
    shard_rows: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0  # epoch seconds

    @property
    def eta_s(self) -> float | None:
        if self.done_items == 0 or self.status != JobStatus.RUNNING:
            return None
        return self.elapsed_s * (self.items - self.done_items) / self.done_items

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "status": self.status, "op": self.op,
                "items": self.items, "done_items": self.done_items, "shards": self.shards,
                "done_shards": self.done_shards, "resent": self.resent,
                "backups": self.backups,
                "elapsed_s": round(self.elapsed_s, 3), "eta_s": self.eta_s, "error": self.error,
                "workers": [{"worker": w.worker, "device": w.device, "shards": w.shards,
                             "items": w.items, "seconds": round(w.seconds, 3),
                             "items_per_s": round(w.items_per_s, 1)} for w in self.workers],
                "shard_rows": self.shard_rows}


def find(settings: Settings, job_id: str) -> InferenceView | None:
    """The inference job ``job_id``, or None if there is none (it may be a training job)."""
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        job = s.get(InferenceJob, job_id)
        if job is None:
            return None
        rows = list(s.scalars(select(InferenceShard).where(InferenceShard.job_id == job_id)
                              .order_by(InferenceShard.shard)))
        end = aware(job.finished_at) if job.finished_at else utcnow()
        view = InferenceView(job.id, job.name, job.status, job.spec["op"], job.items,
                             sum(r.stop - r.start for r in rows if r.status == DONE),
                             job.shards, sum(r.status == DONE for r in rows),
                             sum(max(0, r.attempt - 1 - r.copies) for r in rows),
                             (end - aware(job.created_at)).total_seconds(), job.error,
                             spec=dict(job.spec), created=aware(job.created_at).timestamp(),
                             backups=sum(r.copies for r in rows))
        by: dict[str, WorkerLine] = {}
        for r in rows:
            view.shard_rows.append({
                "shard": r.shard, "start": r.start, "stop": r.stop, "status": r.status,
                "attempt": r.attempt, "backups": r.copies,
                "queue": r.queue, "worker": r.worker, "device": r.device,
                "seconds": r.seconds, "error": r.error,
                "started": aware(r.started_at).timestamp() if r.started_at else None,
                "done": aware(r.done_at).timestamp() if r.done_at else None})
            if r.status == DONE and r.worker:
                line = by.setdefault(r.worker, WorkerLine(r.worker, r.device or "?"))
                line.shards += 1
                line.items += r.stop - r.start
                line.seconds += r.seconds or 0.0
        view.workers = sorted(by.values(), key=lambda w: w.worker)
    return view


def recent(settings: Settings, limit: int = 20) -> list[dict[str, Any]]:
    """The newest inference jobs (``fedq status``): id, name, status, op, items done
    of all, when created, error."""
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        jobs = list(s.scalars(select(InferenceJob).order_by(InferenceJob.created_at.desc())
                              .limit(limit)))
        done = dict(s.execute(
            select(InferenceShard.job_id,
                   func.sum(InferenceShard.stop - InferenceShard.start))
            .where(InferenceShard.job_id.in_([j.id for j in jobs]),
                   InferenceShard.status == DONE)
            .group_by(InferenceShard.job_id)).tuples().all())
        return [{"id": j.id, "kind": "inference", "name": j.name, "status": j.status,
                 "op": j.spec["op"], "items": j.items, "done_items": int(done.get(j.id) or 0),
                 "created_at": aware(j.created_at).isoformat(timespec="seconds"),
                 "error": j.error} for j in jobs]


def merge(settings: Settings, job_id: str, out: Path) -> int:
    """Write the completed job's outputs to ``out`` in input order, each shard's blob
    checked against its sha256: JSONL, or Parquet when ``out`` ends in ``.parquet`` (one
    row group per shard, the columns of the job's op: :func:`parquet_schema`). Written
    to a temporary file and renamed, so ``out`` is whole or untouched. The rows written."""
    parquet = out.suffix.lower() == ".parquet"
    if parquet:
        require_extra("pyarrow", "parquet", f"--out {out.name} (Parquet)")
    with session_scope(settings.database_url) as s:
        job = s.get(InferenceJob, job_id)
        if job is None:
            raise JobNotFound(f"no inference job {job_id}")
        if job.status != JobStatus.COMPLETED:
            raise FedqError(f"job {job_id} is {job.status}, not completed: its outputs are "
                            f"not all there (fedq watch {job_id})")
        refs = [BlobRef(r.key or "", r.sha256 or "", r.size or 0) for r in s.scalars(
            select(InferenceShard).where(InferenceShard.job_id == job_id)
            .order_by(InferenceShard.shard))]
        items, op = job.items, str(job.spec.get("op", ""))
    store = PROCESS.blobs(settings)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    bodies = (store.get(ref, limit=ref.size) for ref in refs)
    try:
        lines = _write_parquet(tmp, op, bodies) if parquet else _write_jsonl(tmp, bodies)
        if lines != items:
            raise FedqError(f"job {job_id}: {lines} output lines for {items} items")
        os.replace(tmp, out)
    except OSError as exc:
        raise FedqError(f"--out {out}: {exc.strerror or exc}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return lines


def _write_jsonl(path: Path, bodies: Iterable[bytes]) -> int:
    lines = 0
    with open(path, "wb") as fh:
        for body in bodies:
            fh.write(body)
            lines += body.count(b"\n")
    return lines


def parquet_schema(op: str) -> Any:
    """The Parquet columns of an op's outputs: the JSONL lines' keys, typed (checked
    when each shard arrived: fedq/protocol/inference.py, ``check_output``)."""
    import pyarrow as pa

    columns = {"classify": [("label", pa.int64()), ("probs", pa.list_(pa.float64()))],
               "score": [("logprob", pa.float64()), ("tokens", pa.int64())],
               "generate": [("text", pa.string())],
               "embed": [("embedding", pa.list_(pa.float64()))]}
    if op not in columns:
        raise FedqError(f"Parquet: no columns known for op {op!r}")
    return pa.schema([("i", pa.int64()), *columns[op]])


def _write_parquet(path: Path, op: str, bodies: Iterable[bytes]) -> int:
    """Each shard's JSONL as one row group, parsed by Arrow with the op's schema (a line
    with another key or type is an error, not a guess)."""
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    schema = parquet_schema(op)
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
    rows = 0
    with pq.ParquetWriter(path, schema) as writer:
        for body in bodies:
            try:
                table = pj.read_json(io.BytesIO(body), parse_options=options,
                                     read_options=pj.ReadOptions(  # the shard in one block
                                         block_size=max(len(body), 1 << 16)))
            except pa.ArrowInvalid as exc:
                raise FedqError(f"Parquet: a shard's output does not fit op {op}: "
                                f"{str(exc).splitlines()[0]}") from None
            writer.write_table(table.select(schema.names).cast(schema))
            rows += table.num_rows
    return rows


def wait(settings: Settings, job_id: str, timeout: float = 0, interval: float = 0.5,
         on_poll: Any = None) -> InferenceView:
    """Poll until the job has finished (``on_poll(view)`` each time)."""
    start = time.monotonic()
    while True:
        view = find(settings, job_id)
        if view is None:
            raise JobNotFound(f"no inference job {job_id}")
        if on_poll is not None:
            on_poll(view)
        if view.status != JobStatus.RUNNING:
            return view
        if timeout and time.monotonic() - start > timeout:
            return view
        time.sleep(interval)
