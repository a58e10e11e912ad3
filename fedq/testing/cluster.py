"""A real fedq deployment for a test: settings from an env, worker subprocesses, beat,
CLI calls, and a recorder for the reliability table (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from celery import Celery
from sqlalchemy import select

from fedq.coordinator.jobs import FINISHED, JobView, get_job
from fedq.db import ClientUpdate, Round, session_scope
from fedq.engine.app import celery_config
from fedq.settings import Settings, load_settings
from fedq.testing import faults
from fedq.testing.procs import WorkerProcess, run_module, start_workers, stop_workers
from fedq.testing.wait import wait_until

DIGITS = {"name": "t", "model": "small_cnn", "dataset": "digits", "num_clients": 6,
          "clients_per_round": 4, "rounds": 3, "local_epochs": 1, "batch_size": 16,
          "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "seed": 7}
# For workers whose tasks train to a clock (time_budget_s): each sleeps 19 times a
# step's wall time after the step (FEDQ_TEST_SLOWDOWN), so a task still lasts its budget on
# a twentieth of the CPU, which the tests run beside it need more. Not for a worker the
# test pauses: a SIGSTOP inside a step stretches that step's time, and the sleep with it.
SLOWED = {"FEDQ_TEST_SLOWDOWN": "20"}


def base_env(home: Path, **urls: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    # Workers on gpu_new in these tests run on this CPU machine: skip the startup check.
    env.update({"FEDQ_HOME": str(home), "FEDQ_TORCH_THREADS": "1",
                "FEDQ_SKIP_HARDWARE_CHECK": "1",
                # jobs named zero-compute-* skip training (fedq/testing/faults.py)
                faults.ZERO_COMPUTE: faults.ZERO_COMPUTE_JOBS})
    env.update({k: v for k, v in urls.items() if v})
    return env


@dataclass
class Cluster:
    home: Path
    env: dict[str, str]
    workers: list[WorkerProcess] = field(default_factory=list)
    beat: subprocess.Popen[bytes] | None = None

    @property
    def settings(self) -> Settings:
        return load_settings(self.env)

    def start(self, **queues_by_name: list[str]) -> "Cluster":
        """start(cpu1=["cpu"], control=["control"]): one worker per keyword."""
        started = [self.worker(name, qs) for name, qs in queues_by_name.items()]
        start_workers(started)
        self.workers += started
        return self

    def add(self, name: str, queues: list[str], **env: str) -> WorkerProcess:
        """Start one more worker whose environment adds ``env`` (FEDQ_TEST_SLOWDOWN=4, say)."""
        worker = self.worker(name, queues, **env)
        start_workers([worker])
        self.workers.append(worker)
        return worker

    def run(self, spec: dict[str, Any], timeout: float = 180) -> tuple[str, JobView]:
        """Submit ``spec``, wait for it to finish, then stop the cluster."""
        try:
            job = self.submit(spec)
            return job, self.wait(job, timeout)
        finally:
            self.stop()

    def worker(self, name: str, queues: list[str], **env: str) -> WorkerProcess:
        log = self.home / "logs" / f"{name}-{time.monotonic_ns()}.log"
        return WorkerProcess(f"{name}@test", queues, log, env={**self.env, **env})

    def replace(self, name: str, **env: str) -> WorkerProcess:
        """Start a fresh worker with the same name and queues as ``name`` (after a kill)."""
        old = self.by_name(name)
        new = self.worker(name, list(old.queues), **env)
        start_workers([new])
        self.workers.remove(old)
        self.workers.append(new)
        return new

    def by_name(self, name: str) -> WorkerProcess:
        return next(w for w in self.workers if w.name == f"{name}@test")

    def start_beat(self) -> None:
        log = open(self.home / "logs" / "beat.log", "ab")
        self.beat = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "fedq", "beat", "-l", "INFO"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=self.home)
        log.close()

    def stop(self) -> None:
        stop_workers(self.workers)
        if self.beat is not None and self.beat.poll() is None:
            os.killpg(self.beat.pid, signal.SIGKILL)  # beat holds no state worth a clean exit
            self.beat.wait(10)

    def fedq(self, *args: str, check: bool = True,
             timeout: float = 180) -> subprocess.CompletedProcess[str]:
        proc = run_module("fedq.cli", args, self.env, timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"fedq {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def submit(self, spec: dict[str, Any]) -> str:
        return self.submit_many([spec])[0]

    def submit_many(self, specs: list[dict[str, Any]]) -> list[str]:
        """`fedq submit A.yaml B.yaml ...`: one process, one job id per spec."""
        paths = []
        for spec in specs:
            path = self.home / f"job-{time.monotonic_ns()}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(spec))
            paths.append(str(path))
        ids = self.fedq("submit", *paths).stdout.strip().splitlines()
        assert len(ids) == len(specs), ids
        return ids

    def wait(self, job_id: str, timeout: float = 180) -> JobView:
        """Block until the job has finished; its view."""
        def finished() -> JobView | None:
            view = get_job(self.settings, job_id)
            return view if view.status in FINISHED else None

        return wait_until(finished, timeout, interval=0.2, what=lambda: (
            f"job {job_id} to finish\n"
            + "\n".join(f"--- {w.name}\n{w.tail(30)}" for w in self.workers)))

    def wait_for_round(self, job_id: str, number: int, timeout: float = 120) -> None:
        """Block until round ``number`` of the job is training (its tasks are out)."""
        def started() -> bool:
            with session_scope(self.settings.database_url) as s:
                return s.scalar(select(Round.status).where(
                    Round.job_id == job_id, Round.number == number)) is not None

        wait_until(started, timeout, what=f"round {number} of job {job_id} to start")

    def rounds(self, job_id: str) -> list[Round]:
        with session_scope(self.settings.database_url) as s:
            return list(s.scalars(select(Round).where(Round.job_id == job_id)
                                  .order_by(Round.number)))

    def updates(self, job_id: str) -> list[ClientUpdate]:
        with session_scope(self.settings.database_url) as s:
            return list(s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job_id)
                                  .order_by(ClientUpdate.round_number, ClientUpdate.client)))

    def results_json(self, job_id: str) -> dict[str, Any]:
        return json.loads(self.fedq("results", job_id, "--json").stdout)

    def client_app(self) -> Celery:
        app = Celery("fedq-test", set_as_current=False)
        app.conf.update(celery_config(self.settings))
        return app


def record(table: str, **fields: Any) -> None:
    """Append a row for a generated doc table (bench/) when FEDQ_TEST_REPORT names a file."""
    path = os.environ.get("FEDQ_TEST_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"table": table, **fields}) + "\n")


def record_outcome(scenario: str, fault: str, outcome: str, committed: int,
                   lost: int, redispatch_s: Sequence[float] = ()) -> None:
    """A row of docs/reliability.md (``redispatch_s``: from each kill to the lost
    client's re-dispatch)."""
    record("reliability", scenario=scenario, fault=fault, outcome=outcome,
           committed=committed, lost=lost, redispatch_s=[round(x, 1) for x in redispatch_s])


def power_supply(folder: Path, online: bool) -> Path:
    """A laptop's power-supply folder laid out as Linux's /sys/class/power_supply (the
    probe of ``FEDQ_AC_ONLY``): mains ``AC`` (online or not) and a battery; returns
    ``folder``. Writing ``AC/online`` plugs the laptop in or unplugs it."""
    for name, kind in (("AC", "Mains"), ("BAT0", "Battery")):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "type").write_text(kind + "\n")
    (folder / "AC" / "online").write_text("1\n" if online else "0\n")
    return folder
