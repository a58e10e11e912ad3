"""``fedq demo``: a real federated job on one machine with no servers.

It points every ``FEDQ_*`` URL at the embedded default under ``home`` (SQLite,
local blobs, Celery's filesystem broker and file result backend), starts real
``celery worker`` subprocesses (training workers on the ``cpu`` queue plus a
control worker), submits the digits job, follows it, prints the per-round table,
classifies the test images with the trained model on the same workers (a batch
inference job) and stops the workers.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from fedq.cli.output import follow, results_table
from fedq.coordinator.jobs import get_job, round_results, submit
from fedq.db.session import ensure_schema
from fedq.settings import Settings, get_settings
from fedq.spec import parse_spec
from fedq.status import JobStatus
from fedq.testing.procs import WorkerProcess, start_workers, stop_workers

#: Same as examples/digits.yaml (a test keeps the two equal).
DEMO_SPEC: dict[str, Any] = {
    "name": "digits-demo",
    "model": "small_cnn",
    "dataset": "digits",
    "partition": {"kind": "iid"},
    "num_clients": 10,
    "clients_per_round": 6,
    "rounds": 5,
    "local_epochs": 2,
    "batch_size": 16,
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "queues": {"cpu": -1},
    "seed": 0,
}

_URL_VARS = ("FEDQ_BROKER_URL", "FEDQ_RESULT_BACKEND", "FEDQ_DATABASE_URL", "FEDQ_BLOB_URL",
             "FEDQ_S3_ENDPOINT_URL")
#: What the embedded default never takes from the shell: the services (also as _FILE
#: secrets), a coordinator's identity setting and a joined worker's keys (whose
#: worker.json names services). Its workers are local processes: identity is off.
_NOT_EMBEDDED = (*_URL_VARS, *(v + "_FILE" for v in _URL_VARS), "FEDQ_IDENTITY",
                 "FEDQ_KEYS_DIR")


def embedded_env(home: Path) -> dict[str, str]:
    """Environment for a process on the embedded default under ``home``."""
    env = {k: v for k, v in os.environ.items() if k not in _NOT_EMBEDDED}
    env["FEDQ_HOME"] = str(home.absolute())
    env.setdefault("FEDQ_TORCH_THREADS", "1")  # 2 cores, several workers: no oversubscription
    return env


def use_embedded(home: Path) -> Settings:
    """Point this process (and the workers it starts) at a fresh embedded default under
    ``home``, with its schema made before any worker uses it."""
    if home.exists():
        shutil.rmtree(home)
    env = embedded_env(home)
    os.environ.clear()
    os.environ.update(env)
    get_settings.cache_clear()
    settings = get_settings()
    ensure_schema(settings.database_url)
    return settings


def run_demo(home: Path, *, rounds: int | None = None, n_workers: int = 3,
             console: Console) -> int:
    """Run the demo; returns the exit code (0 when the job completed)."""
    started = time.perf_counter()
    settings = use_embedded(home)

    spec = parse_spec({**DEMO_SPEC, **({"rounds": rounds} if rounds else {})}, "demo spec")
    logs = home / "logs"
    workers = [WorkerProcess(f"train{i}@demo", ["cpu"], logs / f"train{i}.log")
               for i in range(1, n_workers + 1)]
    workers.append(WorkerProcess("control@demo", ["control"], logs / "control.log"))
    console.print(f"fedq demo: {spec.num_clients} clients on scikit-learn digits, "
                  f"{spec.clients_per_round} per round, {spec.rounds} rounds; "
                  f"state in {home}", highlight=False)
    console.print("identity off: the demo's workers are processes of this machine, trusted "
                  "without keys (workers on other machines join with their own: "
                  "docs/deploy.md)", highlight=False)
    with console.status(f"starting {n_workers} training workers and a control worker"):
        start_workers(workers)
    console.print(f"workers ready after {time.perf_counter() - started:.1f}s: "
                  + ", ".join(w.hostname for w in workers), highlight=False)
    predicted = None
    try:
        job_id = submit(settings, spec)
        console.print(f"submitted job {job_id}", highlight=False)
        view = follow(job_id, interval=0.2, timeout=600, console=console)
        console.print(results_table(view, round_results(settings, job_id)))
        final = get_job(settings, job_id)
        console.print(f"final test accuracy {final.accuracy or 0:.4f}", highlight=False)
        if final.status == JobStatus.COMPLETED:
            predicted = _use_the_model(settings, job_id, home, console)
    finally:
        stop_workers(workers)
    console.print(f"demo took {time.perf_counter() - started:.1f}s (worker logs in {logs})",
                  highlight=False)
    return 0 if final.status == JobStatus.COMPLETED and predicted else 1


def _use_the_model(settings: Settings, job_id: str, home: Path, console: Console) -> bool:
    """The trained model classifies the test images on the same workers (a batch
    inference job, docs/inference.md); the predictions go to ``home``."""
    from fedq.cli import infer as infer_cli
    from fedq.data import load_dataset
    from fedq.inference import jobs as infer_jobs
    from fedq.inference.jobs import merge
    from fedq.inference.spec import parse_inference as parse_infer_spec

    spec = parse_infer_spec({"kind": "inference", "name": "digits-demo-predictions",
                            "model": {"job": job_id}, "op": "classify", "shard_size": 32,
                            "inputs": {"dataset": "digits", "split": "test"}}, "demo spec")
    infer_id = infer_jobs.submit(settings, spec)
    view = infer_cli.follow(settings, infer_id, interval=0.2, timeout=300, console=console)
    if view.status != JobStatus.COMPLETED:
        return False
    out = home / "predictions.jsonl"
    merge(settings, infer_id, out)
    labels = load_dataset("digits").y_test.tolist()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    right = sum(r["label"] == labels[r["i"]] for r in rows)
    rates = ", ".join(f"{w.worker} {w.items} ({w.items_per_s:.0f}/s)" for w in view.workers)
    console.print(f"inference job {infer_id}: the trained model classified {len(rows)} test "
                  f"images on {len(view.workers)} worker(s) ({rates}); "
                  f"{right / len(rows):.4f} right; predictions in {out}", highlight=False)
    return True
