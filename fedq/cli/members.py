"""``fedq worker add / join / list / revoke``: workers with their own keys
(fedq/identity.py, fedq/coordinator/enrol.py; docs/security.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from fedq.cli.commands import _settings, expected_errors, main
from fedq.cli.output import err, out
from fedq.errors import ConfigError, FedqError, ServiceUnavailable

BUNDLE_FORMAT = 1
_SERVICES = ("broker_url", "result_backend", "blob_url", "s3_endpoint_url")


@main.group()
def worker() -> None:
    """Workers with their own keys: add one on the coordinator, join on its machine."""


@worker.command("add")
@click.argument("name")
@click.option("--queues", "-Q", required=True,
              help="its queues, comma-separated (gpu_new, gpu_sm61, cpu; a data "
                   "site's site.<name>)")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write the join bundle to this file (mode 600) instead of printing it")
@click.option("--broker-url", help="the broker URL as the worker reaches it "
                                   "(default: this machine's FEDQ_BROKER_URL)")
@click.option("--result-backend", help="the result backend as the worker reaches it")
@click.option("--blob-url", help="the blob store as the worker reaches it")
@click.option("--s3-endpoint-url", help="the S3 endpoint as the worker reaches it")
@expected_errors
def add(name: str, queues: str, out_path: Path | None, **overrides: str | None) -> None:
    """Invite worker NAME: record it and make its join bundle (the services, the
    coordinator's public key and a one-time token). Take the bundle to the worker's
    machine and run `fedq worker join BUNDLE` there."""
    import fedq.identity as identity
    from fedq.coordinator import enrol

    settings = _settings()
    qs = [q.strip() for q in queues.split(",") if q.strip()]
    enrol.check_name(name)
    enrol.check_queues(qs)
    public = identity.public_text(identity.coordinator_key(settings.keys_dir))
    token = enrol.invite(settings, name, qs)
    try:
        bundle, users = _bundle(settings, name, qs, token, public, overrides)
    except FedqError:  # no broker user, no bundle: no invitation either
        enrol.withdraw(settings, name)
        raise
    _hand_over(bundle, users, out_path, settings.identity)


@worker.command("reissue")
@click.argument("name")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              help="write the new join bundle to this file (mode 600) instead of printing it")
@click.option("--broker-url", help="the broker URL as the worker reaches it "
                                   "(default: this machine's FEDQ_BROKER_URL)")
@click.option("--result-backend", help="the result backend as the worker reaches it")
@click.option("--blob-url", help="the blob store as the worker reaches it")
@click.option("--s3-endpoint-url", help="the S3 endpoint as the worker reaches it")
@expected_errors
def reissue(name: str, out_path: Path | None, **overrides: str | None) -> None:
    """Make a new join bundle for worker NAME, which lost its bundle or keys (or whose
    bundle may have leaked): its old key and broker password stop working now, its
    queues stay. Run `fedq worker join BUNDLE` on its machine again."""
    import fedq.identity as identity
    from fedq.coordinator import enrol

    settings = _settings()
    enrol.check_name(name)
    if out_path is not None and out_path.exists():  # before anything is changed
        raise ConfigError(f"{out_path} exists: the bundle is written to a new file only")
    public = identity.public_text(identity.coordinator_key(settings.keys_dir))
    token, queues, hosts = enrol.reissue(settings, name)
    if hosts:
        err.print(f"fedq: told {', '.join(hosts)} to shut down (they signed as {name})",
                  highlight=False)
    bundle, users = _bundle(settings, name, list(queues), token, public, overrides)
    _hand_over(bundle, users, out_path, settings.identity)


def _bundle(settings: Any, name: str, qs: list[str], token: str, public: str,
            overrides: dict[str, str | None]) -> tuple[dict[str, Any], list[str]]:
    """Worker ``name``'s join bundle, and the broker users made for it (its own, with a
    new password, on the coordinator's Redis or RabbitMQ)."""
    from fedq.coordinator import enrol

    services = {k: overrides.get(k) or getattr(settings, k) for k in _SERVICES}
    if settings.embedded_broker:
        err.print("fedq: note: this coordinator uses the embedded broker; a worker on "
                  "another machine cannot reach it (set FEDQ_BROKER_URL)")
    services, users = enrol.own_users(settings, name, qs, services)
    return {"fedq_bundle": BUNDLE_FORMAT, "name": name, "queues": qs, "token": token,
            "coordinator_key": public,
            "services": {k: v for k, v in services.items() if v}}, users


def _hand_over(bundle: dict[str, Any], users: list[str], out_path: Path | None,
               mode: str) -> None:
    """Print ``bundle`` or write it to ``out_path`` (mode 600), and say how to move it."""
    name, qs = bundle["name"], bundle["queues"]
    text = json.dumps(bundle, indent=2) + "\n"
    if out_path is None:
        out.print(text, end="", highlight=False, soft_wrap=True, markup=False)
    else:
        _write_private(out_path, text)
        out.print(f"wrote {out_path}: the join bundle of worker {name} ({','.join(qs)})"
                  + (f"; its own broker user(s): {', '.join(users)}" if users else ""))
    err.print(f"fedq: the bundle holds a one-time token and the services' passwords: move "
              f"it to the worker's machine privately, run `fedq worker join BUNDLE` there, "
              f"then delete it. This coordinator admits signed results only with "
              f"FEDQ_IDENTITY=required (now {mode}).", highlight=False)


@worker.command("join")
@click.argument("bundle_path", metavar="BUNDLE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--timeout", default=60.0, show_default=True,
              help="seconds to wait for the coordinator's answer")
@expected_errors
def join(bundle_path: Path, timeout: float) -> None:
    """Join the coordinator that made BUNDLE: make this machine's key (it never leaves
    the machine), register its public key with the bundle's token, and keep what
    `celery -A fedq worker -Q QUEUES` needs in FEDQ_KEYS_DIR."""
    import fedq.identity as identity
    from fedq.settings import get_settings

    bundle = _read_bundle(bundle_path)
    keys_dir = _settings().keys_dir
    if (keys_dir / identity.WORKER_FILE).exists():
        raise ConfigError(f"this machine joined already ({keys_dir / identity.WORKER_FILE}); "
                          f"remove {keys_dir} to join again")
    _check_writable(keys_dir)  # before the token is spent: a failed join burns nothing
    for key, value in bundle["services"].items():  # this process talks to that coordinator
        os.environ["FEDQ_" + key.upper()] = value
    get_settings.cache_clear()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    answer = _ask_to_join(identity.join_proof(key, bundle["name"], bundle["token"]), timeout)
    if not answer.get("ok"):
        raise FedqError(str(answer.get("error") or "the coordinator refused the join")[:300])
    _store(keys_dir, key, bundle)
    out.print(f"joined as {bundle['name']} (key {answer.get('key')}); start it with: "
              f"celery -A fedq worker -Q {','.join(bundle['queues'])}"
              + ("" if os.environ.get("FEDQ_KEYS_DIR") is None and
                 os.environ.get("FEDQ_HOME") is None else
                 f"  (with the same FEDQ_HOME / FEDQ_KEYS_DIR: {keys_dir})"))


@worker.command("list")
@expected_errors
def list_workers() -> None:
    """Registered workers: queues, state, key fingerprint, when added, joined, revoked."""
    from fedq.coordinator import enrol

    rows = enrol.members(_settings())
    if not rows:
        out.print("no registered workers (invite one: fedq worker add NAME --queues cpu)")
        return
    table = Table("worker", "queues", "state", "key", "added", "joined", "revoked")
    style = {"active": "green", "invited": "yellow", "revoked": "red"}
    for m in rows:
        table.add_row(m.name, ",".join(m.queues), f"[{style[m.state]}]{m.state}[/]",
                      m.key or "-", _when(m.created), _when(m.joined), _when(m.revoked))
    out.print(table)


@worker.command("revoke")
@click.argument("name")
@expected_errors
def revoke(name: str) -> None:
    """Revoke worker NAME: every result it sends from now on is rejected."""
    from fedq.coordinator import enrol

    member, hosts = enrol.revoke(_settings(), name)
    out.print(f"revoked {member.name}: its results are rejected from now on"
              + (f"; told {', '.join(hosts)} to shut down" if hosts else ""))


def _when(ts: Any) -> str:
    return ts.strftime("%Y-%m-%d %H:%M") if ts is not None else "-"


def _read_bundle(path: Path) -> dict[str, Any]:
    from fedq.coordinator.enrol import check_name, check_queues

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a fedq join bundle ({exc})") from None
    if not isinstance(data, dict) or data.get("fedq_bundle") != BUNDLE_FORMAT:
        raise ConfigError(f"{path}: not a fedq join bundle (format {BUNDLE_FORMAT}; make one "
                          f"with `fedq worker add` on the coordinator)")
    for field in ("name", "token", "coordinator_key"):
        if not isinstance(data.get(field), str) or not data[field]:
            raise ConfigError(f"{path}: the bundle has no {field}")
    services = data.get("services")
    if not isinstance(services, dict) or not isinstance(services.get("broker_url"), str) or \
            any(k not in _SERVICES or not isinstance(v, str) for k, v in services.items()):
        raise ConfigError(f"{path}: the bundle's services are not URLs of "
                          f"{', '.join(_SERVICES)}")
    queues = data.get("queues")
    if not isinstance(queues, list) or not all(isinstance(q, str) for q in queues):
        raise ConfigError(f"{path}: the bundle's queues are not a list of names")
    check_name(data["name"])
    check_queues(queues)
    return data


def _ask_to_join(proof: dict[str, str], timeout: float) -> dict[str, Any]:
    from amqp.exceptions import AMQPError
    from celery.exceptions import TimeoutError as CeleryTimeout
    from kombu.exceptions import OperationalError
    from redis import RedisError

    from fedq.coordinator.rabbit import is_amqp
    from fedq.engine.app import app
    from fedq.engine.backend import send_and_poll
    from fedq.engine.names import CONTROL_QUEUE, JOIN_WORKER_TASK

    if is_amqp(app.conf.broker_url):
        # RabbitMQ refuses a publish by closing the channel, after the send returned:
        # with publisher confirms the send waits for the broker's verdict, so a refusal
        # is said at once instead of as a timeout.
        app.conf.broker_transport_options = {**app.conf.broker_transport_options,
                                             "confirm_publish": True}
    try:
        # not declared: the bundle's broker user may send to the control queue only; its
        # answer is polled by its key, as a worker's user may not subscribe to any task's
        # channel (fedq/coordinator/acl.py)
        answer = send_and_poll(app, JOIN_WORKER_TASK, (proof,), CONTROL_QUEUE, timeout,
                               declare=[])
    except CeleryTimeout:
        raise ServiceUnavailable(f"no answer from the coordinator's control worker in "
                                 f"{timeout:.0f} s (is it running, and is this the broker "
                                 f"it uses?)") from None
    except AMQPError as exc:
        raise FedqError(f"the broker refused the join request: {exc} (was this worker "
                        f"revoked, or is its RabbitMQ user older than the coordinator's "
                        f"fedq? `fedq worker add` it again)") from None
    except (OSError, OperationalError, RedisError) as exc:
        raise ServiceUnavailable(f"cannot reach the bundle's broker: {exc}") from None
    return answer if isinstance(answer, dict) else {"ok": False, "error": "no answer"}


def _check_writable(keys_dir: Path) -> None:
    """Raise a one-line ConfigError unless this machine's key can be kept in
    ``keys_dir`` (made mode 700 if missing; a file written there and removed)."""
    from fedq.files import write_whole

    probe = keys_dir / ".fedq-join-probe"
    try:
        keys_dir.mkdir(parents=True, exist_ok=True)
        write_whole(probe, "")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{keys_dir}: cannot keep this machine's key there "
                          f"({exc.strerror or exc}); the invitation is unused: make the "
                          f"folder writable (or set FEDQ_KEYS_DIR) and join again") from None


def _store(keys_dir: Path, key: Any, bundle: dict[str, Any]) -> None:
    """The worker's key and ``worker.json``, each written whole (mode 600)."""
    from cryptography.hazmat.primitives import serialization

    import fedq.identity as identity

    keys_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    _write_private(keys_dir / identity.WORKER_KEY, pem.decode())
    record = {"name": bundle["name"], "queues": bundle["queues"],
              "coordinator_key": bundle["coordinator_key"], "services": bundle["services"]}
    _write_private(keys_dir / identity.WORKER_FILE, json.dumps(record, indent=2) + "\n")


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` readable by its owner only, written whole
    (fedq.files.write_whole: O_EXCL, mode 600 whatever the umask)."""
    from fedq.files import write_whole

    write_whole(path, text)


@main.command("provision")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--host", "hosts", multiple=True,
              help="a name or address the services are reached at (repeat it)")
@click.option("--worker", "workers", multiple=True, help="a worker's name (repeat it)")
@expected_errors
def provision_cmd(folder: Path, hosts: tuple[str, ...], workers: tuple[str, ...]) -> None:
    """Make a CA and certificates for mutual TLS: FOLDER/server (Redis, PostgreSQL,
    S3), FOLDER/coordinator, FOLDER/workers/NAME. Run again to add workers."""
    from fedq.coordinator.enrol import check_name
    from fedq.provision import provision

    for name in workers:
        check_name(name)
    for made in provision(folder, list(hosts), list(workers)):
        out.print(f"{'made' if made.new else 'kept'} {made.path}")
