"""Jobs as a person sees them: submit one, read its status and per-round results.

The CLI calls these; so do the tests.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select, update

from fedq.blobs import global_key, store_for
from fedq.blobs.keys import job_prefix
from fedq.coordinator.rounds import request_round, round_task_ids
from fedq.db import ClientUpdate, Job, Round, WatchdogAction, session_scope
from fedq.db.models import aware, utcnow
from fedq.db.session import ensure_schema
from fedq.engine.app import broker_errors, refusal
from fedq.engine.broker import check_broker
from fedq.engine.revoke import revoke
from fedq.errors import FedqError, JobNotFound, ServiceUnavailable, SpecError
from fedq.settings import Settings
from fedq.spec import JobSpec
from fedq.status import FINISHED, RESUMABLE, JobStatus, RoundStatus, UpdateStatus


def submit(settings: Settings, spec: JobSpec) -> str:
    """Create a job and ask the control queue to start round 1; returns the job id.

    Checks the database schema, the blob store and the broker first; if anything
    fails after the first write, what was written is removed again.
    """
    check_broker()
    store = store_for(settings)
    store.check()
    ensure_schema(settings.database_url)

    # Deferred: torch builds the initial model; status, results and watch never need it.
    from fedq.coordinator import capacity
    from fedq.coordinator.evaluation import initial_weights
    from fedq.weights import dumps

    if "base_files" in spec.model_args:
        raise SpecError("model_args.base_files: fedq submit writes it (model_args.ship_base: "
                        "true), a spec does not")
    if "tokenizer_files" in spec.dataset_args:
        raise SpecError("dataset_args.tokenizer_files: fedq submit writes it (dataset_args"
                        ".tokenizer: bpe:VOCAB), a spec does not")
    spec, trained = _train_tokenizer(settings, spec)
    try:
        from fedq.models import pinned_args

        spec = spec.model_copy(update={"model_args": pinned_args(spec.model, spec.model_args)})
        weights = initial_weights(spec)
    except (TypeError, ValueError, RuntimeError) as exc:  # the spec's model cannot be built
        raise SpecError(f"model {spec.model} with {spec.model_args or 'no arguments'} cannot "
                        f"be built for dataset {spec.dataset}: {exc}") from None
    job_id = uuid.uuid4().hex[:12]
    body = dumps(weights, {"job": job_id})
    shipped = _shipped(spec)
    capacity.check(settings, spec, store, len(body),
                   tuple(f.stat().st_size for f in [*shipped, *([trained] if trained else [])]),
                   largest=max((t.numel() for t in weights.values()), default=0))
    from fedq.blobs.checkpoint import put_folder

    try:
        if trained is not None:  # the tokenizer beside the job, for workers to fetch
            spec = spec.model_copy(update={"dataset_args": {
                **spec.dataset_args, "tokenizer_files": put_folder(
                    store, [trained], f"{job_prefix(job_id)}tokenizer")}})
        if shipped:  # ship_base: the checkpoint beside the job, for workers without it
            files = put_folder(store, shipped, f"{job_prefix(job_id)}base")
            spec = spec.model_copy(update={"model_args": {**spec.model_args,
                                                          "base_files": files}})
        blob = store.put(global_key(job_id, 0), body)
        with session_scope(settings.database_url) as s:
            s.add(Job(id=job_id, name=spec.name, spec=spec.to_json(), status=JobStatus.RUNNING,
                      total_rounds=spec.rounds, committed_round=0, global_key=blob.key,
                      global_sha256=blob.sha256, global_size=blob.size))
        try:
            request_round(job_id, 1)
        except broker_errors() as exc:  # e.g. an ACL that denies this user the queue
            raise ServiceUnavailable(f"the broker refused to start the job ({refusal(exc)}); "
                                     f"nothing was submitted") from None
    except BaseException:
        _remove(settings, job_id)
        raise
    return job_id


def prepare_store(settings: Settings, wait: float = 60.0) -> str:
    """Make the configured blob store ready (its bucket created) and check it can be
    written, retrying for ``wait`` seconds while its server starts: the compose file's
    s3-init step. One line saying what was done."""
    store = store_for(settings)
    deadline = time.monotonic() + wait
    while True:
        try:
            done = store.prepare()
            store.check()
            return f"{settings.blob_url}: {done}, writable"
        except ServiceUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _train_tokenizer(settings: Settings, spec: JobSpec) -> tuple[JobSpec, Path | None]:
    """A ``text_files`` job whose ``dataset_args.tokenizer`` is ``bpe:VOCAB``: a
    byte-level BPE of VOCAB tokens trained here on the job's files (as this machine has
    them), written to FEDQ_HOME/tokenizers/DIGEST/tokenizer.json, and the spec naming
    that folder; the file, which the job stores beside it for the workers (``None``
    for any other job). SpecError with one line for files that do not read, a
    vocabulary out of range, or ``chat`` (which needs a template a trained BPE has
    not)."""
    from fedq.data.tokens import TRAINED

    name = spec.dataset_args.get("tokenizer")
    match = TRAINED.match(name) if isinstance(name, str) else None
    if match is None or spec.dataset != "text_files":
        return spec, None
    if spec.dataset_args.get("chat"):
        raise SpecError(f"dataset_args.chat: renders conversations with a tokenizer folder's "
                        f"chat template; tokenizer {name} is trained without one")
    import os

    import fedq.digest as digests
    from fedq.data import text
    from fedq.data.tokens import train_bpe

    try:
        found = text.read_files(list(spec.dataset_args.get("files") or ()),
                                Path(spec.data_dir) if spec.data_dir else None,
                                str(spec.dataset_args.get("field", "text")))
        data = train_bpe([body for _, body, _ in found], int(match.group(1)))
    except FedqError as exc:
        raise SpecError(f"dataset_args.tokenizer: {name}: {exc}") from None
    folder = settings.home / "tokenizers" / digests.short(digests.of(data))
    path = folder / "tokenizer.json"
    if not path.is_file() or path.read_bytes() != data:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tokenizer.json.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return spec.model_copy(update={"dataset_args": {**spec.dataset_args,
                                                    "tokenizer": str(folder)}}), path


def _shipped(spec: JobSpec) -> list[Path]:
    """The checkpoint files a job with ``model_args.ship_base`` puts in the blob store
    (fedq/models/hf.py, ``shipped_files``); none for any other job."""
    if not spec.model_args.get("ship_base"):
        return []
    from fedq.models.hf import shipped_files

    return shipped_files(Path(str(spec.model_args["path"])).expanduser())


def _remove(settings: Settings, job_id: str) -> None:
    try:
        with session_scope(settings.database_url) as s:
            job = s.get(Job, job_id)
            if job is not None:
                s.delete(job)
    finally:
        store_for(settings).delete_prefix(job_prefix(job_id))


def cancel(settings: Settings, job_id: str) -> int:
    """Stop a running job: no more dispatch, its open round closed, its outstanding
    training tasks revoked. Returns how many task ids were revoked."""
    get_job(settings, job_id)
    check_broker()  # before anything changes: revoking needs it
    with session_scope(settings.database_url) as s:
        moved = s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.RUNNING)
                          .values(status=JobStatus.CANCELLED, error="cancelled by user",
                                  finished_at=utcnow()))
        if moved.rowcount != 1:  # type: ignore[attr-defined]
            job = s.get(Job, job_id)
            raise FedqError(f"job {job_id} is {job.status if job else 'gone'}, not running")
        from fedq.coordinator.buffered import cancel_ids  # (loads torch: only here)

        ids: list[str] = cancel_ids(s, job_id)
        for rnd in s.scalars(select(Round).where(Round.job_id == job_id,
                                                 Round.status == RoundStatus.TRAINING)):
            ids += [t for tids in round_task_ids(job_id, rnd).values() for t in tids]
            rnd.status, rnd.error, rnd.finished_at = RoundStatus.FAILED, "cancelled", utcnow()
    if ids:
        try:
            revoke(ids, "its job was cancelled", stop=True)
        except Exception as exc:  # kombu raises transport-specific errors
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ServiceUnavailable(
                f"job {job_id} is cancelled (no more rounds start), but its {len(ids)} "
                f"open task(s) could not be revoked: broker unreachable: {first}; they "
                "finish and are recorded as late") from None
    return len(ids)


def resume(settings: Settings, job_id: str) -> int:
    """Restart a failed or cancelled job from its last committed round; returns the
    round it restarts at. Rounds after the last committed one are discarded."""
    check_broker()
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id!r}")
        if job.status not in RESUMABLE:
            raise FedqError(f"job {job_id} is {job.status}; only a failed or cancelled job "
                            "can be resumed")
        after, was, ended = job.committed_round, job.status, job.finished_at
        if JobSpec.stored(job.spec).buffered:
            # A buffered job's rows stay (their task numbers, and so their task ids,
            # are never used again): what waited for a discarded version is closed.
            s.execute(update(ClientUpdate).where(
                ClientUpdate.job_id == job_id,
                ClientUpdate.status.in_((UpdateStatus.TRAINING, UpdateStatus.BUFFERED))).values(
                    status=UpdateStatus.CANCELLED, error="discarded by resume"))
        else:
            s.execute(delete(ClientUpdate).where(ClientUpdate.job_id == job_id,
                                                 ClientUpdate.round_number > after))
        s.execute(delete(Round).where(Round.job_id == job_id, Round.number > after))
        s.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.RUNNING, error=None,
                                                            finished_at=None))
    try:
        request_round(job_id, after + 1)
    except broker_errors() as exc:  # the job goes back to how it was, to be resumed again
        why = refusal(exc)
        with session_scope(settings.database_url) as s:
            s.execute(update(Job).where(Job.id == job_id).values(
                status=was, error=f"the broker refused to resume it: {why}",
                finished_at=ended))
        raise ServiceUnavailable(f"the broker refused to resume job {job_id} ({why}); it "
                                 f"stays {was}") from None
    return after + 1


@dataclass(frozen=True)
class JobView:
    id: str
    name: str
    status: str
    committed_round: int
    total_rounds: int
    accuracy: float | None
    error: str | None
    created_at: str
    spec: dict[str, Any]  # as stored

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "spec"}


def get_job(settings: Settings, job_id: str) -> JobView:
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(f"no job {job_id!r} in {settings.database_url.split('@')[-1]}")
        return _view(s, job)


def list_jobs(settings: Settings, limit: int = 20) -> list[JobView]:
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        jobs = s.scalars(select(Job).order_by(Job.created_at.desc()).limit(limit)).all()
        return [_view(s, j) for j in jobs]


def _view(s: Any, job: Job) -> JobView:
    acc = s.scalar(select(Round.accuracy).where(Round.job_id == job.id,
                                                Round.number == job.committed_round))
    return JobView(job.id, job.name, job.status, job.committed_round, job.total_rounds,
                   acc, job.error, job.created_at.isoformat(timespec="seconds"),
                   job.spec)


ROUND_FIELDS = ("round", "status", "accuracy", "eval_loss", "train_loss", "seconds",
                "participants", "planned", "samples", "bytes_up", "raw_bytes_up",
                "compression_ratio", "bytes_down", "epsilon", "tokens", "tokens_per_second",
                "perplexity", "staleness_mean", "staleness_max", "finalize_seconds",
                "started_at", "finished_at", "error")


def round_results(settings: Settings, job_id: str) -> list[dict[str, Any]]:
    """One dict per round (in order) with the fields of ROUND_FIELDS."""
    get_job(settings, job_id)
    with session_scope(settings.database_url) as s:
        rounds = s.scalars(select(Round).where(Round.job_id == job_id)
                           .order_by(Round.number)).all()
        # language models: the tokens trained into each round's model (PostgreSQL sums
        # come back as Decimal)
        tokens = {number: int(total) for number, total in s.execute(
            select(ClientUpdate.round_number, func.sum(ClientUpdate.tokens))
            .where(ClientUpdate.job_id == job_id, ClientUpdate.status == UpdateStatus.OK)
            .group_by(ClientUpdate.round_number)).tuples() if total}
        # buffered jobs: how stale the updates each version used were
        stale = {number: (float(mean), int(top)) for number, mean, top in s.execute(
            select(ClientUpdate.round_number, func.avg(ClientUpdate.staleness),
                   func.max(ClientUpdate.staleness))
            .where(ClientUpdate.job_id == job_id, ClientUpdate.status == UpdateStatus.OK,
                   ClientUpdate.staleness.is_not(None))
            .group_by(ClientUpdate.round_number)).tuples()}
        return [{"round": r.number, "status": r.status, "accuracy": r.accuracy,
                 "eval_loss": r.eval_loss, "train_loss": r.train_loss, "seconds": r.seconds,
                 "participants": r.participants, "planned": len(r.planned.get("clients", [])),
                 "samples": r.samples, "bytes_up": r.bytes_up, "raw_bytes_up": r.raw_bytes_up,
                 "compression_ratio": (r.raw_bytes_up / r.bytes_up
                                       if r.bytes_up and r.raw_bytes_up else None),
                 "bytes_down": r.bytes_down, "epsilon": r.epsilon,
                 "tokens": tokens.get(r.number) or None,
                 "tokens_per_second": tokens[r.number] / r.seconds
                 if r.number in tokens and r.seconds else None,
                 "perplexity": math.exp(r.eval_loss)
                 if r.number in tokens and r.eval_loss is not None else None,
                 "staleness_mean": stale[r.number][0] if r.number in stale else None,
                 "staleness_max": stale[r.number][1] if r.number in stale else None,
                 "started_at": aware(r.started_at).isoformat(),
                 "finished_at": aware(r.finished_at).isoformat() if r.finished_at else None,
                 "finalize_seconds": r.finalize_seconds,
                 "error": r.error} for r in rounds]


def job_record(settings: Settings, job_id: str) -> dict[str, Any]:
    """The job's row as a dict, its spec included (for reports)."""
    get_job(settings, job_id)  # JobNotFound
    with session_scope(settings.database_url) as s:
        job = s.get(Job, job_id)
        assert job is not None
        return {"id": job.id, "name": job.name, "status": job.status, "spec": job.spec,
                "committed_round": job.committed_round, "total_rounds": job.total_rounds,
                "error": job.error, "created_at": aware(job.created_at).isoformat()}


def client_results(settings: Settings, job_id: str) -> list[dict[str, Any]]:
    """One dict per client update row, by round then client."""
    with session_scope(settings.database_url) as s:
        rows = s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job_id)
                         .order_by(ClientUpdate.round_number, ClientUpdate.client,
                                   ClientUpdate.task_index)).all()
        # when each task was sent: a synchronous round sends all at its start (its row
        # is written at the commit); a buffered task's row is written when it is sent
        opened = {n: aware(t) for n, t in s.execute(
            select(Round.number, Round.started_at).where(Round.job_id == job_id)).tuples()}
        return [{"round": r.round_number, "client": r.client, "status": r.status,
                 "queue": r.queue, "worker": r.worker, "samples": r.samples,
                 "processed": r.processed, "steps": r.steps,
                 "seconds": r.seconds, "loss": r.loss, "bytes_up": r.bytes_up,
                 "raw_bytes": r.raw_bytes, "bytes_down": r.bytes_down,
                 "update_norm": r.update_norm, "train_seconds": r.train_seconds,
                 "device": r.device, "amp": r.amp, "stopped_by_budget": r.stopped_by_budget,
                 "gpu_peak_mb": r.gpu_peak_mb, "gpu_util": r.gpu_util, "tokens": r.tokens,
                 "host_peak_mb": r.host_peak_mb,
                 "task": r.task_index or None, "base_version": r.base_version,
                 "staleness": r.staleness, "weight": r.weight,
                 "dispatched_at": (aware(r.created_at) if r.task_index or
                                   r.round_number not in opened
                                   else opened[r.round_number]).isoformat(),
                 "started_at": aware(r.started_at).isoformat() if r.started_at else None,
                 "download_seconds": r.download_seconds, "upload_seconds": r.upload_seconds,
                 "error": r.error} for r in rows]



__all__ = ["FINISHED", "JobView", "cancel", "client_results", "get_job", "job_record",
           "list_jobs", "resume", "round_results", "submit"]


def repairs(settings: Settings, job_id: str, last: int = 20) -> list[str]:
    """The job's last repairs, oldest first, one line each: re-dispatches of lost or
    overdue clients, late copies recorded, stuck rounds finalized."""
    with session_scope(settings.database_url) as s:
        rows = list(s.scalars(select(WatchdogAction).where(WatchdogAction.job_id == job_id)
                              .order_by(WatchdogAction.id.desc()).limit(last)))
        return [f"{aware(a.at):%H:%M:%S}"
                f"{f' round {a.round_number}' if a.round_number is not None else ''}: "
                f"{a.action}{f' ({a.result})' if a.result else ''}" for a in reversed(rows)]
