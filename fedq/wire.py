"""What may cross the wire between the coordinator and a worker, checked at the edge.

Everything a worker sends is hostile until parsed here (docs/security.md): a training
task's result is read by :class:`ResultModel`, one strict pydantic model with a type,
range and length for every field (strings fit their SQL columns, integers their SQL
types, floats are finite); what does not parse is a rejected update with one line
saying which field was wrong. A worker checks the task it is sent the same way
(:func:`check_task`) before it builds a path or a key from it.

``MESSAGE_FORMAT`` is the version of these messages: a worker and a coordinator of
different formats refuse each other's tasks and results (the version handshake).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import fedq
from fedq.digest import DIGEST, FORMS, is_digest

#: Version of the task and result messages; bump it when their meaning changes.
#: 3: a buffered task's number travels as ``task``, not ``round``; 4: blob digests
#: may be BLAKE3 (fedq/digest.py), which a worker of format 3 would refuse
MESSAGE_FORMAT = 4
FEDQ_VERSION = fedq.__version__

INT32 = 2**31 - 1  # SQL INTEGER
INT64 = 2**63 - 1  # SQL BIGINT

# The shapes fedq itself generates (fedq/blobs/keys.py, fedq/coordinator/jobs.py):
# path-safe (no '/', no '..'), within their columns.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
QUEUE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
#: A blob digest field (fedq/digest.py: BLAKE3, or SHA-256 in jobs begun before).
BlobDigest = Annotated[str, Field(pattern=f"^({DIGEST.pattern})$")]
_MODEL_KEY = r"jobs/{job}/r\d{{5}}/(global|step)(-[0-9a-f]{{1,16}})?\.safetensors"
_UPDATE_KEY = r"jobs/{job}/r\d{{5}}/updates/c\d{{6}}-a\d+\.safetensors"


class FormatError(ValueError):
    """A message that is not in the shape fedq generates."""


def is_job_id(value: object) -> bool:
    return isinstance(value, str) and JOB_ID.fullmatch(value) is not None


def check_job_id(value: object) -> str:
    if not is_job_id(value):
        raise FormatError(f"job id {str(value)[:40]!r} is not a fedq job id "
                          f"({JOB_ID.pattern})")
    return str(value)


def check_blob_digest(value: object, what: str = "sha256") -> str:
    if not is_digest(value):
        raise FormatError(f"{what} {str(value)[:80]!r} is not a blob digest ({FORMS})")
    return str(value)


def check_model_key(key: object, job: str) -> str:
    """A global model's or step's key of job ``job``, as fedq/blobs/keys.py makes it."""
    if not isinstance(key, str) or \
            re.fullmatch(_MODEL_KEY.format(job=re.escape(job)), key) is None:
        raise FormatError(f"model key {str(key)[:120]!r} is not a model key of job {job}")
    return key


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
    for field in ("round", "task", "client", "attempt", "gen"):
        value = data.get(field, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT32:
            raise FormatError(f"task field {field!r} is {str(value)[:40]!r}, not an integer "
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


Finite = Annotated[float, Field(allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
Int32 = Annotated[int, Field(ge=0, le=INT32)]
Int64 = Annotated[int, Field(ge=0, le=INT64)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StatsModel(_Strict):
    """:class:`fedq.refs.TrainStats` as a worker may send it."""

    seen: Int32 = 0
    train_seconds: Seconds = 0.0
    raw_bytes: Int64 = 0
    stopped_by_budget: bool = False
    amp: Literal["bf16", "fp16", "off"] = "off"
    device: str = Field(default="cpu", max_length=32)
    gpu_peak_mb: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] | None = None
    gpu_util: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    tokens: Int64 = 0
    started: Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)] | None = None
    download_seconds: Seconds = 0.0
    upload_seconds: Seconds = 0.0
    codec: Literal["", "none", "fp16", "int8"] = ""
    uplink_mbit: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] | None = None
    yielded: bool = False


class ResultModel(_Strict):
    """A training task's result as a worker may send it (:class:`fedq.refs.UpdateRef`)."""

    status: Literal["ok", "error", "yielded"]
    job: str = Field(max_length=32)
    round: Int32
    client: Int32
    queue: str = Field(max_length=32)
    task: Int32 = 0
    worker: str = Field(min_length=1, max_length=200)
    key: str | None = Field(default=None, max_length=300)
    sha256: BlobDigest | None = None
    samples: Int32 = 0
    steps: Int32 = 0
    loss: Finite | None = None
    seconds: Seconds = 0.0
    bytes_up: Int64 = 0
    bytes_down: Int64 = 0
    error: str | None = Field(default=None, max_length=4000)
    attempt: Annotated[int, Field(ge=1, le=INT32)] = 1
    gen: Int32 = 0
    format: int = MESSAGE_FORMAT
    version: str = Field(default=FEDQ_VERSION, max_length=32)
    stats: StatsModel = Field(default_factory=StatsModel)
    # FEDQ_IDENTITY=required (fedq/identity.py): the registered worker that signed it
    signer: str | None = Field(default=None, max_length=64)
    sig: str | None = Field(default=None, max_length=200)


def parse_result(data: Any) -> ResultModel:
    """The result, or :class:`FormatError` with one line naming the first bad field."""
    if not isinstance(data, dict):
        raise FormatError(f"result is a {type(data).__name__}, not an object")
    try:
        return ResultModel.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "result"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {str(value)[:60]!r})"
        raise FormatError(f"malformed result: {where}: {err['msg']}{shown}") from None


#: The result-backend state a running training task's claim and heartbeat are written
#: with (Celery's own name for a started task): fedq/worker/heartbeat.py writes it,
#: fedq/coordinator/liveness.py reads it.
CLAIM_STATE = "STARTED"


@dataclass(frozen=True)
class Beat:
    """A running task's claim as its worker wrote it: who, and a counter that moves."""

    host: str
    beat: int


def read_claim(meta: Any) -> Beat | None:
    """The claim in a task's result-backend meta, or None (not started, finished, or not
    a claim: a worker could have written anything there)."""
    if not isinstance(meta, dict) or meta.get("status") != CLAIM_STATE:
        return None
    body = meta.get("result")
    if not isinstance(body, dict):
        return None
    host, beat = body.get("hostname"), body.get("beat")
    if not isinstance(host, str) or not 0 < len(host) <= 200 or \
            not isinstance(beat, int) or isinstance(beat, bool) or not 0 <= beat <= INT32:
        return None
    return Beat(host, beat)
