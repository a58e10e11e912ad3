"""A blob cache shared by the workers of one machine (``FEDQ_BLOB_CACHE``).

A multi-GPU box runs one worker per GPU; each round they all need the same global
model. With a cache folder they download it once per machine: files are named by
the blob's digest, written to a temporary name and renamed into place (a crash
mid-write leaves only a temporary file, never a short blob), and every read is
verified against the digest again, with the hash its form names (fedq/digest.py: a
file damaged on disk is deleted and fetched anew). Workers that miss at the same
moment take an exclusive ``flock`` on the blob's lock file, so one downloads and the
others read what it wrote.

Only the newest ``keep`` blobs stay; temporary files older than an hour are removed.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import fedq.digest as digests
from fedq.blobs.base import BlobRef, BlobStore
from fedq.protocol.envelope import check_blob_digest

DEFAULT_KEEP = 4
_STALE_TMP_S = 3600.0


class HostCache:
    def __init__(self, folder: Path, keep: int = DEFAULT_KEEP) -> None:
        self.folder, self.keep = Path(folder), keep
        self.folder.mkdir(parents=True, exist_ok=True)

    def get(self, store: BlobStore, ref: BlobRef) -> tuple[bytearray, bool]:
        """The verified bytes of ``ref`` (one buffer, read into as they arrive, which
        ``fedq.weights.loads`` parses in place) and whether they came over the network.
        The file name is the digest, checked to be one before any path is built (a
        task's ref could otherwise name a file anywhere the worker may write); the
        download is bounded by the ref's size."""
        path = self.folder / check_blob_digest(ref.sha256)
        data = self._read(path, ref)
        if data is not None:
            return data, False
        with open(self.folder / f"{ref.sha256}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._read(path, ref)  # another worker may have fetched it meanwhile
            if data is not None:
                return data, False
            data = store.get_buffer(ref, limit=ref.size or None)  # digest-checked by the store
            tmp = self.folder / f".{ref.sha256}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        self._evict()
        return data, True

    def _read(self, path: Path, ref: BlobRef) -> bytearray | None:
        try:
            with open(path, "rb") as fh:
                data = bytearray(os.fstat(fh.fileno()).st_size)
                fh.readinto(data)
        except FileNotFoundError:
            return None
        if len(data) == ref.size and digests.of(data, ref.sha256) == ref.sha256:
            os.utime(path)  # recently used: evicted last
            return data
        path.unlink(missing_ok=True)  # damaged on disk: fetch it again
        return None

    def _evict(self) -> None:
        now = time.time()
        blobs = []
        for p in self.folder.iterdir():
            try:
                mtime = p.stat().st_mtime
            except FileNotFoundError:
                continue
            if p.name.endswith(".tmp"):
                if now - mtime > _STALE_TMP_S:
                    p.unlink(missing_ok=True)
            elif not p.name.endswith(".lock"):
                blobs.append((mtime, p))
        for _, p in sorted(blobs, reverse=True)[self.keep:]:
            p.unlink(missing_ok=True)
            (p.parent / f"{p.name}.lock").unlink(missing_ok=True)
