"""Throwaway databases on the real services, for the test suite and the benchmarks
(pytest-free: the caller decides what a missing service means)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def fresh_pg_database(admin_url: str, prefix: str,
                      unavailable: Callable[[Exception], None]) -> Iterator[str]:
    """A new, empty PostgreSQL database named ``prefix_<random>``, dropped afterwards.
    ``unavailable(exc)`` is called (and must raise) when it cannot be created."""
    from sqlalchemy import create_engine, text

    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT",
                          connect_args={"connect_timeout": 3})
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        unavailable(exc)
        raise  # unavailable() should have raised
    url = admin_url.rsplit("/", 1)[0] + "/" + name
    try:
        yield url
    finally:
        from fedq.db.session import connect

        connect(url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
