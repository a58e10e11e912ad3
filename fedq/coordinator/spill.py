"""A disk-backed :class:`~fedq.aggregate.robust.UpdateSource` for the robust reducers.

Verified updates are written one at a time to a scratch folder as flat float32 files
(tensors in a fixed order), and read back one slice at a time with seek + read, so a
reducer over K updates holds K slices, not K models. The folder is removed on close.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import torch


class DiskSource:
    def __init__(self, folder: Path | None = None) -> None:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(prefix="fedq-spill-", dir=folder))
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._offsets: dict[str, int] = {}
        self._paths: list[Path] = []

    def add(self, update: Mapping[str, torch.Tensor]) -> None:
        if not self._shapes:
            offset = 0
            for name, value in update.items():
                self._shapes[name] = tuple(value.shape)
                self._offsets[name] = offset
                offset += value.numel()
        path = self.folder / f"{len(self._paths):06d}.f32"
        with open(path, "wb") as fh:
            for name in self._shapes:
                fh.write(update[name].detach().to(torch.float32).contiguous().numpy().tobytes())
        self._paths.append(path)

    def __len__(self) -> int:
        return len(self._paths)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, index: int, name: str, start: int, stop: int) -> torch.Tensor:
        size = math.prod(self._shapes[name])
        if not 0 <= start <= stop <= size:
            raise IndexError(f"{name}[{start}:{stop}] outside 0..{size}")
        with open(self._paths[index], "rb") as fh:
            fh.seek((self._offsets[name] + start) * 4)
            data = bytearray(fh.read((stop - start) * 4))
        return torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "DiskSource":
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
