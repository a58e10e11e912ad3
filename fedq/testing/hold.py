"""Hold a task at a named point until a test lets it go: fault tests kill a worker
there, at a known point, instead of hoping a sleep lands inside the task.

The seam is one environment variable, set only by tests (fedq.testing.cluster) on the
workers they start; a job's spec cannot reach it. With ``FEDQ_TEST_HOLD`` unset,
:func:`at` returns at once.

``FEDQ_TEST_HOLD=POINT:FOLDER:REGEX``: a task whose id matches ``REGEX`` (``re.search``)
reaching ``POINT`` writes ``FOLDER/TASK_ID.held`` (holding the worker's name) and
waits until ``FOLDER/TASK_ID.go`` exists. Points: ``training`` (a training task,
claimed and beating, before its first step; named by its task id), ``finalize`` (a
round about to be aggregated and committed: ``JOB-rROUND``), ``apply`` (a buffered
version about to be aggregated and committed: ``JOB-vVERSION``), ``upload`` (a worker's
update written as chunks, its first chunk stored and its manifest not yet:
``upload-JOB-rROUND-cCLIENT-aATTEMPT``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

ENV = "FEDQ_TEST_HOLD"
POLL_S = 0.05


def at(point: str, task_id: str, worker: str) -> None:
    """Hold task ``task_id`` of ``worker`` here while a test says so (module docstring)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, folder, pattern = spec.split(":", 2)
    if want != point or re.search(pattern, task_id) is None:
        return
    held = Path(folder) / f"{task_id}.held"
    held.write_text(worker)
    go = Path(folder) / f"{task_id}.go"
    while not go.exists():
        time.sleep(POLL_S)


def held(folder: Path) -> dict[str, str]:
    """The tasks held in ``folder`` and not let go yet: task id -> worker name."""
    return {p.name.removesuffix(".held"): p.read_text() for p in folder.glob("*.held")
            if p.read_text() and not (folder / (p.name.removesuffix(".held") + ".go")).exists()}


def release(folder: Path, task_id: str) -> None:
    """Let task ``task_id`` go on."""
    (folder / f"{task_id}.go").touch()


def setting(point: str, folder: Path, pattern: str) -> dict[str, str]:
    """The environment that holds tasks matching ``pattern`` at ``point``."""
    folder.mkdir(parents=True, exist_ok=True)
    return {ENV: f"{point}:{folder}:{pattern}"}


class Holds:
    """A test's side of the holds in ``folder``: wait for a task to be held, and let
    go, from then on, every task matching a pattern marked done (a thread, so that a
    task received after the kill is let go too)."""

    def __init__(self, folder: Path) -> None:
        import threading

        self.folder = folder
        self.done: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._let_go, name="fedq-test-holds",
                                        daemon=True)
        self._thread.start()

    def env(self, point: str, pattern: str) -> dict[str, str]:
        return setting(point, self.folder, pattern)

    def waiting(self, pattern: str) -> dict[str, str]:
        """The held tasks whose id matches ``pattern``: task id -> worker name."""
        return {t: w for t, w in held(self.folder).items() if re.search(pattern, t)}

    def let_go(self, pattern: str) -> None:
        """Let go every task matching ``pattern``, held now or later."""
        self.done.append(pattern)

    def _let_go(self) -> None:
        while not self._stop.wait(POLL_S):
            for task in held(self.folder):
                if any(re.search(p, task) for p in self.done):
                    release(self.folder, task)

    def close(self) -> None:
        """Let every task go and stop the thread."""
        self.done.append("")
        self._stop.wait(4 * POLL_S)
        self._stop.set()
        for task in held(self.folder):
            release(self.folder, task)
