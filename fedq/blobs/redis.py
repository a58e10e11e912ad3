"""Blobs as Redis string values (one SET per blob; Redis caps a value at 512 MB)."""

from __future__ import annotations

from typing import Any

from fedq.blobs.base import BlobStore
from fedq.errors import BlobError, BlobNotFound, ServiceUnavailable

KEY_PREFIX = "fedq:blob:"


class RedisBlobStore(BlobStore):
    def __init__(self, url: str) -> None:
        import redis

        self.url = url
        self._client: Any = redis.Redis.from_url(url, socket_connect_timeout=5)

    def _write(self, key: str, data: bytes) -> None:
        import redis

        try:
            self._client.set(KEY_PREFIX + key, data)
        except redis.RedisError as exc:
            raise BlobError(f"blob store {self.url}: cannot write {key}: {exc}") from None

    def _read(self, key: str) -> bytes:
        import redis

        try:
            data = self._client.get(KEY_PREFIX + key)
        except redis.RedisError as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        if data is None:
            raise BlobNotFound(f"blob {key}: not found in {self.url}")
        return bytes(data)

    def delete_prefix(self, prefix: str) -> None:
        keys = list(self._client.scan_iter(match=KEY_PREFIX + prefix + "*", count=1000))
        if keys:
            self._client.delete(*keys)

    def check(self) -> None:
        import redis

        try:
            self._client.set(KEY_PREFIX + ".check", b"1", ex=60)
        except redis.RedisError as exc:
            raise ServiceUnavailable(f"blob store {self.url} is not reachable: {exc}") from None
