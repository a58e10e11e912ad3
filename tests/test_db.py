"""Migrations make the schema on SQLite and PostgreSQL, and match the ORM."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from fedq.db import Base, Job, session_scope, upgrade
from fedq.db.session import connect, current_revision, ensure_schema, lock_row
from fedq.errors import SchemaOutOfDate, ServiceUnavailable


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fedq.db'}"
    return str(request.getfixturevalue("pg_url"))


def test_migrations_create_schema_matching_orm(db_url: str) -> None:
    upgrade(db_url)
    assert current_revision(db_url) == "0023"
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


def test_0011_moves_a_versions_fill_time_and_keeps_round_ids_unique(db_url: str) -> None:
    """A buffered version's fill time leaves ``deadline`` for ``full_since``; a
    synchronous round keeps its deadline. And the recreated ``rounds`` table never
    hands a deleted round's id out again (its id names its tasks' generation: a
    resumed round that reused it would wait on revoked task ids)."""
    upgrade(db_url, "0010")
    engine = connect(db_url)
    when = "2026-11-25 01:02:03+00:00"
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, name, spec, status, total_rounds, committed_round, "
            "global_key, global_sha256, global_size, created_at, updated_at) VALUES "
            "('j', 'j', '{}', 'running', 3, 0, 'k', 's', 1, :t, :t)"), {"t": when})
        for number, planned in ((1, '{"clients": [], "queues": [], "buffer": 2}'),
                                (2, '{"clients": [0], "queues": ["cpu"]}')):
            conn.execute(text(
                "INSERT INTO rounds (job_id, number, status, planned, attempt, deadline, "
                "started_at) VALUES ('j', :n, 'training', :p, 1, :t, :t)"),
                {"n": number, "p": planned, "t": when})
    upgrade(db_url)
    with engine.begin() as conn:
        rows = {n: (d, f) for n, d, f in conn.execute(text(
            "SELECT number, deadline, full_since FROM rounds ORDER BY number"))}
        assert rows[1][0] is None and rows[1][1] is not None  # the buffered version
        assert rows[2][0] is not None and rows[2][1] is None  # the synchronous round
        top = conn.execute(text("SELECT max(id) FROM rounds")).scalar_one()
        conn.execute(text("DELETE FROM rounds WHERE id = :i"), {"i": top})
        conn.execute(text("INSERT INTO rounds (job_id, number, status, planned, attempt, "
                          "started_at) VALUES ('j', 2, 'training', '{}', 1, :t)"), {"t": when})
        new = conn.execute(text("SELECT max(id) FROM rounds")).scalar_one()
    assert new > top
    assert "chord_id" not in {c["name"] for c in inspect(engine).get_columns("rounds")}


def test_lock_row_holds_the_row_until_commit(db_url: str) -> None:
    """``lock_row`` (every path that changes a job takes the job's row with it first)
    keeps a second transaction out until the first commits: a FOR UPDATE row lock on
    PostgreSQL, the write lock on SQLite. Read the row plainly there instead and the
    second transaction gets it at once, and this fails."""
    import threading
    import time

    upgrade(db_url)
    with session_scope(db_url) as s:
        s.add(Job(id="j", name="t", spec={}, status="running", total_rounds=1,
                  committed_round=0, global_key="k", global_sha256="0" * 64, global_size=1))
    events: list[str] = []
    locked = threading.Event()

    def second() -> None:
        locked.wait(10)
        with session_scope(db_url) as s:
            job = lock_row(s, Job, "j")
            events.append(f"second locked, round {job.committed_round if job else None}")

    thread = threading.Thread(target=second)
    thread.start()
    with session_scope(db_url) as s:
        job = lock_row(s, Job, "j")
        assert job is not None and lock_row(s, Job, "missing") is None
        locked.set()
        time.sleep(0.5)  # time enough for the second to get the row, were it free
        job.committed_round = 1
        events.append("first commits")
    thread.join(30)
    assert events == ["first commits", "second locked, round 1"]


def test_docs_list_exactly_the_statuses() -> None:
    """docs/architecture.md's Statuses section is the enums of fedq/status.py."""
    import re

    from fedq.status import JobStatus, RoundStatus, UpdateStatus

    text = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## Statuses", 1)[1].split("\n## ", 1)[0]
    lines = {kind: set(re.findall(r"`([a-z_]+)`", section.split(f"- {kind}:", 1)[1]
                                  .split("\n- ", 1)[0].split("\n\n", 1)[0]))
             for kind in ("job", "round (a buffered job's version)", "client update")}
    assert lines["job"] == set(JobStatus)
    assert lines["round (a buffered job's version)"] == set(RoundStatus)
    assert lines["client update"] == set(UpdateStatus)
