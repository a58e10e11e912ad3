"""PostgreSQL roles with what each of fedq's roles needs (docs/security.md, "Least
privilege"): the schema owner runs migrations (``fedq db upgrade``, with the URL the
database was created with); ``fedq db role NAME --kind coordinator`` makes the login
the control worker and beat use, ``--kind submitter`` the one a person's ``fedq`` CLI
uses. Neither is a superuser, creates databases or roles, owns a table or can change
the schema, so neither can ``COPY ... TO PROGRAM`` or drop a table. Workers get no
database role at all.

=============  =================================================================
coordinator    SELECT, INSERT, UPDATE, DELETE on every table of the schema but
               alembic_version (SELECT: only migrations move the revision)
submitter      SELECT on every table; INSERT, UPDATE, DELETE on jobs, rounds,
               client_updates, inference_jobs and inference_shards (submit, infer,
               cancel, resume); INSERT, UPDATE on serve_keys (``fedq serve-key add``
               / ``revoke``); on registered_workers INSERT and UPDATE of the
               columns ``fedq worker add`` / ``revoke`` write (never
               ``public_key`` or ``joined_at``: only a join, in the control
               worker, sets a key)
=============  =================================================================

Whoever writes registered_workers, a trigger (migrations 0020 and 0023) keeps each
worker's state moving forward only: a revoked name never comes back, an active worker's
key never changes in place; only the schema's owner may re-invite an active worker, its
key forgotten (``fedq worker reissue``).

Tables a later migration adds get the same rights (``ALTER DEFAULT PRIVILEGES`` for
the owner); run the command again after an upgrade to be sure.
"""

from __future__ import annotations

import re
import secrets
from typing import Literal

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from fedq.errors import ConfigError

Kind = Literal["coordinator", "submitter"]
ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
SUBMITTER_WRITES = ("jobs", "rounds", "client_updates", "inference_jobs", "inference_shards")
SUBMITTER_ADDS = ("serve_keys",)
#: registered_workers: what `fedq worker add` (invite, withdraw) and `revoke` write
WORKER_COLUMNS = ("queues", "state", "token_sha256", "created_at", "revoked_at",
                  "redis_secret")


def grant(owner_url: str, name: str, kind: Kind, password: str | None = None) -> str:
    """Create (or update) login role ``name`` of ``kind`` with a random password (or
    ``password``) on the database of ``owner_url``; returns the role's URL."""
    if ROLE_NAME.fullmatch(name) is None:
        raise ConfigError(f"role name {name[:70]!r}: lower-case letters, digits and '_'")
    url = make_url(owner_url)
    if not url.drivername.startswith("postgresql"):
        raise ConfigError("database roles are for PostgreSQL (FEDQ_DATABASE_URL is "
                          f"{url.drivername})")
    import psycopg
    from psycopg import sql

    password = password or secrets.token_urlsafe(24)
    role = sql.Identifier(name)
    statements = [
        sql.SQL("DO $$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {n}) THEN "
                "CREATE ROLE {r} LOGIN; END IF; END$$").format(n=sql.Literal(name), r=role),
        sql.SQL("ALTER ROLE {r} LOGIN PASSWORD {p} NOSUPERUSER NOCREATEDB NOCREATEROLE "
                "NOREPLICATION NOBYPASSRLS").format(r=role, p=sql.Literal(password)),
        sql.SQL("GRANT CONNECT ON DATABASE {d} TO {r}").format(
            d=sql.Identifier(url.database or ""), r=role),
        sql.SQL("GRANT USAGE ON SCHEMA public TO {r}").format(r=role),
        sql.SQL("REVOKE CREATE ON SCHEMA public FROM {r}").format(r=role),
        sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {r}").format(r=role),
        sql.SQL("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {r}").format(r=role),
    ]
    if kind == "coordinator":
        statements += [
            sql.SQL("GRANT INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {r}")
            .format(r=role),
            sql.SQL("ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT, INSERT, UPDATE, "
                    "DELETE ON TABLES TO {r}").format(r=role),
            # the schema's revision is the owner's: only migrations move it
            sql.SQL("REVOKE INSERT, UPDATE, DELETE ON alembic_version FROM {r}").format(r=role),
        ]
    else:
        statements += [
            sql.SQL("GRANT INSERT, UPDATE, DELETE ON {t} TO {r}").format(
                t=sql.SQL(", ").join(map(sql.Identifier, SUBMITTER_WRITES)), r=role),
            sql.SQL("GRANT INSERT, UPDATE ON {t} TO {r}").format(
                t=sql.SQL(", ").join(map(sql.Identifier, SUBMITTER_ADDS)), r=role),
            # a role made before: its table-wide UPDATE goes, the columns stay
            sql.SQL("REVOKE UPDATE ON registered_workers FROM {r}").format(r=role),
            sql.SQL("GRANT INSERT, UPDATE ({c}) ON registered_workers TO {r}").format(
                c=sql.SQL(", ").join(map(sql.Identifier, WORKER_COLUMNS)), r=role),
            sql.SQL("ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES "
                    "TO {r}").format(r=role),
        ]
    statements.append(sql.SQL("ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT "
                              "ON SEQUENCES TO {r}").format(r=role))
    engine = create_engine(owner_url, pool_pre_ping=True)
    try:
        raw = engine.raw_connection()
        try:
            with raw.cursor() as cur:  # type: ignore[attr-defined]
                for statement in statements:
                    cur.execute(statement)
            raw.commit()
        finally:
            raw.close()
    except (psycopg.Error, SQLAlchemyError) as exc:  # one line, the password redacted
        from fedq.redaction import redact_text

        raise ConfigError(f"could not create role {name}: {redact_text(str(exc))}"
                          .splitlines()[0]) from None
    finally:
        engine.dispose()
    return url.set(username=name, password=password).render_as_string(hide_password=False)
