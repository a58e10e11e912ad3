"""What a message carries instead of a blob's bytes, and the checks every read makes of
them (fedq/blobs/base.py reads, fedq/blobs/chunks.py reads chunks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import fedq.digest as digests
from fedq.errors import BlobIntegrityError, BlobTooLarge


@dataclass(frozen=True)
class BlobRef:
    """What travels in a message instead of the bytes."""

    key: str
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BlobRef":
        return cls(key=str(data["key"]), sha256=str(data["sha256"]), size=int(data["size"]))


def too_large(key: str, size: int, limit: int) -> BlobTooLarge:
    """The refusal of a blob found larger than it may be before it was read."""
    return BlobTooLarge(f"blob {key} is {size} bytes, more than the {limit} it may be: "
                        "not read")


def check_digest(ref: BlobRef, digest: str) -> None:
    """Raise :class:`~fedq.errors.BlobIntegrityError` unless ``digest`` (of the bytes
    read for ``ref``, in the form of its digest) is the ref's."""
    if digest != ref.sha256:
        raise BlobIntegrityError(
            f"blob {ref.key}: digest mismatch (expected {digests.short(ref.sha256)}..., "
            f"got {digests.short(digest)}...): the blob was modified or corrupted")
