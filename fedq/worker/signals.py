"""What happens when a Celery worker process starts.

- ``worker_init``: torch's thread count is set and the training stack imported, before
  the first task arrives;
- ``celeryd_after_setup``: a worker that consumes a GPU queue checks its hardware and
  torch build first, and refuses to start (exit 3, one line) when it would fail at its
  first kernel or when its GPU belongs to another class.
- ``worker_ready``: a training worker that has not joined a coordinator on another host
  says in one line that its work is unsigned (:func:`unsigned_warning`); the worker
  reports its hardware to the control queue
  (``fedq.register_worker``), which records it for ``fedq workers``; a worker with a
  run policy (fedq/worker/owner.py) starts watching its owner's conditions: while one
  fails it consumes nothing, and it tells the coordinator (``fedq.worker_state``).
- ``worker_shutdown``: a worker that is stopped (Ctrl-C, SIGTERM, SIGQUIT, a remote
  shutdown; not a kill) reports itself away, "worker stopped", so the planner stops
  counting its site open; it is back when it starts again and registers.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from celery.signals import celeryd_after_setup, worker_init, worker_ready, worker_shutdown

from fedq.engine.names import (
    CONTROL_QUEUE,
    REGISTER_WORKER_TASK,
    STOPPED_REASON,
    WORKER_STATE_TASK,
)

log = logging.getLogger(__name__)
REFUSED_EXIT_CODE = 3


@worker_init.connect
def prepare(sender: Any = None, **_: Any) -> None:
    """Set torch's threads and import the training stack before the first task arrives
    (deferred to here: ``fedq.worker.signals`` is imported by every process that loads
    the app, and only workers need torch). A worker that trains imports torch._dynamo
    too: torch.optim's optimizers import it when the first one is built, seconds of CPU
    that would otherwise fall inside the worker's first task while its round waits. The
    control worker builds no optimizer and skips it."""
    import torch

    import fedq.worker.update  # noqa: F401  (torch, torchvision, the model zoo)
    if sender is None or set(_queues(sender.app)) - {CONTROL_QUEUE}:
        import torch._dynamo  # noqa: F401
    from fedq.settings import get_settings
    settings = get_settings()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    if settings.gpu_memory_fraction and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):  # the owner's share stays free
            torch.cuda.set_per_process_memory_fraction(settings.gpu_memory_fraction, i)


def _queues(app: Any) -> list[str]:
    return sorted(app.amqp.queues.consume_from or app.amqp.queues)


@celeryd_after_setup.connect
def check_hardware(sender: str, instance: Any, **_: Any) -> None:
    import torch

    from fedq.errors import ConfigError
    from fedq.settings import get_settings
    from fedq.worker.hardware import GPU_QUEUES, probe, queue_problems, torch_problem
    from fedq.worker.owner import Policy

    too_old = torch_problem(torch.__version__)
    if too_old:  # an older torch than fedq is tested on: say so before consuming anything
        print(f"fedq: worker {sender} refused to start: {too_old}", file=sys.stderr,
              flush=True)
        os._exit(REFUSED_EXIT_CODE)

    try:
        Policy.from_settings(get_settings())
    except ConfigError as exc:  # a run policy it cannot read: say so before consuming
        print(f"fedq: worker {sender} refused to start: {exc}", file=sys.stderr, flush=True)
        os._exit(REFUSED_EXIT_CODE)
    queues = _queues(instance.app)
    if not any(q in GPU_QUEUES for q in queues) or get_settings().skip_hardware_check:
        return
    problems = queue_problems(queues, probe())
    if problems:
        for problem in problems:
            print(f"fedq: worker {sender} refused to start: {problem}", file=sys.stderr,
                  flush=True)
        os._exit(REFUSED_EXIT_CODE)  # before it consumes anything; SystemExit is swallowed


def _signed(task: str, args: tuple[Any, ...]) -> dict[str, Any]:
    """A control message's keyword arguments: its signature when this machine joined a
    coordinator (fedq worker join), which then takes only signed ones."""
    import fedq.identity as identity
    from fedq.settings import get_settings

    me = identity.joined(get_settings().keys_dir)
    return {} if me is None else {"signed": me.sign_message(task, args)}


def unsigned_warning(broker_url: str, joined: bool, queues: list[str]) -> str | None:
    """The one line a training worker logs at start when it has not joined a coordinator
    (``fedq worker join``) and its broker is on another host: its work is then unsigned,
    and anyone holding the broker's password can take or answer its tasks. None on one
    host (a loopback broker, the embedded default), for a joined worker and for the
    control worker."""
    from urllib.parse import urlsplit

    if joined or not set(queues) - {CONTROL_QUEUE}:
        return None
    parts = urlsplit(broker_url.split(";")[0])
    if parts.scheme not in ("redis", "rediss", "amqp", "amqps", "pyamqp"):
        return None
    host = (parts.hostname or "localhost").lower()
    if host == "localhost" or host == "::1" or host.startswith("127."):
        return None
    return (f"fedq: this worker has not joined the coordinator at {host} (identity off): "
            "its results are unsigned and anyone with the broker's password can answer "
            "its tasks; across machines, run the stack with identity and join each "
            "worker (docs/deploy.md, \"The stack with identity and TLS\")")


@worker_ready.connect
def register(sender: Any, **_: Any) -> None:
    from fedq.worker.hardware import probe

    try:
        import fedq.identity as identity
        from fedq.settings import get_settings

        settings = get_settings()
        warning = unsigned_warning(settings.broker_url,
                                   identity.joined(settings.keys_dir) is not None,
                                   _queues(sender.app))
        if warning:
            log.warning(warning)
    except Exception as exc:  # a keys folder it cannot read: the join check says more
        log.warning("fedq: could not read this worker's identity: %s", exc)
    try:
        from fedq.protocol.envelope import FEDQ_VERSION, MESSAGE_FORMAT

        report = probe(run_smoke=False).to_json()
        # the tasks it runs at once (its pool's processes, ``-c``): the slots the round
        # planner and an inference job count it for (fedq.engine.broker.registered_slots)
        report["concurrency"] = getattr(getattr(sender, "controller", None), "concurrency",
                                        None)
        args = (sender.hostname, _queues(sender.app), report, FEDQ_VERSION, MESSAGE_FORMAT)
        sender.app.send_task(REGISTER_WORKER_TASK, queue=CONTROL_QUEUE, args=args,
                             kwargs=_signed(REGISTER_WORKER_TASK, args))
    except Exception as exc:  # registration is informative; never stop a worker for it
        log.warning("fedq: could not register worker %s: %s", sender.hostname, exc)


@worker_ready.connect
def say_present(sender: Any, **_: Any) -> None:
    """Every FEDQ_PRESENCE_S, tell the coordinator this worker is here. The consumer's
    timer runs between tasks (a task's own heartbeat covers the time it runs), so the
    first message after a pause that outlived a task's heartbeat (SIGSTOP, a
    suspended laptop) comes as soon as the worker is idle again, and the coordinator
    reopens the site it closed for that worker (roster.record_availability)."""
    from fedq.settings import get_settings

    every = get_settings().presence_s
    if every <= 0 or not [q for q in _queues(sender.app) if q != CONTROL_QUEUE]:
        return

    def beat() -> None:
        try:
            args = (sender.hostname, None, None)
            sender.app.send_task(WORKER_STATE_TASK, queue=CONTROL_QUEUE, args=args,
                                 kwargs=_signed(WORKER_STATE_TASK, args), retry=False)
        except Exception as exc:  # noqa: BLE001 - the next beat tries again
            log.warning("fedq: could not say %s is here: %s", sender.hostname, exc)

    sender.timer.call_repeatedly(every, beat)


@worker_ready.connect
def mind_the_owner(sender: Any, **_: Any) -> None:
    """With a run policy: stop consuming the training queues while the owner's
    conditions fail, consume again once they hold, and report each change. Runs on the
    consumer's own timer (the event loop's thread), where Celery's remote-control
    ``cancel_consumer`` runs too; the running task stops itself (fedq/worker/loop.py)."""
    from fedq.worker import owner

    watch = owner.watch()
    if watch is None:
        return
    queues = [q for q in _queues(sender.app) if q != CONTROL_QUEUE]
    state: dict[str, bool | None] = {"consuming": True, "reported": None}

    def apply() -> None:
        reason = watch.reason
        free = reason is None
        if free != state["consuming"]:
            for q in queues:
                (sender.add_task_queue if free else sender.cancel_task_queue)(q)
            state["consuming"] = free
        if free != state["reported"]:
            try:
                args = (sender.hostname, free, reason)
                sender.app.send_task(WORKER_STATE_TASK, queue=CONTROL_QUEUE, args=args,
                                     kwargs=_signed(WORKER_STATE_TASK, args))
                state["reported"] = free
            except Exception as exc:  # noqa: BLE001 - tried again at the next tick
                log.warning("fedq: could not report availability: %s", exc)

    apply()
    owner.set_step_aside(apply)
    sender.timer.call_repeatedly(owner.TICK_S, apply)


@worker_shutdown.connect
def say_stopped(sender: Any, **_: Any) -> None:
    """Report this worker away ("worker stopped") as it shuts down: a site whose only
    worker stopped is closed at once instead of at its tasks' deadline. Sent once,
    without retries (a broker that is gone must not hold the shutdown up)."""
    hostname = getattr(sender, "hostname", None)
    if not isinstance(hostname, str):
        return
    try:
        args = (hostname, False, STOPPED_REASON)
        sender.app.send_task(WORKER_STATE_TASK, queue=CONTROL_QUEUE, args=args,
                             kwargs=_signed(WORKER_STATE_TASK, args), retry=False)
    except Exception as exc:  # noqa: BLE001 - the shutdown goes on; the deadline settles it
        log.warning("fedq: could not report the stop of %s: %s", hostname, exc)
