"""Start and stop real ``celery -A fedq worker`` subprocesses (``fedq demo``, tests, bench).

Each worker runs in its own process group, so stopping it (or SIGKILLing it in a
fault test) takes its pool children with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedq.errors import FedqError

READY_TIMEOUT = 120.0


@dataclass
class WorkerProcess:
    """One ``celery worker`` consuming ``queues``, logging to ``log_path``."""

    name: str
    queues: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    pool: str = "solo"
    concurrency: int = 1
    extra_args: Sequence[str] = ()
    app: str = "fedq"
    prefix: Sequence[str] = ()  # e.g. ``ip netns exec NS``: run it on an emulated host
    proc: subprocess.Popen[bytes] | None = None

    @property
    def hostname(self) -> str:
        return self.name if "@" in self.name else f"celery@{self.name}"

    def command(self) -> list[str]:
        return [*self.prefix, sys.executable, "-m", "celery", "-A", self.app, "worker",
                "-Q", ",".join(self.queues), "-n", self.name, "--pool", self.pool,
                "-c", str(self.concurrency), "--without-gossip", "--without-mingle",
                "-l", "INFO", *self.extra_args]

    def start(self) -> "WorkerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        """Block until the worker logs 'ready' (it then consumes its queues)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        marker = f"{self.hostname} ready".encode()
        while time.monotonic() < deadline:
            if self.log_path.exists() and marker in self.log_path.read_bytes():
                return
            if self.proc.poll() is not None:
                raise FedqError(f"worker {self.name} exited with {self.proc.returncode} before "
                                f"it was ready; see {self.log_path}:\n{self.tail()}")
            time.sleep(0.1)
        raise FedqError(f"worker {self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker's whole process group."""
        if self.alive():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 1.5, sig: int = signal.SIGQUIT) -> None:
        """Shut the worker down and wait; SIGKILL if it lingers past ``timeout``.

        The default is Celery's cold shutdown (SIGQUIT), cut short after 1.5 s: the
        demo and the tests stop idle workers, and a worker takes about 6 s to close its
        connections on its own. A task still running would be re-queued (acks_late)
        or re-dispatched at its round's deadline. Pass SIGTERM and a longer timeout for
        a warm shutdown that finishes the running task first."""
        if self.proc is None:
            return
        self.kill(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.proc.wait(5)


def start_workers(workers: Sequence[WorkerProcess], timeout: float = READY_TIMEOUT) -> None:
    """Start all, then wait for all (they import torch in parallel)."""
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.wait_ready(timeout)
    except BaseException:
        stop_workers(workers)
        raise


def stop_workers(workers: Sequence[WorkerProcess], sig: int = signal.SIGQUIT,
                 timeout: float = 1.5) -> None:
    """Stop all at once (see :meth:`WorkerProcess.stop`), one shared deadline."""
    for w in workers:
        w.kill(sig)
    deadline = time.monotonic() + timeout
    for w in workers:
        w.stop(timeout=max(0.0, deadline - time.monotonic()), sig=sig)
