"""A folder of files (a Hugging Face checkpoint's config and weights) through the blob
store: put once by the coordinator under a job's prefix, and fetched once per machine
into a folder of its own, named by the checkpoint's digest.

A fetched folder is written under a temporary name, each file read through the store
(so checked against its digest and size) and then renamed into place whole: a crash
mid-fetch leaves a temporary folder, never a short checkpoint, and workers of one
machine that fetch at once each write their own and keep the first renamed.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedq.blobs.base import BlobRef, BlobStore
from fedq.errors import BlobError

#: What a file shipped with a checkpoint may be named (its name in the folder).
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: What a fetched folder is named by (a digest's hex, cut).
FOLDER_NAME = re.compile(r"^[0-9a-f]{16,64}$")


def put_folder(store: BlobStore, files: list[Path], prefix: str) -> dict[str, Any]:
    """Each of ``files`` stored under ``prefix/NAME``; ``{NAME: blob ref as JSON}``."""
    return {f.name: store.put(f"{prefix}/{f.name}", f.read_bytes()).to_json() for f in files}


def fetch_folder(store: BlobStore, files: dict[str, Any], root: Path, name: str) -> Path:
    """The folder ``root/name`` holding ``files`` (``{NAME: blob ref as JSON}``), fetched
    from ``store`` unless it is there whole already. BlobError for a file name or
    folder name that is not one, or a ref that does not read."""
    if not FOLDER_NAME.match(name):
        raise BlobError(f"checkpoint folder name {name[:80]!r} is not a digest")
    refs = {}
    for file, ref in files.items():
        if not isinstance(file, str) or not FILE_NAME.match(file):
            raise BlobError(f"checkpoint file name {str(file)[:80]!r} is not a file name")
        try:
            refs[file] = BlobRef.from_json(ref)
        except (KeyError, TypeError, ValueError):
            raise BlobError(f"checkpoint file {file}: not a blob reference") from None
    final = root / name
    if _whole(final, refs):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for file, ref in refs.items():
            (tmp / file).write_bytes(store.get(ref, limit=ref.size or None))
        try:
            os.rename(tmp, final)
        except OSError:  # another worker of this machine renamed its copy first
            if not _whole(final, refs):
                shutil.rmtree(final, ignore_errors=True)  # a damaged copy: replace it
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def fetcher(store: BlobStore, home: Path) -> Callable[[str, dict[str, Any], str], Path]:
    """``fetch(kind, files, name)``: :func:`fetch_folder` from ``store`` into
    ``home/kind/name`` (what fedq/models/stored.py's ``localized`` takes)."""
    return lambda kind, files, name: fetch_folder(store, files, home / kind, name)


def _whole(folder: Path, refs: dict[str, BlobRef]) -> bool:
    """Whether ``folder`` holds exactly the files of ``refs`` at their sizes (their
    bytes are checked by the checkpoint's own digest when the model is built)."""
    try:
        present = {p.name: p.stat().st_size for p in folder.iterdir()}
    except OSError:
        return False
    return present == {file: ref.size for file, ref in refs.items()}
