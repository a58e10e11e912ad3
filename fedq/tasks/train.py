"""The training task, run on a ``gpu_new``, ``gpu_sm61`` or ``cpu`` worker."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from celery import Task

from fedq.app import TRAIN_SOFT_TIME_LIMIT, TRAIN_TASK, TRAIN_TIME_LIMIT, app
from fedq.blobs import BlobStore, open_store
from fedq.settings import get_settings


@lru_cache(maxsize=1)
def _store() -> BlobStore:
    settings = get_settings()
    return open_store(settings.blob_url, settings.s3_endpoint_url)


@app.task(name=TRAIN_TASK, bind=True, soft_time_limit=TRAIN_SOFT_TIME_LIMIT,
          time_limit=TRAIN_TIME_LIMIT)
def train(self: Task, ref: dict[str, Any]) -> dict[str, Any]:
    """Train one client for one round; returns an UpdateRef (never raises)."""
    from fedq.client import run_training

    worker = self.request.hostname or "unknown"
    delivered = (self.request.delivery_info or {}).get("routing_key")
    if delivered:
        ref = {**ref, "queue": delivered}
    return run_training(ref, _store(), worker)
