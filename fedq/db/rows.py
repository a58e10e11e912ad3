"""The one mapping between what a worker reported (:class:`~fedq.protocol.training.UpdateRef`,
already admitted by fedq/coordinator/intake.py) and a ``client_updates`` row: every
path that records a task — a round's commit or failure, a late result, a buffered
job's absorb — writes its row through :func:`fill_row`, and a buffered version reads
its updates back through :func:`row_ref`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, inspect

from fedq.db.models import ClientUpdate, worker_time
from fedq.protocol.training import TrainStats, UpdateRef

_COLUMNS = [a.key for a in inspect(ClientUpdate).column_attrs]


def insert_rows(session: Any, rows: Sequence[ClientUpdate]) -> None:
    """Insert new ``rows`` in one batched INSERT (within the caller's transaction),
    without the ORM's unit of work (faster than ``add_all`` for a large round:
    docs/benchmarks.md, "Scale"). Unset attributes take the
    column's default, as ``add_all`` would; ``rows`` stay detached (no ids)."""
    if rows:
        session.execute(insert(ClientUpdate), [
            {k: v for k in _COLUMNS if (v := getattr(row, k)) is not None} for row in rows])


def fill_row(row: ClientUpdate, ref: UpdateRef) -> None:
    """Copy what the task reported into ``row`` (its status and error are the
    caller's: they say what fedq did with the update). How it trained is kept only
    for a task that reported success."""
    ok = ref.status == "ok"
    row.worker, row.attempt, row.signer = ref.worker, ref.attempt, ref.signer
    row.samples, row.processed, row.steps = ref.samples, ref.stats.seen, ref.steps
    row.seconds, row.loss = ref.seconds, ref.loss
    row.bytes_up, row.bytes_down = ref.bytes_up, ref.bytes_down
    row.blob_key, row.blob_sha256 = ref.key, ref.sha256
    row.error = ref.error
    row.train_seconds = ref.stats.train_seconds if ok else None
    row.device = ref.stats.device if ok else None
    row.amp = ref.stats.amp if ok else None
    row.stopped_by_budget = ref.stats.stopped_by_budget if ok else None
    row.yielded = ref.stats.yielded if ok else None
    row.tokens = ref.stats.tokens if ok else None
    row.download_seconds = ref.stats.download_seconds if ok else None
    row.upload_seconds = ref.stats.upload_seconds if ok else None
    row.codec = (ref.stats.codec or None) if ok else None
    row.gpu_peak_mb, row.gpu_util = ref.stats.gpu_peak_mb, ref.stats.gpu_util
    row.host_peak_mb = ref.stats.host_peak_mb if ok else None
    row.uplink_mbit = ref.stats.uplink_mbit
    row.started_at = worker_time(ref.stats.started)


def new_row(job_id: str, round_number: int, ref: UpdateRef, status: str,
            error: str | None = None, norm: float | None = None,
            raw_bytes: int = 0) -> ClientUpdate:
    """A row for ``ref`` with fedq's verdict on it (``status``, ``error``)."""
    row = ClientUpdate(job_id=job_id, round_number=round_number, client=ref.client,
                       queue=ref.queue)
    fill_row(row, ref)
    row.status, row.error = status, error
    row.update_norm, row.raw_bytes = norm, raw_bytes
    return row


def row_ref(row: ClientUpdate) -> UpdateRef:
    """A buffered row's update as the pipeline reads it (the version it trained from,
    plus one, as its round; its task number)."""
    return UpdateRef(status="ok", job=row.job_id, round=(row.base_version or 0) + 1,
                     task=row.task_index, client=row.client,
                     queue=row.queue or "?", worker=row.worker or "?", key=row.blob_key,
                     sha256=row.blob_sha256, samples=row.samples, steps=row.steps,
                     loss=row.loss, seconds=row.seconds, bytes_up=row.bytes_up,
                     bytes_down=row.bytes_down, attempt=row.attempt,
                     stats=TrainStats(seen=row.processed, train_seconds=row.train_seconds or 0.0,
                                      tokens=row.tokens or 0))
