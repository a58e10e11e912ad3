"""kombu's Redis transport, with one client object per channel instead of one per message.

kombu 5.7 builds a new ``redis.Redis`` object for every command it sends outside the
event loop (``Channel.conn_or_acquire``): each message published (``_put``, the task
events' ``_put_fanout``) and each message a worker takes and acknowledges
(``QoS.append``, ``QoS.ack``), and redis-py fills a dictionary of some 200 response
callbacks for each (docs/inference.md measures what that cost a serving worker). The
object holds no
connection of its own (it takes one from the channel's pool for each command), so one
per channel serves every command; a new pool (after a reconnect) gets a new one.

:func:`install` (``fedq.engine.app`` calls it) makes it kombu's transport for the
``redis`` and ``rediss`` schemes, in kombu's table of transport aliases, rather than
naming it in Celery's ``broker_transport``: a connection's URL then still reads
``redis://…`` (in the worker's banner and logs, and for Celery's Flower dashboard,
which picks its broker client by that scheme).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, redis

_batch = threading.local()  # .sessions: channel -> kombu PublishBatch, while batching
_MAX_BATCH = 64  # commands a pipeline holds before it is sent (see batched_publishes)


@contextmanager
def batched_publishes() -> Iterator[None]:
    """Messages published to Redis inside the block go out together: one pipeline
    (one round trip) per ``_MAX_BATCH`` commands, instead of one ``LPUSH`` each.

    A round's chord is one ``train`` message per client, then its task-sent events:
    sent one by one they cost a round trip each. Celery publishes them through
    whichever producer it takes from its pool, so this works below it, on this
    transport's channels, with kombu's own ``PublishBatch`` (a non-transactional
    pipeline). A full pipeline goes out at once, so that the first tasks of a large
    round train while the rest are built (held to the end, no worker would start
    until the last was built). What is still held when the block raises is never
    sent; a nested block joins the outer one. Other transports (AMQP) publish at
    once, as before."""
    if getattr(_batch, "sessions", None) is not None:
        yield
        return
    sessions: dict[Channel, Any] = {}
    _batch.sessions = sessions
    try:
        yield
        for session in sessions.values():
            session.flush()
    except BaseException:
        for session in sessions.values():
            session.discard()
        raise
    finally:
        _batch.sessions = None
        for session in sessions.values():
            session.close()


class Channel(redis.Channel):  # type: ignore[misc]
    _sync_client: Any = None

    def basic_publish(self, message: Any, exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        sessions = getattr(_batch, "sessions", None)
        if sessions is None or "_publish_batch" in kwargs or not self.supports_batch_publish:
            return super().basic_publish(message, exchange, routing_key, **kwargs)
        session = sessions.get(self)
        if session is None:
            session = sessions[self] = self.create_publish_batch(max_size=_MAX_BATCH)
        return session.publish(message, exchange=exchange, routing_key=routing_key, **kwargs)

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:  # the event loop's own (BRPOP, LISTEN): kombu's, unchanged
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client(asynchronous=False)
        return client


class Transport(redis.Transport):  # type: ignore[misc]
    Channel = Channel


def install() -> None:
    """kombu's ``redis://`` and ``rediss://`` connections use :class:`Transport`."""
    for scheme in ("redis", "rediss"):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
