"""``fedq doctor --smoke``: one real training round on this machine's hardware.

It starts, on the embedded default under a fresh folder, a control worker and a
training worker on the queue this machine's hardware class maps to (with the
worker's start-up check of the GPU and torch build on), submits a one-round
ResNet-18 job on CIFAR-shaped synthetic data, waits for it, and reports what the
worker measured: samples/s, the AMP mode it chose, peak GPU memory and mean GPU
utilisation. ``scripts/gpu-check.sh`` runs it; docs/hardware.md holds its output
from a GPU machine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedq.cli.demo import use_embedded
from fedq.coordinator.jobs import client_results, get_job, round_results, submit
from fedq.errors import FedqError
from fedq.spec import parse_spec
from fedq.status import JobStatus
from fedq.testing.procs import WorkerProcess, start_workers, stop_workers
from fedq.worker.hardware import HardwareReport


def smoke_spec(queue: str, steps: int, batch_size: int) -> dict[str, Any]:
    """A one-round, one-client ResNet-18 job on CIFAR-shaped data for ``queue``."""
    return {
        "name": "doctor-smoke", "model": "resnet18_cifar", "dataset": "synthetic",
        "dataset_args": {"n_train": max(batch_size * 8, 512), "n_test": 256,
                         "shape": [3, 32, 32], "num_classes": 10},
        "num_clients": 1, "clients_per_round": 1, "rounds": 1, "local_steps": steps,
        "batch_size": batch_size, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "queues": {queue: 1}, "round_timeout_s": 1800, "max_redispatch": 0, "seed": 0,
    }


def run_smoke(home: Path, report: HardwareReport, *, steps: int,
              batch_size: int) -> dict[str, Any]:
    """Run the round; returns what was measured. Raises FedqError when it fails."""
    settings = use_embedded(home)
    queue = report.hardware_class
    spec = parse_spec(smoke_spec(queue, steps, batch_size), "smoke spec")
    logs = home / "logs"
    workers = [WorkerProcess("smoke-train@doctor", [queue], logs / "train.log"),
               WorkerProcess("smoke-control@doctor", ["control"], logs / "control.log")]
    started = time.perf_counter()
    start_workers(workers)  # a GPU worker refuses to start here if its torch cannot run
    try:
        job = submit(settings, spec)
        while get_job(settings, job).status == JobStatus.RUNNING:
            if time.perf_counter() - started > spec.round_timeout_s:
                raise FedqError(f"smoke round not done after {spec.round_timeout_s:.0f}s; "
                                f"see {logs}")
            time.sleep(0.2)
    finally:
        stop_workers(workers)
    view = get_job(settings, job)
    if view.status != JobStatus.COMPLETED:
        raise FedqError(f"smoke round {view.status}: {view.error}; see {logs}")
    [row] = [r for r in client_results(settings, job) if r["status"] == "ok"]
    [rnd] = round_results(settings, job)
    return {
        "queue": queue, "worker": row["worker"], "device": row["device"], "amp": row["amp"],
        "steps": row["steps"], "batch_size": batch_size, "samples": row["processed"],
        "train_seconds": row["train_seconds"],
        "samples_per_second": row["processed"] / row["train_seconds"],
        "gpu_peak_mb": row["gpu_peak_mb"], "gpu_util_percent": row["gpu_util"],
        "bytes_up": row["bytes_up"], "bytes_down": row["bytes_down"],
        "round_seconds": rnd["seconds"], "test_accuracy": rnd["accuracy"],
        "total_seconds": time.perf_counter() - started,
    }
