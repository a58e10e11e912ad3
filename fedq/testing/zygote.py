"""A process that has imported torch once and forks ``celery worker`` processes on request.

The test suite starts hundreds of workers and ``fedq`` commands, and a worker started
cold spends seconds of CPU importing torch, Celery and the rest before it is ready.
They are forked from this process instead: each child is still a real ``celery -A fedq worker`` (or
``python -m fedq.cli``) process, run by that module's own entry point with its own
arguments, environment, working directory, session and output files, but the imports
that do not depend on the environment are already done (README.md, "Run the tests").

Only the test harness uses it (``fedq.testing.procs.use_zygote``), and the benchmarks'
smoke runs in CI (``FEDQ_TEST_ZYGOTE=1``, tests/test_bench_smoke.py).
``fedq demo`` and the benchmarks' real runs start their workers as plain subprocesses.
fedq's Celery app is not imported here: it reads its settings from the environment,
which differs per worker.

Protocol: one JSON object per line on stdin, one JSON reply per line on the original
stdout. ``{"op": "spawn", "argv": [...], "env": {...}, "cwd": ..., "stdout": ..., "stderr": ...}``
answers
``{"pid": N}``; ``{"op": "poll", "pid": N}`` answers ``{"code": null}`` while it runs,
else its exit status as ``subprocess.Popen.returncode`` gives it (``-signal`` if it was
killed). End of input ends the zygote; the workers it forked live on.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import sys
import threading
import traceback
from typing import Any, NoReturn, TextIO

from fedq.testing.procs import import_time_env

# torch._dynamo: every worker imports it at start (fedq/worker/signals.py);
# sklearn.model_selection: the digits data set's split, at a worker's first task.
PRELOAD = ("torch", "torch._dynamo", "numpy", "sklearn.datasets", "sklearn.model_selection",
           "safetensors.torch", "sqlalchemy", "pydantic", "redis", "kombu.transport.redis",
           "celery.bin.celery", "celery.worker.consumer")
# The [llm] extra's modules, when installed (fedq/models/hf.py imports them in every
# process that builds a Hugging Face model), with the hub switched off as fedq switches
# it off before its own import.
OPTIONAL = ("transformers", "transformers.models.auto.modeling_auto", "peft")


def _child(request: dict[str, Any], reply: TextIO) -> NoReturn:
    """In the forked child: become the process the request names, then end as Python's
    own exit does (non-daemon threads joined, atexit handlers run, output flushed), less
    tearing down every module (slow with torch loaded)."""
    try:
        code = _become(request, reply)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()  # type: ignore[attr-defined]
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _become(request: dict[str, Any], reply: TextIO) -> int:
    reply.close()
    os.setsid()  # its own process group: killpg(pid) reaches it and its pool
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull)  # not the zygote's buffered reader of requests
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # not the zygote's state, shared by every sibling
    argv = request["argv"]  # [python, "-m", module, args...]: celery or fedq.cli
    sys.argv = [argv[2], *argv[3:]]
    sys.path[0] = request["cwd"]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


def _status(pid: int, codes: dict[int, int]) -> int | None:
    if pid not in codes:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return codes.get(pid, 0)
        if done == 0:
            return None
        codes[pid] = os.waitstatus_to_exitcode(status)
    return codes[pid]


def main() -> None:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print from an import cannot corrupt the replies
    for name in PRELOAD:
        __import__(name)
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    for name in OPTIONAL:
        try:
            __import__(name)
        except ImportError:
            break
    reply = os.fdopen(reply_fd, "w", buffering=1)
    codes: dict[int, int] = {}
    reply.write(json.dumps({"ready": os.getpid(), "env": import_time_env(os.environ)}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, reply)
            reply.write(json.dumps({"pid": pid}) + "\n")
        else:
            reply.write(json.dumps({"code": _status(request["pid"], codes)}) + "\n")


if __name__ == "__main__":
    main()
