"""``fedq doctor --services``: which of a registered worker's limits hold for the
credentials this shell holds (docs/security.md, "Least privilege"). With RabbitMQ as the
broker its limits are tried on channels of their own (:func:`_amqp_limits`), and the
Redis limits on the result backend's Redis.

Each Redis limit is probed inside ``MULTI`` ... ``DISCARD``: Redis checks a command's
ACL (its name, keys and channels) when it is queued, so a refused command answers
NOPERM and an allowed one answers QUEUED and is thrown away unrun. Nothing is
flushed, configured or published, whoever runs the check; Redis's ``ACL LOG`` records
each refusal (that is the limit working).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from fedq.blobs.redis import KEY_PREFIX
from fedq.engine.names import CONTROL_EXCHANGE, CONTROL_QUEUE, TRAINING_QUEUES
from fedq.settings import Settings, secret

#: A job id no real job has: the probes' keys name it.
PROBE_JOB = "doctor-probe"


@dataclass(frozen=True)
class Limit:
    what: str           # "cannot FLUSHDB"
    holds: bool | None  # None: could not tell
    detail: str         # what the service answered, or why it was not asked

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def worker_limits(settings: Settings, name: str | None,
                  queues: tuple[str, ...]) -> list[Limit]:
    """What a registered worker ``name`` consuming ``queues`` must be unable to do, and
    the few things it needs, checked with this shell's credentials."""
    name = name or "this-worker"
    queues = queues or ("cpu",)
    if urlsplit(settings.broker_url).scheme in ("amqp", "amqps", "pyamqp"):
        found = _amqp_limits(settings.broker_url, queues)
        redis_url = next((u for u in (settings.result_backend, settings.blob_url)
                          if urlsplit(u).scheme in ("redis", "rediss")), None)
        if redis_url is not None:  # results and blobs: its Redis user
            found += [Limit(f"{limit.what} (Redis)", limit.holds, limit.detail)
                      for limit in _redis_limits(settings, name, queues, redis_url)]
    else:
        found = _redis_limits(settings, name, queues, settings.broker_url)
    found.append(_no_database(settings))
    found.append(_no_s3_key(settings))
    return found


def _redis_limits(settings: Settings, name: str, queues: tuple[str, ...],
                  url: str) -> list[Limit]:
    if urlsplit(url).scheme not in ("redis", "rediss"):
        return [Limit("a broker user of its own", None,
                      f"per-worker users are made on Redis and RabbitMQ only; the broker is "
                      f"{urlsplit(url).scheme}")]
    import redis

    database = urlsplit(url).path.strip("/")  # kombu's fanout channels carry it
    other_queue = next((q for q in TRAINING_QUEUES if q not in queues), None)
    blob = KEY_PREFIX + f"jobs/{PROBE_JOB}"
    refused: list[tuple[str, tuple[object, ...]]] = [
        (f"cannot read the {CONTROL_QUEUE} queue", ("LRANGE", CONTROL_QUEUE, 0, -1)),
        ("cannot read another worker's update", ("GET", f"{blob}/updates/not-{name}/u")),
        ("cannot write the global model", ("SET", f"{blob}/r00001/global.safetensors", "x")),
        ("cannot FLUSHDB", ("FLUSHDB",)),
        ("cannot FLUSHALL", ("FLUSHALL",)),
        ("cannot CONFIG SET", ("CONFIG", "SET", "maxmemory", "0")),
        ("cannot KEYS", ("KEYS", "*")),
        ("cannot ACL", ("ACL", "LIST")),
        ("cannot send remote-control commands (shutdown, revoke)",
         ("PUBLISH", f"/{int(database) if database.isdigit() else 0}.celery.pidbox", "{}")),
    ]
    if other_queue is not None:
        refused.insert(0, (f"cannot read another queue ({other_queue})",
                           ("LRANGE", other_queue, 0, -1)))
    needed: list[tuple[str, tuple[object, ...]]] = [
        (f"can take tasks from its queue ({queues[0]})", ("BRPOP", queues[0], 1)),
        ("can read the global model", ("GET", f"{blob}/r00001/global.safetensors")),
        ("can write its own update", ("SET", f"{blob}/updates/{name}/u", "x")),
    ]
    try:
        client = redis.Redis.from_url(url, single_connection_client=True,
                                      socket_connect_timeout=5, socket_timeout=5)
        try:
            found = [_probe(client, what, command, allowed=False) for what, command in refused]
            found += [_probe(client, what, command, allowed=True) for what, command in needed]
        finally:
            client.close()
    except redis.RedisError as exc:
        return [Limit("the broker's limits", None, f"{type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")]
    return found


def _amqp_limits(url: str, queues: tuple[str, ...]) -> list[Limit]:
    """A worker's RabbitMQ limits (fedq/coordinator/rabbit.py), each tried on a channel
    of its own (a refusal closes the channel). What is tried cannot do harm if it is
    allowed: publishes are routed nowhere or to no one, the queue declared is this
    connection's own and goes with it, the control queue is declared as it is."""
    import amqp

    other_queue = next((q for q in TRAINING_QUEUES if q not in queues), None)
    probe = f"fedq-{PROBE_JOB}"
    command = json.dumps({"method": "ping", "arguments": {}, "destination": [f"{probe}@none"]})

    def consume(queue: str) -> Callable[[Any], object]:
        def run(channel: Any) -> None:
            channel.basic_qos(0, 1, False)
            channel.basic_cancel(channel.basic_consume(queue))  # unacked: put back

        return run

    def publish(exchange: str, key: str, body: str = "{}") -> Callable[[Any], object]:
        def run(channel: Any) -> None:  # confirmed: the broker's verdict comes back
            channel.basic_publish_confirm(amqp.Message(body), exchange=exchange,
                                          routing_key=key, confirm_timeout=5)

        return run

    refused: list[tuple[str, Callable[[Any], object]]] = [
        (f"cannot take tasks from the {CONTROL_QUEUE} queue", consume(CONTROL_QUEUE)),
        (f"cannot declare the {CONTROL_QUEUE} queue",
         lambda ch: ch.queue_declare(CONTROL_QUEUE, durable=True, auto_delete=False)),
        ("cannot declare a queue of its own choosing",
         lambda ch: ch.queue_declare(probe, exclusive=True, auto_delete=True)),
        ("cannot send remote-control commands (shutdown, revoke)",
         publish("celery.pidbox", "", command)),
        ("cannot publish through the default exchange (to any queue)", publish("", probe)),
    ]
    if other_queue is not None:
        refused.insert(0, (f"cannot take tasks from another queue ({other_queue})",
                           consume(other_queue)))
    needed: list[tuple[str, Callable[[Any], object]]] = [
        (f"can take tasks from its queue ({queues[0]})", consume(queues[0])),
        (f"can send to the {CONTROL_QUEUE} queue", publish(CONTROL_EXCHANGE, probe)),
    ]
    parts = urlsplit(url)
    path = parts.path[1:] if parts.path.startswith("/") else ""
    try:
        conn = amqp.Connection(f"{parts.hostname or 'localhost'}:{parts.port or 5672}",
                               userid=unquote(parts.username or "guest"),
                               password=unquote(parts.password or "guest"),
                               virtual_host=unquote(path) or "/",
                               ssl=parts.scheme == "amqps", connect_timeout=5)
        conn.connect()
    except (OSError, amqp.exceptions.AMQPError) as exc:
        return [Limit("the broker's limits", None, f"{type(exc).__name__}: {exc}"[:200])]
    try:
        found = []
        for (what, action), allowed in [*((r, False) for r in refused),
                                        *((n, True) for n in needed)]:
            channel = conn.channel()
            try:
                action(channel)
                permitted, said = True, "allowed"
            except amqp.exceptions.AccessRefused as exc:
                permitted, said = False, f"ACCESS_REFUSED {str(exc)[:90]}"
            except amqp.exceptions.AMQPError as exc:  # not found, locked: not a permission
                permitted, said = True, f"{type(exc).__name__} {str(exc)[:90]}"
            finally:
                if channel.is_open:
                    channel.close()
            found.append(Limit(what, permitted == allowed, said))
        return found
    finally:
        conn.close()


def _probe(client: Any, what: str, command: tuple[object, ...], allowed: bool) -> Limit:
    """Queue ``command`` in a transaction and discard it: does Redis's ACL allow it?"""
    import redis

    conn = client.connection
    conn.send_command("MULTI")
    conn.read_response()
    try:
        conn.send_command(*command)
        conn.read_response()
        permitted, said = True, "allowed"
    except redis.exceptions.NoPermissionError as exc:
        permitted, said = False, f"NOPERM {str(exc)[:80]}"
    finally:
        conn.send_command("DISCARD")
        try:
            conn.read_response()
        except redis.exceptions.ResponseError:
            pass  # DISCARD after a refused command: nothing was queued
    return Limit(what, permitted == allowed, said)


def _no_database(settings: Settings) -> Limit:
    scheme = urlsplit(settings.database_url).scheme
    if scheme.startswith("sqlite"):
        return Limit("no coordinator database URL", True,
                     "only a local file (sqlite) is configured")
    return Limit("no coordinator database URL", False,
                 f"FEDQ_DATABASE_URL is a {scheme.split('+')[0]} server")


def _no_s3_key(settings: Settings) -> Limit:
    if not settings.blob_url.startswith("s3://"):
        return Limit("no S3 key", True, "the blob store is not S3")
    if secret(os.environ, "AWS_SECRET_ACCESS_KEY"):
        return Limit("no S3 key", False,
                     "AWS_SECRET_ACCESS_KEY(_FILE) is set (with FEDQ_PRESIGN_ENDPOINT on the "
                     "coordinator a worker needs none)")
    return Limit("no S3 key", True, "no AWS_SECRET_ACCESS_KEY in this environment")
