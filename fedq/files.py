"""Files only their owner may read, written whole (join bundles, keys, certificates).

A file is written to a temporary name that :func:`tempfile.mkstemp` creates with
``O_EXCL`` and mode 600 (so nobody who guessed the name first can own it, whatever the
umask), filled, flushed to disk, given its final mode, and renamed into place: a reader
sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_whole(path: Path, data: bytes | str, mode: int = 0o600) -> None:
    """``data`` into ``path`` with ``mode`` (600 by default: the owner's alone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def private_folder(path: Path) -> None:
    """``path`` made if missing, readable by its owner alone (mode 700, whatever the
    umask): the embedded default's ``.fedq/`` holds the database, the queued tasks and
    their results. An existing folder is narrowed only when it is a ``.fedq`` of this
    user's (never a shared folder such as /tmp named by FEDQ_HOME)."""
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    info = path.stat()
    if (made or path.name == ".fedq") and info.st_uid == os.getuid() and info.st_mode & 0o077:
        os.chmod(path, 0o700)
