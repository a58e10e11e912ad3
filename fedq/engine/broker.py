"""Is the broker there, and who consumes which queue (Celery inspect)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from fedq.engine.app import app
from fedq.errors import ServiceUnavailable
from fedq.redaction import redact
from fedq.settings import get_settings


def check_broker(timeout: float = 5.0) -> None:
    """Raise :class:`ServiceUnavailable` unless the broker accepts a connection."""
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
    except Exception as exc:  # kombu raises transport-specific errors
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ServiceUnavailable(f"broker {redact(get_settings().broker_url)} is not "
                                 f"reachable: {first}") from None


def live_queues(timeout: float = 1.0) -> dict[str, list[str]]:
    """Queue name -> hostnames of live workers consuming it (Celery inspect)."""
    replies = app.control.inspect(timeout=timeout).active_queues() or {}
    out: dict[str, list[str]] = {}
    for worker, queues in replies.items():
        for q in queues or []:
            out.setdefault(q["name"], []).append(worker)
    return out


#: The most tasks at once a worker's registration is believed for (from the worker:
#: bounded, so that one row cannot claim a queue's every task).
MAX_WORKER_SLOTS = 64


def registered_slots(hardware: Any) -> int:
    """The tasks a worker runs at once, as its registration said (``concurrency`` in its
    hardware report, fedq/worker/signals.py); 1 where it did not say (a worker of an
    earlier fedq) or said something that is not an integer in 1..:data:`MAX_WORKER_SLOTS`."""
    n = hardware.get("concurrency") if isinstance(hardware, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_WORKER_SLOTS:
        return n
    return 1


def worker_slots(timeout: float = 1.0) -> dict[str, int]:
    """Hostname -> the tasks each live worker runs at once (its pool's concurrency:
    ``-c``; 1 where its stats do not say)."""
    replies = app.control.inspect(timeout=timeout).stats() or {}
    slots = {}
    for worker, stats in replies.items():
        pool = stats.get("pool") if isinstance(stats, dict) else None
        n = pool.get("max-concurrency") if isinstance(pool, dict) else None
        slots[worker] = n if isinstance(n, int) and n > 0 else 1
    return slots


def queue_depths(queues: list[str], conn: Any = None) -> dict[str, int]:
    """Queue name -> messages waiting in it (a passive declare: nothing is created).
    A queue the broker does not know yet counts 0. Pass a kombu connection to reuse
    it (its default channel) across calls; a fresh one is opened and closed otherwise."""
    url = get_settings().broker_url
    if url.startswith(("redis://", "rediss://")):
        return _redis_depths(url, tuple(queues))
    if conn is None:
        with app.connection_for_read() as fresh:
            return queue_depths(queues, fresh)
    depths: dict[str, int] = {}
    for name in queues:
        try:
            depths[name] = int(conn.default_channel.queue_declare(
                queue=name, passive=True).message_count)
        except conn.channel_errors:  # amqp NOT_FOUND (and it closes the channel)
            depths[name] = 0
            conn.release()  # the next call reconnects with a fresh channel
    return depths


@lru_cache(maxsize=4)
def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def _redis_depths(url: str, queues: tuple[str, ...]) -> dict[str, int]:
    """Redis: LLEN of each queue's lists (one per priority step, named as kombu names
    them) in one round trip, on one client (kombu's channel would build a client object
    per call)."""
    from kombu.transport.redis import PRIORITY_STEPS, Channel

    names = [[q if pri == 0 else f"{q}{Channel.sep}{pri}" for pri in PRIORITY_STEPS]
             for q in queues]
    pipe = _redis(url).pipeline(transaction=False)
    for group in names:
        for name in group:
            pipe.llen(name)
    counts = iter(pipe.execute())
    return {q: sum(next(counts) for _ in group) for q, group in zip(queues, names)}
