"""The test harness's zygote (fedq/testing/zygote.py): what it forks behaves as the
process started cold would, and what it cannot start the same way is started cold."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

from fedq.testing import procs
from fedq.testing.procs import Forked, WorkerProcess, run_module, start_module


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env["FEDQ_HOME"] = str(home)
    return env


def test_a_forked_command_has_its_own_arguments_environment_output_and_exit(
        tmp_path: Path) -> None:
    zygote = procs._the_zygote()
    assert zygote is not None  # tests/conftest.py turns it on
    before = zygote.forked
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: x\nrounds: -1\n")
    proc = run_module("fedq.cli", ["submit", str(spec)], _env(tmp_path / "home"), 60)
    assert zygote.forked == before + 1
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()  # one line per problem, each naming the file
    assert all(line.startswith(f"fedq: error: {spec}") for line in lines), proc.stderr
    assert "rounds: Input should be greater than or equal to 1" in lines[-1]
    ok = run_module("fedq.cli", ["status"], _env(tmp_path / "home"), 60)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "home" / "fedq.db").exists()  # FEDQ_HOME reached the child


def test_another_environment_is_started_cold(tmp_path: Path) -> None:
    zygote = procs._the_zygote()
    assert zygote is not None
    before, cold = zygote.forked, zygote.cold
    env = {**_env(tmp_path / "home"), "AWS_REGION": "somewhere"}
    assert run_module("fedq.cli", ["--version"], env, 60).returncode == 0
    assert zygote.forked == before + 1  # read after the fork: forked
    env["OMP_NUM_THREADS"] = "7"  # read when torch is imported, before the fork
    proc = run_module("fedq.cli", ["--version"], env, 60)
    assert proc.returncode == 0 and "version" in proc.stdout
    assert zygote.forked == before + 1  # started cold
    assert zygote.cold == cold + 1 and zygote.differ["OMP_NUM_THREADS"] >= 1


def test_a_module_started_while_stderr_is_a_socket_starts_cold_and_runs(
        tmp_path: Path) -> None:
    """A forked child opens its parent's stderr by its path (/proc/PID/fd/2), which a
    socket does not have: start_module starts such a child cold, and it runs."""
    mine, theirs = socket.socketpair()
    saved = os.dup(2)
    try:
        os.dup2(theirs.fileno(), 2)
        proc = start_module("fedq.cli", ["--version"], tmp_path / "out", tmp_path)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        theirs.close()
        mine.close()
    assert isinstance(proc, subprocess.Popen)  # not Forked
    assert proc.wait(60) == 0 and "version" in (tmp_path / "out").read_text()


def test_a_forked_worker_is_its_own_process_group_and_reports_how_it_ended(
        tmp_path: Path) -> None:
    env = {**_env(tmp_path / "home"), "FEDQ_TORCH_THREADS": "1",
           "FEDQ_SKIP_HARDWARE_CHECK": "1"}
    worker = WorkerProcess("zygote@test", ["cpu"], tmp_path / "w.log", env=env).start()
    try:
        assert isinstance(worker.proc, Forked)
        worker.wait_ready()
        assert os.getpgid(worker.proc.pid) == worker.proc.pid
        assert worker.alive()
        worker.kill(signal.SIGKILL)
        assert worker.proc.wait(10) == -signal.SIGKILL
        assert not worker.alive()
    finally:
        worker.stop()
    assert "zygote@test ready" in worker.log_path.read_text()
