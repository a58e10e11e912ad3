"""API keys of ``fedq serve``, one per person or program (docs/inference.md, "API keys").

``fedq serve-key add NAME`` makes a random key, prints it once and keeps only its
sha256; ``fedq serve-key revoke NAME`` marks it revoked. A gateway reads the table when
it starts and every few seconds after: it asks for a key once the table holds any row
(revoking every key leaves it closed, not open) or when FEDQ_SERVE_API_KEY is set,
and takes a key whose sha256 is an active row's, or the shared key.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select

from fedq.db.models import ServeKey, utcnow
from fedq.db.session import ensure_schema, session_scope
from fedq.errors import ConfigError, FedqError

#: a key's name: what `fedq serve-key list` shows and `revoke` takes
NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789-_."


class NoSuchKey(FedqError):
    exit_code = 4


@dataclass(frozen=True)
class Keys:
    """What a gateway checks a request's key against."""

    required: bool  # any key was ever made (or a shared key is set)
    active: frozenset[str]  # sha256 of each key not revoked


@dataclass(frozen=True)
class KeyRow:
    name: str
    created: datetime
    revoked: datetime | None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_name(name: str) -> str:
    if not 1 <= len(name) <= 64 or any(c not in NAME_CHARS for c in name):
        raise ConfigError(f"key name {name[:70]!r}: 1-64 lower-case letters, digits, "
                          f"'-', '_' or '.'")
    return name


def add(db_url: str, name: str) -> str:
    """Make key ``name`` and return it (only its sha256 is kept). A name in use, or
    revoked, is refused: a revoked key never comes back under its name."""
    check_name(name)
    key = "fedq-" + secrets.token_urlsafe(32)
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        row = s.get(ServeKey, name)
        if row is not None:
            raise ConfigError(f"serve key {name} exists"
                              + (" (revoked)" if row.revoked_at else "")
                              + ": choose another name")
        s.add(ServeKey(name=name, key_sha256=digest(key)))
    return key


def revoke(db_url: str, name: str) -> KeyRow:
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        row = s.get(ServeKey, name)
        if row is None:
            raise NoSuchKey(f"no serve key {name} (`fedq serve-key list`)")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
        return KeyRow(row.name, row.created_at, row.revoked_at)


def listed(db_url: str) -> list[KeyRow]:
    ensure_schema(db_url)
    with session_scope(db_url) as s:
        return [KeyRow(r.name, r.created_at, r.revoked_at)
                for r in s.scalars(select(ServeKey).order_by(ServeKey.name))]


def read(db_url: str) -> Keys:
    """The keys a gateway takes now (read fresh: a revocation holds from the next read)."""
    with session_scope(db_url) as s:
        rows = list(s.scalars(select(ServeKey)))
        return Keys(bool(rows), frozenset(r.key_sha256 for r in rows if r.revoked_at is None))
