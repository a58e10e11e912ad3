"""A worker holds only what it needs: its own Redis user (fedq/coordinator/acl.py;
docs/security.md, "Least privilege").

A redis-server of the test's own (the coordinator holds its admin password) is the
broker, result backend and blob store. ``fedq worker add`` makes the worker's Redis
user and ``fedq worker join`` takes it to the worker's 'machine' (a keys folder with
no other credentials); a real ``celery worker`` then trains a job with only those
rights, and ``ACL LOG`` shows that nothing it needed was denied. Then each thing the
worker's credentials must not do is tried and refused: another queue, another
worker's update, the global model, FLUSHDB, CONFIG SET, KEYS, a remote-control
``shutdown`` aimed at the control worker. Revoking the worker disables its user.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedq.coordinator import acl
from fedq.testing.cluster import DIGITS, Cluster, record
from fedq.testing.procs import run_module
from fedq.testing.wait import wait_until
from tests.test_identity import _join, _joined_worker
from tests.test_security import protected_redis

SPEC = {**DIGITS, "num_clients": 4, "clients_per_round": 2, "rounds": 2, "min_clients": 2,
        "round_timeout_s": 60}


@pytest.fixture
def admin(tmp_path: Path, pg_url: str) -> Iterator[tuple[Cluster, str]]:
    from tests.conftest import migrated_cluster

    with protected_redis(tmp_path) as url:
        redis_url = f"{url}/0"
        cluster = migrated_cluster(tmp_path, redis_url, redis_url, pg_url)
        cluster.env.update(FEDQ_IDENTITY="required", FEDQ_KEYS_DIR=str(tmp_path / "coord"),
                           FEDQ_BLOB_URL=redis_url)
        cluster.start(control=["control"])
        cluster.start_beat()
        yield cluster, redis_url
        cluster.stop()


def _doctor(env: dict[str, str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    """`fedq doctor --services --json` in ``env``: its exit status and report."""
    proc = run_module("fedq.cli", ["doctor", "--services", "--json"], env, 120)
    assert proc.stdout.startswith("{"), proc.stdout + proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _refused(client, *command: object) -> str:  # type: ignore[no-untyped-def]
    import redis

    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError as exc:
        return str(exc)
    raise AssertionError(f"{command[0]} was allowed")


@pytest.mark.slow
def test_a_worker_user_can_train_and_nothing_else(admin: tuple[Cluster, str]) -> None:
    import redis

    cluster, admin_url = admin
    cluster.fedq("worker", "add", "w1", "--queues", "cpu", "--out",
                 str(cluster.home / "w1.bundle"))
    bundle = json.loads((cluster.home / "w1.bundle").read_text())
    assert bundle["services"]["broker_url"].startswith("redis://fedq-w-w1:")
    assert bundle["services"]["blob_url"] == bundle["services"]["broker_url"]
    _join(cluster, "w1", cluster.home / "w1.bundle")

    root = redis.Redis.from_url(admin_url)
    root.execute_command("ACL", "LOG", "RESET")
    w1 = cluster.add("w1", ["cpu"], **_joined_worker(cluster, "w1"))
    job = cluster.submit({**SPEC, "name": "acl"})
    view = cluster.wait(job)
    # a batch inference job on the same worker: its model and inputs read, its outputs
    # written in its own folder
    import yaml

    from fedq.data import load_dataset
    from fedq.models import seeded_model
    from fedq.weights import dumps, state_of

    ds = load_dataset("digits")
    (cluster.home / "cnn.safetensors").write_bytes(dumps(state_of(seeded_model(
        "small_cnn", ds.input_shape, ds.num_classes, 3))))
    (cluster.home / "infer.yaml").write_text(yaml.safe_dump({
        "kind": "inference", "name": "acl-infer", "queues": ["cpu"], "op": "classify",
        "model": {"weights": "cnn.safetensors", "name": "small_cnn", "dataset": "digits"},
        "inputs": {"dataset": "digits", "split": "test"}, "shard_size": 200}))
    infer = cluster.fedq("infer", str(cluster.home / "infer.yaml"), "--out",
                         str(cluster.home / "out.jsonl"), timeout=240).stdout.strip()
    denied = [{k.decode() if isinstance(k, bytes) else k: v for k, v in entry.items()}
              for entry in root.execute_command("ACL", "LOG")]
    assert view.status == "completed", f"{view.error}\n{denied}\n{w1.tail(40)}"
    assert not denied, denied  # the worker had everything it needed, for both jobs
    assert len((cluster.home / "out.jsonl").read_text().splitlines()) > 100
    rows = [u for u in cluster.updates(job) if u.status == "ok"]
    assert rows and all(u.signer and f"/updates/{u.signer}/" in (u.blob_key or "")
                        for u in rows), [(u.signer, u.blob_key) for u in rows]

    # each thing a worker's credentials must not do, tried with w1's
    mine = redis.Redis.from_url(bundle["services"]["broker_url"])
    other_update = next(u.blob_key for u in rows)  # w1's own, or write below another's
    model = f"fedq:blob:jobs/{job}/r00001/global.safetensors"
    refusals = {
        "another queue": ("LRANGE", "gpu_new", 0, -1),
        "another worker's update": ("GET", "fedq:blob:" + other_update.replace(
            "/updates/w1/", "/updates/w2/")),
        "the control queue's tasks": ("LRANGE", "control", 0, -1),
        "the global model (write)": ("SET", model, b"x"),
        "another worker's inference output (write)": (
            "SET", f"fedq:blob:jobs/{infer}/infer/out/w2/s000000-a1.jsonl", b"x"),
        "an inference job's model (write)": (
            "SET", f"fedq:blob:jobs/{infer}/infer/model.safetensors", b"x"),
        "a job's shipped checkpoint (write)": (
            "SET", f"fedq:blob:jobs/{job}/base/model.safetensors", b"x"),
        "a job's trained tokenizer (write)": (
            "SET", f"fedq:blob:jobs/{job}/tokenizer/tokenizer.json", b"x"),
        "FLUSHDB": ("FLUSHDB",),
        "CONFIG SET": ("CONFIG", "SET", "maxmemory", "1"),
        "KEYS": ("KEYS", "*"),
        "a remote-control command": ("PUBLISH", "/0.celery.pidbox", b"{}"),
        "ACL": ("ACL", "LIST"),
        # what another task's channel says (its id, claim, answer): never heard
        "another task's channel (pattern)": ("PSUBSCRIBE", "celery-task-meta-*"),
        "another task's channel": ("SUBSCRIBE", f"celery-task-meta-fedq-{job}-g1-r1-c0-a1"),
    }
    for what, command in refusals.items():
        said = _refused(mine, *command)
        assert "permission" in said.lower(), what
        record("security", scenario=f"redis user: {what}",
               did=f"`{' '.join(str(c) for c in command[:2])}` with its own credentials",
               fedq=f"refused by Redis: NOPERM {said[:70]}",
               guard="its Redis user (coordinator/acl.py)",
               outcome="refused; the same user trained a job with no ACL denial")
    assert mine.get(model)  # what it needs: the global model, read
    # and what a job stores beside it for machines without it (read, never written)
    for key in (f"fedq:blob:jobs/{job}/base/config.json",
                f"fedq:blob:jobs/{job}/tokenizer/tokenizer.json"):
        root.set(key, b"{}")
        assert mine.get(key) == b"{}"

    # a `shutdown` sent with the worker's credentials does not reach the control worker
    from celery import Celery

    from fedq.engine.app import celery_config
    from fedq.settings import load_settings

    env = {**cluster.env, **_joined_worker(cluster, "w1")}
    hostile = Celery("hostile", set_as_current=False)
    hostile.conf.update(celery_config(load_settings({k: v for k, v in env.items() if v})))
    with pytest.raises(Exception, match="(?i)permission|noperm"):
        hostile.control.shutdown(destination=["control@test"])
    assert cluster.by_name("control").alive()
    record("security", scenario="redis user: shut down the control worker",
           did="`celery control shutdown` aimed at the control worker, with its credentials",
           fedq="refused by Redis (no PUBLISH on the remote-control channel)",
           guard="its Redis user (coordinator/acl.py)", outcome="the control worker lives")

    # `fedq doctor --services` with the worker's credentials: every limit holds, and the
    # same check with the admin's broker URL under w1's name names what does not
    machine = {**cluster.env, **_joined_worker(cluster, "w1"), "FEDQ_DATABASE_URL": ""}
    code, report = _doctor(machine)
    limits = {limit["what"]: limit for limit in report["services"]["limits"]}
    assert code == 0 and not report["problems"], report["problems"]
    assert report["services"]["joined_as"] == "w1"
    assert len(limits) == 15 and all(limit["holds"] for limit in limits.values()), limits
    assert "NOPERM" in limits["cannot FLUSHDB"]["detail"]
    assert limits["can write its own update"]["detail"] == "allowed"
    code, report = _doctor({**machine, "FEDQ_BROKER_URL": admin_url})
    assert code == 1, report
    lax = [p for p in report["problems"] if "can do more than it needs" in p]
    assert len(lax) == 10 and any("'cannot FLUSHDB' does not hold" in p for p in lax), lax
    assert root.dbsize() > 0 and root.config_get("maxmemory")["maxmemory"] == "0"  # untouched
    record("security", scenario="doctor: which limits hold",
           did="`fedq doctor --services` with a joined worker's credentials, then with the "
               "broker's admin URL under its name",
           fedq="each limit probed in MULTI/DISCARD; exit 1 naming the 10 that do not hold",
           guard="fedq/worker/limits.py", outcome="nothing flushed, configured or published")

    # revoked: its user is off, its connections gone
    cluster.fedq("worker", "revoke", "w1")
    wait_until(lambda: not w1.alive(), 30, what="the revoked worker to stop")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(bundle["services"]["broker_url"]).ping()
    assert acl.username("w1") in {u.decode() for u in root.execute_command("ACL", "USERS")}


@pytest.mark.slow
def test_a_restarted_redis_gets_its_joined_workers_users_back(tmp_path: Path,
                                                                pg_url: str) -> None:
    """The registry is the source of truth for broker users: a Redis restarted without
    its ACL (as a container restart does) loses every worker's user, and the watchdog's
    next pass makes each one again from the registry (its queues and its password's
    SHA-256, all that fedq keeps of it). The worker joined before reconnects with its own
    user and trains the next job. Remove restore_users from the watchdog's pass and the
    worker stays locked out: this fails."""
    import subprocess

    import redis

    from tests.conftest import free_port, migrated_cluster, missing
    from tests.test_security import SECRET

    port = free_port()

    def start() -> subprocess.Popen[bytes]:
        try:
            proc = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--requirepass", SECRET, "--dir", str(tmp_path)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            missing("redis-server", exc)
        root = redis.Redis.from_url(url)
        wait_until(lambda: _pings(root), 30, what="redis-server to answer")
        return proc

    url = f"redis://:{SECRET}@127.0.0.1:{port}/0"
    server = start()
    # results and blobs in databases of their own, as a deployment keeps them: the user
    # made again must name the broker's database in its remote-control channel rule
    cluster = migrated_cluster(tmp_path, url, url.replace("/0", "/1"), pg_url)
    try:
        cluster.env.update(FEDQ_IDENTITY="required", FEDQ_KEYS_DIR=str(tmp_path / "coord"),
                           FEDQ_BLOB_URL=url.replace("/0", "/2"), FEDQ_WATCHDOG_INTERVAL="1")
        cluster.start(control=["control"])
        cluster.start_beat()
        cluster.fedq("worker", "add", "w1", "--queues", "cpu", "--out",
                     str(cluster.home / "w1.bundle"))
        _join(cluster, "w1", cluster.home / "w1.bundle")
        w1 = cluster.add("w1", ["cpu"], **_joined_worker(cluster, "w1"))
        before = cluster.wait(cluster.submit({**SPEC, "name": "before"}))
        assert before.status == "completed", f"{before.error}\n{w1.tail(30)}"

        server.terminate()
        server.wait(10)
        server = start()  # no ACL kept: only the admin's requirepass
        root = redis.Redis.from_url(url)
        wait_until(lambda: acl.username("w1") in _users(root), 60,
                   what=lambda: "the watchdog to make w1's Redis user again\n" +
                   cluster.by_name("control").tail(20))
        job = cluster.submit({**SPEC, "name": "after"})
        after = cluster.wait(job, timeout=240)
        assert after.status == "completed", f"{after.error}\n{w1.tail(40)}"
        rows = [u for u in cluster.updates(job) if u.status == "ok"]
        assert rows and {u.signer for u in rows} == {"w1"}, [(u.signer, u.error) for u in rows]
    finally:
        cluster.stop()
        server.terminate()
        server.wait(10)


def _pings(client: object) -> bool:
    import redis

    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except redis.RedisError:
        return False


def _users(client: object) -> set[str]:
    return {u.decode() for u in client.execute_command("ACL", "USERS")}  # type: ignore[attr-defined]


@pytest.fixture
def rabbit_admin(tmp_path: Path, pg_url: str) -> Iterator[tuple[Cluster, str, str]]:
    """RabbitMQ (a vhost of the test's own, guest as its administrator, the management
    API on) as the broker; a protected Redis of the test's own for results and blobs."""
    from fedq.coordinator import rabbit
    from fedq.errors import ServiceUnavailable
    from tests.conftest import migrated_cluster, missing
    from tests.test_faults import rabbit_vhost

    vhosts = rabbit_vhost.__wrapped__()  # type: ignore[attr-defined]
    broker = next(vhosts)
    try:
        rabbit.user_exists(broker, "probe")
    except ServiceUnavailable:  # the plugin ships with RabbitMQ; turn it on
        import shutil
        import subprocess
        import time

        plugins = shutil.which("rabbitmq-plugins")
        if plugins is None:
            missing("RabbitMQ's management API", "rabbitmq-plugins not found")
        subprocess.run([plugins, "enable", "rabbitmq_management"], capture_output=True,
                       timeout=120, check=False)
        for _ in range(60):
            try:
                rabbit.user_exists(broker, "probe")
                break
            except ServiceUnavailable:
                time.sleep(0.5)
        else:
            missing("RabbitMQ's management API", "not answering on 15672")
    try:
        with protected_redis(tmp_path) as url:
            redis_url = f"{url}/0"
            cluster = migrated_cluster(tmp_path, broker, redis_url, pg_url)
            cluster.env.update(FEDQ_IDENTITY="required", FEDQ_KEYS_DIR=str(tmp_path / "coord"),
                               FEDQ_BLOB_URL=redis_url)
            cluster.start(control=["control"])
            cluster.start_beat()
            yield cluster, broker, redis_url
            cluster.stop()
    finally:
        next(vhosts, None)  # the vhost, and with it the worker's permissions, deleted
        rabbit.disable_user(broker, "w1")
        rabbit.disable_user(broker, "w2")


@pytest.mark.slow
def test_a_worker_rabbitmq_user_can_train_and_nothing_else(
        rabbit_admin: tuple[Cluster, str, str]) -> None:
    """RabbitMQ's side of least privilege (fedq/coordinator/rabbit.py): `fedq worker
    add` makes the worker's own RabbitMQ user on the broker's vhost, a real worker
    trains a job with it, and what it must not do is refused by RabbitMQ."""
    import amqp
    import redis

    from fedq.coordinator import rabbit

    cluster, broker, admin_redis = rabbit_admin
    cluster.fedq("worker", "add", "w1", "--queues", "cpu", "--out",
                 str(cluster.home / "w1.bundle"))
    bundle = json.loads((cluster.home / "w1.bundle").read_text())
    mine = bundle["services"]["broker_url"]
    assert mine.startswith("amqp://fedq-w-w1:") and mine.endswith(broker.rsplit("/", 1)[1])
    assert bundle["services"]["result_backend"].startswith("redis://fedq-w-w1:")
    _join(cluster, "w1", cluster.home / "w1.bundle")
    root = redis.Redis.from_url(admin_redis)
    root.execute_command("ACL", "LOG", "RESET")
    w1 = cluster.add("w1", ["cpu"], **_joined_worker(cluster, "w1"))
    view = cluster.wait(cluster.submit({**SPEC, "name": "acl-rabbit"}))
    assert view.status == "completed", f"{view.error}\n{w1.tail(40)}"
    assert b"ACCESS_REFUSED" not in w1.log_path.read_bytes(), w1.tail(40)
    assert not root.execute_command("ACL", "LOG")  # nor did its Redis user lack anything

    # a remote-control `shutdown` with its credentials never reaches the control worker
    from celery import Celery

    from fedq.engine.app import celery_config
    from fedq.settings import load_settings

    env = {**cluster.env, **_joined_worker(cluster, "w1")}
    hostile = Celery("hostile", set_as_current=False)
    hostile.conf.update(celery_config(load_settings({k: v for k, v in env.items() if v})))
    try:
        hostile.control.shutdown(destination=["control@test"])
    except Exception:  # noqa: BLE001  (refused at once, or when the channel closes)
        pass
    import time

    time.sleep(3.0)
    assert cluster.by_name("control").alive()
    record("security", scenario="rabbitmq user: shut down the control worker",
           did="`celery control shutdown` aimed at the control worker, with its credentials",
           fedq="refused by RabbitMQ (no write on the celery.pidbox exchange)",
           guard="its RabbitMQ user's permissions (coordinator/rabbit.py)",
           outcome="the control worker lives")

    # each limit, tried with its credentials: `fedq doctor --services` on its machine
    code, report = _doctor({**env, "FEDQ_DATABASE_URL": ""})
    limits = {limit["what"]: limit for limit in report["services"]["limits"]}
    assert code == 0 and not report["problems"], report["problems"]
    assert all(limit["holds"] for limit in limits.values()), limits
    refused = {w: lim["detail"] for w, lim in limits.items()
               if lim["detail"].startswith("ACCESS_REFUSED")}
    assert set(refused) >= {"cannot take tasks from another queue (gpu_new)",
                            "cannot take tasks from the control queue",
                            "cannot declare the control queue",
                            "cannot declare a queue of its own choosing",
                            "cannot send remote-control commands (shutdown, revoke)",
                            "cannot publish through the default exchange (to any queue)"}, \
        [(w, lim["detail"]) for w, lim in limits.items()]
    for what, said in refused.items():
        record("security", scenario=f"rabbitmq user: {what.removeprefix('cannot ')}",
               did="`fedq doctor --services` tried it with the worker's own RabbitMQ user",
               fedq=f"refused by RabbitMQ: {said[:80]}",
               guard="its RabbitMQ user's permissions (coordinator/rabbit.py)",
               outcome="refused; the same user trained a job")
    # the same check with the broker's administrator under w1's name names what fails
    code, report = _doctor({**env, "FEDQ_DATABASE_URL": "", "FEDQ_BROKER_URL": broker})
    lax = [p for p in report["problems"] if "can do more than it needs" in p]
    assert code == 1 and any("remote-control" in p for p in lax), report["problems"]

    # a user that may not publish to the control exchange (made by an older fedq, say):
    # its join is refused at once, in one line, not a timeout (publisher confirms)
    cluster.fedq("worker", "add", "w2", "--queues", "cpu", "--out",
                 str(cluster.home / "w2.bundle"))
    old = {**rabbit.permissions(["cpu"]), "write": "^cpu$"}
    rabbit._call(rabbit.api_url(broker), "PUT", f"/api/permissions/"
                 f"{rabbit.vhost(broker)}/{rabbit.username('w2')}", old)
    said = _join(cluster, "w2", cluster.home / "w2.bundle", check=False)
    code, _, err = said.partition("\n")
    assert code == "1" and "the broker refused the join request" in err, said
    assert "ACCESS_REFUSED" in err and "Traceback" not in err and "30 s" not in err, said
    assert len(err.strip().splitlines()) == 1, said

    # revoked: the user is gone, its connections closed, the worker told to stop
    cluster.fedq("worker", "revoke", "w1")
    assert not rabbit.user_exists(broker, "w1")
    wait_until(lambda: not w1.alive(), 30, what="the revoked worker to stop")
    parts = mine.split("@", 1)[1]
    user, password = mine.split("//", 1)[1].split("@", 1)[0].split(":", 1)
    with pytest.raises(amqp.exceptions.AccessRefused):
        amqp.Connection(parts.split("/", 1)[0], userid=user, password=password,
                        virtual_host=parts.split("/", 1)[1]).connect()
    record("security", scenario="rabbitmq user: a revoked worker reconnects",
           did="connected with its bundle's broker URL after `fedq worker revoke`",
           fedq="refused by RabbitMQ: the user was deleted, its connections closed",
           guard="enrol.revoke, rabbit.disable_user", outcome="refused; its process stopped")


def test_worker_add_without_rabbitmqs_api_is_one_line_and_leaves_no_invitation(
        tmp_path: Path) -> None:
    """With RabbitMQ as the broker and its management API unreachable, `fedq worker
    add` says so in one line, exits non-zero, and no invitation is left behind."""
    import os
    import subprocess

    from tests.conftest import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env.update(FEDQ_HOME=str(tmp_path), FEDQ_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//",
               FEDQ_RABBITMQ_API=f"http://127.0.0.1:{free_port()}")

    def fedq(*args: str) -> subprocess.CompletedProcess[str]:
        return run_module("fedq.cli", args, env, 120)

    added = fedq("worker", "add", "w1", "--queues", "cpu", "--out", str(tmp_path / "b"))
    assert added.returncode != 0 and "Traceback" not in added.stderr, added.stderr
    lines = added.stderr.strip().splitlines()
    assert len(lines) == 1 and "RabbitMQ's management API" in lines[0], lines
    assert not (tmp_path / "b").exists()
    listed = fedq("worker", "list")
    assert listed.returncode == 0 and "w1" not in listed.stdout, listed.stdout


def _all_keys_but(key: str) -> list[str]:
    """Redis ACL key patterns for every key but ``key`` (^ negates a character class)."""
    return ([f"~{key[:i]}[^{key[i]}]*" for i in range(len(key))]
            + [f"~{key[:i]}" for i in range(1, len(key))] + [f"~{key}?*"])


def test_a_submit_the_broker_refuses_is_one_line_and_leaves_no_job(tmp_path: Path,
                                                                    pg_url: str) -> None:
    """`fedq submit` as a Redis user an ACL denies the control queue: one line naming
    the refusal, exit 3, no traceback, and no job or blob left behind; the same user
    with the queue allowed submits."""
    import redis
    import yaml
    from sqlalchemy import select

    from fedq.db import Job, session_scope
    from tests.conftest import migrated_cluster, private_redis

    with private_redis() as (url, _):
        admin = redis.Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "u", "on", ">u-pw", "&*", "+@all",
                              *_all_keys_but("control"))
        as_u = url.replace("redis://", "redis://u:u-pw@")
        cluster = migrated_cluster(tmp_path, as_u, as_u, pg_url)
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(SPEC))
        refused = cluster.fedq("submit", str(path), check=False)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 3 and len(lines) == 1, refused.stderr
        assert lines[0].startswith("fedq: error: the broker refused to start the job") and \
            "no permissions" in lines[0] and lines[0].endswith("nothing was submitted"), lines
        assert "u-pw" not in refused.stderr and refused.stdout == ""
        with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
            assert list(s.scalars(select(Job.id))) == []
        assert not [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
        admin.execute_command("ACL", "SETUSER", "u", "resetkeys", "~*")
        job = cluster.fedq("submit", str(path)).stdout.strip()
        with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
            assert list(s.scalars(select(Job.id))) == [job]
        # `fedq resume` refused the same way: one line, and the job stays cancelled
        cluster.fedq("cancel", job)
        admin.execute_command("ACL", "SETUSER", "u", "resetkeys", *_all_keys_but("control"))
        refused = cluster.fedq("resume", job, check=False)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 3 and len(lines) == 1, refused.stderr
        assert lines[0].startswith(f"fedq: error: the broker refused to resume job {job}") \
            and lines[0].endswith("it stays cancelled"), lines
        with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
            row = s.get(Job, job)
            assert row is not None and row.status == "cancelled", row
        admin.execute_command("ACL", "SETUSER", "u", "resetkeys", "~*")
        assert cluster.fedq("resume", job).returncode == 0


def test_any_other_send_the_broker_refuses_is_one_line_with_exit_3() -> None:
    """The CLI's net under every command (``expected_errors``): what kombu raises for a
    refused send (OperationalError over Redis' NOPERM, as the submit test above sees
    it from a real ACL when submit's own catch is removed) is one line and exit 3."""
    import click
    import redis
    from click.testing import CliRunner
    from kombu.exceptions import OperationalError

    from fedq.cli.commands import expected_errors

    @click.command()
    @expected_errors
    def send() -> None:
        try:
            raise redis.exceptions.NoPermissionError("this user has no permissions")
        except redis.exceptions.NoPermissionError as exc:
            raise OperationalError(str(exc)) from exc

    result = CliRunner().invoke(send, [])
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "the broker refused a send: OperationalError" in lines[0] \
        and "no permissions" in lines[0], lines


def test_reissue_gives_a_lost_machine_a_new_bundle_and_shuts_the_old_one_out(
        admin: tuple[Cluster, str]) -> None:
    """`fedq worker reissue NAME`: the name stays (no revoke and rename), its old key and
    broker password stop working at once, and the new bundle joins from a new machine;
    a revoked or unknown name is refused in one line, and so is an existing --out file
    (before anything changes)."""
    import redis

    from fedq.coordinator import enrol

    cluster, _ = admin
    home = cluster.home
    cluster.fedq("worker", "add", "w1", "--queues", "cpu", "--out", str(home / "old.bundle"))
    _join(cluster, "w1", home / "old.bundle")
    old = json.loads((home / "old.bundle").read_text())
    assert redis.Redis.from_url(old["services"]["broker_url"]).ping()
    held = redis.Redis.from_url(old["services"]["broker_url"])
    held.ping()  # a connection the old machine holds open
    key_before = enrol.registry(cluster.settings.database_url).active["w1"]

    refused = cluster.fedq("worker", "reissue", "w1", "--out", str(home / "old.bundle"),
                           check=False)
    assert refused.returncode == 2 and "old.bundle exists" in refused.stderr, refused.stderr
    assert "w1" in enrol.registry(cluster.settings.database_url).active  # nothing changed

    done = cluster.fedq("worker", "reissue", "w1", "--out", str(home / "new.bundle"))
    assert "wrote" in done.stdout and "new.bundle" in done.stdout
    assert (home / "new.bundle").stat().st_mode & 0o777 == 0o600
    new = json.loads((home / "new.bundle").read_text())
    assert new["queues"] == ["cpu"] and new["token"] != old["token"]
    assert "w1" not in enrol.registry(cluster.settings.database_url).active
    for what, client in (("an open connection", held),
                         ("a new connection", redis.Redis.from_url(
                             old["services"]["broker_url"]))):
        with pytest.raises((redis.AuthenticationError, redis.ConnectionError)) as said:
            client.ping()  # the old password, and the connection made with it
        record("security", scenario=f"identity: a reissued worker's old bundle, {what}",
               did="PING with the old bundle's broker password after `fedq worker "
                   "reissue w1`",
               fedq=f"refused by Redis: {str(said.value).splitlines()[0][:60]}",
               guard="enrol.reissue: acl.disable_user, then a new password",
               outcome="refused")
    listed = cluster.fedq("worker", "list").stdout
    assert "invited" in listed

    again = _join(cluster, "w1-old", home / "old.bundle", check=False)
    # the old bundle's password is gone: it cannot even reach the broker to ask
    assert again.startswith("3\n") and "invalid username-password pair" in again, again
    record("security", scenario="identity: a reissued worker's old bundle joins again",
           did="`fedq worker join OLD_BUNDLE` on another machine after the reissue",
           fedq=again.splitlines()[-1][:90], guard="enrol.reissue (old password gone, "
           "old token replaced)", outcome="refused; nothing registered")
    _join(cluster, "w1-new", home / "new.bundle")
    assert redis.Redis.from_url(new["services"]["broker_url"]).ping()
    key_after = enrol.registry(cluster.settings.database_url).active["w1"]
    assert key_after != key_before

    unknown = cluster.fedq("worker", "reissue", "w9", check=False)
    assert unknown.returncode == 4 and unknown.stderr.strip().count("\n") == 0
    assert "no registered worker w9" in unknown.stderr
    cluster.fedq("worker", "revoke", "w1")
    gone = cluster.fedq("worker", "reissue", "w1", check=False)
    assert gone.returncode == 2 and "w1 is revoked, for good" in gone.stderr, gone.stderr
    assert "Traceback" not in unknown.stderr + gone.stderr + refused.stderr
