"""kombu's Redis transport, with one client object per channel instead of one per message.

kombu 5.7 builds a new ``redis.Redis`` object for every command it sends outside the
event loop (``Channel.conn_or_acquire``): each message published (``_put``, the task
events' ``_put_fanout``) and each message a worker takes and acknowledges
(``QoS.append``, ``QoS.ack``). Building one costs about 0.1 ms here (redis-py 8 fills a
dictionary of some 200 response callbacks), a quarter of a serving worker's busy time
in a py-spy profile at concurrency 1 (docs/inference.md). The object holds no
connection of its own (it takes one from the channel's pool for each command), so one
per channel serves every command; a new pool (after a reconnect) gets a new one.

:func:`install` (``fedq.engine.app`` calls it) makes it kombu's transport for the
``redis`` and ``rediss`` schemes, in kombu's table of transport aliases, rather than
naming it in Celery's ``broker_transport``: a connection's URL then still reads
``redis://…`` (in the worker's banner and logs, and for Celery's Flower dashboard,
which picks its broker client by that scheme).
"""

from __future__ import annotations

from typing import Any

from kombu.transport import TRANSPORT_ALIASES, redis


class Channel(redis.Channel):  # type: ignore[misc]
    _sync_client: Any = None

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
