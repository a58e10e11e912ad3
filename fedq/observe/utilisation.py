"""Where each worker's time went in a job: computing (its training steps), moving the
model and its update, and waiting between tasks (for the round's barrier, the broker,
the next task), from the client rows a job keeps.

For one worker, the window runs from the start of its first task to the end of its last
one (both on the worker's own clock: ``started_at`` and ``seconds``, so no clock is
compared with another machine's). Compute is the sum of its tasks' ``train_seconds``,
transfer the sum of their download and upload seconds, the rest of its tasks' time is
other work in a task (loading data, building the model, encoding), and ``waiting`` is
the window less its tasks' time. ``utilisation`` is compute over the window: what a
DiLoCo worker that never stops to talk would bring to 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any


def _start(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value).timestamp()
    return None


def worker_utilisation(clients: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per worker that finished a task of the job (rows as
    ``fedq.coordinator.jobs.client_results`` returns them, or any mapping with
    ``worker``, ``started_at``, ``seconds``, ``train_seconds``, ``download_seconds`` and
    ``upload_seconds``), sorted by worker: its tasks, window, compute, transfer, other
    and waiting seconds, and utilisation (compute / window, None for an empty window)."""
    spans: dict[str, list[tuple[float, float, float, float]]] = {}
    for row in clients:
        worker, start = row.get("worker"), _start(row.get("started_at"))
        seconds = row.get("seconds") or 0.0
        if not worker or start is None or row.get("train_seconds") is None:
            continue  # never started, or no report of how it trained (an error)
        transfer = (row.get("download_seconds") or 0.0) + (row.get("upload_seconds") or 0.0)
        spans.setdefault(str(worker), []).append(
            (start, float(seconds), float(row["train_seconds"]), float(transfer)))
    out = []
    for worker, tasks in sorted(spans.items()):
        window = max(s + d for s, d, _, _ in tasks) - min(s for s, _, _, _ in tasks)
        busy = sum(d for _, d, _, _ in tasks)
        compute = sum(c for _, _, c, _ in tasks)
        transfer = sum(t for _, _, _, t in tasks)
        window, compute = round(window, 3), round(compute, 3)  # as shown, and divided
        out.append({"worker": worker, "tasks": len(tasks), "window_s": window,
                    "compute_s": compute, "transfer_s": round(transfer, 3),
                    "other_s": round(max(0.0, busy - compute - transfer), 3),
                    "waiting_s": round(max(0.0, window - busy), 3),
                    "utilisation": round(min(1.0, compute / window), 4) if window > 0
                    else None})
    return out


def job_utilisation(workers: list[dict[str, Any]]) -> float | None:
    """The job's utilisation: its workers' compute over their windows, summed (one
    worker's: its own)."""
    window = sum(w["window_s"] for w in workers)
    return round(min(1.0, sum(w["compute_s"] for w in workers) / window), 4) if window > 0 \
        else None
