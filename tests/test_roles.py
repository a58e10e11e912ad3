"""PostgreSQL roles: the schema owner migrates, the coordinator and the submitters
get only what they need (fedq/db/roles.py; docs/security.md, "Least privilege").

On a fresh database of this machine's PostgreSQL: ``fedq db role`` makes both roles;
each is tried at what it must not do — change the schema, ``COPY ... TO PROGRAM``
(a superuser's way to run commands in the database's container), write the
migration table, and for the submitter delete the watchdog's records — and refused
by PostgreSQL's privilege check. Then a job runs with the control worker on the
coordinator's role and ``fedq submit``/``results``/``worker add`` on the submitter's.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedq.testing.cluster import DIGITS, base_env, record
from fedq.testing.procs import run_module


def _role(owner_url: str, kind: str, name: str) -> str:
    proc = run_module("fedq.cli", ["db", "role", name, "--kind", kind],
                      {**base_env(Path("/tmp")), "FEDQ_DATABASE_URL": owner_url}, 120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture
def roles(pg_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """(the owner's URL, {kind: the role's URL}) on a migrated database."""
    import psycopg
    from sqlalchemy.engine import make_url

    from fedq.db import upgrade

    upgrade(pg_url)
    suffix = secrets.token_hex(4)
    names = {kind: f"fedq_{kind}_{suffix}" for kind in ("coordinator", "submitter")}
    urls = {kind: _role(pg_url, kind, name) for kind, name in names.items()}
    try:
        yield pg_url, urls
    finally:
        plain = make_url(pg_url).set(drivername="postgresql").render_as_string(
            hide_password=False)
        with psycopg.connect(plain, autocommit=True) as conn:
            for name in names.values():
                conn.execute(f"DROP OWNED BY {name}")
                conn.execute(f"DROP ROLE {name}")


def _refused(url: str, statement: str) -> str:
    import psycopg
    from sqlalchemy.engine import make_url

    plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(plain, autocommit=True) as conn:
        try:
            conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege as exc:
            return str(exc)
    raise AssertionError(f"allowed: {statement}")


REINVITE = ("UPDATE registered_workers SET state = 'invited', public_key = NULL, "
            "joined_at = NULL, token_sha256 = 'x' WHERE name = 'live'")
REFUSED_TO_BOTH = {
    "change the schema": "DROP TABLE client_updates",
    "add a table": "CREATE TABLE evil (x int)",
    "run a program": "COPY (SELECT 1) TO PROGRAM 'id'",
    "read the server's files": "SELECT pg_read_file('/etc/passwd')",
    "move the schema's revision": "UPDATE alembic_version SET version_num = '0001'",
    "make a role": "CREATE ROLE evil LOGIN",
    # `fedq worker reissue` is the schema owner's (migration 0023): the coordinator's role
    # is refused by the trigger, the submitter's by its column grants
    "re-invite an active worker": REINVITE,
}
REFUSED_TO_SUBMITTERS = {
    "erase the watchdog's record": "DELETE FROM watchdog_actions",
    "forge a worker's row": "UPDATE workers SET tasks_done = 0",
    "erase a claim": "DELETE FROM claims",
    # registered workers (rows 'live', active, and 'gone', revoked: _registered)
    "re-activate a revoked worker": "UPDATE registered_workers SET state = 'active' "
                                    "WHERE name = 'gone'",
    "give an active worker its own key": "UPDATE registered_workers SET public_key = "
                                         "'AAAA' WHERE name = 'live'",
    "take over an active worker's name": "UPDATE registered_workers SET state = 'invited', "
                                         "token_sha256 = 'x' WHERE name = 'live'",
    "register a key without a token": "INSERT INTO registered_workers (name, queues, state, "
                                      "public_key) VALUES ('evil', 'cpu', 'active', 'AAAA')",
}


def _registered(owner_url: str) -> None:
    """An active worker 'live' and a revoked one 'gone', as `fedq worker add`, `join`
    and `revoke` leave them."""
    import psycopg
    from sqlalchemy.engine import make_url

    plain = make_url(owner_url).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(plain, autocommit=True) as conn:
        for name in ("live", "gone"):
            conn.execute("INSERT INTO registered_workers (name, queues, state, token_sha256, "
                         "created_at) VALUES (%s, 'cpu', 'invited', 't', now())", (name,))
            conn.execute("UPDATE registered_workers SET state = 'active', public_key = %s, "
                         "token_sha256 = NULL WHERE name = %s", (f"key-{name}", name))
        conn.execute("UPDATE registered_workers SET state = 'revoked', revoked_at = now() "
                     "WHERE name = 'gone'")


def test_each_role_is_refused_what_it_does_not_need(
        roles: tuple[str, dict[str, str]]) -> None:
    owner, urls = roles
    _registered(owner)
    for kind, url in urls.items():
        assert url.startswith("postgresql+psycopg://fedq_") and kind in url
        refused = {**REFUSED_TO_BOTH, **(REFUSED_TO_SUBMITTERS if kind == "submitter" else {})}
        for what, statement in refused.items():
            said = _refused(url, statement)  # PostgreSQL's privilege check, by its class
            assert any(w in said for w in ("permission denied", "must be owner",
                                           "must be superuser")), (what, said)
            record("security", scenario=f"database {kind}: {what}", did=f"`{statement}`",
                   fedq=f"refused by PostgreSQL: {said.splitlines()[0][:70]}",
                   guard=f"the {kind} role (db/roles.py)", outcome="refused")
    # the owner may: a reissue forgets the key and opens a new invitation
    import psycopg
    from sqlalchemy.engine import make_url

    plain = make_url(owner).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(REINVITE)
        row = conn.execute("SELECT state, public_key FROM registered_workers "
                           "WHERE name = 'live'").fetchone()
        assert row == ("invited", None)
        said = _refused(owner, "UPDATE registered_workers SET state = 'invited', "
                               "token_sha256 = 'x' WHERE name = 'gone'")
        assert "worker gone is revoked for good" in said, said


@pytest.mark.slow
def test_a_job_runs_on_the_coordinator_and_submitter_roles(
        tmp_path: Path, roles: tuple[str, dict[str, str]]) -> None:
    from tests.conftest import private_redis

    _, urls = roles
    with private_redis() as (redis_db, _):  # fedq worker add makes a server-wide Redis user
        _run_job(tmp_path, urls, redis_db)


def _run_job(tmp_path: Path, urls: dict[str, str], redis_db: str) -> None:
    from fedq.testing.cluster import Cluster

    env = base_env(tmp_path, FEDQ_BROKER_URL=redis_db, FEDQ_RESULT_BACKEND=redis_db,
                   FEDQ_DATABASE_URL=urls["coordinator"], FEDQ_BLOB_URL=str(tmp_path / "blobs"),
                   FEDQ_WATCHDOG_INTERVAL="1")
    (tmp_path / "logs").mkdir()
    cluster = Cluster(tmp_path, env)
    try:
        cluster.start(control=["control"], cpu1=["cpu"])
        cluster.start_beat()
        person = Cluster(tmp_path, {**env, "FEDQ_DATABASE_URL": urls["submitter"]})
        job = person.submit({**DIGITS, "name": "roles", "rounds": 2})
        assert person.wait(job).status == "completed"
        assert len(person.results_json(job)["rounds"]) == 2
        person.fedq("worker", "add", "w1", "--queues", "cpu", "--out", str(tmp_path / "b"))
        assert "w1" in person.fedq("worker", "list").stdout
    finally:
        cluster.stop()


def test_a_role_takes_the_password_a_service_already_holds(tmp_path: Path,
                                                          pg_url: str) -> None:
    """`fedq db role NAME --password-file F` (how the compose stack gives the control
    worker its role: the URL file is written before the database exists) sets the
    password F's URL holds; a URL of another role, or a short password, is one line."""
    import psycopg
    from sqlalchemy.engine import make_url

    from fedq.db import upgrade

    upgrade(pg_url)
    name = f"fedq_pw_{secrets.token_hex(4)}"
    url = make_url(pg_url).set(username=name, password=secrets.token_urlsafe(18))
    held = url.render_as_string(hide_password=False)
    (tmp_path / "url").write_text(held + "\n")
    env = {**base_env(tmp_path), "FEDQ_DATABASE_URL": pg_url}

    def role(*args: str) -> subprocess.CompletedProcess[str]:
        return run_module("fedq.cli", ["db", "role", *args], env, 120)

    try:
        made = role(name, "--kind", "coordinator", "--password-file", str(tmp_path / "url"))
        assert made.returncode == 0, made.stderr
        # the URL is not printed (its holder has it): a log keeps no password
        assert made.stdout.strip() == f"role {name} (coordinator): password set from " \
            f"{tmp_path / 'url'}" and str(url.password) not in made.stdout
        plain = url.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(plain) as conn:  # the service's URL logs in
            assert conn.execute("SELECT current_user").fetchone() == (name,)
        (tmp_path / "other").write_text(held.replace(name, "someone_else"))
        (tmp_path / "short").write_text("tiny")
        for path, said in (("other", "its URL is not role " + name),
                           ("short", "shorter than 16 characters"),
                           ("absent", "cannot read it")):
            bad = role(name, "--kind", "coordinator", "--password-file", str(tmp_path / path))
            assert bad.returncode != 0 and said in bad.stderr, bad.stderr
            assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    finally:
        plain = make_url(pg_url).set(drivername="postgresql").render_as_string(
            hide_password=False)
        with psycopg.connect(plain, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                conn.execute(f"DROP OWNED BY {name}")
                conn.execute(f"DROP ROLE {name}")
