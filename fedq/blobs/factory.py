"""Pick a blob store backend from a URL."""

from __future__ import annotations

from fedq.blobs.base import BlobStore
from fedq.errors import ConfigError


def open_store(url: str, s3_endpoint_url: str | None = None) -> BlobStore:
    """``/path`` or ``file:///path`` -> local; ``redis://`` -> Redis; ``s3://`` -> S3."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from fedq.blobs.redis import RedisBlobStore

        return RedisBlobStore(url)
    if url.startswith("s3://"):
        from fedq.blobs.s3 import S3BlobStore

        return S3BlobStore(url, s3_endpoint_url)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        raise ConfigError(f"FEDQ_BLOB_URL: unsupported scheme in {url!r} "
                          "(use a path, file://, redis:// or s3://)")
    from fedq.blobs.local import LocalBlobStore

    return LocalBlobStore(url)
