"""Chunked blobs: a blob larger than its store keeps in one value, as chunks and a manifest.

A store with a ``chunk_bytes`` (Redis: a value is at most 512 MiB there, and one large
value blocks the server while it is copied) writes a blob over that size as chunks of
at most ``chunk_bytes`` under ``KEY.chunkNNNNN``, then, last, a manifest under ``KEY``
itself: :data:`MAGIC`, then JSON ``{"size", "digest", "chunks": [[size, digest], ...]}``
(each chunk's size and BLAKE3 digest, and the whole blob's digest and size). A reader
sees either no blob or a whole one: until the manifest is there, ``KEY`` is missing (or
still the older value). The blob's :class:`~fedq.blobs.base.BlobRef` is the same as
for one value (the whole bytes' digest and size): messages, SQL and the per-host cache
do not know whether a blob is chunked, and a blob written as one value before chunks
existed reads as it always did.

What a manifest is trusted for: nothing it says is believed before it is checked. A
reader takes ``KEY``'s value as a manifest only when it is not the ref's size and
begins with :data:`MAGIC`; the manifest must name the ref's size and digest, be at most
:data:`MAX_MANIFEST_BYTES`, list at most :data:`MAX_CHUNKS` chunks whose sizes add up
to the size; the chunk keys are derived from ``KEY`` (a manifest cannot point at
another blob's chunks); each chunk is read with its declared size as a bound (a larger
one is refused unread where the store can tell), checked against its digest, and the
whole is checked against the ref's digest. Any failure is one line naming the key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import fedq.digest as digests
from fedq.blobs.ref import BlobRef, check_digest, too_large
from fedq.errors import BlobIntegrityError, BlobTooLarge


class BlobStore(Protocol):
    """What chunks need of a store (fedq/blobs/base.py's ``BlobStore``)."""

    def put_whole_parts(self, key: str, parts: Sequence[Any]) -> BlobRef: ...

    def get_whole(self, ref: BlobRef, limit: int | None = None) -> bytes: ...

#: The first bytes of a manifest.
MAGIC = b"fedq-chunked-blob/1\n"
#: The largest manifest read (10,000 chunks take about 0.7 MB).
MAX_MANIFEST_BYTES = 1 << 20
#: The most chunks one blob has (640 GB at the default 64 MiB chunk).
MAX_CHUNKS = 10_000


def chunk_key(key: str, index: int) -> str:
    """Where chunk ``index`` of the blob ``key`` is kept."""
    return f"{key}.chunk{index:05d}"


def is_manifest(ref: BlobRef, head: Any) -> bool:
    """Whether ``head``, the value stored under ``ref.key``, is a manifest rather than
    the blob itself."""
    return len(head) != ref.size and bytes(memoryview(head)[:len(MAGIC)]) == MAGIC


def put(store: BlobStore, key: str, parts: Iterable[Any], chunk: int,
        progress: Callable[[int], None] | None = None) -> BlobRef:
    """Write the concatenation of ``parts`` as chunks of at most ``chunk`` bytes, then
    the manifest; the whole blob's ref. ``progress(n)`` is called once chunk ``n``
    (counting from 1) is stored, before the next one is written."""
    whole = digests.new()
    listed: list[list[Any]] = []
    pending: list[memoryview] = []
    filled = 0

    def flush() -> None:
        nonlocal filled
        if len(listed) >= MAX_CHUNKS:
            raise BlobTooLarge(f"blob {key}: more than {MAX_CHUNKS} chunks of {chunk} bytes")
        ref = store.put_whole_parts(chunk_key(key, len(listed)), pending)
        for piece in pending:
            whole.update(piece)
        listed.append([ref.size, ref.sha256])
        pending.clear()
        filled = 0
        if progress is not None:
            progress(len(listed))

    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            take = min(view.nbytes, chunk - filled)
            pending.append(view[:take])
            filled += take
            view = view[take:]
            if filled == chunk:
                flush()
    if pending or not listed:
        flush()
    size = sum(n for n, _ in listed)
    digest = digests.text(whole)
    manifest = MAGIC + json.dumps({"size": size, "digest": digest, "chunks": listed},
                                  separators=(",", ":")).encode()
    store.put_whole_parts(key, [manifest])
    return BlobRef(key, digest, size)


def stream(store: BlobStore, ref: BlobRef, head: Any, limit: int | None) -> Iterator[bytes]:
    """The chunks of the blob ``ref`` whose stored value ``head`` is a manifest, one at
    a time, each checked against its digest before it is yielded; the whole blob's
    digest is checked after the last one (a mismatch raises then: whoever consumes
    the chunks commits nothing before the iteration ends)."""
    chunks = _manifest(ref, head)
    if limit is not None and ref.size > limit:
        raise too_large(ref.key, ref.size, limit)
    whole = digests.new(ref.sha256)
    for index, (size, digest) in enumerate(chunks):
        data = store.get_whole(BlobRef(chunk_key(ref.key, index), digest, size), limit=size)
        if len(data) != size:
            raise BlobIntegrityError(f"blob {ref.key}: chunk {index} is {len(data)} bytes, "
                                     f"its manifest says {size}")
        whole.update(data)
        yield data
    check_digest(ref, digests.text(whole))


def get(store: BlobStore, ref: BlobRef, head: Any, limit: int | None) -> bytearray:
    """The blob ``ref`` whose stored value ``head`` is a manifest: its chunks read,
    each checked, into one buffer, the whole checked against the ref."""
    chunks = _manifest(ref, head)
    if limit is not None and ref.size > limit:
        raise too_large(ref.key, ref.size, limit)
    out = bytearray(ref.size)
    whole = digests.new(ref.sha256)
    at = 0
    for index, (size, digest) in enumerate(chunks):
        data = store.get_whole(BlobRef(chunk_key(ref.key, index), digest, size), limit=size)
        if len(data) != size:
            raise BlobIntegrityError(f"blob {ref.key}: chunk {index} is {len(data)} bytes, "
                                     f"its manifest says {size}")
        out[at:at + size] = data
        whole.update(memoryview(out)[at:at + size])
        at += size
    check_digest(ref, digests.text(whole))
    return out


def keys_of(ref_key: str, head: Any) -> list[str]:
    """The chunk keys a stored manifest under ``ref_key`` lists (none for anything
    that does not parse as one): what deleting the blob removes besides ``ref_key``."""
    if bytes(memoryview(head)[:len(MAGIC)]) != MAGIC or len(head) > MAX_MANIFEST_BYTES:
        return []
    try:
        listed = json.loads(bytes(memoryview(head)[len(MAGIC):]))["chunks"]
        return [chunk_key(ref_key, i) for i in range(min(len(listed), MAX_CHUNKS))]
    except (ValueError, KeyError, TypeError):
        return []


def _manifest(ref: BlobRef, head: Any) -> list[tuple[int, str]]:
    """The chunks (size, digest) a manifest lists, once it holds for ``ref``."""
    def bad(why: str) -> BlobIntegrityError:
        return BlobIntegrityError(f"blob {ref.key}: its manifest {why}: not read")

    if len(head) > MAX_MANIFEST_BYTES:
        raise bad(f"is {len(head)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        manifest = json.loads(bytes(memoryview(head)[len(MAGIC):]))
    except ValueError:
        raise bad("is not JSON") from None
    if not isinstance(manifest, dict) or set(manifest) != {"size", "digest", "chunks"}:
        raise bad("does not have exactly the fields size, digest and chunks")
    size, digest, listed = manifest["size"], manifest["digest"], manifest["chunks"]
    if size != ref.size or digest != ref.sha256:
        raise bad(f"names another blob (size {str(size)[:20]}, digest "
                  f"{digests.short(str(digest))}...)")
    if not isinstance(listed, list) or not 0 < len(listed) <= MAX_CHUNKS:
        raise bad(f"lists no chunks or more than {MAX_CHUNKS}")
    chunks: list[tuple[int, str]] = []
    for entry in listed:
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                and entry[0] > 0 and digests.is_digest(entry[1])):
            raise bad("lists a chunk that is not [size > 0, digest]")
        chunks.append((entry[0], entry[1]))
    if sum(n for n, _ in chunks) != ref.size:
        raise bad(f"lists chunks of {sum(n for n, _ in chunks)} bytes for a blob of "
                  f"{ref.size}")
    return chunks
