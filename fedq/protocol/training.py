"""A training task and its result, the JSON messages of training (never weights).

The coordinator sends :class:`TrainRef`; a worker checks it (:func:`check_task`)
before it builds a path or a key from it. The worker answers with :class:`UpdateRef`
(and its :class:`TrainStats`): one frozen dataclass each, whose field annotations are
both what the code builds and the strict check of what a worker sends
(:func:`parse_result`: a type, range and length for every field, no coercion; what
does not parse is a rejected update with one line naming the field). A new result
field is one annotated field here, its row mapping (fedq/db/rows.py) and a migration.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictStr, TypeAdapter, ValidationError

from fedq.blobs.ref import BlobRef
from fedq.protocol.envelope import (
    FEDQ_VERSION,
    INT32,
    INT64,
    MESSAGE_FORMAT,
    QUEUE,
    BlobDigest,
    Finite,
    Flag,
    FormatError,
    Int32,
    Int64,
    Seconds,
    check_blob_digest,
    check_job_id,
    check_model_key,
    first_error,
)

_UPDATE_KEY = r"jobs/{job}/r\d{{5}}/updates/c\d{{6}}-a\d+\.safetensors"
#: How a worker's result is checked: every field as annotated, nothing else.
_STRICT = ConfigDict(extra="forbid")
Name = Annotated[StrictStr, Field(min_length=1, max_length=200)]  # a worker's host name
Short = Annotated[StrictStr, Field(max_length=32)]  # a job id, queue, device, version
Key = Annotated[StrictStr, Field(max_length=300)]  # a blob key
ErrorText = Annotated[StrictStr, Field(max_length=4000)]
Megabytes = Annotated[float, Field(strict=True, ge=0, le=1e9, allow_inf_nan=False)]
Percent = Annotated[float, Field(strict=True, ge=0, le=100, allow_inf_nan=False)]
UnixTime = Annotated[float, Field(strict=True, ge=0, le=1e11, allow_inf_nan=False)]


@dataclass(frozen=True)
class StepRef:
    """The global model as an int8 step from the previous one (``compression:
    {downlink: int8}``, fedq/aggregate/downlink.py): the step blob and the sha256 of
    the previous global model's blob, which a worker must hold to use it."""

    blob: BlobRef
    base: str

    def to_json(self) -> dict[str, Any]:
        return {**self.blob.to_json(), "base": self.base}

    @classmethod
    def from_json(cls, data: Any) -> "StepRef | None":
        if not data:
            return None
        return cls(BlobRef.from_json(data), str(data["base"]))


@dataclass(frozen=True)
class TrainRef:
    """What a training task needs: its job's spec, its place, and the global model's ref.

    ``round``: the round it trains for (a buffered task: the model version it trains
    from, plus one); ``task``: a buffered job's task number (0 in synchronous rounds)."""

    job: str
    round: int
    client: int
    queue: str
    spec: dict[str, Any]
    model: BlobRef
    attempt: int = 1  # dispatch attempt of this round (re-dispatch after a deadline)
    gen: int = 0  # the round row's id: tells a resumed round from the one it replaced
    step: StepRef | None = None  # the model as a step from the previous one, if published
    task: int = 0  # a buffered job's task number (0: a synchronous round's task)
    # presigned URLs for its blobs ({"get": {key: url}, "put": {key: url}}), where the
    # workers hold no S3 key (FEDQ_PRESIGN_ENDPOINT; fedq/blobs/presigned.py)
    links: dict[str, dict[str, str]] | None = None

    @property
    def number(self) -> int:
        """What names this task's update and seeds its training: the task number in a
        buffered job, the round otherwise."""
        return self.task or self.round

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "round": self.round, "task": self.task, "client": self.client,
                "queue": self.queue, "spec": self.spec, "model": self.model.to_json(),
                "attempt": self.attempt, "gen": self.gen,
                "step": self.step.to_json() if self.step else None,
                "format": MESSAGE_FORMAT, **({"links": self.links} if self.links else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainRef":
        """Parse a task: :class:`fedq.wire.FormatError` unless it has the shape fedq
        generates (checked before any field is used)."""
        check_task(data)
        return cls(job=str(data["job"]), round=int(data["round"]), client=int(data["client"]),
                   queue=str(data["queue"]), spec=dict(data["spec"]),
                   model=BlobRef.from_json(data["model"]), attempt=int(data.get("attempt", 1)),
                   gen=int(data.get("gen", 0)), step=StepRef.from_json(data.get("step")),
                   task=int(data.get("task", 0)), links=data.get("links"))


@dataclass(frozen=True)
class TrainStats:
    """How the training went on the worker, beyond what FedAvg needs."""

    __pydantic_config__ = _STRICT

    seen: Int32 = 0  # samples processed, counting repeats (the ``processed`` weight)
    train_seconds: Seconds = 0.0  # the training loop alone (no download, upload)
    raw_bytes: Int64 = 0  # float32 size of the delta before its codec
    stopped_by_budget: Flag = False  # the time budget ended training before its steps did
    amp: Annotated[StrictStr, Field(pattern="^(bf16|fp16|off)$")] = "off"  # mixed precision
    device: Short = "cpu"  # cpu | cuda:N | mps
    gpu_peak_mb: Megabytes | None = None  # peak GPU memory torch allocated in the task
    gpu_util: Percent | None = None  # mean GPU utilisation (%) sampled during training
    host_peak_mb: Megabytes | None = None  # peak resident memory of the process that trained
    tokens: Int64 = 0  # language models: tokens processed (samples processed x context)
    started: UnixTime | None = None  # the task's start, Unix seconds on the worker's clock
    download_seconds: Seconds = 0.0  # fetching the global model (0: this process kept it)
    upload_seconds: Seconds = 0.0  # encoding and storing the update
    # the update's codec (``codec: auto`` picks it per worker)
    codec: Annotated[StrictStr, Field(pattern="^(|none|fp16|int8)$")] = ""
    uplink_mbit: Megabytes | None = None  # the worker's uplink (Mbit/s): its last large upload
    yielded: Flag = False  # a partial update: training stopped early for the machine's owner


#: Uploads smaller than this say more about latency than about a link's rate: the
#: uplink is measured (worker, ``fedq workers``) only from larger ones.
MEASURE_UPLINK_BYTES = 1 << 20


@dataclass(frozen=True)
class UpdateRef:
    """What a training task returns: status ok|error|yielded (stopped for the machine's
    owner with too little done to send: fedq/worker/owner.py), where its update lies,
    what it did. The coordinator's verdict on a result is an UpdateRef too, with status
    ``rejected`` (fedq/coordinator/intake.py), which no worker may send."""

    __pydantic_config__ = _STRICT

    status: Annotated[StrictStr, Field(pattern="^(ok|error|yielded)$")]
    job: Short
    round: Int32
    client: Int32
    queue: Short
    worker: Name
    key: Key | None = None
    sha256: BlobDigest | None = None
    samples: Int32 = 0
    steps: Int32 = 0
    loss: Finite | None = None
    seconds: Seconds = 0.0
    bytes_up: Int64 = 0
    bytes_down: Int64 = 0
    error: ErrorText | None = None
    attempt: Annotated[int, Field(strict=True, ge=1, le=INT32)] = 1
    gen: Int32 = 0
    stats: TrainStats = field(default_factory=TrainStats)
    format: Annotated[int, Field(strict=True)] = MESSAGE_FORMAT  # the sender's format
    version: Short = FEDQ_VERSION  # its fedq version
    task: Int32 = 0  # a buffered job's task number (0: a synchronous round's update)
    # FEDQ_IDENTITY=required (fedq/identity.py): the registered worker whose signature
    # it carried, and the signature (dropped once admitted)
    signer: Annotated[StrictStr, Field(max_length=64)] | None = None
    sig: Annotated[StrictStr, Field(max_length=200)] | None = None

    @property
    def blob(self) -> BlobRef:
        assert self.key is not None and self.sha256 is not None
        return BlobRef(self.key, self.sha256, self.bytes_up)

    def to_json(self) -> dict[str, Any]:
        """The result as a worker sends it (``signer`` and ``sig`` only when it signs:
        :meth:`fedq.identity.Joined.sign_result` adds them)."""
        data = asdict(self)
        for name in ("signer", "sig"):
            if data[name] is None:
                del data[name]
        return data

    @classmethod
    def from_json(cls, data: Any) -> "UpdateRef":
        """A result as the worker wrote it, for code that trusts its source (a row this
        coordinator stored). Results from the wire go through
        :func:`fedq.coordinator.intake.admit`, which checks every field."""
        return parse_result(data)


_RESULT: TypeAdapter[UpdateRef] = TypeAdapter(UpdateRef)


def parse_result(data: Any) -> UpdateRef:
    """A worker's result as annotated in :class:`UpdateRef`, or :class:`FormatError`
    with one line naming the first bad field."""
    if not isinstance(data, dict):
        raise FormatError(f"result is a {type(data).__name__}, not an object")
    try:
        return _RESULT.validate_python(data)
    except ValidationError as exc:
        raise FormatError(first_error(exc, "result")) from None


def check_task(data: Any) -> None:
    """Raise :class:`FormatError` unless ``data`` (a training task's argument) has the
    shape fedq generates: its format, job id, queue, model key and hashes. A worker
    calls it before it reads anything else of the task."""
    if not isinstance(data, dict):
        raise FormatError(f"task is a {type(data).__name__}, not an object")
    fmt = data.get("format", 1)
    if fmt != MESSAGE_FORMAT:
        raise FormatError(f"task message format {fmt!r}, this worker speaks "
                          f"{MESSAGE_FORMAT} (fedq {FEDQ_VERSION}): run the same fedq "
                          f"version on the coordinator and the workers")
    job = check_job_id(data.get("job"))
    for name in ("round", "task", "client", "attempt", "gen"):
        value = data.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT32:
            raise FormatError(f"task field {name!r} is {str(value)[:40]!r}, not an integer "
                              f"in 0..{INT32}")
    if not isinstance(data.get("queue"), str) or QUEUE.fullmatch(data["queue"]) is None:
        raise FormatError(f"task queue {str(data.get('queue'))[:40]!r} is not a queue name")
    for name in ("model", "step"):
        blob = data.get(name)
        if blob is None and name == "step":
            continue
        if not isinstance(blob, dict):
            raise FormatError(f"task field {name!r} is not a blob reference")
        check_model_key(blob.get("key"), job)
        check_blob_digest(blob.get("sha256"), f"{name} sha256")
        size = blob.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= INT64:
            raise FormatError(f"{name} size {str(size)[:40]!r} is not a byte count")
        if name == "step":
            check_blob_digest(blob.get("base"), "step base")
    if not isinstance(data.get("spec"), dict):
        raise FormatError("task field 'spec' is not an object")
    links = data.get("links")
    if links is not None:
        _check_links(links, job)


def _check_links(links: Any, job: str) -> None:
    """Presigned URLs: a GET per model key of the job, one PUT for an update key."""
    if not isinstance(links, dict) or set(links) - {"get", "put"}:
        raise FormatError("task field 'links' is not {get: {...}, put: {...}}")
    for method, table in links.items():
        if not isinstance(table, dict) or len(table) > (2 if method == "get" else 1):
            raise FormatError(f"task links {method!r}: not a small table of key -> URL")
        for key, url in table.items():
            if method == "get":
                check_model_key(key, job)
            elif not isinstance(key, str) or re.fullmatch(_UPDATE_KEY.format(
                    job=re.escape(job)), key) is None:
                raise FormatError(f"task link key {str(key)[:120]!r} is not an update key of "
                                  f"job {job}")
            if not isinstance(url, str) or len(url) > 4096 or \
                    not url.startswith(("http://", "https://")):
                raise FormatError(f"task link for {str(key)[:80]} is not an http(s) URL")


