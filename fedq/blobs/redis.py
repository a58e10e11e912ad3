"""Blobs as Redis string values: one SET per blob up to the chunk size (FEDQ_BLOB_CHUNK_MB,
64 MiB unless set), a larger one as chunks of that size and a manifest
(fedq/blobs/chunks.py). Redis caps a value at 512 MiB, so the chunk size may be no more.

Reads of large values bypass redis-py's parser: it assembles a bulk reply in a
BytesIO, chunk by chunk, and moves a 45 MB value at about 0.3-0.5 GB/s here, while
reading the reply straight into one preallocated ``bytearray`` runs at memory-copy
speed (docs/benchmarks.md, "Round overhead"). The fast path speaks RESP2 on its own
plain TCP connection (AUTH and SELECT from the URL); ``rediss://`` and ``unix://``
URLs use redis-py for everything.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

import fedq.digest as digests
from fedq.blobs import chunks
from fedq.blobs.base import BlobRef, BlobStore, too_large, write_hashing
from fedq.errors import BlobError, BlobNotFound, BlobTooLarge, ConfigError, ServiceUnavailable
from fedq.redaction import redact

KEY_PREFIX = "fedq:blob:"
#: The most bytes Redis keeps in one string value (its ``proto-max-bulk-len``, 512 MB
#: unless raised): the largest chunk.
MAX_VALUE_BYTES = 512 << 20
#: The chunk size unless FEDQ_BLOB_CHUNK_MB says otherwise.
DEFAULT_CHUNK_BYTES = 64 << 20


class RedisBlobStore(BlobStore):
    def __init__(self, url: str, chunk_bytes: int | None = DEFAULT_CHUNK_BYTES) -> None:
        """``chunk_bytes``: a blob larger than this is written as chunks (None: never,
        and one over :data:`MAX_VALUE_BYTES` is refused before anything is sent)."""
        import redis
        from redis.connection import parse_url

        if chunk_bytes is not None and not 0 < chunk_bytes <= MAX_VALUE_BYTES:
            raise ConfigError(f"FEDQ_BLOB_CHUNK_MB: a Redis chunk is 1 byte to "
                              f"{MAX_VALUE_BYTES >> 20} MiB, not {chunk_bytes} bytes")
        self.chunk_bytes = chunk_bytes
        self.url = redact(url)  # for messages: the password never leaves in text
        self._client: Any = redis.Redis.from_url(url, socket_connect_timeout=5)
        self._reader: _BulkReader | None = None
        if url.startswith("redis://"):
            opts = parse_url(url)
            self._reader = _BulkReader(opts.get("host", "localhost"), int(opts.get("port", 6379)),
                                       int(opts.get("db", 0) or 0), opts.get("username"),
                                       opts.get("password"))
            self.bounds_reads = True  # the reply's length comes before its bytes

    def _fits(self, key: str, size: int) -> None:
        """Raise a one-line BlobTooLarge for a blob Redis cannot keep in one value."""
        if size > MAX_VALUE_BYTES:
            raise BlobTooLarge(
                f"blob store {self.url}: {key} is {size / 2**20:,.0f} MiB, more than the "
                f"{MAX_VALUE_BYTES >> 20} MiB Redis keeps in one value: let it be written "
                f"in chunks (FEDQ_BLOB_CHUNK_MB, at most {MAX_VALUE_BYTES >> 20})")

    def _write(self, key: str, data: bytes) -> None:
        import redis

        self._fits(key, len(data))
        try:
            self._client.set(KEY_PREFIX + key, data)
        except redis.RedisError as exc:
            raise BlobError(f"blob store {self.url}: cannot write {key}: {exc}") from None

    def put_whole_parts(self, key: str, parts: Sequence[Any]) -> BlobRef:
        """SET the parts one after the other on the raw connection (no joined copy),
        hashing them on a second thread meanwhile."""
        size = sum(memoryview(p).nbytes for p in parts)
        self._fits(key, size)  # before anything is joined or sent
        reader = self._reader
        if reader is None:
            return super().put_whole_parts(key, parts)
        import redis

        try:
            sha = write_hashing(
                lambda: reader.set_parts((KEY_PREFIX + key).encode(), parts, size), parts)
        except (redis.RedisError, OSError) as exc:
            raise BlobError(f"blob store {self.url}: cannot write {key}: {exc}") from None
        return BlobRef(key, sha, size)

    def _read(self, key: str) -> bytes:
        import redis

        try:
            if self._reader is not None:
                data: Any = self._reader.get((KEY_PREFIX + key).encode())
            else:
                data = self._client.get(KEY_PREFIX + key)
        except (redis.RedisError, OSError) as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        if data is None:
            raise BlobNotFound(f"blob {key}: not found in {self.url}")
        return data  # type: ignore[no-any-return]  # bytes, or a bytearray from the reader

    def _read_hashed(self, key: str, limit: int | None = None, like: str | None = None
                     ) -> tuple[bytes, str | None]:
        """A large value is hashed on a second thread as it arrives (the hash and socket
        reads release the GIL): the digest, in the form of ``like``, costs little more
        than the read. A value over ``limit`` is refused from the reply's length, its
        bytes unread."""
        import redis

        if self._reader is None:
            return self._read(key), None
        try:
            data, digest = self._reader.get_hashed((KEY_PREFIX + key).encode(), limit=limit,
                                                   like=like)
        except _TooLarge as exc:
            raise too_large(key, exc.size, exc.limit) from None
        except (redis.RedisError, OSError) as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        if data is None:
            raise BlobNotFound(f"blob {key}: not found in {self.url}")
        return data, digest  # type: ignore[return-value]  # a bytearray

    def _size(self, key: str) -> int | None:
        import redis

        try:
            exists, size = self._client.pipeline().exists(KEY_PREFIX + key) \
                .strlen(KEY_PREFIX + key).execute()
        except redis.RedisError as exc:
            raise BlobError(f"blob store {self.url}: cannot read {key}: {exc}") from None
        if not exists:
            raise BlobNotFound(f"blob {key}: not found in {self.url}")
        return int(size)

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Delete these blobs, and the chunks of those stored as chunks (their manifests
        are read first: a blob's chunk keys all begin with its key), and the chunks a
        writer stopped mid-blob left under any of these keys with no manifest (one SCAN
        for the keys' common prefix; skipped for a user that may not SCAN, such as a
        worker's: the coordinator's deletion of the round removes them)."""
        self._delete_listed(keys)
        if self.chunk_bytes is not None and keys:
            self._delete_orphans(keys)

    def _delete_orphans(self, keys: Sequence[str]) -> None:
        import redis

        wanted = set(keys)
        common = os.path.commonprefix(list(keys))
        pattern = KEY_PREFIX + _glob_escape(common) + "*.chunk*"
        try:
            found = list(self._client.scan_iter(match=pattern, count=1000))
        except redis.exceptions.NoPermissionError:
            return
        orphans = [k for k in found
                   if k.decode(errors="replace")[len(KEY_PREFIX):].rsplit(".chunk", 1)[0]
                   in wanted]
        for j in range(0, len(orphans), 1000):
            self._client.delete(*orphans[j:j + 1000])

    def _delete_listed(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = list(keys[i:i + 1000])
            pipe = self._client.pipeline(transaction=False)
            for k in batch:
                pipe.getrange(KEY_PREFIX + k, 0, len(chunks.MAGIC) - 1)
            heads = pipe.execute()
            chunked = [k for k, head in zip(batch, heads) if head == chunks.MAGIC]
            manifests = self._client.mget([KEY_PREFIX + k for k in chunked]) if chunked else []
            doomed = batch + [c for k, m in zip(chunked, manifests) if m is not None
                              for c in chunks.keys_of(k, m)]
            for j in range(0, len(doomed), 1000):
                self._client.delete(*(KEY_PREFIX + k for k in doomed[j:j + 1000]))

    def delete_prefix(self, prefix: str) -> None:
        keys = list(self._client.scan_iter(match=KEY_PREFIX + _glob_escape(prefix) + "*",
                                           count=1000))
        if keys:
            self._client.delete(*keys)

    def layout(self) -> str:
        if self.chunk_bytes is None:
            return f"one value a blob, at most {MAX_VALUE_BYTES >> 20} MiB"
        return (super().layout() + f" (a chunk: at most {MAX_VALUE_BYTES >> 20} MiB; "
                "FEDQ_BLOB_CHUNK_MB)")

    def max_blob_bytes(self) -> int | None:
        return MAX_VALUE_BYTES if self.chunk_bytes is None else super().max_blob_bytes()

    def room(self) -> tuple[int, str] | None:
        """What Redis's ``maxmemory`` leaves above what it holds now; None when it has
        no ``maxmemory`` (or does not say: an ACL user may not run INFO)."""
        import redis

        try:
            memory = self._client.info("memory")
        except redis.RedisError:
            return None
        most, used = int(memory.get("maxmemory") or 0), int(memory.get("used_memory") or 0)
        if most <= 0:
            return None
        return max(0, most - used), (f"Redis at {self.url} has {(most - used) / 2**20:,.0f} "
                                     f"MiB free below its maxmemory of {most / 2**20:,.0f} MiB")

    def check(self) -> None:
        import redis

        try:
            self._client.set(KEY_PREFIX + ".check", b"1", ex=60)
        except redis.RedisError as exc:
            raise ServiceUnavailable(f"blob store {self.url} is not reachable: {exc}") from None


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out += [b"$%d\r\n" % len(p), p, b"\r\n"]
    return b"".join(out)


class _BulkReader:
    """``GET key`` over RESP2, the value read into one preallocated bytearray."""

    def __init__(self, host: str, port: int, db: int, username: str | None,
                 password: str | None, timeout: float = 60.0) -> None:
        self.addr, self.db, self.timeout = (host, port), db, timeout
        self.username, self.password = username, password
        self._sock: socket.socket | None = None
        self._pid = os.getpid()
        self._pool: list[bytearray] = []

    def get(self, key: bytes) -> bytearray | None:
        """The value, or None when the key does not exist."""
        return self.get_hashed(key, hashing=False)[0]

    def get_hashed(self, key: bytes, hashing: bool = True, limit: int | None = None,
                   like: str | None = None) -> tuple[bytearray | None, str | None]:
        """The value (None when the key does not exist) and, with ``hashing``, its
        digest in the form of ``like`` (fedq/digest.py), computed as it was received.
        A value longer than ``limit`` raises
        :class:`_TooLarge` before its bytes are read (the connection is closed: the
        reply is left unread). One reconnect on a dropped connection (Redis restarted,
        idle timeout), with the hash started afresh."""
        for attempt in (1, 2):
            hasher = _Hasher(like) if hashing else None
            try:
                data = self._get(key, hasher, limit)
            except (ConnectionError, socket.timeout):
                self.close()
                if attempt == 2:
                    raise
                continue
            return data, (hasher.digest() if hasher and data is not None else None)
        raise AssertionError("unreachable")

    def set_parts(self, key: bytes, parts: Sequence[Any], size: int) -> None:
        """``SET key value`` with the value sent as ``parts`` (``size`` bytes in all)."""
        sock = self._connect()
        try:
            sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size))
            for part in parts:
                sock.sendall(part)
            sock.sendall(b"\r\n")
            line, _ = self._line()
        except OSError:
            self.close()  # a half-sent command: this connection is unusable
            raise
        if not line.startswith(b"+"):
            self.close()
            raise _error(line)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._pid != os.getpid():  # forked: the parent's socket is not ours to read
            self._sock, self._pid = None, os.getpid()
        if self._sock is None:
            sock = socket.create_connection(self.addr, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            if self.password is not None:
                auth = [b"AUTH", self.password.encode()]
                if self.username:
                    auth.insert(1, self.username.encode())
                self._simple(_command(*auth))
            if self.db:
                self._simple(_command(b"SELECT", str(self.db).encode()))
        return self._sock

    def _simple(self, command: bytes) -> None:
        assert self._sock is not None
        self._sock.sendall(command)
        line, _ = self._line()
        if not line.startswith(b"+"):
            self.close()
            raise _error(line)

    def _line(self) -> tuple[bytes, bytearray]:
        """The first reply line (without CRLF) and whatever bytes came after it."""
        assert self._sock is not None
        head = bytearray()
        while True:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed by the server")
            head += chunk
            end = head.find(b"\r\n")
            if end >= 0:
                return bytes(head[:end]), head[end + 2:]

    def _get(self, key: bytes, hasher: _Hasher | None = None, limit: int | None = None
             ) -> bytearray | None:
        """``GET key``; with ``hasher``, the value is also fed to it as it arrives."""
        sock = self._connect()
        sock.sendall(_command(b"GET", key))
        line, rest = self._line()
        if not line.startswith(b"$"):
            self.close()
            raise _error(line)
        length = int(line[1:])
        if length < 0:
            return None
        if limit is not None and length > limit:
            self.close()  # the rest of the reply is not read: this connection is done
            raise _TooLarge(length, limit)
        out = self._buffer(length)  # the value and its CRLF
        view = memoryview(out)
        have = len(rest)
        view[:have] = rest
        if hasher is not None:
            hasher.start(view, length)
        try:
            while have < length + 2:
                n = sock.recv_into(view[have:])
                if n == 0:
                    self.close()
                    raise ConnectionError("connection closed mid-reply")
                have += n
                if hasher is not None:
                    hasher.received(have)
        finally:
            if hasher is not None:
                hasher.finish()  # joins the thread: no slice of ``view`` is left
        view.release()
        del out[length:]
        return out


    def _buffer(self, length: int) -> bytearray:
        """A bytearray of ``length`` + 2 bytes to receive a value into: for a large
        value, a buffer this reader handed out before that nothing references any more
        (its memory is mapped already: a fresh 45 MB buffer costs about as much in page
        faults as receiving into it), else a new one, remembered for next time."""
        if length < _POOL_MIN:
            return bytearray(length + 2)
        for buf in self._pool:
            # Referenced only by the pool's list, this loop and getrefcount's argument:
            # no caller holds it and no tensor views it (a view holds a reference).
            if len(buf) == length and sys.getrefcount(buf) == 3:
                buf += b"\r\n"  # back to length + 2 (trimmed in place before)
                return buf
        buf = bytearray(length + 2)
        self._pool.append(buf)
        del self._pool[:-_POOL_SIZE]
        return buf


class _TooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size, self.limit = size, limit


class _Hasher:
    """The digest of a value being received into one buffer (in the form of ``like``:
    fedq/digest.py), on a second thread that hashes each stretch as soon as it has
    arrived (a small value: hashed at the end)."""

    def __init__(self, like: str | None = None) -> None:
        self._sha = digests.new(like)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._view: memoryview | None = None
        self._length = self._have = 0
        self._stop = False

    def start(self, view: memoryview, length: int) -> None:
        self._view, self._length = view, length
        if length >= _HASH_THREAD_MIN:
            self._thread = threading.Thread(target=self._run, name="fedq-digest", daemon=True)
            self._thread.start()

    def received(self, have: int) -> None:
        if self._thread is not None:
            with self._cond:
                self._have = have
                self._cond.notify()

    def finish(self) -> None:
        """Wait for the thread (after the whole value came, or after a failure)."""
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify()
            self._thread.join()
        elif self._view is not None:
            self._sha.update(self._view[:self._length])
        self._view = None

    def digest(self) -> str:
        return digests.text(self._sha)

    def _run(self) -> None:
        assert self._view is not None
        done = 0
        while done < self._length:
            with self._cond:
                while self._have <= done and not self._stop:
                    self._cond.wait()
                upto = min(self._have, self._length)
                if upto <= done:  # stopped short: the read failed
                    return
            self._sha.update(self._view[done:upto])
            done = upto


#: Values at least this large are hashed on a second thread while they are received.
_HASH_THREAD_MIN = 1 << 20

#: Values at least this large are read into pooled buffers; at most this many pooled.
_POOL_MIN, _POOL_SIZE = 1 << 20, 4


def _error(line: bytes) -> Exception:
    import redis

    text = line.decode(errors="replace").lstrip("-+")
    return redis.RedisError(text or "unexpected reply")


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
