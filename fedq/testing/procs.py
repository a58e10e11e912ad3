"""Start and stop real ``celery -A fedq worker`` subprocesses (``fedq demo``, tests, bench).

Each worker runs in its own process group, so stopping it (or SIGKILLing it in a
fault test) takes its pool children with it.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedq.errors import FedqError

READY_TIMEOUT = 120.0


class Forked:
    """A worker forked by the zygote (fedq.testing.zygote): the parts of
    ``subprocess.Popen`` that the harness uses (pid, returncode, poll, wait)."""

    def __init__(self, zygote: "Zygote", pid: int, argv: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.002
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return code


# Variables read while Python, torch, NumPy or Celery are imported (the zygote's own
# imports): a child whose value differs from the zygote's is started cold instead.
_READ_AT_IMPORT = ("PYTHON", "LD_", "LC_", "LANG", "OMP_", "MKL_", "OPENBLAS_", "KMP_",
                   "GOMP_", "CUDA", "NVIDIA_", "TORCH", "PYTORCH_", "TZ", "CELERY_")


# Set in pytest's own environment along the way, and harmless to a child either way:
# scikit-learn and joblib set the KMP_ two when imported (os.environ.setdefault; they
# tell Intel's OpenMP runtime how to behave at fork, and torch's wheels use GNU's);
# torch.compile sets its cache folder to the default it would use anyway
# (tests/test_amp.py: before this, every worker after it was started cold).
_SET_BY_IMPORTS = ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR")


# The modules the zygote forks by default: ``python -m celery`` and ``python -m fedq.cli``.
FORKABLE = ("celery", "fedq.cli")


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a forked child must share with the zygote."""
    return {k: v for k, v in env.items()
            if k.startswith(_READ_AT_IMPORT) and k not in _SET_BY_IMPORTS}


class Zygote:
    """fedq.testing.zygote's process: forks workers that skip importing torch (tests)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "fedq.testing.zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1,
                                     start_new_session=True)
        self.lock = threading.Lock()
        self.forked = self.cold = 0
        self.differ: collections.Counter[str] = collections.Counter()
        # its environment once its imports have run
        self.env: dict[str, str] = self._read()["env"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise FedqError(f"the test zygote exited with {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return self._read()

    def differs(self, argv: Sequence[str], env: Mapping[str, str],
                forkable: Sequence[str] = FORKABLE) -> set[str] | None:
        """None where ``argv`` with ``env`` can be forked: ``python -m M ...`` for a module
        M of ``forkable`` (by default ``celery`` and ``fedq.cli``), whose environment
        agrees with the zygote's in every variable read at import
        (:data:`_READ_AT_IMPORT`; the rest, FEDQ_*, AWS_*, PATH, ..., are read after the
        fork, in the child). Otherwise the variables that differ (empty for another
        command)."""
        if list(argv[:2]) != [sys.executable, "-m"] or argv[2] not in forkable:
            return set()
        mine = import_time_env(env)
        if mine == self.env:
            return None
        return {k for k in {*mine, *self.env} if mine.get(k) != self.env.get(k)}

    def spawn(self, argv: list[str], env: Mapping[str, str], stdout: Path,
              stderr: Path | None = None, cwd: Path | None = None,
              forkable: Sequence[str] = FORKABLE) -> Forked | None:
        """Fork ``argv`` with ``env`` in ``cwd`` (this process's unless given), its stdout
        to ``stdout`` and its stderr there too unless ``stderr`` is given; None where it
        must start cold (:meth:`differs`)."""
        differ = self.differs(argv, env, forkable)
        if differ is not None:
            self.cold += 1
            self.differ.update(differ)
            return None
        reply = self._ask({"op": "spawn", "argv": argv, "env": dict(env),
                           "cwd": str(cwd or os.getcwd()),
                           "stdout": str(stdout), "stderr": str(stderr or stdout)})
        self.forked += 1
        return Forked(self, int(reply["pid"]), argv)

    def status(self, pid: int) -> int | None:
        code = self._ask({"op": "poll", "pid": pid})["code"]
        return None if code is None else int(code)

    def close(self) -> None:
        print(f"fedq.testing.zygote: forked {self.forked} processes, started {self.cold} "
              f"cold (their environment differed in a variable read at import: "
              f"{dict(self.differ) or 'none'})", file=sys.stderr)
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(10)


_zygote: Zygote | None = None
_use_zygote = False


def run_module(module: str, args: Sequence[str], env: Mapping[str, str],
               timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, -m, module, *args])`` with its output captured as text;
    forked from the zygote where :func:`use_zygote` is on and the module allows it."""
    argv = [sys.executable, "-m", module, *args]
    zygote = _the_zygote()
    with tempfile.TemporaryDirectory(prefix="fedq-run-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = None if zygote is None else zygote.spawn(argv, env, out, err)
        if proc is None:
            return subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


def start_module(module: str, args: Sequence[str], stdout: Path, cwd: Path
                 ) -> subprocess.Popen[bytes] | Forked:
    """``python -m module *args`` in ``cwd``, not waited for: its stdout to the file
    ``stdout``, its stderr to this process's stderr. Forked from the zygote where
    :func:`use_zygote` is on (or ``FEDQ_TEST_ZYGOTE=1``), so it skips importing torch;
    ``module`` must then be one that a process which has made the zygote's imports can
    run as a fresh interpreter would (bench.lm's runs). Where this process's stderr is
    a socket, which a forked child cannot open by its path, it starts cold."""
    argv = [sys.executable, "-m", module, *args]
    env = dict(os.environ)
    zygote = None if stat.S_ISSOCK(os.fstat(2).st_mode) else _the_zygote()
    # the child opens this process's stderr by its path (a pipe or a file alike)
    forked = None if zygote is None else zygote.spawn(
        argv, env, stdout, Path(f"/proc/{os.getpid()}/fd/2"), cwd=cwd, forkable=(module,))
    if forked is not None:
        return forked
    with open(stdout, "wb") as out:
        return subprocess.Popen(argv, cwd=cwd, stdout=out, env=env)


def use_zygote(on: bool = True) -> None:
    """Fork this process's workers from a zygote that has imported torch (the tests; the
    benchmarks' smoke runs set ``FEDQ_TEST_ZYGOTE=1`` in their environment instead)."""
    global _use_zygote
    _use_zygote = on


def _the_zygote() -> Zygote | None:
    global _zygote
    if not (_use_zygote or os.environ.get("FEDQ_TEST_ZYGOTE") == "1"):
        return None
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = Zygote()
        atexit.register(_zygote.close)
    return _zygote


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
    proc: subprocess.Popen[bytes] | Forked | None = None

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
        env = {**os.environ, **self.env}
        zygote = _the_zygote()
        forked = None if zygote is None else zygote.spawn(self.command(), env, self.log_path)
        if forked is not None:
            self.proc = forked
            return self
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
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
        demo and the tests stop idle workers, and a worker takes seconds to close its
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
