"""Structured logs: ``FEDQ_LOG_FORMAT=json`` makes every log line of a fedq process
(control worker, training worker, beat) one JSON object.

Each line carries, besides time, level, logger and message, the context of the task
that wrote it: ``job``, ``round``, ``client``, ``task_id``, ``task``, ``worker`` and
``queue``, so one job can be followed across machines (``jq 'select(.job == "...")'``).
The context is set when a task starts (Celery's ``task_prerun``) from its arguments
and cleared when it ends; lines written outside a task carry only what applies.

Plain text stays the default. The formatter is python-json-logger's.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import warnings
from typing import Any

from celery.exceptions import CPendingDeprecationWarning
from celery.signals import (
    after_setup_logger,
    after_setup_task_logger,
    task_postrun,
    task_prerun,
    worker_ready,
)

from fedq.redaction import install_log_filter

#: The fields a JSON line carries for the task that wrote it.
CONTEXT_FIELDS = ("job", "round", "client", "task_id", "task", "worker", "queue")

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "fedq_log_context", default=None)


class TaskContext(logging.Filter):
    """Copies the running task's context onto each record (every field present, null
    when it does not apply, so lines have one shape)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = _context.get() or {}
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, context.get(name))
        return True


def json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s "
        + " ".join(f"%({name})s" for name in CONTEXT_FIELDS),
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        datefmt="%Y-%m-%dT%H:%M:%S%z")


def use_json(logger: logging.Logger) -> None:
    """Give every handler of ``logger`` the JSON formatter and the task context."""
    for handler in logger.handlers:
        handler.setFormatter(json_formatter())
        if not any(isinstance(f, TaskContext) for f in handler.filters):
            handler.addFilter(TaskContext())


def task_context(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The log context of one task call: its job, round and client from its arguments
    (a training task's ref, or a control task's ``job_id`` / ``round_number``)."""
    request = getattr(task, "request", None)
    context: dict[str, Any] = {
        "task_id": getattr(request, "id", None), "task": getattr(task, "name", None),
        "worker": getattr(request, "hostname", None),
        "queue": (getattr(request, "delivery_info", None) or {}).get("routing_key")}
    try:
        bound = inspect.signature(task.run).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return context
    ref = bound.get("ref")
    if isinstance(ref, dict):  # a training task: fedq.protocol.training.TrainRef as JSON
        context.update(job=ref.get("job"), round=ref.get("round"), client=ref.get("client"))
    else:
        context.update(job=bound.get("job_id"), round=bound.get("round_number"))
    return context


def _enabled() -> bool:
    from fedq.settings import get_settings

    try:
        return get_settings().log_format == "json"
    except Exception:  # a bad setting is reported where it is used, not here
        return False


@after_setup_logger.connect
@after_setup_task_logger.connect
def _setup(logger: logging.Logger, **_: Any) -> None:
    if _enabled():
        use_json(logger)
    install_log_filter(logger)  # no password leaves in a log line (fedq/redaction.py)


@task_prerun.connect
def _enter(task: Any = None, args: Any = (), kwargs: Any = None, **_: Any) -> None:
    _context.set(task_context(task, tuple(args or ()), dict(kwargs or {})))


@task_postrun.connect
def _leave(**_: Any) -> None:
    _context.set(None)


@worker_ready.connect
def _quiet_the_cancel_notice(**_: Any) -> None:
    """Celery warns at every broker reconnect, ten lines each time, that tasks will be
    cancelled on connection loss by default in Celery 6; fedq sets the setting
    (``worker_cancel_long_running_tasks_on_connection_loss``, fedq/engine/app.py), so
    a reconnect is one log line. Added once the worker is up: Celery's logging setup
    turns all its deprecation warnings back on before that."""
    warnings.filterwarnings("ignore", category=CPendingDeprecationWarning,
                            message=r"\s*In Celery 5\.1 we introduced an optional breaking")
