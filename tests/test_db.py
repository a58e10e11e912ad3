"""Migrations make the schema on SQLite and PostgreSQL, and match the ORM."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from fedq.db import Base, Job, session_scope, upgrade
from fedq.db.session import connect, current_revision, ensure_schema
from fedq.errors import SchemaOutOfDate, ServiceUnavailable


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fedq.db'}"
    return str(request.getfixturevalue("pg_url"))


def test_migrations_create_schema_matching_orm(db_url: str) -> None:
    upgrade(db_url)
    assert current_revision(db_url) == "0010"
    engine = connect(db_url)
    tables = set(inspect(engine).get_table_names())
    assert {"jobs", "rounds", "client_updates", "workers", "alembic_version"} <= tables
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_schema_required_before_use_on_postgres(pg_url: str) -> None:
    with pytest.raises(SchemaOutOfDate, match="run `fedq db upgrade`"):
        ensure_schema(pg_url)
    upgrade(pg_url)
    ensure_schema(pg_url)
    with session_scope(pg_url) as s:
        assert s.query(Job).count() == 0


def test_unreachable_database_is_one_line() -> None:
    with pytest.raises(ServiceUnavailable, match="database postgresql"):
        upgrade("postgresql+psycopg://nobody@127.0.0.1:1/none")
