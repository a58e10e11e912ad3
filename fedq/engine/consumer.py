"""The worker's consumer: Celery's, without the Gossip and Mingle steps.

Gossip is how Celery workers watch one another (clock sync, leader election); fedq's
workers never talk to each other, so it does nothing for them, and after the broker
goes away and comes back its restart fails inside kombu (``Error on restarting
Gossip: AttributeError: 'NoneType' object has no attribute 'connection_errors'``, a
traceback in every worker's log; reproduced with a Redis that refuses connections
while it restarts, as Docker's port proxy does). Celery's own switch for this is the
``--without-gossip`` flag; ``worker_consumer`` makes it the default of
``celery -A fedq worker``.

Mingle goes for the same reason (``--without-mingle``): at start-up a worker
broadcasts ``hello`` to every other worker on the remote-control channel to sync
revoked ids and clocks. fedq's workers never talk to each other, and a registered
worker's Redis user may listen on that channel but never publish on it (a worker that
could publish there could shut down the control worker: fedq/coordinator/acl.py).
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

GOSSIP = "celery.worker.consumer.gossip:Gossip"


class Consumer(CeleryConsumer):  # type: ignore[misc]
    gossip: Any = None  # what the election control command reads where Gossip is off

    class Blueprint(CeleryConsumer.Blueprint):  # type: ignore[misc,name-defined]
        default_steps = [s for s in CeleryConsumer.Blueprint.default_steps if s != GOSSIP]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Mingle stays in the blueprint (the Tasks step requires it), switched off as
        # `--without-mingle` does
        kwargs["without_mingle"] = True
        super().__init__(*args, **kwargs)
