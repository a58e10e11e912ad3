"""The worker's consumer: Celery's, without the Gossip step.

Gossip is how Celery workers watch one another (clock sync, leader election); fedq's
workers never talk to each other, so it does nothing for them, and after the broker
goes away and comes back its restart fails inside kombu (``Error on restarting
Gossip: AttributeError: 'NoneType' object has no attribute 'connection_errors'``, a
traceback in every worker's log; reproduced with a Redis that refuses connections
while it restarts, as Docker's port proxy does). Celery's own switch for this is the
``--without-gossip`` flag; ``worker_consumer`` makes it the default of
``celery -A fedq worker``.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

GOSSIP = "celery.worker.consumer.gossip:Gossip"


class Consumer(CeleryConsumer):  # type: ignore[misc]
    gossip: Any = None  # what the election control command reads where Gossip is off

    class Blueprint(CeleryConsumer.Blueprint):  # type: ignore[misc,name-defined]
        default_steps = [s for s in CeleryConsumer.Blueprint.default_steps if s != GOSSIP]
