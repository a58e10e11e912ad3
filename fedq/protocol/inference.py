"""What crosses the wire for an inference shard, checked at the edge (docs/security.md).

The coordinator sends :class:`ShardTask`; the worker parses it before it reads anything
else, and writes its output only under the key :func:`output_key` makes from the
task's job, shard and attempt (never a key the task names). The worker's answer is
read by :class:`ShardResult`; its output blob is read back with its digest and a size
bound and every line is checked by :func:`check_output` before the shard counts."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedq.protocol.envelope import (
    FEDQ_VERSION,
    INT32,
    INT64,
    JOB_ID,
    MESSAGE_FORMAT,
    BlobDigest,
    FormatError,
    first_error,
)

Int32 = Annotated[int, Field(ge=0, le=INT32)]
Int64 = Annotated[int, Field(ge=0, le=INT64)]
Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
JobId = Annotated[str, Field(pattern=f"^{JOB_ID.pattern}$")]

#: The most bytes one output line may take, by operation (a classify line holds one
#: probability per class; a generated line its text: :func:`line_bytes`). The output
#: blob's bound is the line's times the shard's items.
LINE_BYTES = {"classify": 64 * 1024, "score": 256, "generate": 4 * 1024, "embed": 64 * 1024}

#: The most bytes one character of a text takes in a JSON line (``\uXXXX`` escapes
#: of a surrogate pair: 12 for two UTF-16 units, 6 a unit).
JSON_CHAR_BYTES = 6


def line_bytes(op: str, max_tokens: int = 0, token_chars: int = 1) -> int:
    """The most bytes one output line of ``op`` may take: :data:`LINE_BYTES`, and for a
    generated text of ``max_tokens`` tokens of at most ``token_chars`` characters each,
    room for every character escaped (:data:`JSON_CHAR_BYTES`) beside its keys."""
    if op != "generate":
        return LINE_BYTES[op]
    return max(LINE_BYTES[op], 2 * JSON_CHAR_BYTES * max_tokens * token_chars + 64)


def output_key(job: str, shard: int, attempt: int, worker: str | None = None) -> str:
    """Where a shard's output goes: under ``out/WORKER/`` when a registered worker made
    it (its Redis user may write there only: fedq/coordinator/acl.py)."""
    folder = f"{worker}/" if worker else ""
    return f"jobs/{job}/infer/out/{folder}s{shard:06d}-a{attempt}.jsonl"


def model_key(job: str) -> str:
    """Where ``fedq infer`` puts a model given as a file."""
    return f"jobs/{job}/infer/model.safetensors"


def inputs_key(job: str) -> str:
    return f"jobs/{job}/infer/inputs.json"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class Blob(_Strict):
    key: str = Field(max_length=300, pattern=r"^jobs/[A-Za-z0-9_-]{1,32}/[A-Za-z0-9_./-]+$")
    sha256: BlobDigest
    size: Int64


class Arch(_Strict):
    """The registry model to build and the data set that fixes its shapes."""

    name: str = Field(max_length=64)
    dataset: str = Field(max_length=64)
    args: dict[str, Any] = Field(default_factory=dict)
    dataset_args: dict[str, Any] = Field(default_factory=dict)


class ShardTask(_Strict):
    format: Literal[MESSAGE_FORMAT] = MESSAGE_FORMAT  # type: ignore[valid-type]
    job: JobId
    shard: Int32
    attempt: Annotated[int, Field(ge=1, le=INT32)]
    queue: str = Field(max_length=32, pattern=r"^[A-Za-z0-9_.-]+$")
    op: Literal["classify", "score", "generate", "embed"]
    start: Int32
    stop: Int32
    batch_size: Annotated[int, Field(ge=1, le=65_536)]
    model: Blob
    arch: Arch
    split: Literal["train", "test"] | None = None  # dataset inputs
    inputs: Blob | None = None  # prompt inputs
    sampling: dict[str, float | int] = Field(default_factory=dict)


class Completion(_Strict):
    prompt: str = Field(max_length=16_384)
    max_tokens: Annotated[int, Field(ge=1, le=4096)]
    temperature: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False)]
    top_k: Annotated[int, Field(ge=0, le=1_000_000)]
    seed: Int32


class ServeBatch(_Strict):
    """A batch of ``fedq serve`` requests (fedq/serve/)."""

    format: Literal[MESSAGE_FORMAT] = MESSAGE_FORMAT  # type: ignore[valid-type]
    op: Literal["classify", "generate", "embed"]
    model: Blob
    arch: Arch
    items: list[Any] = Field(min_length=1, max_length=4096)
    # some request of the batch is streamed: the worker writes its texts so far as it
    # generates (else it writes only the answer)
    stream: bool = False


class ShardResult(_Strict):
    status: Literal["ok", "error", "yielded"]
    job: JobId
    shard: Int32
    attempt: Annotated[int, Field(ge=1, le=INT32)]
    worker: str = Field(min_length=1, max_length=200)
    queue: str = Field(max_length=32)
    key: str | None = Field(default=None, max_length=300)
    sha256: BlobDigest | None = None
    size: Int64 = 0
    items: Int32 = 0
    seconds: Seconds = 0.0
    started: Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)] | None = None
    device: str = Field(default="cpu", max_length=32)
    error: str | None = Field(default=None, max_length=4000)
    version: str = Field(default=FEDQ_VERSION, max_length=32)
    signer: str | None = Field(default=None, max_length=48)  # a joined worker's name
    sig: str | None = Field(default=None, max_length=200)  # its signature (fedq/identity.py)


def parse_task(data: Any) -> ShardTask:
    if not isinstance(data, dict):
        raise FormatError(f"shard task is a {type(data).__name__}, not an object")
    if data.get("format", 1) != MESSAGE_FORMAT:
        raise FormatError(f"task message format {data.get('format')!r}, this worker speaks "
                          f"{MESSAGE_FORMAT} (fedq {FEDQ_VERSION}): run the same fedq "
                          "version on the coordinator and the workers")
    try:
        task = ShardTask.model_validate(data)
    except ValidationError as exc:
        raise FormatError(first_error(exc, "shard task")) from None
    if task.stop <= task.start:
        raise FormatError(f"shard task: empty range {task.start}..{task.stop}")
    if (task.split is None) == (task.inputs is None):
        raise FormatError("shard task: give one of split and inputs")
    return task


def parse_result(data: Any) -> ShardResult:
    if not isinstance(data, dict):
        raise FormatError(f"shard result is a {type(data).__name__}, not an object")
    try:
        return ShardResult.model_validate(data)
    except ValidationError as exc:
        raise FormatError(first_error(exc, "shard result")) from None


def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def check_output(data: bytes, op: str, start: int, stop: int, classes: int,
                 max_tokens: int | Sequence[int] = 0, token_chars: int = 1) -> None:
    """Raise :class:`FormatError` unless ``data`` is exactly one JSON line per item
    ``start..stop-1``, in order, each in the shape ``op`` writes; a generated text no
    longer than its item's ``max_tokens`` (one number for every item, or one an item)
    times ``token_chars``, the most characters one token of the model's tokenizer
    decodes to (1 for bytes: ``fedq.data.tokens``)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if len(lines) != stop - start:
        raise FormatError(f"output has {len(lines)} line(s), the shard {stop - start} item(s)")
    limits = [max_tokens] * (stop - start) if isinstance(max_tokens, int) else list(max_tokens)
    if op == "generate" and len(limits) != stop - start:
        raise FormatError(f"{len(limits)} max_tokens for {stop - start} item(s)")
    for n, raw in enumerate(lines):
        i = start + n
        bound = line_bytes(op, limits[n], token_chars) if op == "generate" else LINE_BYTES[op]
        if len(raw) > bound:
            raise FormatError(f"output line {n + 1} is {len(raw)} bytes (at most "
                              f"{bound} for {op})")
        try:
            row = json.loads(raw)
        except ValueError:
            raise FormatError(f"output line {n + 1} is not JSON") from None
        if not isinstance(row, dict) or row.get("i") != i or isinstance(row.get("i"), bool):
            raise FormatError(f"output line {n + 1} is not item {i}")
        if op == "classify":
            label, probs = row.get("label"), row.get("probs")
            if set(row) != {"i", "label", "probs"} or not isinstance(label, int) or \
                    isinstance(label, bool) or not 0 <= label < classes or \
                    not isinstance(probs, list) or len(probs) != classes or \
                    not all(_finite(p) and 0.0 <= p <= 1.0 for p in probs):
                raise FormatError(f"output line {n + 1}: not {{i, label in 0..{classes - 1}, "
                                  f"probs: {classes} numbers in [0, 1]}}")
        elif op == "score":
            lp, tokens = row.get("logprob"), row.get("tokens")
            if set(row) != {"i", "logprob", "tokens"} or not isinstance(lp, float) or \
                    not math.isfinite(lp) or lp > 0 or \
                    not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
                raise FormatError(f"output line {n + 1}: not {{i, logprob <= 0, tokens}}")
        elif op == "embed":  # ``classes``: the model's embedding width
            vector = row.get("embedding")
            if set(row) != {"i", "embedding"} or not isinstance(vector, list) or \
                    len(vector) != classes or not all(_finite(v) for v in vector) or \
                    abs(math.fsum(v * v for v in vector) - 1.0) > 1e-3:
                raise FormatError(f"output line {n + 1}: not {{i, embedding: {classes} "
                                  f"numbers of unit length}}")
        else:
            text = row.get("text")
            if set(row) != {"i", "text"} or not isinstance(text, str):
                raise FormatError(f"output line {n + 1}: not {{i, text}}")
            if len(text) > limits[n] * token_chars:
                raise FormatError(f"output line {n + 1}: a text of {len(text)} characters, "
                                  f"more than its max_tokens {limits[n]} can decode to "
                                  f"({token_chars} a token)")


def parse_batch(data: Any) -> ServeBatch:
    """A serve batch, its items checked for its operation (images: flat lists of finite
    numbers; completions: :class:`Completion`)."""
    if not isinstance(data, dict):
        raise FormatError(f"serve batch is a {type(data).__name__}, not an object")
    try:
        batch = ServeBatch.model_validate(data)
    except ValidationError as exc:
        raise FormatError(first_error(exc, "serve batch")) from None
    for n, item in enumerate(batch.items):
        if batch.op == "classify":
            if not isinstance(item, list) or len(item) > 1 << 20 or \
                    not all(_finite(v) for v in item):
                raise FormatError(f"serve batch item {n}: not a list of finite numbers")
        elif batch.op == "embed":
            if not isinstance(item, str) or len(item) > 1 << 20:
                raise FormatError(f"serve batch item {n}: not a prompt (a string)")
        else:
            try:
                Completion.model_validate(item)
            except ValidationError as exc:
                raise FormatError(first_error(exc, f"serve batch item {n}")) from None
    return batch
