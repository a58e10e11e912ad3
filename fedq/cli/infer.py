"""What ``fedq infer`` and the inference branches of watch/results print."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from fedq.cli.output import fmt, out, status_style


def _rate(view: Any) -> str:
    rates = "  ".join(f"{w.worker.split('@')[0]} {w.items_per_s:.0f}/s" for w in view.workers)
    eta = view.eta_s
    return (f"{rates}  ETA {eta:.0f}s" if eta is not None else rates).strip()


def follow(settings: Any, job_id: str, *, interval: float = 0.5, timeout: float | None = None,
           console: Console = out) -> Any:
    """A progress bar of items done (items/s per worker, ETA) until the job finishes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedq.coordinator.liveness import describe, held
    from fedq.inference.jobs import find
    from fedq.status import JobStatus

    view = find(settings, job_id)
    assert view is not None
    said: set[tuple[str, bool]] = set()  # lost claims already reported
    deadline = time.monotonic() + timeout if timeout else None
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        bar = progress.add_task(f"{view.op} {job_id}", total=view.items, rate="")
        while True:
            view = find(settings, job_id)
            assert view is not None
            progress.update(bar, completed=view.done_items, rate=_rate(view))
            for claim in held(settings, job_id):  # a lost worker's shard, once
                if (claim.resent or claim.silent_s >= settings.worker_lost_s) and \
                        (claim.task_id, claim.resent) not in said:
                    said.add((claim.task_id, claim.resent))
                    progress.console.print(describe(claim, settings.worker_lost_s, "shard",
                                                    "running"),
                                           style="yellow", highlight=False)
            if view.status != JobStatus.RUNNING:
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(interval)
    console.print(f"job {job_id} {status_style(view.status)}: {view.done_items}/{view.items} "
                  f"items in {view.elapsed_s:.1f}s, {view.done_shards}/{view.shards} shards"
                  + (f", {view.resent} re-sent" if view.resent else "")
                  + (f", {view.backups} backup cop{'y' if view.backups == 1 else 'ies'}"
                     if view.backups else ""), highlight=False)
    return view


def summary(view: Any) -> Table:
    table = Table("worker", "device", "shards", "items", "seconds", "items/s",
                  title=f"inference job {view.id} ({view.name}): {view.op}, "
                        f"{view.status}, {view.done_items}/{view.items} items, "
                        f"{view.elapsed_s:.1f}s")
    for w in view.workers:
        table.add_row(w.worker, w.device, str(w.shards), str(w.items), fmt(w.seconds, ".2f"),
                      f"{w.items_per_s:.1f}")
    return table
