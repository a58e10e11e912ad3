"""What every message between the coordinator and a worker shares, checked at the edge.

Everything a worker sends is hostile until parsed (docs/security.md): the field types
here (bounded, without coercion) are what the messages of fedq.protocol.training and
fedq.protocol.inference are made of; what does not parse is refused with one line
saying which field was wrong (:func:`first_error`).

``MESSAGE_FORMAT`` is the version of these messages: a worker and a coordinator of
different formats refuse each other's tasks and results (the version handshake).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

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
BlobDigest = Annotated[StrictStr, Field(pattern=f"^({DIGEST.pattern})$")]
_MODEL_KEY = r"jobs/{job}/r\d{{5}}/(global|step)(-[0-9a-f]{{1,16}})?\.safetensors"


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


# Bounded fields of what a worker sends, checked without coercion (a string is never
# read as a number, nor a number as a flag): strings fit their SQL columns, integers
# their SQL types, floats are finite.
Finite = Annotated[StrictFloat, Field(allow_inf_nan=False)]
Seconds = Annotated[StrictFloat, Field(ge=0, le=1e9, allow_inf_nan=False)]
Int32 = Annotated[StrictInt, Field(ge=0, le=INT32)]
Int64 = Annotated[StrictInt, Field(ge=0, le=INT64)]
Flag = StrictBool


def first_error(exc: ValidationError, what: str) -> str:
    """One line naming the first field of ``what`` that did not parse, and its value."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or what
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) else f" (got {str(value)[:60]!r})"
    return f"malformed {what}: {where}: {err['msg']}{shown}"


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
