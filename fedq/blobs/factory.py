"""Pick a blob store backend from a URL."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedq.blobs.base import BlobStore
from fedq.errors import ConfigError

if TYPE_CHECKING:
    from fedq.settings import Settings

#: A blob's chunk (Redis) or part (S3) unless FEDQ_BLOB_CHUNK_MB says otherwise.
DEFAULT_CHUNK_BYTES = 64 << 20


def open_store(url: str, s3_endpoint_url: str | None = None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> BlobStore:
    """``/path`` or ``file:///path`` -> local (one file a blob, of any size);
    ``redis://`` -> Redis (a blob over ``chunk_bytes`` as chunks and a manifest:
    fedq/blobs/chunks.py); ``s3://`` -> S3 (one over ``chunk_bytes`` uploaded in parts)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from fedq.blobs.redis import RedisBlobStore

        return RedisBlobStore(url, chunk_bytes)
    if url.startswith("s3://"):
        from fedq.blobs.s3 import S3BlobStore

        return S3BlobStore(url, s3_endpoint_url, chunk_bytes)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        raise ConfigError(f"FEDQ_BLOB_URL: unsupported scheme in {url!r} "
                          "(use a path, file://, redis:// or s3://)")
    from fedq.blobs.local import LocalBlobStore

    return LocalBlobStore(url)


def store_for(settings: Settings) -> BlobStore:
    """The blob store ``settings`` name: FEDQ_BLOB_URL, FEDQ_S3_ENDPOINT_URL and
    FEDQ_BLOB_CHUNK_MB."""
    return open_store(settings.blob_url, settings.s3_endpoint_url, settings.blob_chunk_bytes)
