"""Engines, sessions and migrations.

SQLite (the embedded default) runs in WAL mode with a busy timeout, so the control
worker writing and `fedq watch` reading do not trip over each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar, cast

from sqlalchemy import Engine, create_engine, event, inspect, select, text, update
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from fedq.errors import SchemaOutOfDate, ServiceUnavailable, require_extra


def migrations_dir() -> Path:
    """Where the Alembic scripts are: the ``fedq._migrations`` package of the install.

    The wheel ships the repository's ``migrations/`` folder under that name (setup.py);
    an editable install maps it the same way. Only a checkout run without installing
    (``PYTHONPATH=.``) falls back to the folder beside the package.
    """
    try:
        from importlib.resources import files

        return Path(str(files("fedq._migrations")))
    except ModuleNotFoundError:
        beside = Path(__file__).resolve().parents[2] / "migrations"
        if (beside / "env.py").is_file():
            return beside
        raise SchemaOutOfDate(
            "fedq's migrations are missing from this install (fedq._migrations): "
            "reinstall fedq") from None


@lru_cache(maxsize=8)
def connect(url: str) -> Engine:
    """A pooled engine for ``url`` (one per process and URL)."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": 30}
    elif url.startswith("postgresql"):
        driver = "psycopg2" if url.startswith("postgresql+psycopg2") or "+" not in \
            url.split(":", 1)[0] else "psycopg"
        require_extra(driver, "postgres", f"the database {_safe(url)}")
        kwargs["connect_args"] = {"connect_timeout": 5}
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
    return engine


_Row = TypeVar("_Row")


def lock_row(session: Session, model: type[_Row], key: str) -> _Row | None:
    """``model``'s row ``key`` (None when there is none), locked for the rest of the
    session's transaction, its ``updated_at`` set to now. Call it first in the
    transaction: every path that changes a job takes its row this way first, so two
    of them never hold each other's rows (claiming a round first deadlocked against a
    concurrent ``fedq cancel`` on PostgreSQL).

    PostgreSQL: one ``SELECT ... FOR UPDATE``. SQLite has no row locks: the first
    statement is an ``UPDATE``, which takes the database's write lock, and the row is
    read after it (read first, the transaction would hold a snapshot that a
    concurrent writer can make stale, and its first write would then fail)."""
    from fedq.db.models import utcnow

    now, table = utcnow(), cast(Any, model)
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(table).where(table.id == key).values(updated_at=now))
        return session.get(model, key)
    row = session.execute(select(table).where(table.id == key).with_for_update()
                          .execution_options(populate_existing=True)).scalar_one_or_none()
    if row is not None:
        row.updated_at = now
    return cast("_Row | None", row)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    factory = _factory(url)
    session = factory()
    try:
        yield session
        session.commit()
    except OperationalError as exc:
        session.rollback()
        raise ServiceUnavailable(f"database {_safe(url)}: {_first_line(exc)}") from None
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


@lru_cache(maxsize=8)
def _factory(url: str) -> sessionmaker[Session]:
    return sessionmaker(connect(url), expire_on_commit=False)


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Run Alembic migrations up to ``revision``: the only way fedq's schema is made."""
    from alembic import command

    try:
        with connect(url).connect():
            pass
    except OperationalError as exc:
        raise ServiceUnavailable(f"database {_safe(url)}: {_first_line(exc)}") from None
    command.upgrade(_alembic_config(url), revision)


_CHECKED: set[str] = set()


def ensure_schema(url: str) -> None:
    """Raise :class:`SchemaOutOfDate` unless the database is at the newest migration.

    The embedded SQLite default is migrated on first use; other databases must be
    migrated on purpose with ``fedq db upgrade``.
    """
    if url in _CHECKED:
        return
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config(url)).get_current_head()
    current = current_revision(url)
    if current != head and url.startswith("sqlite"):
        with _migration_lock(url):  # the CLI and a worker may both get here first
            if current_revision(url) != head:
                upgrade(url)
        current = head
    if current == head:
        _CHECKED.add(url)
        return
    raise SchemaOutOfDate(
        f"database {_safe(url)} is at revision {current or 'none'}, fedq needs {head}: "
        "run `fedq db upgrade`")


@contextmanager
def _migration_lock(url: str) -> Iterator[None]:
    """An exclusive file lock beside a SQLite database, held while it is migrated."""
    import fcntl

    path = url.split("///", 1)[-1]
    if not path or path == ":memory:":
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path + ".migrate.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def current_revision(url: str) -> str | None:
    try:
        with connect(url).connect() as conn:
            if not inspect(conn).has_table("alembic_version"):
                return None
            row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
            return row[0] if row else None
    except SQLAlchemyError as exc:
        raise ServiceUnavailable(f"database {_safe(url)}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0]


def _safe(url: str) -> str:
    """The URL without its password, for messages."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url
