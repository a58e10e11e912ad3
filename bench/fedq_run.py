"""Run fedq jobs on real services and real worker processes, and read back their rounds.

The bench uses the same deployment a coordinator would: Redis as broker, result
backend and blob store, PostgreSQL for the rounds, one ``control`` worker and N
training workers (``celery -A fedq worker``, solo pool, one process each).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import BenchError, Context, pg_database, redis_database, status_mb
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.procs import start_workers


@contextmanager
def fedq_cluster(ctx: Context, name: str, workers: int, *,
                 slow: dict[int, float] | None = None,
                 torch_threads: int = 1) -> Iterator[Cluster]:
    """A running fedq deployment: Redis + PostgreSQL with a
    control worker and ``workers`` training workers on ``cpu``; ``slow`` maps a worker
    index to its FEDQ_TEST_SLOWDOWN. A smoke run gets one shared deployment with two
    training workers, whatever is asked (it checks the code, not the figures)."""
    if ctx.smoke:
        if ctx.shared is None:
            ctx.shared = ctx.stack.enter_context(_deployment(ctx, "smoke", 2, None, 1))
        yield ctx.shared
        return
    with _deployment(ctx, name, workers, slow, torch_threads) as cluster:
        yield cluster


@contextmanager
def _deployment(ctx: Context, name: str, workers: int, slow: dict[int, float] | None,
                torch_threads: int) -> Iterator[Cluster]:
    home = ctx.work / f"{name}-{time.monotonic_ns()}"
    with pg_database() as db, redis_database() as redis_url:
        env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                       FEDQ_BLOB_URL=redis_url, FEDQ_DATABASE_URL=db)
        env["FEDQ_TORCH_THREADS"] = str(torch_threads)
        cluster = Cluster(home, env)
        try:
            cluster.fedq("db", "upgrade")
            procs = [cluster.worker("control", ["control"])]
            procs += [cluster.worker(f"w{i}", ["cpu"], **({"FEDQ_TEST_SLOWDOWN": str(slow[i])}
                                                         if slow and i in slow else {}))
                      for i in range(workers)]
            cluster.workers += procs  # stopped by cluster.stop(), even half-started
            start_workers(procs)
            yield cluster
        finally:
            cluster.stop()


@dataclass
class JobRun:
    job: str
    status: str
    rounds: list[dict[str, Any]]  # round_results rows, plus finished_at (epoch seconds)
    wall: float
    started_at: float  # epoch seconds: round 1 was dispatched
    control_peak_mb: float = 0.0
    control_rss_mb: list[tuple[float, float]] | None = None

    def intervals(self, skip_first: int = 1) -> list[float]:
        """Seconds between consecutive round commits (the first ``skip_first`` rounds,
        which include loading the model on each worker, are not counted)."""
        t = [r["finished_at"] for r in self.rounds if r["status"] == "committed"]
        return [b - a for a, b in zip(t[skip_first - 1:], t[skip_first:])] if skip_first \
            else [b - a for a, b in zip(t, t[1:])]


def run_job(cluster: Cluster, spec: dict[str, Any], timeout: float = 600,
            sample_control: bool = False) -> JobRun:
    """Submit ``spec``, wait for it, and read its rounds; optionally sample the control
    worker's memory while it runs."""
    return run_jobs(cluster, [spec], timeout, sample_control)[0]


def run_jobs(cluster: Cluster, specs: list[dict[str, Any]], timeout: float = 600,
             sample_control: bool = False) -> list[JobRun]:
    """Submit ``specs`` at once (one `fedq submit`), wait for all, read their rounds."""
    control = cluster.by_name("control")
    assert control.proc is not None
    pid = control.proc.pid
    samples: list[tuple[float, float]] = []  # (epoch seconds, RSS MB)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            samples.append((time.time(), _tree_mb(pid)))

    sampler = threading.Thread(target=sample, daemon=True)
    if sample_control:
        sampler.start()
    start = time.perf_counter()
    jobs = cluster.submit_many(specs)
    try:
        views = [cluster.wait(job, timeout) for job in jobs]
    finally:
        stop.set()
    wall = time.perf_counter() - start
    runs = []
    for job, view in zip(jobs, views, strict=True):
        if view.status != "completed":
            raise BenchError(f"fedq job {job} ended {view.status}: {view.error}")
        rows = [{"round": r.number, "status": r.status, "accuracy": r.accuracy,
                 "eval_loss": r.eval_loss,
                 "seconds": r.seconds, "bytes_up": r.bytes_up,
                 "raw_bytes_up": r.raw_bytes_up, "participants": r.participants,
                 "started_at": _epoch(r.started_at), "finished_at": _epoch(r.finished_at)}
                for r in cluster.rounds(job)]
        runs.append(JobRun(job, view.status, rows, wall, float(rows[0]["started_at"] or 0),
                           _tree_mb(pid, "VmHWM"), samples if sample_control else None))
    return runs


def _epoch(ts: datetime | None) -> float | None:
    if ts is None:
        return None
    return (ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)).timestamp()


def _tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (a solo-pool worker is one process; be safe)."""
    out = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for c in children:
        out += _tree_pids(int(c))
    return out


def _tree_mb(pid: int, field: str = "VmRSS") -> float:
    """Sum of a /proc memory field (VmRSS, VmHWM) over ``pid`` and its descendants."""
    total = 0.0
    for p in _tree_pids(pid):
        try:
            total += status_mb(p, field)
        except OSError:  # exited meanwhile
            pass
    return total


def zero_compute_spec(model: str, rounds: int, clients: int, **extra: Any) -> dict[str, Any]:
    """A zero-compute job: every client of every round sends a small change of the whole
    model (its name starts ``zero-compute-``, which the workers of
    :func:`fedq.testing.cluster.base_env` know; fedq/testing/faults.py); no evaluation."""
    if model == "resnet18":
        base = {"model": "resnet18_cifar", "dataset": "synthetic",
                "dataset_args": {"n_train": 64, "n_test": 16}}
    else:
        base = {"model": "mlp", "dataset": "digits"}
    return {"name": f"zero-compute-{model}", **base, "num_clients": clients,
            "clients_per_round": clients, "rounds": rounds,
            "eval_every": 0, "keep_updates": 0, "round_timeout_s": 600, **extra}
