"""Blobs as files under a folder (the embedded default, or a shared filesystem)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fedq.digest as digests
from fedq.blobs.base import PIECE_BYTES, BlobStore
from fedq.blobs.ref import BlobRef
from fedq.errors import BlobError, BlobNotFound, ServiceUnavailable


class LocalBlobStore(BlobStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise BlobError(f"blob key {key!r} escapes the store")
        return path

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)  # atomic: readers see old or new, never half
        except OSError as exc:
            raise BlobError(f"blob store {self.root}: cannot write {key}: {exc.strerror}") from None

    def put_whole_parts(self, key: str, parts: Sequence[Any]) -> BlobRef:
        return self._put_iterable(key, parts)

    def _put_iterable(self, key: str, parts: Iterable[Any]) -> BlobRef:
        """Each part written to a temporary file as it comes, hashed on the way, then
        the file renamed into place: never the whole blob in memory."""
        path = self._path(key)
        whole = digests.new()
        size = 0
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as fh:
                for part in parts:
                    view = memoryview(part).cast("B")
                    fh.write(view)
                    whole.update(view)
                    size += view.nbytes
            os.replace(tmp, path)  # atomic: readers see old or new, never half
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise BlobError(f"blob store {self.root}: cannot write {key}: {exc.strerror}") from None
        except BaseException:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise
        return BlobRef(key, digests.text(whole), size)

    def _read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(f"blob {key}: not found in {self.root}") from None
        except OSError as exc:
            raise BlobError(f"blob {key}: cannot read: {exc.strerror}") from None

    read_piece_bytes = PIECE_BYTES

    def _pieces(self, key: str) -> Iterator[bytes]:
        try:
            fh = open(self._path(key), "rb")  # noqa: SIM115 - closed by the generator
        except FileNotFoundError:
            raise BlobNotFound(f"blob {key}: not found in {self.root}") from None
        except OSError as exc:
            raise BlobError(f"blob {key}: cannot read: {exc.strerror}") from None

        size = self.read_piece_bytes or PIECE_BYTES

        def read() -> Iterator[bytes]:
            with fh:
                try:
                    while piece := fh.read(size):
                        yield piece
                except OSError as exc:
                    raise BlobError(f"blob {key}: cannot read: {exc.strerror}") from None

        return read()

    def _size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"blob {key}: not found in {self.root}") from None
        except OSError as exc:
            raise BlobError(f"blob {key}: cannot read: {exc.strerror}") from None

    def delete_keys(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        target = self._path(prefix)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()

    def layout(self) -> str:
        return "one file a blob, of any size the disk holds"

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".check-")
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            raise ServiceUnavailable(
                f"blob store {self.root} is not writable: {exc.strerror}") from None
