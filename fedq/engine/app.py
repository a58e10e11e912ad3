"""The Celery app: ``celery -A fedq worker -Q cpu`` finds it as ``fedq.app``.

Configuration is built lazily from :mod:`fedq.settings` on first use, so
``import fedq`` is cheap and a bad ``FEDQ_*`` variable surfaces as a
:class:`~fedq.errors.ConfigError` where it is used, not at import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery
from celery.app import amqp
from celery.utils.nodenames import anon_nodename
from celery.utils.time import utcoffset
from kombu import Exchange, Queue
from kombu.exceptions import BatchPublishError, OperationalError

from fedq.engine import (
    logs,  # noqa: F401  (connects FEDQ_LOG_FORMAT=json to Celery's logging)
    redis_transport,
)
from fedq.engine.names import (
    ABSORB_SHARD_TASK,
    ABSORB_UPDATE_TASK,
    CONTROL_EXCHANGE,
    CONTROL_QUEUE,
    FINALIZE_ROUND_TASK,
    REGISTER_WORKER_TASK,
    SITE_NAME_PATTERN,
    SITE_PREFIX,
    START_ROUND_TASK,
    TRAINING_QUEUES,
    WATCHDOG_TASK,
    WORKER_STATE_TASK,
)
from fedq.files import private_folder
from fedq.redaction import redact_text
from fedq.settings import Settings, get_settings


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for ``settings``; see docs/architecture.md for the why of each."""
    transport_options: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout}
    if settings.embedded_broker or settings.result_backend.startswith("file://") or \
            settings.database_url.startswith("sqlite"):
        private_folder(settings.home)  # its database, tasks and results: the owner's only
    if settings.embedded_broker:
        folder = settings.broker_folder
        for sub in ("queue", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        transport_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "control_folder": str(folder / "control"),
            "store_processed": False,
            "polling_interval": settings.poll_interval,
        }
    elif settings.joined_as:  # a registered worker's own unacked keys (coordinator/acl.py)
        transport_options.update({f"unacked{part}_key": f"unacked{part}:{settings.joined_as}"
                                  for part in ("", "_index", "_mutex")})
    if settings.result_backend.startswith("file://"):
        (settings.home / "results").mkdir(parents=True, exist_ok=True)
        path = settings.result_backend[len("file://"):]
        if path:
            from pathlib import Path

            Path(path).mkdir(parents=True, exist_ok=True)
    # The control queue's exchange has another name and is a topic exchange: Celery
    # publishes to it by name, not through the default exchange (which a worker's
    # RabbitMQ user may not use: it reaches every queue), and a joined worker neither
    # declares nor binds it (fedq/coordinator/rabbit.py, acl.py).
    queues = [Queue(CONTROL_QUEUE, Exchange(CONTROL_EXCHANGE, type="topic"),
                    routing_key=CONTROL_QUEUE, no_declare=bool(settings.joined_as))]
    queues += [Queue(name, Exchange(name, type="direct"), routing_key=name)
               for name in TRAINING_QUEUES]
    extra: dict[str, Any] = {}
    if settings.embedded_broker:
        extra["broker_transport"] = "fedq.engine.transport:Transport"  # atomic message files
    return {
        **extra,
        "broker_url": settings.broker_url,
        "result_backend": _result_backend(settings.result_backend),
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        # JSON only, in both directions: nothing from another machine is unpickled.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # A task is acknowledged after it ran, and re-queued when its worker dies.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        # A task keeps training through a broker blip (its result is written when the
        # broker is back; a lost worker is found by its heartbeat, docs/reliability.md).
        # Set, not defaulted: Celery warns at every reconnect until it is.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Celery's consumer without Gossip (fedq.engine.consumer says why).
        "worker_consumer": "fedq.engine.consumer:Consumer",
        "task_queues": queues,
        "task_default_queue": CONTROL_QUEUE,
        "task_create_missing_queues": False,
        "task_routes": {
            START_ROUND_TASK: {"queue": CONTROL_QUEUE},
            FINALIZE_ROUND_TASK: {"queue": CONTROL_QUEUE},
            ABSORB_UPDATE_TASK: {"queue": CONTROL_QUEUE},
            ABSORB_SHARD_TASK: {"queue": CONTROL_QUEUE},
            REGISTER_WORKER_TASK: {"queue": CONTROL_QUEUE},
            WORKER_STATE_TASK: {"queue": CONTROL_QUEUE},
            WATCHDOG_TASK: {"queue": CONTROL_QUEUE},
            "celery.chord_unlock": {"queue": CONTROL_QUEUE},
        },
        "result_expires": 3 * 24 * 3600,
        "result_chord_join_timeout": 10,
        "result_chord_retry_interval": settings.poll_interval,
        "result_extended": False,
        # Events feed the Flower dashboard and `fedq workers`.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        # The watchdog runs from `celery -A fedq beat`; a run that waited longer than
        # one interval in the queue is dropped (the next one is on its way).
        "beat_schedule": {
            "fedq-watchdog": {"task": WATCHDOG_TASK, "schedule": settings.watchdog_interval,
                              "options": {"queue": CONTROL_QUEUE,
                                          "expires": settings.watchdog_interval}},
        },
        "beat_schedule_filename": str(settings.home / "beat-schedule"),
        "beat_scheduler": "fedq.engine.beat:BeatSchedule",  # its file says it is alive
        "include": ["fedq.tasks.train", "fedq.tasks.infer", "fedq.tasks.control",
                    "fedq.worker.signals"],
    }


class Queues(amqp.Queues):
    """Celery's queue table, which makes a data site's queue (``site.<name>``) when it
    is first named, by a worker's ``-Q`` or a task sent to it; any other unknown queue
    stays an error (``task_create_missing_queues`` is off: a typo names no queue)."""

    def __missing__(self, name: str) -> Queue:
        if name.startswith(SITE_PREFIX) and \
                re.fullmatch(SITE_NAME_PATTERN, name[len(SITE_PREFIX):]) is not None:
            return self.add(Queue(name, Exchange(name, type="direct"), routing_key=name))
        raise KeyError(name)


class AMQP(amqp.AMQP):
    queues_cls = Queues


redis_transport.install()  # redis:// brokers: one client object per channel
app = Celery("fedq", amqp=AMQP)
app.add_defaults(lambda: celery_config(get_settings()))


class SentEvents:
    """The task-sent events of many tasks sent at once (a round's chord), published
    after them as one message, as a worker publishes its own task events (routing key
    ``task.multi``, a list body; Celery's event receivers, the Flower dashboard's
    among them, take either), instead of one broker round trip per task.

    Given to each signature as its ``event_dispatcher`` option: Celery hands every
    task-sent event to :meth:`publish` (``celery.app.amqp``'s send_task_message)."""

    def __init__(self) -> None:
        from celery.events import Event

        self._event = Event
        self.hostname = anon_nodename()  # as Celery's own sender of these events
        self.events: list[dict[str, Any]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> SentEvents:
        return self  # Celery deep-copies a signature's options as it sends the chord

    def publish(self, type: str, fields: dict[str, Any], producer: Any,
                **_: Any) -> None:
        self.events.append(self._event(type, hostname=self.hostname,
                                       utcoffset=utcoffset(), pid=os.getpid(),
                                       clock=app.clock.forward(), **fields))

    def flush(self) -> None:
        """Publish what was collected (nothing when events are off or none came)."""
        if not self.events:
            return
        from celery.events.event import get_exchange

        batch, self.events = self.events, []
        with app.producer_or_acquire() as producer:
            exchange = get_exchange(producer.connection, name=app.conf.event_exchange)
            producer.publish(batch, routing_key="task.multi", exchange=exchange.name,
                             declare=[exchange], serializer=app.conf.event_serializer,
                             headers={"hostname": self.hostname},
                             delivery_mode=1)


@contextmanager
def sending() -> Iterator[SentEvents]:
    """Send many tasks at once: give each the yielded :class:`SentEvents` as its
    ``event_dispatcher``. On a Redis broker the tasks and then their task-sent events
    go out in pipelines of 64 commands, the last when the block ends
    (``redis_transport.batched_publishes``); what is still held when it raises is
    never sent."""
    events = SentEvents()
    with redis_transport.batched_publishes():
        yield events
        events.flush()


def _result_backend(url: str) -> str:
    """Redis result backends use fedq.engine.backend.RedisBackend (Celery's, minus result
    subscriptions nobody reads); Celery's ``class+url`` form selects it."""
    if url.startswith(("redis://", "rediss://")):
        return f"fedq.engine.backend:RedisBackend+{url}"
    return url


def broker_errors() -> tuple[type[BaseException], ...]:
    """What a broker that refuses a send raises: kombu's OperationalError (Celery's
    wrapping), its BatchPublishError (a Redis pipeline flushed by ``sending`` that
    failed: a refused ``LPUSH``) and the transport's own connection and channel errors.
    Anything else is a fault of fedq's and raises as before."""
    with app.connection_for_write() as conn:  # not connected: its transport's classes
        return (OperationalError, BatchPublishError, *conn.connection_errors,
                *conn.channel_errors)


def refusal(exc: BaseException) -> str:
    """One line for a broker's refusal, with its cause (a ``BatchPublishError`` says
    only that the batch failed; the Redis error under it says why), redacted."""
    why = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        why += f" ({type(cause).__name__}: {cause})"
    return redact_text(why)[:300]
