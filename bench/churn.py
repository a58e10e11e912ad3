"""Machines that come and go: time to the target accuracy under churn, per mode, into
docs/owners.md.

    .venv/bin/python -m bench.churn                      # about 4 minutes on 2 cores
    .venv/bin/python -m bench.churn --task gpt           # the language model
    .venv/bin/python -m bench.churn --slowdown 3 --target 0.9 --mean-s 15  # short jobs
    .venv/bin/python -m bench.churn --trace trace.csv    # replay your own availability
    .venv/bin/python -m bench.churn --sites              # each client's data on one machine

Four polite workers (``FEDQ_AC_ONLY=1``), each with a power-supply folder the harness
controls (laid out as Linux's /sys/class/power_supply: the probe a laptop's worker
reads, not SIGSTOP), train the digits task (or ``--task gpt``: table 7's GPT on
Shakespeare and Milton, 10 inner steps a task) on Redis + PostgreSQL. The availability
model: per worker, sessions available and away alternate with exponentially
distributed lengths (mean ``--mean-s`` seconds each, so each worker is available
about half the time), the first state drawn at random; seeded, so every mode sees the
same trace from its job's submission. Or ``--trace FILE``: a CSV of
``worker,start,end`` (the worker's index 0-3, and seconds from the job's submission
during which it is available).

Modes: synchronous waiting for all four clients; synchronous with a deadline and a
quorum of two; time-budgeted synchronous; buffered (FedBuff, K = 2). Each reports the
time from submission to the first committed model at the target (digits: 95% test
accuracy; gpt: the validation loss the wait-for-all run reached after two thirds of
its rounds, or ``--target`` nats per byte), and the
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
from bench.jobs import LM
from fedq.testing.cluster import DIGITS, Cluster, base_env, power_supply
from fedq.testing.procs import start_workers

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "owners.md"
MARKERS = {"digits": ("<!-- churn table -->", "<!-- end of churn table -->"),
           "gpt": ("<!-- churn gpt table -->", "<!-- end of churn gpt table -->"),
           "digits-sites": ("<!-- churn sites table -->", "<!-- end of churn sites table -->"),
           "gpt-sites": ("<!-- churn gpt sites table -->",
                         "<!-- end of churn gpt sites table -->")}
WORKERS = 4
TARGET = 0.95  # digits: test accuracy
SLOWDOWN = 10.0  # each machine slower than this one's core: tasks last seconds
SHARED: dict[str, Any] = {"num_clients": 8, "clients_per_round": WORKERS,
                          "round_timeout_s": 300, "max_redispatch": 50}
COMMON: dict[str, dict[str, Any]] = {
    "digits": {**DIGITS, **SHARED, "local_epochs": 2,
               "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9}},
    "gpt": {**LM, **SHARED, "local_steps": 10}}
# time-budgeted mode: more work than the budget allows, cut at the budget
UNBOUNDED = {"digits": {"local_epochs": 50}, "gpt": {"local_steps": 1000}}
DESCRIBED = {"digits": "Digits, small_cnn, 8 clients",
             "gpt": "A GPT (2 layers, 2 heads, width 64, context 32 bytes; AdamW lr 0.003) "
                    "on Shakespeare and Milton, 8 clients of 10 inner steps a task"}
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
    """(steps thrown away, all steps trained) for ``run``'s job. The steps trained are
    read from the workers' logs, task by task: a result's steps (an update's, or a
    yielded task's "after N of M steps") less those its try took over from a yielded
    one kept in memory ("resuming: K steps kept", docs/owners.md). Thrown away: all
    of them less the steps of the updates the job used."""
    used = sum(u.steps or 0 for u in cluster.updates(run.job) if u.status == "ok")
    trained = 0
    for w in cluster.workers:
        if not w.name.startswith("p"):
            continue
        text = w.log_path.read_text(errors="replace")[logs_from.get(w.name, 0):]
        trained += trained_steps(text, run.job)
    return trained - used, trained


def trained_steps(log: str, job: str) -> int:
    """The training steps one worker's log (``--pool solo``: one task at a time) shows
    it took for ``job``'s tasks, each resumed try counting only its own."""
    total = kept = 0
    for line in log.splitlines():
        if "] received" in line:
            kept = 0
        elif (m := re.search(r"resuming: (\d+) steps kept", line)):
            kept = int(m.group(1))
        elif re.search(rf"fedq\.train\[fedq-{job}-[^\]]*\] succeeded", line):
            done = re.search(r"after (\d+) of \d+ steps", line) \
                if "'status': 'yielded'" in line else re.search(r"'steps': (\d+)", line)
            total += int(done.group(1)) - kept if done else 0
    return total


def metric(task: str) -> str:
    """The round result a task's target is read from."""
    return "eval_loss" if task == "gpt" else "accuracy"


def sites(clients: int) -> dict[str, list[int]]:
    """``--sites``: each worker's machine holds the data of clients/WORKERS clients."""
    return {f"p{w}": list(range(w * clients // WORKERS, (w + 1) * clients // WORKERS))
            for w in range(WORKERS)}


def run(trace: Trace, slowdown: float, task: str = "digits",
        rounds: int = ROUNDS, bound: bool = False) -> list[dict[str, Any]]:
    """Each mode's job under the same trace: its curve (seconds from submission, the
    task's metric) of committed rounds or versions, total time, work thrown away and
    the share of the time the workers were available. ``bound``: each client's data
    lives on one worker's machine (the job's ``sites``)."""
    modes: list[tuple[str, dict[str, Any]]] = [
        ("synchronous, wait for all", {"rounds": rounds, "min_clients": WORKERS}),
        ("synchronous, deadline 8 s + quorum 2", {"rounds": rounds, "min_clients": 2,
                                                   "round_timeout_s": 8}),
        ("synchronous, time budget 2 s, quorum 2", {
            "rounds": rounds, "min_clients": 2, "round_timeout_s": 8, **UNBOUNDED[task],
            "time_budget_s": 2.0, "weight_by": "processed"}),
        ("buffered K=2", {"rounds": rounds * WORKERS // 2,
                          "aggregation": {"mode": "buffered", "buffer": 2}}),
    ]
    common = COMMON[task]
    if bound:
        common = {**common, "sites": sites(common["num_clients"])}
    out = []
    with tempfile.TemporaryDirectory() as tmp, redis_database() as redis_url, \
            pg_database() as pg_url:
        home = Path(tmp)
        folders = [power_supply(home / "power" / f"p{w}", online=True)
                   for w in range(WORKERS)]
        env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                       FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=redis_url,
                       FEDQ_WATCHDOG_INTERVAL="1")
        (home / "logs").mkdir()
        cluster = Cluster(home, env)
        cluster.fedq("db", "upgrade")
        try:
            procs = [cluster.worker("control", ["control"])]
            procs += [cluster.worker(f"p{w}", ["cpu", f"site.p{w}"], FEDQ_AC_ONLY="1",
                                     FEDQ_POWER_SUPPLY_DIR=str(folders[w]),
                                     FEDQ_RESUME_AFTER_S="1", FEDQ_TEST_SLOWDOWN=f"{slowdown:g}")
                      for w in range(WORKERS)]
            cluster.workers += procs
            start_workers(procs)
            cluster.start_beat()
            run_job(cluster, {**common, "name": "churn-warm-up", "rounds": 1})
            harness = Harness(folders, trace)
            for mode, extra in modes:
                print(f"[bench] churn: {mode}", file=sys.stderr, flush=True)
                logs_from = {w.name: len(w.log_path.read_text(errors="replace"))
                             for w in cluster.workers}
                harness.available_s = [0.0] * WORKERS
                harness.start()
                submitted = time.time()
                try:
                    job = run_job(cluster, {**common, "name": "churn", **extra}, timeout=900)
                finally:
                    lasted = harness.stop()
                curve = [(r["finished_at"] - submitted, r[metric(task)]) for r in job.rounds
                         if r["status"] == "committed" and r[metric(task)] is not None]
                if not curve:
                    raise BenchError(f"{mode}: job {job.job} committed no evaluated round")
                thrown, total = wasted(cluster, job, logs_from)
                out.append({"mode": mode, "curve": curve, "total": lasted,
                            "final": curve[-1][1], "waste": thrown / total if total else 0.0,
                            "available": sum(harness.available_s) / (WORKERS * lasted)})
        finally:
            cluster.stop()
    return out


def default_target(task: str, rows: list[dict[str, Any]], rounds: int) -> float:
    """digits: 95% test accuracy; gpt: the validation loss the wait-for-all run reached
    after two thirds of its rounds (as table 7 of docs/benchmarks.md sets its target)."""
    if task != "gpt":
        return TARGET
    base = rows[0]["curve"]
    return float(base[max(1, min(len(base), 2 * rounds // 3)) - 1][1])


def render(rows: list[dict[str, Any]], source: str, slowdown: float, target: float,
           task: str = "digits", rounds: int = ROUNDS, bound: bool = False) -> list[str]:
    loss = task == "gpt"
    for r in rows:  # the first commit at the target
        r["to_target"] = next((t for t, v in r["curve"]
                               if (v <= target if loss else v >= target)), None)
    best_sync = min((r["to_target"] for r in rows
                     if r["mode"].startswith("sync") and r["to_target"]), default=None)
    buffered = next(r for r in rows if r["mode"].startswith("buffered"))
    goal = f"validation loss {target:.4f}" if loss else f"{target:.0%}"
    lines = [
        f"Generated by `.venv/bin/python -m bench.churn{source}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} ({platform.machine()}, {os.cpu_count()} "
        f"cores; Redis + PostgreSQL). {DESCRIBED[task]}, {WORKERS} polite "
        f"workers (FEDQ_TEST_SLOWDOWN {slowdown:g}) whose machines the harness unplugs and plugs "
        f"in by the trace; " + ("each client's data on one worker's machine (sites: "
                                "two clients a machine); " if bound else
                                "any worker trains any client; ") +
        f"{rounds} rounds of {WORKERS} clients (buffered: the same "
        f"number of updates). Time: from submission to the first committed model " +
        (f"at or below a validation loss of {target:.4f} nats per byte (the wait-for-all "
         f"run's after {max(1, 2 * rounds // 3)} of its {rounds} rounds)." if loss else
         f"with {target:.0%} test accuracy."),
        "",
        f"| mode | time to {goal} (s) | total (s) | final "
        f"{'validation loss' if loss else 'accuracy'} | workers available | "
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
        f"| buffered >= 1.5x sooner to {goal} than the best synchronous mode | "
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
                        help="FEDQ_TEST_SLOWDOWN of every worker")
    parser.add_argument("--task", choices=sorted(COMMON), default="digits",
                        help="what the workers train")
    parser.add_argument("--target", type=float,
                        help=f"digits: test accuracy (default {TARGET}); gpt: validation "
                             "loss (default: the wait-for-all run's after 2/3 of its rounds)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="synchronous rounds per mode (buffered: as many updates)")
    parser.add_argument("--sites", action="store_true",
                        help="bind each client's data to one worker's machine (sites)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs")
    args = parser.parse_args()
    if args.rounds < 1 or args.mean_s <= 0:
        parser.error("--rounds and --mean-s must be positive")
    try:
        trace = read_trace(args.trace) if args.trace else \
            exponential_trace(args.seed, args.mean_s, 3600)
        rows = run(trace, args.slowdown, args.task, args.rounds, args.sites)
    except BenchError as exc:
        print(f"bench.churn: {exc}", file=sys.stderr)
        return 1
    target = args.target if args.target is not None else \
        default_target(args.task, rows, args.rounds)
    source = f" --trace {args.trace}" if args.trace else \
        f" --mean-s {args.mean_s:g} --seed {args.seed}"
    source += f" --slowdown {args.slowdown:g}"
    if args.task == "gpt":
        source += " --task gpt"
    if args.task != "gpt" or args.target is not None:
        source += f" --target {target:g}"
    if args.rounds != ROUNDS:
        source += f" --rounds {args.rounds}"
    if args.sites:
        source += " --sites"
    lines = render(rows, source, args.slowdown, target, args.task, args.rounds, args.sites)
    if not args.trace:
        lines.insert(1, f"Availability: sessions available and away of exponential length, "
                        f"mean {args.mean_s:g} s each, seed {args.seed}.")
    print("\n".join(lines))
    if not args.no_write:
        write_section(DOC, *MARKERS[args.task + ("-sites" if args.sites else "")], lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
