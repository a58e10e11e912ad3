"""Is the broker there, and who consumes which queue (Celery inspect)."""

from __future__ import annotations

from fedq.engine.app import app
from fedq.errors import ServiceUnavailable
from fedq.settings import get_settings, redact


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


def queue_depths(queues: list[str]) -> dict[str, int]:
    """Queue name -> messages waiting in it (a passive declare: nothing is created).
    A queue the broker does not know yet counts 0."""
    depths: dict[str, int] = {}
    with app.connection_for_read() as conn:
        for name in queues:
            channel = conn.channel()
            try:
                depths[name] = int(channel.queue_declare(queue=name, passive=True).message_count)
            except Exception:  # amqp: NOT_FOUND closes the channel; redis: never raises
                depths[name] = 0
            finally:
                try:
                    channel.close()
                except Exception:
                    pass
    return depths
