"""The blob store contract.

A backend implements four small methods over raw bytes; integrity lives here, once:
:meth:`BlobStore.put` returns a :class:`BlobRef` carrying the digest of what was
written (BLAKE3, in the ref's ``sha256`` field: fedq/digest.py), and
:meth:`BlobStore.get` refuses bytes that do not hash to the ref's digest (with the
digest's own hash: SHA-256 for a blob written before BLAKE3), naming the key.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fedq.digest as digests
from fedq.blobs import chunks
from fedq.blobs.ref import BlobRef, check_digest, too_large
from fedq.errors import BlobError, BlobIntegrityError, BlobTooLarge

_OVERLAP_HASH_BYTES = 4 << 20
#: The pieces a file or an object is read in by :meth:`BlobStore.stream`.
PIECE_BYTES = 16 << 20


#: Below this many bytes a blob is hashed before it is written, not beside it: a
#: thread to hash in costs more to start and join than hashing that much takes.
HASH_BESIDE_BYTES = 1 << 20


def write_hashing(write: Callable[[], None], parts: Sequence[Any]) -> str:
    """Run ``write()`` while a second thread hashes ``parts`` (the bytes-like pieces it
    writes, in order); their digest. The hash and socket/file writes release the GIL,
    so the two overlap instead of running one after the other. Small blobs
    (:data:`HASH_BESIDE_BYTES`) are hashed first, in this thread."""
    def digest() -> str:
        h = digests.new()
        for part in parts:
            h.update(part)
        return digests.text(h)

    if sum(memoryview(part).nbytes for part in parts) < HASH_BESIDE_BYTES:
        hexdigest = digest()
        write()
        return hexdigest
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedq-sha256") as pool:
        hashed = pool.submit(digest)
        write()
        return hashed.result()


class BlobStore(ABC):
    """Bytes under string keys.

    Contract for backends:
    - ``_write(key, data)`` stores ``data`` atomically: a reader sees the old bytes or
      the new bytes, never a mix. Writing an existing key replaces it.
    - ``_read(key)`` returns the bytes or raises :class:`~fedq.errors.BlobNotFound`.
    - ``_size(key)`` returns the stored value's length in bytes without reading it
      (stat, STRLEN, HEAD), raises :class:`~fedq.errors.BlobNotFound`, or returns None
      where the backend cannot tell; :meth:`get` with a ``limit`` asks it first.
    - ``delete_prefix(prefix)`` removes every key starting with ``prefix``.
    - ``check()`` raises :class:`~fedq.errors.ServiceUnavailable` (or BlobError) when the
      store cannot be written right now, with one line saying why.
    Network and disk errors surface as :class:`~fedq.errors.BlobError` subclasses.
    """

    url: str

    @abstractmethod
    def _write(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _read(self, key: str) -> bytes: ...

    def _size(self, key: str) -> int | None:
        return None

    #: True where ``_read_hashed`` learns a value's size before its bytes and refuses
    #: one over its ``limit`` there: ``get`` then asks no size first (one round trip
    #: instead of two for every bounded read).
    bounds_reads = False

    def _read_hashed(self, key: str, limit: int | None = None, like: str | None = None
                     ) -> tuple[bytes, str | None]:
        """``_read(key)`` and, where the backend hashed the bytes while it received
        them, their digest in the form of ``like`` (else None: ``get`` hashes them
        after). A backend with ``bounds_reads`` raises :func:`too_large` for a value
        over ``limit``, unread."""
        return self._read(key), None

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None: ...

    @abstractmethod
    def check(self) -> None: ...

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Remove these keys (missing ones are fine). Backends that can delete many in
        one request override this."""
        for key in keys:
            self.delete_prefix(key)

    def layout(self) -> str:
        """How this store keeps a blob, and its limits, in one line (``fedq doctor
        --services``)."""
        if self.chunk_bytes is None:
            return "one value a blob"
        return (f"one value a blob up to {_mib(self.chunk_bytes)}, a larger one as chunks "
                f"of that size and a manifest, at most {chunks.MAX_CHUNKS:,} chunks")

    def prepare(self) -> str:
        """Make the store ready to be written (an S3 store creates its bucket); one
        line saying what was done."""
        return "nothing to prepare"

    def max_blob_bytes(self) -> int | None:
        """The largest blob this store can keep, in bytes (None: no limit of its own)."""
        if self.chunk_bytes is None:
            return None
        return chunks.MAX_CHUNKS * self.chunk_bytes

    def room(self) -> tuple[int, str] | None:
        """(bytes this store can still take, what says so) where its server caps the
        memory it holds (Redis's ``maxmemory``); None where nothing does."""
        return None

    #: A blob larger than this many bytes is written as chunks and a manifest
    #: (fedq/blobs/chunks.py); None: always one value (a file, or an S3 object that the
    #: store uploads in parts itself).
    chunk_bytes: int | None = None

    def put(self, key: str, data: bytes) -> BlobRef:
        """Store ``data`` under ``key``; return its ref (key, digest, size)."""
        if self.chunk_bytes is not None and len(data) > self.chunk_bytes:
            return chunks.put(self, key, [data], self.chunk_bytes)
        if len(data) < _OVERLAP_HASH_BYTES:
            self._write(key, data)
            return BlobRef(key, digests.of(data), len(data))
        return BlobRef(key, write_hashing(lambda: self._write(key, data), [data]), len(data))

    def put_parts(self, key: str, parts: Sequence[Any],
                  progress: Callable[[int], None] | None = None) -> BlobRef:
        """Store the concatenation of ``parts`` (bytes-like) under ``key``, as chunks
        where it is larger than ``chunk_bytes``; ``progress(n)`` after each chunk ``n``
        is stored (never for a blob kept as one value)."""
        if self.chunk_bytes is not None and \
                sum(memoryview(p).nbytes for p in parts) > self.chunk_bytes:
            return chunks.put(self, key, parts, self.chunk_bytes, progress)
        return self.put_whole_parts(key, parts)

    def put_stream(self, key: str, size: int, parts: Iterable[Any],
                   progress: Callable[[int], None] | None = None) -> BlobRef:
        """:meth:`put_parts` for ``parts`` made as they are written (a generator), whose
        ``size`` in bytes is known up front: a blob over ``chunk_bytes`` is written chunk
        by chunk as the parts come, so they are never all held at once."""
        if self.chunk_bytes is not None and size > self.chunk_bytes:
            ref = chunks.put(self, key, parts, self.chunk_bytes, progress)
        else:
            ref = self._put_iterable(key, parts)
        if ref.size != size:
            raise BlobError(f"blob {key}: {ref.size} bytes written, {size} announced")
        return ref

    def _put_iterable(self, key: str, parts: Iterable[Any]) -> BlobRef:
        """Store the concatenation of ``parts`` as one value, never chunked, taking the
        parts as they come. Backends that can write a value as it arrives (a file, an
        S3 multipart upload) override this; here they are gathered first."""
        return self.put_whole_parts(key, list(parts))

    def put_whole_parts(self, key: str, parts: Sequence[Any]) -> BlobRef:
        """Store the concatenation of ``parts`` as one value, never chunked. Backends that
        can write a value in pieces override this to skip joining them."""
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        if len(data) < _OVERLAP_HASH_BYTES:
            self._write(key, data)
            return BlobRef(key, digests.of(data), len(data))
        return BlobRef(key, write_hashing(lambda: self._write(key, data), [data]), len(data))

    def get(self, ref: BlobRef, limit: int | None = None) -> bytes:
        """The bytes of ``ref``, verified against its digest, whether they were written as
        one value or as chunks. With ``limit``, a blob larger than ``limit`` bytes is
        refused (:class:`~fedq.errors.BlobTooLarge`) before it is read, as far as the
        backend can tell its size, and after."""
        data, digest = self._get_unchecked(ref, limit)
        if digest != ref.sha256 and chunks.is_manifest(ref, data):
            return chunks.get(self, ref, data, limit)  # type: ignore[return-value]
        check_digest(ref, digest or digests.of(data, ref.sha256))
        return data

    #: The pieces a backend that reads a file or object in pieces (:meth:`_pieces`)
    #: reads it in; None where a value is read whole.
    read_piece_bytes: int | None = None

    @property
    def piece_bytes(self) -> int | None:
        """The most bytes :meth:`stream` holds at once for any blob: a chunk where the
        store writes chunks, else a piece of the file or object; None where a blob
        kept as one value is read whole."""
        return self.chunk_bytes if self.chunk_bytes is not None else self.read_piece_bytes

    def _pieces(self, key: str) -> Iterator[bytes] | None:
        """The value under ``key`` in pieces of at most :attr:`piece_bytes` (raising
        :class:`~fedq.errors.BlobNotFound` at the first), where the backend reads that
        way; None where it reads a value whole."""
        return None

    def stream(self, ref: BlobRef, limit: int | None = None) -> Generator[bytes, None, None]:
        """The bytes of ``ref`` in pieces, for a reader that never holds the blob whole:
        a chunked blob's chunks, each checked against its digest as it is yielded; a
        file or object the backend reads in pieces, as they come; a blob kept as one
        value, as one piece. The whole is checked against the ref's digest after the
        last piece (a mismatch raises then, so a consumer commits nothing before the
        iteration ends). ``limit`` as for :meth:`get`."""
        if limit is not None and not self.bounds_reads:
            size = self._size(ref.key)
            if size is not None and size > limit:
                raise too_large(ref.key, size, limit)
        pieces = self._pieces(ref.key)
        if pieces is not None:
            yield from self._stream_pieces(ref, pieces, limit)
            return
        data, digest = self._get_unchecked(ref, limit)
        if digest != ref.sha256 and chunks.is_manifest(ref, data):
            yield from chunks.stream(self, ref, data, limit)
            return
        check_digest(ref, digest or digests.of(data, ref.sha256))
        yield data

    def get_buffer(self, ref: BlobRef, limit: int | None = None) -> bytearray:
        """The bytes of ``ref``, checked, in one bytearray of its size, filled piece by
        piece as :meth:`stream` reads them: the one copy of a big blob the reader
        holds (``fedq.weights.loads`` parses a bytearray in place)."""
        if self.piece_bytes is None or ref.size <= self.piece_bytes:
            data = self.get(ref, limit)
            return data if isinstance(data, bytearray) else bytearray(data)
        out = bytearray(ref.size)
        at = 0
        for piece in self.stream(ref, limit):
            if at + len(piece) > ref.size:
                raise BlobIntegrityError(f"blob {ref.key} is longer than its {ref.size} "
                                         f"bytes: the blob was modified or corrupted")
            out[at:at + len(piece)] = piece
            at += len(piece)
        return out

    def _stream_pieces(self, ref: BlobRef, pieces: Iterator[bytes], limit: int | None
                       ) -> Iterator[bytes]:
        first = next(pieces, b"")
        if chunks.is_manifest(ref, first):  # written with chunk_bytes: read it whole,
            head = bytearray(first)  # or as much as shows it is too large
            for piece in pieces:
                head += piece
                if len(head) > chunks.MAX_MANIFEST_BYTES:
                    break
            yield from chunks.stream(self, ref, head, limit)
            return
        whole = digests.new(ref.sha256)
        size = 0
        for piece in itertools.chain([first], pieces):
            size += len(piece)
            if limit is not None and size > limit:
                raise BlobTooLarge(f"blob {ref.key} is more than the {limit} bytes it may be")
            whole.update(piece)
            yield piece
        check_digest(ref, digests.text(whole))

    def get_whole(self, ref: BlobRef, limit: int | None = None) -> bytes:
        """The bytes of ``ref`` stored as one value (a chunk), verified against its
        digest; never read as a manifest."""
        data, digest = self._get_unchecked(ref, limit)
        check_digest(ref, digest or digests.of(data, ref.sha256))
        return data

    def _get_unchecked(self, ref: BlobRef, limit: int | None) -> tuple[bytes, str | None]:
        """The value under ``ref.key`` within ``limit``, and its digest where the backend
        hashed it as it arrived."""
        if limit is not None and not self.bounds_reads:
            size = self._size(ref.key)
            if size is not None and size > limit:
                raise too_large(ref.key, size, limit)
        data, digest = self._read_hashed(ref.key, limit, ref.sha256)
        if limit is not None and len(data) > limit:
            raise BlobTooLarge(f"blob {ref.key} is {len(data)} bytes, more than the {limit} "
                               f"it may be")
        return data, digest


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
