"""Admitting a training task's result: attributed by the task it answers, parsed
strictly, bounded by what the coordinator knows (docs/security.md).

A result arrives under a task id the coordinator chose (the chord is only a doorbell:
finalize reads every result back from the backend by its task ids; a buffered job's
``absorb`` is called for one task number). So who a result is for — job, round or
task number, client, attempt, generation, queue — comes from :class:`Sent`, never from
the result's body: a body that names anything else is a rejection saying so. The
update key must be the one fedq derives for that task (:attr:`Sent.update_key`), and
the FedAvg weight cannot exceed what the client's shard allows (:class:`Limits`: the
partition is a pure function of the spec, so the coordinator computes the shard size
itself): a result may report fewer samples, never more.

:func:`admit` never raises: anything wrong is an :class:`~fedq.protocol.training.UpdateRef` with
status ``rejected`` and one line naming the check.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedq.blobs.base import BlobRef
from fedq.blobs.keys import update_key
from fedq.blobs.s3 import S3BlobStore
from fedq.coordinator.enrol import Registry
from fedq.errors import ConfigError, FedqError
from fedq.identity import EXPIRY_GRACE_S, result_problem, seal, task_tag
from fedq.process import PROCESS
from fedq.protocol.envelope import FEDQ_VERSION, MESSAGE_FORMAT, FormatError
from fedq.protocol.training import StepRef, TrainRef, UpdateRef, parse_result
from fedq.redaction import redact_text
from fedq.settings import get_settings
from fedq.spec import JobSpec
from fedq.status import UpdateStatus

ERROR_CHARS = 2000  # a worker's error text kept in a row

log = logging.getLogger(__name__)


def task_id(job: str, number: int, attempt: int, client: int | None = None,
            gen: int | None = None) -> str:
    """The Celery task id of a training task, chosen before it is sent (the
    coordinator reads its result back by it): a round's ``fedq-JOB-gGEN-rROUND-cCLIENT-
    aATTEMPT`` (GEN: the round row's id, never reused, which tells a resumed round from
    the one it replaced), or with ``gen`` None a buffered job's ``fedq-JOB-bTASK-
    aATTEMPT`` (``number``: its task number). With FEDQ_IDENTITY=required a tag only the
    coordinator can compute follows (:func:`fedq.identity.task_tag`): a worker cannot
    name a task it was not given."""
    base = f"fedq-{job}-b{number}-a{attempt}" if gen is None \
        else f"fedq-{job}-g{gen}-r{number}-c{client}-a{attempt}"
    return base + task_tag(base, sealing_keys())


def sealing_keys() -> Path | None:
    """The coordinator's keys folder when it signs its tasks (FEDQ_IDENTITY=required),
    else None."""
    settings = get_settings()
    return settings.keys_dir if settings.identity == "required" else None


@dataclass(frozen=True)
class Sent:
    """A training task as the coordinator sent it."""

    job: str
    round: int  # the round it trains for (buffered: the version it trains from, + 1)
    client: int
    attempt: int
    gen: int  # the round row's id (synchronous; 0 for buffered tasks)
    queue: str
    task: int = 0  # a buffered job's task number, from 1 (0: a synchronous round's)

    @property
    def buffered(self) -> bool:
        return self.task > 0

    @property
    def identity(self) -> tuple[str, ...]:
        """The fields a result must repeat: a buffered task is named by its number (a
        re-sent one trains from a newer version, and a late first attempt still
        counts), a round's by its round and generation."""
        return ("job", "task", "client", "attempt", "gen") + (() if self.buffered
                                                               else ("round",))

    @property
    def task_id(self) -> str:
        if self.buffered:
            return task_id(self.job, self.task, self.attempt)
        return task_id(self.job, self.round, self.attempt, self.client, self.gen)

    @property
    def shown(self) -> str:
        """What the task's message headers and task events show of it (Celery's
        ``argsrepr``): who it is for, never its argument. Celery would otherwise put a
        repr of the whole message there, for the dashboard: its presigned URLs, at a
        cost per task that docs/benchmarks.md measures."""
        which = f"task {self.task}" if self.buffered else f"round {self.round}"
        return f"job {self.job} {which} client {self.client} attempt {self.attempt}"

    @property
    def update_key(self) -> str:
        """The one key this task's update may be stored under (a registered worker's:
        :meth:`key_of`)."""
        return self.key_of(None)

    def key_of(self, signer: str | None) -> str:
        """The one key this task's update may be stored under by ``signer``."""
        return update_key(self.job, self.task or self.round, self.client, self.attempt, signer)

    def train_ref(self, spec: dict[str, Any], model: BlobRef, step: StepRef | None = None,
                  links: dict[str, dict[str, str]] | None = None) -> TrainRef:
        """The task's message, as both modes send it (the spec travels whole)."""
        return TrainRef(self.job, self.round, self.client, self.queue, spec, model,
                        attempt=self.attempt, gen=self.gen, step=step, task=self.task,
                        links=links)

    def message(self, spec: dict[str, Any], model: BlobRef, step: StepRef | None,
                ttl_s: float) -> dict[str, Any]:
        """The task's argument as it is sent: with presigned URLs for its blobs when
        FEDQ_PRESIGN_ENDPOINT is set (fedq/blobs/presigned.py), sealed by the
        coordinator's key with an expiry ``ttl_s`` from now when FEDQ_IDENTITY=required
        (fedq/identity.py)."""
        shipped = {**((spec.get("model_args") or {}).get("base_files") or {}),
                   **((spec.get("dataset_args") or {}).get("tokenizer_files") or {})}
        links = self.links(model, step, ttl_s, [ref["key"] for ref in shipped.values()])
        return seal(self.train_ref(spec, model, step, links).to_json(), self.task_id, ttl_s,
                    sealing_keys())

    def links(self, model: BlobRef, step: StepRef | None, ttl_s: float,
              more: list[str] | None = None) -> dict[str, dict[str, str]] | None:
        """Presigned GET URLs for the task's model (and step, and the ``more`` keys: a
        shipped checkpoint's files) and a PUT URL for its update, valid as long as its
        seal; None unless FEDQ_PRESIGN_ENDPOINT is set."""
        settings = get_settings()
        if not settings.presign_endpoint:
            return None
        store = PROCESS.blobs(settings)
        if not isinstance(store, S3BlobStore):
            raise ConfigError("FEDQ_PRESIGN_ENDPOINT is set, but the blob store is not S3 "
                              "(FEDQ_BLOB_URL=s3://bucket/prefix)")
        gets = [model.key] + ([step.blob.key] if step is not None else []) + (more or [])
        return store.presign(settings.presign_endpoint,
                             int(ttl_s + EXPIRY_GRACE_S), gets, [self.update_key])


@dataclass(frozen=True)
class Limits:
    """The most a client's result may claim under its job's spec."""

    samples: int  # the client's shard size: the FedAvg weight
    steps: int  # local steps the spec allows
    seen: int  # samples processed the spec allows (the ``processed`` weight)


def limits(spec: JobSpec, client: int) -> Limits:
    """What client ``client`` can report under ``spec`` (its shard from the partition,
    computed here; cached per process)."""
    from fedq.coordinator.evaluation import here

    spec = here(spec, base=False)  # a tokenizer fedq submit trained, on this machine
    n = _shard_sizes(spec.dataset, str(spec.data_dir) if spec.data_dir else "",
                     json.dumps(spec.dataset_args or {}, sort_keys=True),
                     spec.partition.model_dump_json(), spec.num_clients, spec.seed)[client]
    batches = math.ceil(n / spec.batch_size)
    steps = spec.local_steps if spec.local_steps is not None \
        else (spec.local_epochs or 1) * batches
    return Limits(samples=n, steps=steps, seen=steps * spec.batch_size)


def known_limits(spec: JobSpec, client: int) -> Limits | None:
    """:func:`limits`, or None (no bound, logged) where the coordinator cannot load the
    job's dataset to compute the shard (a dataset only the workers hold)."""
    try:
        return limits(spec, client)
    except FedqError as exc:
        log.warning("cannot bound client %d's sample count: %s", client, exc)
        return None


@lru_cache(maxsize=8)
def _shard_sizes(dataset: str, data_dir: str, args: str, partition: str, num_clients: int,
                 seed: int) -> tuple[int, ...]:
    from pydantic import TypeAdapter

    from fedq.data import load_dataset
    from fedq.data.partition import Partition, partition_indices

    ds = load_dataset(dataset, data_dir or None, json.loads(args))
    part = TypeAdapter(Partition).validate_json(partition)
    return tuple(len(p) for p in partition_indices(ds.partition_labels(), part,
                                                   num_clients, seed))


def unread(sent: Sent, why: str) -> UpdateRef:
    """Task ``sent``'s result, rejected unread: its stored state is over the bound a
    result may have, or does not decode (``why``: fedq.engine.backend.unread_reason)."""
    return UpdateRef(status=UpdateStatus.REJECTED, job=sent.job, round=sent.round,
                     task=sent.task, client=sent.client, queue=sent.queue, worker="?",
                     attempt=sent.attempt, gen=sent.gen, error=f"result: {why}")


def admit(raw: Any, sent: Sent, bound: Limits | None,
          registry: Registry | None = None) -> UpdateRef:
    """The result ``raw`` of task ``sent``: status ok or error as the worker reported
    it, identity from ``sent``; or status ``rejected`` with the reason. ``registry``
    (FEDQ_IDENTITY=required): the result must be signed, for this task, by an active
    registered worker, who is recorded as its signer."""
    rejected = UpdateRef(status=UpdateStatus.REJECTED, job=sent.job, round=sent.round,
                         task=sent.task, client=sent.client, queue=sent.queue, worker="?",
                         attempt=sent.attempt, gen=sent.gen)
    try:
        got = parse_result(raw)
    except FormatError as exc:
        worker = raw.get("worker") if isinstance(raw, dict) else None
        return dataclasses.replace(
            rejected, worker=str(worker)[:200] if isinstance(worker, str) and worker else "?",
            error=redact_text(str(exc)))
    rejected = dataclasses.replace(rejected, worker=got.worker)
    if got.format != MESSAGE_FORMAT:
        return dataclasses.replace(rejected, error=(
            f"version: worker {got.worker} speaks message format {got.format} (fedq "
            f"{got.version}), the coordinator {MESSAGE_FORMAT} (fedq {FEDQ_VERSION})"))
    if registry is not None:
        problem = _unsigned(raw, got.signer, got.sig, got.worker, sent, registry)
        if problem:
            return dataclasses.replace(rejected, error=f"signature: {problem}")
    for name in sent.identity:
        said, truth = getattr(got, name), getattr(sent, name)
        if said != truth:
            return dataclasses.replace(rejected, error=(
                f"identity: the result names {name} {_show(said)}, its task was "
                f"{name} {_show(truth)}"))
    ref = dataclasses.replace(
        got, sig=None, queue=sent.queue, signer=got.signer if registry is not None else None,
        error=redact_text(got.error)[:ERROR_CHARS] if got.error else None)
    if ref.status != "ok":
        return ref
    # a registered worker's folder (its signature verified above when it counts), or
    # the key of the task's presigned upload URL
    if ref.key not in (sent.key_of(got.signer), sent.update_key):
        return dataclasses.replace(rejected, error=(
            f"key: the update is at {str(ref.key)[:120]!r}, its task's key is "
            f"{sent.key_of(got.signer)!r}"))
    if ref.sha256 is None:
        return dataclasses.replace(rejected, error="key: the result names no sha256")
    if bound is not None:
        problem = _beyond(ref, bound)
        if problem:
            return dataclasses.replace(rejected, error=f"weight: {problem}")
    return ref


def _unsigned(raw: dict[str, Any], signer: str | None, sig: str | None, worker: str,
              sent: Sent, registry: Registry) -> str | None:
    """Why ``raw`` is not a result signed for ``sent`` by an active registered worker."""
    return result_problem(raw, signer, sig, worker, sent.task_id, registry, [sent.queue])


def _show(value: object) -> str:
    return repr(value[:40]) if isinstance(value, str) else str(value)


def _beyond(ref: UpdateRef, bound: Limits) -> str | None:
    """Why ``ref`` claims more than its client can, or None."""
    if ref.samples < 1:
        return f"reports {ref.samples} samples"
    if ref.samples > bound.samples:
        return (f"reports {ref.samples} samples, client {ref.client}'s shard has "
                f"{bound.samples}")
    if ref.steps > bound.steps:
        return f"reports {ref.steps} local steps, the spec allows {bound.steps}"
    if ref.stats.seen > bound.seen:
        return f"reports {ref.stats.seen} samples processed, the spec allows {bound.seen}"
    return None
