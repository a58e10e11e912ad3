"""Blob digests: what a blob reference's ``sha256`` field holds.

Every blob fedq writes is named in messages and SQL by a digest of its bytes, checked
on every read (docs/security.md). Two forms are read:

- BLAKE3-256, written as ``b3-`` and its 32 bytes in unpadded base64url (43
  characters): what fedq writes since message format 4. BLAKE3 (Aumasson, Neves,
  O'Connor, Wilcox-O'Hearn, 2020) is a 256-bit cryptographic hash with the same
  collision and preimage resistance as SHA-256 (128-bit collision security), and
  several times faster on one thread (docs/benchmarks.md, "BLAKE3 for blob digests",
  measures it).
- SHA-256, written as 64 lowercase hex digits: what fedq wrote before, so that jobs
  begun then (their models' digests in SQL) resume and verify as they were written.

The fields keep the name ``sha256`` (messages, ``BlobRef``, SQL columns) so that a
stored job's rows need no migration; the form of the value says which hash it is,
and a check against a digest always uses that digest's own hash (neither is weaker
than the other: docs/security.md, "Blob digests").
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any, Protocol

import blake3

#: The prefix of a BLAKE3 digest.
B3 = "b3-"
#: A digest in either form (the SHA-256 form first: ``fedq.wire`` also reads it alone).
DIGEST = re.compile(r"[0-9a-f]{64}|b3-[A-Za-z0-9_-]{43}")
#: What the check of a malformed digest says it expected.
FORMS = "64 hex digits (SHA-256) or b3- and 43 base64url characters (BLAKE3)"


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...


def is_digest(value: object) -> bool:
    return isinstance(value, str) and DIGEST.fullmatch(value) is not None


def new(like: str | None = None) -> Hasher:
    """A hasher for bytes to be checked against the digest ``like`` (its hash), or, with
    none, for bytes being written (BLAKE3)."""
    if like is not None and not like.startswith(B3):
        return hashlib.sha256()
    return blake3.blake3()


def text(hasher: Hasher) -> str:
    """The digest of what ``hasher`` took, in its form."""
    if isinstance(hasher, blake3.blake3):
        return B3 + base64.urlsafe_b64encode(hasher.digest()).rstrip(b"=").decode()
    return str(hasher.hexdigest())  # type: ignore[attr-defined]


def of(data: Any, like: str | None = None) -> str:
    """The digest of ``data`` (bytes-like) in the form of ``like`` (BLAKE3 without one)."""
    hasher = new(like)
    hasher.update(data)
    return text(hasher)


def short(digest: str) -> str:
    """The first characters of a digest after its prefix (log lines, file names)."""
    return digest[len(B3):len(B3) + 12] if digest.startswith(B3) else digest[:12]
