"""A real fedq deployment for a test: settings from an env, worker subprocesses, CLI calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from celery import Celery

from fedq.app import celery_config
from fedq.jobs import FINISHED, JobView, get_job
from fedq.procs import WorkerProcess, start_workers, stop_workers
from fedq.settings import Settings, load_settings

DIGITS = {"name": "t", "model": "small_cnn", "dataset": "digits", "num_clients": 6,
          "clients_per_round": 4, "rounds": 3, "local_epochs": 1, "batch_size": 16,
          "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "seed": 7}


def base_env(home: Path, **urls: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    # Workers on gpu_new in these tests run on this CPU machine: skip the startup check.
    env.update({"FEDQ_HOME": str(home), "FEDQ_TORCH_THREADS": "1",
                "FEDQ_SKIP_HARDWARE_CHECK": "1"})
    env.update({k: v for k, v in urls.items() if v})
    return env


@dataclass
class Cluster:
    home: Path
    env: dict[str, str]
    workers: list[WorkerProcess] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return load_settings(self.env)

    def start(self, **queues_by_name: list[str]) -> "Cluster":
        """start(cpu1=["cpu"], control=["control"]): one worker per keyword."""
        self.workers = [WorkerProcess(f"{name}@test", qs, self.home / "logs" / f"{name}.log",
                                      env=self.env) for name, qs in queues_by_name.items()]
        start_workers(self.workers)
        return self

    def stop(self) -> None:
        stop_workers(self.workers)

    def fedq(self, *args: str, check: bool = True,
             timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "fedq.cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"fedq {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def submit(self, spec: dict[str, Any]) -> str:
        path = self.home / f"job-{time.monotonic_ns()}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(spec))
        return self.fedq("submit", str(path)).stdout.strip().splitlines()[-1]

    def wait(self, job_id: str, timeout: float = 180) -> JobView:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            view = get_job(self.settings, job_id)
            if view.status in FINISHED:
                return view
            time.sleep(0.2)
        logs = "\n".join(f"--- {w.name}\n{w.tail(30)}" for w in self.workers)
        raise AssertionError(f"job {job_id} not finished after {timeout}s\n{logs}")

    def results_json(self, job_id: str) -> dict[str, Any]:
        return json.loads(self.fedq("results", job_id, "--json").stdout)

    def client_app(self) -> Celery:
        app = Celery("fedq-test", set_as_current=False)
        app.conf.update(celery_config(self.settings))
        return app
