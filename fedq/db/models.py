"""SQLAlchemy 2 typed ORM. The schema itself is made only by migrations/ (Alembic)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def aware(ts: datetime) -> datetime:
    """SQLite hands back naive datetimes; they were written as UTC."""
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)


def worker_time(started: float | None) -> datetime | None:
    """A worker's Unix timestamp as an aware datetime (None stays None)."""
    return None if started is None else datetime.fromtimestamp(started, tz=timezone.utc)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)  # fedq.status.JobStatus
    total_rounds: Mapped[int] = mapped_column(Integer)
    committed_round: Mapped[int] = mapped_column(Integer, default=0)  # 0: none yet
    global_key: Mapped[str] = mapped_column(String(300))
    global_sha256: Mapped[str] = mapped_column(String(64))
    global_size: Mapped[int] = mapped_column(BigInteger)
    # the server optimizer's state after the last committed round (None: stateless)
    state_key: Mapped[str | None] = mapped_column(String(300), default=None)
    state_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    state_size: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # Migration 0009: the global model as an int8 step from the previous one
    # (compression: {downlink: int8}); step_base is the previous global blob's sha256
    step_key: Mapped[str | None] = mapped_column(String(300), default=None)
    step_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    step_size: Mapped[int | None] = mapped_column(BigInteger, default=None)
    step_base: Mapped[str | None] = mapped_column(String(64), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow,
                                                 onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class Round(Base):
    __tablename__ = "rounds"
    __table_args__ = (
        UniqueConstraint("job_id", "number", name="uq_rounds_job_number"),
        # a round's id names its task generation (task ids, result filtering): SQLite
        # must never hand a deleted round's id to the round that replaces it on resume
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), index=True)  # fedq.status.RoundStatus
    planned: Mapped[dict[str, Any]] = mapped_column(JSON)  # {"clients": [...], "queues": [...]}
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # synchronous rounds: when the round is finalized with what it has
    deadline: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # buffered versions: when it held its K updates (the watchdog applies one left full)
    full_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    seconds: Mapped[float | None] = mapped_column(Float, default=None)
    participants: Mapped[int | None] = mapped_column(Integer, default=None)
    samples: Mapped[int | None] = mapped_column(BigInteger, default=None)
    train_loss: Mapped[float | None] = mapped_column(Float, default=None)
    eval_loss: Mapped[float | None] = mapped_column(Float, default=None)
    accuracy: Mapped[float | None] = mapped_column(Float, default=None)
    bytes_up: Mapped[int | None] = mapped_column(BigInteger, default=None)
    raw_bytes_up: Mapped[int | None] = mapped_column(BigInteger, default=None)  # uncompressed
    bytes_down: Mapped[int | None] = mapped_column(BigInteger, default=None)
    epsilon: Mapped[float | None] = mapped_column(Float, default=None)  # DP spent so far
    global_key: Mapped[str | None] = mapped_column(String(300), default=None)
    global_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    finalize_seconds: Mapped[float | None] = mapped_column(Float, default=None)


class ClientUpdate(Base):
    __tablename__ = "client_updates"
    __table_args__ = (
        UniqueConstraint("job_id", "round_number", "client", "task_index",
                         name="uq_updates_job_round_client_task"),
        Index("ix_updates_job_task", "job_id", "task_index"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    round_number: Mapped[int] = mapped_column(Integer)
    client: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # fedq.status.UpdateStatus
    queue: Mapped[str | None] = mapped_column(String(32), default=None)
    worker: Mapped[str | None] = mapped_column(String(200), default=None)
    samples: Mapped[int] = mapped_column(Integer, default=0)  # shard size
    processed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    steps: Mapped[int] = mapped_column(Integer, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    loss: Mapped[float | None] = mapped_column(Float, default=None)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    raw_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    update_norm: Mapped[float | None] = mapped_column(Float, default=None)
    blob_key: Mapped[str | None] = mapped_column(String(300), default=None)
    blob_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    # How it trained (fedq.protocol.training.TrainStats): loop seconds, device, AMP, budget
    # stop, GPU, host memory.
    train_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    device: Mapped[str | None] = mapped_column(String(32), default=None)
    amp: Mapped[str | None] = mapped_column(String(8), default=None)
    stopped_by_budget: Mapped[bool | None] = mapped_column(Boolean, default=None)
    yielded: Mapped[bool | None] = mapped_column(Boolean, default=None)  # 0014: partial
    gpu_peak_mb: Mapped[float | None] = mapped_column(Float, default=None)
    gpu_util: Mapped[float | None] = mapped_column(Float, default=None)
    host_peak_mb: Mapped[float | None] = mapped_column(Float, default=None)  # 0022
    tokens: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # Buffered jobs (fedq/coordinator/buffered.py): the task's number within the job
    # (0 for synchronous rows), its dispatch attempt, the model version it trained
    # from, and at the version it went into: its staleness and aggregation weight.
    task_index: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    base_version: Mapped[int | None] = mapped_column(Integer, default=None)
    staleness: Mapped[int | None] = mapped_column(Integer, default=None)
    weight: Mapped[float | None] = mapped_column(Float, default=None)
    # Where the task's time went (migration 0007): its start on the worker's clock and
    # the seconds of the model download and the update upload.
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    download_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    upload_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    # Migration 0008: the update's codec, the worker's uplink (Mbit/s) as it measured it.
    codec: Mapped[str | None] = mapped_column(String(16), default=None)
    uplink_mbit: Mapped[float | None] = mapped_column(Float, default=None)
    # Migration 0013: the registered worker whose signature the result carried
    # (FEDQ_IDENTITY=required; fedq/identity.py).
    signer: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Worker(Base):
    __tablename__ = "workers"

    hostname: Mapped[str] = mapped_column(String(200), primary_key=True)
    queues: Mapped[list[Any]] = mapped_column(JSON)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSON)
    tasks_done: Mapped[int] = mapped_column(Integer, default=0)
    samples_per_second: Mapped[float | None] = mapped_column(Float, default=None)
    tasks_failed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    gpu_peak_mb: Mapped[float | None] = mapped_column(Float, default=None)  # last task
    gpu_util: Mapped[float | None] = mapped_column(Float, default=None)  # last task, %
    last_task_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                          default=None)
    # The uplink (Mbit/s) its last large upload measured, and the codec it last sent.
    uplink_mbit: Mapped[float | None] = mapped_column(Float, default=None)
    codec: Mapped[str | None] = mapped_column(String(16), default=None)
    # Migration 0010: what it registered with (the version handshake, fedq/protocol/envelope.py).
    fedq_version: Mapped[str | None] = mapped_column(String(32), default=None)
    message_format: Mapped[int | None] = mapped_column(Integer, default=None)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Migration 0014: whether its owner's conditions let it train (fedq/worker/owner.py;
    # None: it never reported, a worker without a run policy), why not, since when.
    available: Mapped[bool | None] = mapped_column(Boolean, default=None)
    away_reason: Mapped[str | None] = mapped_column(String(200), default=None)
    available_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True),
                                                             default=None)
    # Migration 0016: the registered worker whose signed control message first named
    # this hostname (FEDQ_IDENTITY=required); None: it never sent one
    signer: Mapped[str | None] = mapped_column(String(48), default=None)


class Availability(Base):
    """One change of a worker's availability as it reported it (migration 0014)."""

    __tablename__ = "worker_availability"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hostname: Mapped[str] = mapped_column(String(200), index=True)
    available: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(String(200), default=None)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RegisteredWorker(Base):
    """A worker machine with its own key (migration 0013; fedq/identity.py): ``invited``
    by ``fedq worker add`` (the sha256 of its one-time token), ``active`` once ``fedq
    worker join`` registered its Ed25519 public key, ``revoked`` by ``fedq worker
    revoke``: its results are rejected from then on."""

    __tablename__ = "registered_workers"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    queues: Mapped[str] = mapped_column(String(200))  # comma-separated
    state: Mapped[str] = mapped_column(String(16))  # invited | active | revoked
    token_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    public_key: Mapped[str | None] = mapped_column(String(64), default=None)  # base64, raw
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    joined_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    # the SHA-256 (hex) of its Redis user's password: the user is made again from it
    # when Redis lost its ACL (migration 0021)
    redis_secret: Mapped[str | None] = mapped_column(String(64), default=None)


class Claim(Base):
    """A training task that has started, as the watchdog last read its heartbeat
    (migration 0012; fedq/coordinator/liveness.py). ``moved_at`` is when the
    coordinator saw ``beat`` change, by its own clock."""

    __tablename__ = "claims"

    task_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    client: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(200))
    beat: Mapped[int] = mapped_column(Integer)
    moved_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    resent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class WatchdogAction(Base):
    """One repair the watchdog made (fedq/coordinator/watchdog.py)."""

    __tablename__ = "watchdog_actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    job_id: Mapped[str] = mapped_column(String(32), index=True)
    round_number: Mapped[int | None] = mapped_column(Integer, default=None)
    action: Mapped[str] = mapped_column(String(64))
    result: Mapped[str | None] = mapped_column(String(32), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)  # a failed repair's reason


class ServeKey(Base):
    """An API key of ``fedq serve`` (migration 0017; fedq/serve/keys.py): its name,
    the sha256 of the key (the key itself is shown once), and when it was revoked."""

    __tablename__ = "serve_keys"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class InferenceJob(Base):
    """A batch inference job (migration 0015; fedq/inference/jobs.py)."""

    __tablename__ = "inference_jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)  # fedq.status.JobStatus
    items: Mapped[int] = mapped_column(Integer)
    shards: Mapped[int] = mapped_column(Integer)
    model_key: Mapped[str] = mapped_column(String(300))
    model_sha256: Mapped[str] = mapped_column(String(64))
    model_size: Mapped[int] = mapped_column(BigInteger)
    # the model's registry name, data set and arguments (from the training job or spec)
    arch: Mapped[dict[str, Any]] = mapped_column(JSON)
    classes: Mapped[int] = mapped_column(Integer)
    inputs_key: Mapped[str | None] = mapped_column(String(300), default=None)
    inputs_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    inputs_size: Mapped[int | None] = mapped_column(BigInteger, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class InferenceShard(Base):
    """One shard of an inference job: items ``start..stop-1``; its output blob once done
    (written once: a re-sent shard's second answer is dropped)."""

    __tablename__ = "inference_shards"
    __table_args__ = (UniqueConstraint("job_id", "shard"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("inference_jobs.id"), index=True)
    shard: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(Integer)
    stop: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))  # queued running done failed cancelled
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # dispatches so far
    # dispatches that do not count against max_redispatch: yields to an owner, and
    # those before a resume
    spared: Mapped[int] = mapped_column(Integer, default=0)
    # backup copies sent while an earlier attempt was still out (not failures either)
    backups: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # backup copies over the job's whole life: a resume starts ``backups`` again from 0
    # (the copies out before it were revoked) but keeps these, so that a copy sent
    # before a resume is not taken for a re-send afterwards
    copies: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    queue: Mapped[str | None] = mapped_column(String(32), default=None)
    worker: Mapped[str | None] = mapped_column(String(200), default=None)
    key: Mapped[str | None] = mapped_column(String(300), default=None)
    sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    size: Mapped[int | None] = mapped_column(BigInteger, default=None)
    seconds: Mapped[float | None] = mapped_column(Float, default=None)
    device: Mapped[str | None] = mapped_column(String(32), default=None)
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
