"""The one owner of what a fedq process keeps between tasks.

A Celery worker process runs many tasks; some things are worth keeping from one to
the next, and each is kept here, nowhere else:

- ``models``: global models by digest — a training worker keeps the last two it
  downloaded (a round's tasks share one), the control worker the model it committed
  last (the next round's finalize starts from it without a read);
- ``accumulator``: FedAvg's model-sized mean buffer, reused round to round (a fresh one
  pays a page fault per 4 kB page every round); released when a job ends;
- ``store``: one blob store client per URL (connection pools);
- ``uplink_mbit``: a training worker's upload rate, measured on its last large upload
  (``codec: auto`` picks the update codec from it).
- ``kept``: training tasks that yielded to the machine's owner, where each stopped
  (fedq/worker/loop.py ``Kept``, in CPU memory; the newest :data:`KEPT_TASKS`), by
  (job, client, global model): the task goes on from there when it comes back.

Pure memoisation (a dataset loaded from its arguments, a partition from its seed,
a database engine per URL) stays beside its function as ``functools.lru_cache``.
``PROCESS.clear()`` drops everything (tests; a worker never needs to).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedq.blobs import BlobStore, open_store
from fedq.blobs.factory import DEFAULT_CHUNK_BYTES

if TYPE_CHECKING:  # (torch is imported where a model is first kept or averaged: the
    # CLI's read-only commands import this module and never need it)
    from fedq.aggregate import Accumulator
    from fedq.aggregate.types import Weights
    from fedq.settings import Settings

#: Global models a process keeps at once.
MODEL_CACHE_SIZE = 2
#: Yielded tasks a process keeps where they stopped (docs/owners.md, leave in memory).
KEPT_TASKS = 2


@dataclass
class ProcessState:
    models: OrderedDict[str, Weights] = field(default_factory=OrderedDict)
    stores: dict[tuple[str, str | None, int], BlobStore] = field(default_factory=dict)
    uplink_mbit: float | None = None
    kept: OrderedDict[tuple[str, int, str], Any] = field(default_factory=OrderedDict)
    _accumulator: Accumulator | None = None

    @property
    def accumulator(self) -> Accumulator:
        if self._accumulator is None:
            from fedq.aggregate import Accumulator

            self._accumulator = Accumulator()
        return self._accumulator

    def model(self, sha256: str) -> Weights | None:
        """The kept model with this digest, if any (and mark it recently used)."""
        weights = self.models.get(sha256)
        if weights is not None:
            self.models.move_to_end(sha256)
        return weights

    def keep_model(self, sha256: str, weights: Weights, *, only: bool = False) -> None:
        """Keep ``weights`` under its digest ``sha256``; ``only``: drop every other model first."""
        if only:
            self.models.clear()
        self.models[sha256] = weights
        while len(self.models) > MODEL_CACHE_SIZE:
            self.models.popitem(last=False)

    def keep_task(self, key: tuple[str, int, str], kept: Any) -> None:
        """Keep a yielded task's training (``Kept``) under (job, client, model digest)."""
        self.kept.pop(key, None)
        self.kept[key] = kept
        while len(self.kept) > KEPT_TASKS:
            self.kept.popitem(last=False)

    def blobs(self, settings: Settings) -> BlobStore:
        """The blob store ``settings`` name (FEDQ_BLOB_URL, its endpoint and chunk size),
        opened once in this process."""
        return self.store(settings.blob_url, settings.s3_endpoint_url,
                          settings.blob_chunk_bytes)

    def store(self, url: str, s3_endpoint_url: str | None = None,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> BlobStore:
        key = (url, s3_endpoint_url, chunk_bytes)
        if key not in self.stores:
            self.stores[key] = open_store(url, s3_endpoint_url, chunk_bytes)
        return self.stores[key]

    def clear(self) -> None:
        self.models.clear()
        if self._accumulator is not None:
            self._accumulator.release()
        self.stores.clear()
        self.uplink_mbit = None
        self.kept.clear()


PROCESS = ProcessState()
