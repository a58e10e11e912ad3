"""Several workers sharing one GPU: the ResNet-18 round, per-worker samples/s and GPU use.

    .venv/bin/python -m bench.gpu_share                 # on a GPU machine: about 3 minutes
    .venv/bin/python -m bench.gpu_share --smoke --no-write   # tiny sizes, any machine

On the embedded default (no servers), one training worker process first trains the
job alone, then ``--workers`` processes (default 4) train together on the same
machine, each its own client of every round: a ResNet-18 on CIFAR-shaped data
(3x32x32, 10 classes), ``--steps`` steps of ``--batch-size`` per task, ``--rounds``
rounds. Per worker it reports what the worker itself measured in the rounds after the
first (the first pays for start-up: data set, cuDNN autotuning): samples/s of its
training loop, the GPU's utilisation while it trained (NVML, device-wide, so it counts
the other workers' kernels too) and its peak GPU memory. The table goes between its
markers in docs/benchmarks.md (``--no-write``: print it only). The queue is this
machine's hardware class, so on a machine without a GPU it measures the CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from bench.common import BenchError, write_section
from fedq.cli.demo import use_embedded
from fedq.coordinator.jobs import client_results, get_job, round_results, submit
from fedq.settings import Settings
from fedq.spec import parse_spec
from fedq.status import JobStatus
from fedq.testing.procs import WorkerProcess, start_workers, stop_workers
from fedq.worker.hardware import probe

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- begin gpu share table -->", "<!-- end gpu share table -->"


def spec_for(queue: str, workers: int, *, steps: int, batch_size: int,
             rounds: int) -> dict[str, Any]:
    """``workers`` clients per round, every one of them in every round."""
    return {
        "name": f"gpu-share-{workers}", "model": "resnet18_cifar", "dataset": "synthetic",
        "dataset_args": {"n_train": max(batch_size * 8, 512) * workers, "n_test": 256,
                         "shape": [3, 32, 32], "num_classes": 10},
        "num_clients": workers, "clients_per_round": workers, "rounds": rounds,
        "local_steps": steps, "batch_size": batch_size,
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "queues": {queue: workers}, "round_timeout_s": 1800, "max_redispatch": 0, "seed": 0,
    }


def run_job(settings: Settings, queue: str, workers: int, *, steps: int, batch_size: int,
            rounds: int) -> dict[str, Any]:
    """Start ``workers`` training workers and a control worker, run the job, stop them,
    and return the job's per-client rows and round times."""
    spec = parse_spec(spec_for(queue, workers, steps=steps, batch_size=batch_size,
                               rounds=rounds), "gpu share spec")
    logs = settings.home / "logs" / f"{workers}"
    procs = [WorkerProcess(f"share{i}@bench", [queue], logs / f"share{i}.log")
             for i in range(1, workers + 1)]
    procs.append(WorkerProcess("control@bench", ["control"], logs / "control.log"))
    started = time.perf_counter()
    start_workers(procs)
    try:
        job = submit(settings, spec)
        while get_job(settings, job).status == JobStatus.RUNNING:
            if time.perf_counter() - started > spec.round_timeout_s * rounds:
                raise BenchError(f"{workers} workers: job not done after "
                                 f"{time.perf_counter() - started:.0f} s")
            time.sleep(0.2)
    finally:
        stop_workers(procs)
    view = get_job(settings, job)
    if view.status != JobStatus.COMPLETED:
        tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
        raise BenchError(f"{workers} workers: job {view.status}: {view.error}\n{tails}")
    return {"clients": [r for r in client_results(settings, job) if r["status"] == "ok"],
            "rounds": round_results(settings, job)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Per worker: median samples/s, mean GPU utilisation and the peak GPU memory over
    the rounds after the first (all rounds when there is only one)."""
    rows = result["clients"]
    first = min(r["round"] for r in rows)
    warm = [r for r in rows if r["round"] > first] or rows
    per: dict[str, list[dict[str, Any]]] = {}
    for r in warm:
        per.setdefault(r["worker"], []).append(r)
    workers = {}
    for name, mine in sorted(per.items()):
        workers[name] = {
            "tasks": len(mine),
            "samples_per_s": statistics.median(r["processed"] / r["train_seconds"]
                                               for r in mine),
            "gpu_util": (statistics.fmean(r["gpu_util"] for r in mine)
                         if all(r["gpu_util"] is not None for r in mine) else None),
            "gpu_peak_mb": (max(r["gpu_peak_mb"] for r in mine)
                            if all(r["gpu_peak_mb"] is not None for r in mine) else None),
            "device": mine[0]["device"], "amp": mine[0]["amp"],
        }
    seconds = [r["seconds"] for r in result["rounds"] if r["round"] > first] or \
        [r["seconds"] for r in result["rounds"]]
    return {"workers": workers, "round_s": statistics.median(seconds),
            "total": sum(w["samples_per_s"] for w in workers.values())}


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "–" if x is None else format(x, fmt)


def render(alone: dict[str, Any], shared: dict[str, Any], *, n: int, steps: int,
           batch_size: int, rounds: int, where: str, minutes: float) -> list[str]:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    lines = [
        f"Generated {stamp} by `python -m bench.gpu_share --workers {n} --steps {steps} "
        f"--batch-size {batch_size} --rounds {rounds}` on {where}, in {minutes:.1f} min. "
        f"ResNet-18 on CIFAR-shaped data (3x32x32), {steps} steps x batch {batch_size} per "
        f"task; figures from rounds 2-{rounds} (round 1 pays for start-up). GPU "
        "utilisation is NVML's, device-wide, sampled while that worker trained.", "",
        "| run | worker | tasks | device, AMP | samples/s | GPU util % | GPU peak MB "
        "| round s (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, run in (("one worker alone", alone), (f"{n} workers sharing", shared)):
        for i, (name, w) in enumerate(run["workers"].items()):
            lines.append(
                f"| {label if i == 0 else ''} | {name} | {w['tasks']} | {w['device']}, "
                f"{w['amp']} | {_num(w['samples_per_s'])} | {_num(w['gpu_util'])} | "
                f"{_num(w['gpu_peak_mb'])} | {run['round_s']:.2f} |")
    ratio = shared["total"] / alone["total"]
    lines += ["",
              f"Together the {n} workers trained {shared['total']:,.0f} samples/s, "
              f"{ratio:.2f}x the {alone['total']:,.0f} samples/s of one worker alone "
              f"({shared['total'] / n:,.0f} per worker)."]
    return lines


def where_run() -> str:
    gpu = (f"{torch.cuda.get_device_name(0)}, " if torch.cuda.is_available() else "no GPU, ")
    return (f"{platform.machine()}, {os.cpu_count()} cores, {gpu}torch {torch.__version__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_share", description=__doc__
                                     .split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.batch_size, args.rounds = 2, 16, 2
    if args.workers < 1 or args.steps < 1 or args.batch_size < 1 or args.rounds < 1:
        parser.error("--workers, --steps, --batch-size and --rounds must be at least 1")
    queue = probe(run_smoke=False).hardware_class
    started = time.monotonic()
    sizes = {"steps": args.steps, "batch_size": args.batch_size, "rounds": args.rounds}
    try:
        with tempfile.TemporaryDirectory(prefix="fedq-gpu-share-") as work:
            print(f"gpu_share: one worker alone on {queue}", file=sys.stderr, flush=True)
            # one embedded default for both runs: the process's Celery app keeps the
            # broker folder it was first configured with
            settings = use_embedded(Path(work) / "home")
            alone = summarize(run_job(settings, queue, 1, **sizes))
            print(f"gpu_share: {args.workers} workers sharing", file=sys.stderr, flush=True)
            shared = summarize(run_job(settings, queue, args.workers, **sizes))
    except BenchError as exc:
        print(f"bench.gpu_share: {exc}", file=sys.stderr)
        return 1
    lines = render(alone, shared, n=args.workers, where=where_run(),
                   minutes=(time.monotonic() - started) / 60, **sizes)
    print("\n".join(lines))
    if not args.no_write:
        write_section(args.out, BEGIN, END, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
