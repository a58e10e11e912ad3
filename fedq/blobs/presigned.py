"""A training task's blobs through presigned S3 URLs: the worker holds no S3
credentials at all (docs/security.md, "Least privilege").

With ``FEDQ_PRESIGN_ENDPOINT`` set on the coordinator (the S3 endpoint as the workers
reach it), each training task carries ``links``: a GET URL for the global model (and
the step, if one is published) and one PUT URL for its update, each signed by the
coordinator's S3 key for that one object and method and valid until the task
expires. The worker reads and writes through them (:class:`PresignedStore`) and
nothing else; a URL for one key is refused by S3 for any other, so a worker can
neither read another client's update nor write the global model.

Over https, the S3 server's certificate is checked against the system's CAs, or only
against the CA file ``AWS_CA_BUNDLE`` names (the variable the coordinator's S3 client,
boto3, reads for the same purpose), as a private CA's deployment needs
(docs/deploy.md, "The stack with identity and TLS").
"""

from __future__ import annotations

import functools
import http.client
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import fedq.digest as digests
from fedq.blobs.base import BlobRef, BlobStore, check_digest
from fedq.errors import BlobError, BlobNotFound, BlobTooLarge

_CHUNK = 1 << 20
TIMEOUT_S = 60


class PresignedStore(BlobStore):
    """Reads and writes only the keys a task's ``links`` name."""

    def __init__(self, links: dict[str, Any]) -> None:
        self.url = "presigned S3 URLs of the task"
        get, put = links.get("get"), links.get("put")  # checked by training.check_task
        self._get: dict[str, str] = dict(get) if isinstance(get, dict) else {}
        self._put: dict[str, str] = dict(put) if isinstance(put, dict) else {}
        self._tls = _tls_context()

    @property
    def upload_key(self) -> str:
        """The one key this task may write."""
        (key,) = self._put
        return key

    def _url(self, table: dict[str, str], key: str, what: str) -> str:
        url = table.get(key)
        if url is None:
            raise BlobError(f"the task carries no presigned URL to {what} {key}")
        return url

    def _write(self, key: str, data: bytes) -> None:
        self.put_parts(key, [data])

    def put_parts(self, key: str, parts: Sequence[Any],
                  progress: Callable[[int], None] | None = None) -> BlobRef:
        """One PUT through ``key``'s URL (S3 keeps the object whole: no chunks, so no
        ``progress``)."""
        return self.put_stream(key, sum(len(memoryview(p).cast("B")) for p in parts), parts)

    def put_stream(self, key: str, size: int, parts: Iterable[Any],
                   progress: Callable[[int], None] | None = None) -> BlobRef:
        """One PUT through ``key``'s URL of ``size`` bytes, sent as ``parts`` come."""
        url = self._url(self._put, key, "write")
        digest = digests.new()

        def body() -> Any:
            for part in parts:
                view = memoryview(part).cast("B")
                digest.update(view)
                yield view

        request = urllib.request.Request(url, data=body(), method="PUT",
                                         headers={"Content-Length": str(size)})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S,
                                        context=self._tls) as response:
                response.read()
        except (urllib.error.URLError, OSError) as exc:
            raise BlobError(f"cannot write {key} through its presigned URL: "
                            f"{_reason(exc)}") from None
        return BlobRef(key, digests.text(digest), size)

    def _read(self, key: str) -> bytes:
        return bytes(self._fetch(key, None, None)[0])

    def get(self, ref: BlobRef, limit: int | None = None) -> bytes:
        data, digest = self._fetch(ref.key, limit, ref.sha256)
        check_digest(ref, digest)
        return data  # type: ignore[return-value]  # a bytearray: the tensors view it

    def _fetch(self, key: str, limit: int | None,
               like: str | None) -> tuple[bytearray, str]:
        """The body under ``key`` within ``limit``, and its digest in the form of
        ``like``, hashed as it arrives. With a Content-Length (S3 always sends one) the
        body is received into one buffer of that size, the only copy of the blob this
        process holds; without one, in 1 MiB pieces joined at the end."""
        url = self._url(self._get, key, "read")
        hasher = digests.new(like)
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S, context=self._tls) as response:
                size = response.headers.get("Content-Length")
                declared = int(size) if size is not None and size.isdigit() else None
                if limit is not None and declared is not None and declared > limit:
                    raise BlobTooLarge(f"blob {key} is {size} bytes, more than the {limit} "
                                       f"it may be: not read")
                if declared is not None:
                    return _receive(response, key, declared, hasher), digests.text(hasher)
                pieces, total = [], 0
                while piece := response.read(_CHUNK):
                    total += len(piece)
                    if limit is not None and total > limit:
                        raise BlobTooLarge(f"blob {key} is more than the {limit} bytes it "
                                           f"may be")
                    hasher.update(piece)
                    pieces.append(piece)
                return bytearray(b"".join(pieces)), digests.text(hasher)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise BlobNotFound(f"blob {key}: not found") from None
            raise BlobError(f"cannot read {key} through its presigned URL: "
                            f"{_reason(exc)}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise BlobError(f"cannot read {key} through its presigned URL: "
                            f"{_reason(exc)}") from None

    def delete_prefix(self, prefix: str) -> None:
        raise BlobError("a worker deletes nothing")

    def check(self) -> None:
        return None


def _receive(response: Any, key: str, size: int, hasher: digests.Hasher) -> bytearray:
    """``size`` bytes of ``response`` into one new buffer, hashed piece by piece as
    they arrive."""
    out = bytearray(size)
    view = memoryview(out)
    at = 0
    while at < size:
        got = response.readinto(view[at:at + _CHUNK])
        if not got:
            raise BlobError(f"cannot read {key} through its presigned URL: the body ended "
                            f"after {at} of its {size} bytes")
        hasher.update(view[at:at + got])
        at += got
    return out


def _tls_context() -> ssl.SSLContext:
    """The https check for presigned URLs: the system's CAs, or only ``AWS_CA_BUNDLE``'s
    (made once per file: loading a CA store costs milliseconds, a task may be tiny)."""
    return _context_for(os.environ.get("AWS_CA_BUNDLE") or None)


@functools.lru_cache(maxsize=4)
def _context_for(bundle: str | None) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=bundle)
    except (OSError, ssl.SSLError) as exc:
        raise BlobError(f"AWS_CA_BUNDLE: cannot read {bundle} as a CA file "
                        f"({exc.strerror or exc})") from None


def _reason(exc: Exception) -> str:
    """Why a request failed, without the URL (it carries a signature)."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return type(exc).__name__
