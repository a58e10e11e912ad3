"""A registered worker's own Redis user (Redis 7 ACLs): what Celery's consumer, its
result backend and fedq's blob store need on a training worker, and nothing else
(docs/security.md, "Least privilege").

A worker's user may:

- take tasks from its own queues only (BRPOP ``cpu``, not LRANGE ``gpu_new``), keep its
  unacknowledged messages under keys of its own (``unacked:NAME``: kombu's
  ``unacked_key`` transport options, set by fedq/engine/app.py for a joined worker) and
  send tasks to the ``control`` queue (the chord's doorbell, a buffered job's callback,
  registration) without reading it or declaring it;
- write and read result-backend entries (Celery's task results, chord counters) and
  publish their notifications, never subscribe to them: a task's id (with identity
  required it carries a tag only the coordinator computes) reaches only the worker the
  task was sent to;
- listen for remote-control commands and answer them, and send task events (the
  dashboard), but never publish a command itself (no ``shutdown`` of the control
  worker, no ``revoke``, no ``cancel_consumer``);
- read global models and steps, and write only update blobs under its own name
  (``jobs/*/updates/NAME/*``, which intake requires of its results);
- read an inference job's model and inputs, and write shard outputs under its own
  name only (``jobs/*/infer/out/NAME/*``, which fedq/inference/jobs.py requires).

No KEYS/SCAN, FLUSH*, CONFIG, DEBUG, ACL, SHUTDOWN, MONITOR, EVAL, or reading another
worker's update. The rules were found by running real workers under them and reading
``ACL LOG`` until a job ran with none denied (tests/test_acl.py runs that job and
tries each refusal).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from fedq.blobs.redis import KEY_PREFIX
from fedq.engine.names import CONTROL_QUEUE
from fedq.errors import ConfigError, ServiceUnavailable

log = logging.getLogger(__name__)

USER_PREFIX = "fedq-w-"

#: Commands a training worker's connections send (kombu's Redis transport, Celery's
#: Redis result backend, redis-py's handshake, fedq's Redis blob store).
COMMANDS = (
    # the connection
    "ping", "select", "client|setname", "client|id", "hello", "auth",
    "multi", "exec", "discard", "watch", "unwatch", "info",
    # queues and acknowledgements (kombu): take, put back, ack
    "brpop", "lpush", "rpush", "llen", "hset", "hget", "hdel", "zadd", "zrem",
    "zrevrangebyscore", "set", "get", "del", "expire", "pexpire", "exists", "smembers",
    "sadd", "srem", "sismember", "setex", "mget", "incr", "incrby", "decr", "lrange",
    "ltrim", "zcount",
    "zrange", "zrangebyscore", "rpop", "lpop", "strlen", "getrange", "ttl", "pttl",
    # kombu's mutex and fedq's result store (Lua scripts: fedq/engine/backend.py; Redis
    # checks a script's keys and channels against these rules too)
    "evalsha", "eval", "script|load", "script|exists", "time",
    # pub/sub: remote-control commands in (PUBLISH only in the selector below)
    "subscribe", "psubscribe", "unsubscribe", "punsubscribe",
)


def username(name: str) -> str:
    return USER_PREFIX + name


def secret(password: str) -> str:
    """How Redis keeps ``password``: its SHA-256 in hex (``ACL SETUSER name #HEX``)."""
    import hashlib

    return hashlib.sha256(password.encode()).hexdigest()


def worker_rules(name: str, queues: Iterable[str], hashed: str, db: int = 0) -> list[str]:
    """The ``ACL SETUSER`` rules of worker ``name``'s user, for Redis database ``db``
    (kombu prefixes its fanout channels with it; a PSUBSCRIBE pattern must match the
    rule literally). ``hashed``: its password's :func:`secret`, which is all the
    registry keeps of it."""
    keys = [f"~{q}" for q in queues] + [f"~{q}\x06\x16*" for q in queues]  # priorities
    keys += [
        f"%W~{CONTROL_QUEUE}", f"%W~{CONTROL_QUEUE}\x06\x16*",  # send, never read
        f"~unacked:{name}", f"~unacked_index:{name}", f"~unacked_mutex:{name}",
        # bindings: read any (publishing looks them up); declare its own queues' (a
        # joined worker never declares the control queue: fedq/engine/app.py)
        "%R~_kombu.binding*", *(f"~_kombu.binding{kind}.{q}" for q in queues
                                for kind in ("", "_permanent")),
        "~_kombu.binding_deadlines",  # kombu's expiry of its bindings
        "%W~*.reply.celery.pidbox*",  # answers to remote-control commands
        "~*.celery.pidbox*", "~_kombu.binding*.celery.pidbox",  # its remote-control queue
        "~celery-task-meta-*", "~celery-taskset-meta-*", "~chord-unlock-*",
        f"%R~{KEY_PREFIX}jobs/*/global*", f"%R~{KEY_PREFIX}jobs/*/step*",
        f"%R~{KEY_PREFIX}jobs/*/base/*",  # a checkpoint a job ships (model_args.ship_base)
        f"%R~{KEY_PREFIX}jobs/*/tokenizer/*",  # a tokenizer fedq submit trained for a job
        f"~{KEY_PREFIX}jobs/*/updates/{name}/*",
        # batch inference: read the job's model and inputs, write its own outputs
        f"%R~{KEY_PREFIX}jobs/*/infer/model*", f"%R~{KEY_PREFIX}jobs/*/infer/inputs*",
        f"~{KEY_PREFIX}jobs/*/infer/out/{name}/*",
    ]
    # listen on the remote-control channel only; publish only events and result notices
    # (Redis's channel rules admit PUBLISH and SUBSCRIBE alike: the task channels are in
    # the selector that allows PUBLISH alone, so no worker hears another task's claim,
    # heartbeat or answer, nor learns its id)
    publish = "(+publish resetchannels &/*.celeryev/* &celery-task-meta-*)"
    return ["reset", "on", f"#{hashed}", "resetchannels", "-@all",
            *(f"+{c}" for c in COMMANDS), *keys, f"&/{db}.celery.pidbox", publish]


def redis_admin(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=5)


def create_user(admin_url: str, name: str, queues: Iterable[str], hashed: str) -> None:
    """Create (or reset) worker ``name``'s Redis user with its rules and the password
    whose :func:`secret` is ``hashed``."""
    import redis

    rules = worker_rules(name, queues, hashed, database(admin_url))
    try:
        redis_admin(admin_url).execute_command("ACL", "SETUSER", username(name), *rules)
    except redis.ConnectionError as exc:
        raise ServiceUnavailable(f"cannot reach Redis to create {username(name)}: {exc}") \
            from None
    except redis.ResponseError as exc:
        raise ConfigError(f"Redis refused to create the user {username(name)} ({exc}); "
                          f"the coordinator's broker URL must be Redis's admin user") from None


def missing_users(admin_url: str, names: Iterable[str]) -> list[str]:
    """Which of workers ``names`` have no Redis user on ``admin_url``'s server."""
    import redis

    try:
        users = {u.decode() if isinstance(u, bytes) else str(u)
                 for u in redis_admin(admin_url).execute_command("ACL", "USERS")}
    except redis.ConnectionError as exc:
        raise ServiceUnavailable(f"cannot reach Redis to read its users: {exc}") from None
    except redis.ResponseError as exc:
        raise ConfigError(f"Redis refused to list its users ({exc}): the coordinator's "
                          f"broker URL must be Redis's admin user") from None
    return [n for n in names if username(n) not in users]


def disable_user(admin_url: str, name: str) -> bool:
    """Turn worker ``name``'s Redis user off and drop its connections; False when
    there is no such user (the worker did not get one)."""
    import redis

    try:
        client = redis_admin(admin_url)
        if client.execute_command("ACL", "GETUSER", username(name)) is None:
            return False
        client.execute_command("ACL", "SETUSER", username(name), "off", "resetpass")
        client.execute_command("CLIENT", "KILL", "USER", username(name))
        return True
    except redis.RedisError as exc:
        log.warning("could not disable the Redis user %s: %s", username(name), exc)
        return False


def with_user(url: str, user: str, password: str) -> str:
    """``url`` with ``user:password`` as its credentials."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + \
        (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def database(url: str) -> int:
    """The Redis database number of ``url`` (0 when it names none)."""
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def server(url: str) -> str:
    """The Redis server ``url`` names (host:port): its users are the server's."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}"


def is_redis(url: str | None) -> bool:
    return bool(url) and urlsplit(url or "").scheme in ("redis", "rediss")
