"""Registered workers: invite (``fedq worker add``), join (the ``fedq.join_worker``
control task that ``fedq worker join`` sends), revoke, list; and the keys the
coordinator admits results by (fedq/identity.py, docs/security.md)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

import fedq.identity as identity
from fedq.db.models import ClientUpdate, RegisteredWorker, utcnow
from fedq.db.session import ensure_schema, session_scope
from fedq.errors import ConfigError, FedqError
from fedq.protocol.envelope import QUEUE
from fedq.settings import Settings

Registry = identity.Registry  # where intake and roster have always found it

log = logging.getLogger(__name__)

INVITED, ACTIVE, REVOKED = "invited", "active", "revoked"


class NoSuchWorker(FedqError):
    exit_code = 4


@dataclass(frozen=True)
class Member:
    name: str
    queues: tuple[str, ...]
    state: str
    key: str | None  # fingerprint of the public key (None until joined)
    created: datetime
    joined: datetime | None
    revoked: datetime | None


def check_name(name: str) -> str:
    if identity.NAME.fullmatch(name) is None:
        raise ConfigError(f"worker name {name[:60]!r}: use 1-48 lower-case letters, digits, "
                          f"'-' or '_', starting with a letter or digit")
    return name


def check_queues(queues: list[str]) -> tuple[str, ...]:
    if not queues or any(QUEUE.fullmatch(q) is None for q in queues):
        raise ConfigError(f"queues {','.join(queues)[:80]!r}: name at least one queue "
                          f"(gpu_new, gpu_sm61, cpu), separated by commas")
    return tuple(queues)


def invite(settings: Settings, name: str, queues: list[str]) -> str:
    """Record worker ``name`` as invited and return its one-time token (only its sha256
    is kept). Inviting an invited name again replaces its token; an active or revoked
    name is refused (revoke keeps the name, so a revoked key can never come back)."""
    check_name(name)
    qs = check_queues(queues)
    token = secrets.token_urlsafe(32)
    digest = hashlib.sha256(token.encode()).hexdigest()
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        row = s.get(RegisteredWorker, name)
        if row is not None and row.state != INVITED:
            raise ConfigError(f"worker {name} is {row.state}: choose another name")
        if row is None:
            s.add(RegisteredWorker(name=name, queues=",".join(qs), state=INVITED,
                                   token_sha256=digest))
        else:
            row.queues, row.token_sha256, row.created_at = ",".join(qs), digest, utcnow()
    return token


def withdraw(settings: Settings, name: str) -> None:
    """Forget worker ``name``'s invitation (its bundle could not be made: nothing of
    it is left behind). Only an invitation: a joined or revoked name stays."""
    with session_scope(settings.database_url) as s:
        row = s.get(RegisteredWorker, name)
        if row is not None and row.state == INVITED:
            s.delete(row)


def own_users(settings: Settings, name: str, queues: tuple[str, ...] | list[str],
              services: dict[str, str | None]) -> tuple[dict[str, str | None], list[str]]:
    """``services`` with worker ``name``'s own credentials wherever the coordinator's
    service is Redis or RabbitMQ: a user with only what a worker needs is created there
    (fedq/coordinator/acl.py, rabbit.py). Returns the services and the users made."""
    from fedq.coordinator import acl, rabbit

    password = secrets.token_urlsafe(24)
    servers: set[str] = set()  # a Redis user belongs to its server: made once per server
    out = dict(services)
    made: list[str] = []
    broker = services.get("broker_url")
    if rabbit.is_amqp(settings.broker_url) and rabbit.is_amqp(broker):
        rabbit.create_user(settings.broker_url, name, queues, password, settings.rabbitmq_api)
        out["broker_url"] = acl.with_user(str(broker), acl.username(name), password)
        made.append(f"{acl.username(name)} (RabbitMQ)")
    for key in ("broker_url", "result_backend", "blob_url"):
        mine, theirs = getattr(settings, key), services.get(key)
        if not (acl.is_redis(mine) and acl.is_redis(theirs)):
            continue
        if acl.server(mine) not in servers:
            acl.create_user(mine, name, queues, acl.secret(password))
            servers.add(acl.server(mine))
        out[key] = acl.with_user(str(theirs), acl.username(name), password)
    if servers:
        made.append(f"{acl.username(name)} (Redis)")
        with session_scope(settings.database_url) as s:  # its user can be made again
            row = s.get(RegisteredWorker, name)
            if row is not None:
                row.redis_secret = acl.secret(password)
    return out, made


def restore_users(settings: Settings) -> list[str]:
    """Make again the Redis user of every active or invited worker that its Redis
    server lost (restarted without its ACL), from the registry (its queues and its
    password's hash); the names restored. The registry is the source of truth for
    broker users."""
    from fedq.coordinator import acl

    # one URL a server, the first of these, as enrol() makes them: the broker's, whose
    # database numbers the user's channel rule (its remote-control channel)
    servers: dict[str, str] = {}
    for url in (settings.broker_url, settings.result_backend, settings.blob_url):
        if acl.is_redis(url):
            servers.setdefault(acl.server(url), str(url))
    if not servers:
        return []
    with session_scope(settings.database_url) as s:
        rows = [(r.name, r.queues.split(","), r.redis_secret) for r in s.scalars(
            select(RegisteredWorker).where(RegisteredWorker.state.in_((ACTIVE, INVITED)),
                                           RegisteredWorker.redis_secret.is_not(None)))]
    if not rows:
        return []
    restored: list[str] = []
    for url in servers.values():
        lost = set(acl.missing_users(url, [name for name, _, _ in rows]))
        for name, queues, hashed in rows:
            if name in lost and hashed:
                acl.create_user(url, name, queues, hashed)
                restored.append(name)
    if restored:
        log.warning("made again the Redis users of %s (their Redis lost them)",
                    ", ".join(sorted(set(restored))))
    return sorted(set(restored))


def join(db_url: str, proof: Any) -> dict[str, Any]:
    """Register a joining worker's public key (the control task's work). Every field
    comes from the wire: checked here; never raises. The token works once."""
    if not isinstance(proof, dict) or not all(
            isinstance(proof.get(k), str) and len(proof[k]) <= 200
            for k in ("name", "public_key", "token", "sig")):
        return {"ok": False, "error": "refused: not a join request"}
    name, public, token = proof["name"], proof["public_key"], proof["token"]
    if identity.NAME.fullmatch(name) is None:
        return {"ok": False, "error": "refused: not a worker name"}
    if not identity.verify(public, {"name": name, "public_key": public, "token": token},
                           proof["sig"]):
        return {"ok": False, "error": f"refused {name}: the proof of its key does not verify"}
    digest = hashlib.sha256(token.encode()).hexdigest()
    with session_scope(db_url) as s:
        row = s.get(RegisteredWorker, name)
        if row is None or row.state != INVITED or row.token_sha256 is None or \
                not hmac.compare_digest(row.token_sha256, digest):
            log.warning("refused a join as %s: no invitation with that token", name)
            return {"ok": False, "error": f"refused {name}: no open invitation with this "
                                          f"token (used already, or not from `fedq worker add "
                                          f"{name}`)"}
        row.public_key, row.state, row.token_sha256 = public, ACTIVE, None
        row.joined_at = utcnow()
    log.info("worker %s joined (key %s)", name, identity.fingerprint(public))
    return {"ok": True, "name": name, "key": identity.fingerprint(public)}


def reissue(settings: Settings, name: str) -> tuple[str, tuple[str, ...], list[str]]:
    """Invite active (or invited) worker ``name`` again, for a machine that lost its
    bundle or keys, or whose bundle may have leaked: its key is forgotten (results
    signed with it are rejected from the next one on), the Celery workers that signed
    as it are told to shut down, its broker users are turned off with their
    connections, and a new one-time token is made (the new bundle brings a new
    password). Returns the token, its queues and the hosts told. A revoked name stays
    revoked."""
    from sqlalchemy.exc import DBAPIError

    ensure_schema(settings.database_url)
    token = secrets.token_urlsafe(32)
    try:
        with session_scope(settings.database_url) as s:
            row = s.get(RegisteredWorker, name)
            if row is None:
                raise NoSuchWorker(f"no registered worker {name} (`fedq worker list`)")
            if row.state == REVOKED:
                raise ConfigError(f"worker {name} is revoked, for good: add a new name "
                                  f"(`fedq worker add`)")
            row.state, row.public_key, row.joined_at = INVITED, None, None
            row.redis_secret = None  # until the new bundle's user is made
            row.token_sha256 = hashlib.sha256(token.encode()).hexdigest()
            row.created_at = utcnow()
            queues = tuple(row.queues.split(","))
            hosts = sorted(h for h in s.scalars(select(ClientUpdate.worker).distinct()
                                                .where(ClientUpdate.signer == name)) if h)
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != "42501":  # insufficient_privilege
            raise
        raise ConfigError(f"worker {name}: the database refused the reissue "
                          f"({str(exc.orig).splitlines()[0][:160]}): run it with the "
                          f"database owner's URL, the one `fedq db upgrade` uses") from None
    _disconnect(settings, name, hosts)
    log.warning("worker %s re-invited: its old key and broker password no longer work", name)
    return token, queues, hosts


def revoke(settings: Settings, name: str) -> tuple[Member, list[str]]:
    """Revoke worker ``name``: its results are rejected from the next one on, and each
    Celery worker that signed as it is told to shut down (:func:`cut_off`). Returns the
    member and those workers' hostnames."""
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        row = s.get(RegisteredWorker, name)
        if row is None:
            raise NoSuchWorker(f"no registered worker {name} (`fedq worker list`)")
        if row.state != REVOKED:
            row.state, row.revoked_at, row.token_sha256 = REVOKED, utcnow(), None
        s.flush()
        member = _member(row)
        hosts = sorted(h for h in s.scalars(select(ClientUpdate.worker).distinct()
                                            .where(ClientUpdate.signer == name)) if h)
    _disconnect(settings, name, hosts)
    return member, hosts


def _disconnect(settings: Settings, name: str, hosts: list[str]) -> None:
    """Tell ``hosts`` (the Celery workers that signed as ``name``) to shut down, then
    turn ``name``'s Redis and RabbitMQ users off and drop their connections."""
    from fedq.coordinator import acl, rabbit

    cut_off(hosts)  # first, while they can still hear it
    redis_urls = {acl.server(u): u for u in (settings.broker_url, settings.result_backend,
                                             settings.blob_url) if acl.is_redis(u)}.values()
    amqp = rabbit.is_amqp(settings.broker_url)
    if hosts and (redis_urls or amqp):
        time.sleep(1.0)  # the shutdown is read before the connections go
    for url in redis_urls:
        acl.disable_user(url, name)  # its connections dropped, its password gone
    if amqp:
        rabbit.disable_user(settings.broker_url, name, settings.rabbitmq_api)


def cut_off(hosts: list[str]) -> None:
    """Tell the Celery workers ``hosts`` to shut down (a revoked worker's processes; an
    honest one obeys, and a hostile one's results are rejected anyway). Broadcast on
    the broker, no reply awaited."""
    if not hosts:
        return
    from fedq.engine.app import app

    try:
        app.control.shutdown(destination=hosts)
        log.warning("told revoked worker process(es) %s to shut down", ", ".join(hosts))
    except Exception as exc:  # the broadcast is a courtesy; rejection is the guarantee
        log.warning("could not tell %s to shut down: %s", ", ".join(hosts), exc)


def members(settings: Settings) -> list[Member]:
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        return [_member(r) for r in s.scalars(select(RegisteredWorker)
                                              .order_by(RegisteredWorker.name))]


def registry(db_url: str) -> Registry:
    """The registered workers' keys, read fresh (a revocation holds from the next
    result on)."""
    with session_scope(db_url) as s:
        rows = list(s.scalars(select(RegisteredWorker)))
        active = [(r, r.public_key) for r in rows if r.state == ACTIVE and r.public_key]
        return Registry({r.name: key for r, key in active},
                        frozenset(r.name for r in rows if r.state == REVOKED),
                        {r.name: frozenset(r.queues.split(",")) for r, _ in active})


def registry_if_required(settings: Settings) -> Registry | None:
    """The registry when FEDQ_IDENTITY=required (results must be signed), else None."""
    return registry(settings.database_url) if settings.identity == "required" else None


def _member(row: RegisteredWorker) -> Member:
    return Member(row.name, tuple(row.queues.split(",")), row.state,
                  identity.fingerprint(row.public_key) if row.public_key else None,
                  row.created_at, row.joined_at, row.revoked_at)
