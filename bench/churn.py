"""Machines that come and go: time to the target accuracy under churn, per mode, into
docs/owners.md.

    .venv/bin/python -m bench.churn                      # about 4 minutes on 2 cores
    .venv/bin/python -m bench.churn --slowdown 3 --target 0.9 --mean-s 15  # short jobs
    .venv/bin/python -m bench.churn --trace trace.csv    # replay your own availability

Four polite workers (``FEDQ_AC_ONLY=1``), each with a power-supply folder the harness
controls (laid out as Linux's /sys/class/power_supply: the probe a laptop's worker
reads, not SIGSTOP), train the digits task on Redis + PostgreSQL. The availability
model: per worker, sessions available and away alternate with exponentially
distributed lengths (mean ``--mean-s`` seconds each, so each worker is available
about half the time), the first state drawn at random; seeded, so every mode sees the
same trace from its job's submission. Or ``--trace FILE``: a CSV of
``worker,start,end`` (the worker's index 0-3, and seconds from the job's submission
during which it is available).

Modes: synchronous waiting for all four clients; synchronous with a deadline and a
quorum of two; time-budgeted synchronous; buffered (FedBuff, K = 2). Each reports the
time from submission to the first committed model with 90% test accuracy, and the
work thrown away: the training steps of tasks handed back by a worker that stepped
aside (they send nothing) and of updates trained but not used (late, stale, missing),
over all training steps.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import BenchError, pg_database, redis_database, write_section
from bench.fedq_run import JobRun, run_job
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.testing.procs import start_workers

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "owners.md"
BEGIN, END = "<!-- churn table -->", "<!-- end of churn table -->"
WORKERS = 4
TARGET = 0.95
SLOWDOWN = 10.0  # each machine slower than this one's core: tasks last seconds
COMMON: dict[str, Any] = {
    **DIGITS, "num_clients": 8, "local_epochs": 2, "clients_per_round": WORKERS,
    "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9}, "round_timeout_s": 300,
    "max_redispatch": 50}
ROUNDS = 12

Trace = dict[int, list[tuple[float, float]]]  # worker -> available (start, end) windows


def exponential_trace(seed: int, mean_s: float, horizon: float) -> Trace:
    rng = random.Random(seed)
    trace: Trace = {}
    for w in range(WORKERS):
        t, up, windows = 0.0, rng.random() < 0.5, []
        while t < horizon:
            length = rng.expovariate(1 / mean_s)
            if up:
                windows.append((t, t + length))
            t, up = t + length, not up
        trace[w] = windows
    return trace


def read_trace(path: Path) -> Trace:
    trace: Trace = {w: [] for w in range(WORKERS)}
    with open(path, newline="") as fh:
        for n, row in enumerate(csv.reader(fh), 1):
            if not row or row[0].startswith("#") or row[0] == "worker":
                continue
            try:
                w, start, end = int(row[0]), float(row[1]), float(row[2])
            except (ValueError, IndexError):
                raise BenchError(f"{path}:{n}: not worker,start,end") from None
            if w not in trace or end <= start:
                raise BenchError(f"{path}:{n}: worker 0-{WORKERS - 1}, end after start")
            trace[w].append((start, end))
    return trace


class Harness:
    """Plugs each worker's machine in while its trace says available."""

    def __init__(self, folders: list[Path], trace: Trace) -> None:
        self.folders, self.trace = folders, trace
        self._stop = threading.Event()
        self._t0 = 0.0
        self.available_s = [0.0] * WORKERS

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        for folder in self.folders:
            (folder / "AC" / "online").write_text("1\n")
        return time.monotonic() - self._t0

    def _run(self) -> None:
        last: list[bool | None] = [None] * WORKERS
        while not self._stop.wait(0.1):
            t = time.monotonic() - self._t0
            for w, folder in enumerate(self.folders):
                up = any(a <= t < b for a, b in self.trace[w])
                if up:
                    self.available_s[w] += 0.1
                if up != last[w]:
                    (folder / "AC" / "online").write_text("1\n" if up else "0\n")
                    last[w] = up


def wasted(cluster: Cluster, run: JobRun, logs_from: dict[str, int]) -> tuple[int, int]:
    """(steps thrown away, all steps trained) for ``run``'s job."""
    used = sum(u.steps or 0 for u in cluster.updates(run.job) if u.status == "ok")
    unused = sum(u.steps or 0 for u in cluster.updates(run.job)
                 if u.status in ("late", "stale", "missing", "cancelled") and u.blob_key)
    handed_back = 0
    for w in cluster.workers:
        if not w.name.startswith("p"):
            continue
        text = w.log_path.read_text(errors="replace")[logs_from.get(w.name, 0):]
        handed_back += sum(int(n) for n in re.findall(
            rf"fedq-{run.job}-[^\]]*\] succeeded[^\n]*'status': 'yielded'[^\n]*after "
            r"(\d+) of \d+ steps", text))
    return unused + handed_back, used + unused + handed_back


def run(trace: Trace, slowdown: float, target: float) -> list[dict[str, Any]]:
    modes: list[tuple[str, dict[str, Any]]] = [
        ("synchronous, wait for all", {"rounds": ROUNDS, "min_clients": WORKERS}),
        ("synchronous, deadline 8 s + quorum 2", {"rounds": ROUNDS, "min_clients": 2,
                                                   "round_timeout_s": 8}),
        ("synchronous, time budget 2 s, quorum 2", {
            "rounds": ROUNDS, "min_clients": 2, "round_timeout_s": 8, "local_epochs": 50,
            "time_budget_s": 2.0, "weight_by": "processed"}),
        ("buffered K=2", {"rounds": ROUNDS * WORKERS // 2,
                          "aggregation": {"mode": "buffered", "buffer": 2}}),
    ]
    out = []
    with tempfile.TemporaryDirectory() as tmp, redis_database() as redis_url, \
            pg_database() as pg_url:
        home = Path(tmp)
        folders = []
        for w in range(WORKERS):
            folder = home / "power" / f"p{w}"
            for name, kind in (("AC", "Mains"), ("BAT0", "Battery")):
                (folder / name).mkdir(parents=True)
                (folder / name / "type").write_text(kind + "\n")
            (folder / "AC" / "online").write_text("1\n")
            folders.append(folder)
        env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                       FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=redis_url,
                       FEDQ_WATCHDOG_INTERVAL="1")
        (home / "logs").mkdir()
        cluster = Cluster(home, env)
        cluster.fedq("db", "upgrade")
        try:
            procs = [cluster.worker("control", ["control"])]
            procs += [cluster.worker(f"p{w}", ["cpu"], FEDQ_AC_ONLY="1",
                                     FEDQ_POWER_SUPPLY_DIR=str(folders[w]),
                                     FEDQ_RESUME_AFTER_S="1", FEDQ_SLOWDOWN=f"{slowdown:g}")
                      for w in range(WORKERS)]
            cluster.workers += procs
            start_workers(procs)
            cluster.start_beat()
            run_job(cluster, {**COMMON, "name": "churn-warm-up", "rounds": 1})
            harness = Harness(folders, trace)
            for mode, extra in modes:
                print(f"[bench] churn: {mode}", file=sys.stderr, flush=True)
                logs_from = {w.name: len(w.log_path.read_text(errors="replace"))
                             for w in cluster.workers}
                harness.available_s = [0.0] * WORKERS
                harness.start()
                submitted = time.time()
                try:
                    job = run_job(cluster, {**COMMON, "name": "churn", **extra}, timeout=900)
                finally:
                    lasted = harness.stop()
                hit = next((r["finished_at"] - submitted for r in job.rounds
                            if r["status"] == "committed" and (r["accuracy"] or 0) >= target),
                           None)
                thrown, total = wasted(cluster, job, logs_from)
                final = [r["accuracy"] for r in job.rounds if r["accuracy"] is not None]
                out.append({"mode": mode, "to_target": hit, "total": lasted,
                            "final": final[-1] if final else None,
                            "waste": thrown / total if total else 0.0,
                            "available": sum(harness.available_s) / (WORKERS * lasted)})
        finally:
            cluster.stop()
    return out


def render(rows: list[dict[str, Any]], source: str, slowdown: float,
           target: float) -> list[str]:
    best_sync = min((r["to_target"] for r in rows
                     if r["mode"].startswith("sync") and r["to_target"]), default=None)
    buffered = next(r for r in rows if r["mode"].startswith("buffered"))
    lines = [
        f"Generated by `.venv/bin/python -m bench.churn{source}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} ({platform.machine()}, {os.cpu_count()} "
        f"cores; Redis + PostgreSQL). Digits, small_cnn, 8 clients, {WORKERS} polite "
        f"workers (FEDQ_SLOWDOWN {slowdown:g}) whose machines the harness unplugs and plugs "
        f"in by the trace; {ROUNDS} rounds of {WORKERS} clients (buffered: the same "
        f"number of updates). Time: from submission to the first committed model with "
        f"{target:.0%} test accuracy.",
        "",
        f"| mode | time to {target:.0%} (s) | total (s) | final accuracy | workers available | "
        "work thrown away | speed-up over the best synchronous |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speed = f"{best_sync / r['to_target']:.2f}x" if best_sync and r["to_target"] else "-"
        lines.append(
            f"| {r['mode']} | {r['to_target']:.1f} |" if r["to_target"] else
            f"| {r['mode']} | not reached |")
        lines[-1] += (f" {r['total']:.1f} | {r['final']:.4f} | {r['available']:.0%} | "
                      f"{r['waste']:.1%} | {speed} |")
    ratio = best_sync / buffered["to_target"] if best_sync and buffered["to_target"] else None
    lines += [
        "",
        "| target | met | measured |",
        "|---|---|---|",
        f"| buffered >= 1.5x sooner to {target:.0%} than the best synchronous mode | "
        f"{'met' if ratio and ratio >= 1.5 else 'not met'} | "
        f"{f'{ratio:.2f}x' if ratio else 'not reached'} |",
        f"| work thrown away < 10% (buffered) | "
        f"{'met' if buffered['waste'] < 0.10 else 'not met'} | {buffered['waste']:.1%} |",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, help="CSV of worker,start,end")
    parser.add_argument("--mean-s", type=float, default=10.0,
                        help="mean length of an available or away session (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=SLOWDOWN,
                        help="FEDQ_SLOWDOWN of every worker")
    parser.add_argument("--target", type=float, default=TARGET, help="test accuracy")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs")
    args = parser.parse_args()
    try:
        trace = read_trace(args.trace) if args.trace else \
            exponential_trace(args.seed, args.mean_s, 3600)
        rows = run(trace, args.slowdown, args.target)
    except BenchError as exc:
        print(f"bench.churn: {exc}", file=sys.stderr)
        return 1
    source = f" --trace {args.trace}" if args.trace else \
        f" --mean-s {args.mean_s:g} --seed {args.seed}"
    lines = render(rows, f"{source} --slowdown {args.slowdown:g} --target {args.target:g}",
                   args.slowdown, args.target)
    if not args.trace:
        lines.insert(1, f"Availability: sessions available and away of exponential length, "
                        f"mean {args.mean_s:g} s each, seed {args.seed}.")
    print("\n".join(lines))
    if not args.no_write:
        write_section(DOC, BEGIN, END, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
