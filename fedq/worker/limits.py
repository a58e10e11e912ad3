"""``fedq doctor --services``: which of a registered worker's limits hold for the
credentials this shell holds (docs/security.md, "Least privilege").

Each Redis limit is probed inside ``MULTI`` ... ``DISCARD``: Redis checks a command's
ACL (its name, keys and channels) when it is queued, so a refused command answers
NOPERM and an allowed one answers QUEUED and is thrown away unrun. Nothing is
flushed, configured or published, whoever runs the check; Redis's ``ACL LOG`` records
each refusal (that is the limit working).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from fedq.blobs.redis import KEY_PREFIX
from fedq.engine.names import CONTROL_QUEUE, TRAINING_QUEUES
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
    found = _redis_limits(settings, name, queues)
    found.append(_no_database(settings))
    found.append(_no_s3_key(settings))
    return found


def _redis_limits(settings: Settings, name: str, queues: tuple[str, ...]) -> list[Limit]:
    url = settings.broker_url
    if urlsplit(url).scheme not in ("redis", "rediss"):
        return [Limit("a broker user of its own", None,
                      f"per-worker users are made on Redis only; the broker is "
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
