"""The compose stack with identity, least privilege and TLS on (docker/compose.secure.yaml;
docs/deploy.md, "The stack with identity and TLS"), on a real Docker engine.

`scripts/secure.sh` provisions the CA and certificates and writes the secure stack's
secrets beside the ones `scripts/env.sh` writes; `docker compose up` with the override:
Redis takes TLS only, with client certificates; PostgreSQL takes TCP logins over TLS
only; the dashboard and S3 answer https only; the control worker requires signed results,
runs on a database role of its own and hands workers presigned https S3 URLs. A
worker is added with `fedq worker add` in the control container, joins from a worker
container on the host's network (as another machine would) with its own certificate
and no S3 key or database URL, and trains a job submitted by the fedq CLI on the host
on a submitter role.

A stage of its own (`bash scripts/test-deploy.sh`, marker `docker`)."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedq.testing.cluster import Cluster
from fedq.testing.wait import wait_until
from tests.test_deploy import (
    JOB,
    ROOT,
    Stack,
    _docker_env,
    _mounted_secrets,
    _write_secrets,
    running,
    stack_files,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]


def _tls_query(folder: Path, ca: str = "ca.crt") -> str:
    return (f"ssl_cert_reqs=required&ssl_ca_certs={folder / ca}"
            f"&ssl_certfile={folder / 'client.crt'}&ssl_keyfile={folder / 'client.key'}")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    docker = _docker_env()
    home = tmp_path_factory.mktemp("secure")
    pw, ports, _, env_file = stack_files(home)  # scripts/env.sh's files
    pki = home / "pki"
    owner = (f"postgresql+psycopg://fedq:{pw['postgres']}@127.0.0.1:{ports['postgres']}/fedq"
             f"?sslmode=verify-full&sslrootcert={pki / 'ca.crt'}")
    # then scripts/secure.sh adds the secure stack's
    made = subprocess.run(["bash", str(ROOT / "scripts" / "secure.sh"), "w1"],
                          env={**docker, "FEDQ_ENV_FILE": str(env_file),
                               "FEDQ_PKI_DIR": str(pki)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    # the CLI on the host: Redis's admin over TLS with the coordinator's certificate
    admin = f"rediss://:{pw['redis']}@127.0.0.1:{ports['redis']}"
    query = _tls_query(pki / "coordinator")
    cli_env = {k: v for k, v in docker.items() if not k.startswith("FEDQ_")}
    cli_env.update(FEDQ_BROKER_URL=f"{admin}/0?{query}", FEDQ_RESULT_BACKEND=f"{admin}/1?{query}",
                   FEDQ_DATABASE_URL=owner, FEDQ_BLOB_URL="s3://fedq/blobs",
                   FEDQ_S3_ENDPOINT_URL=f"https://127.0.0.1:{ports['s3']}",
                   AWS_CA_BUNDLE=str(pki / "ca.crt"),
                   AWS_ACCESS_KEY_ID="fedq", AWS_SECRET_ACCESS_KEY=pw["s3"],
                   AWS_DEFAULT_REGION="us-east-1", FEDQ_HOME=str(home / "cli"))
    project = f"fedqs{uuid.uuid4().hex[:8]}"
    compose = ["docker-compose", "-p", project, "--env-file", str(env_file),
               "-f", str(ROOT / "docker" / "compose.yaml"),
               "-f", str(ROOT / "docker" / "compose.debian.yaml"),
               "-f", str(ROOT / "docker" / "compose.secure.yaml")]
    with running(Stack(docker, compose, project, Cluster(home, cli_env), home / "unused.env",
                       home, ports, pw["flower"], list(pw.values()))) as s:
        yield s


def test_a_joined_worker_trains_over_tls_with_only_its_own_credentials(secure: Stack) -> None:
    import redis

    stack = secure
    cli = stack.cli
    # Redis answers TLS clients with a certificate only: plaintext with the password fails
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=stack.ports["redis"], password=stack.passwords[0],
                    socket_connect_timeout=3, socket_timeout=3).ping()
    # PostgreSQL refuses a login without TLS, with the right password
    import psycopg

    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        psycopg.connect(host="127.0.0.1", port=stack.ports["postgres"], user="fedq",
                        password=stack.passwords[1], dbname="fedq", sslmode="disable",
                        connect_timeout=5)
    # the dashboard answers https with the services' certificate, and not http
    import ssl
    import urllib.error
    import urllib.request

    flower = f"127.0.0.1:{stack.ports['flower']}/healthcheck"
    ca = ssl.create_default_context(cafile=str(stack.home / "pki" / "ca.crt"))
    assert urllib.request.urlopen(f"https://{flower}", timeout=10, context=ca).status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{flower}", timeout=10)
    # so does S3 (an S3 error answer is an answer; plain http gets none)
    s3 = f"127.0.0.1:{stack.ports['s3']}/"
    with pytest.raises(urllib.error.HTTPError) as answered:
        urllib.request.urlopen(f"https://{s3}", timeout=10, context=ca)
    assert answered.value.code == 403, answered.value
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{s3}", timeout=10)
    # the control worker logs in as its own role, and holds no schema owner's URL
    control = stack.container("control")
    held = stack.run("docker", "exec", control, "cat", "/run/secrets/database_url")
    assert held.startswith("postgresql+psycopg://fedq_control:"), held[:40]
    assert "owner_database_url" not in _mounted_secrets(stack, control)
    # a person's CLI on a submitter role (made with the owner's URL, as docs/deploy.md)
    alice = cli.fedq("db", "role", "alice", "--kind", "submitter").stdout.strip()
    cli.env["FEDQ_DATABASE_URL"] = alice

    # fedq worker add, in the control container (its key is in the `keys` volume)
    worker_dir = stack.home / "w1"
    tls = "ssl_cert_reqs=required&ssl_ca_certs=/etc/fedq/ca.crt" \
          "&ssl_certfile=/etc/fedq/client.crt&ssl_keyfile=/etc/fedq/client.key"
    reach = f"rediss://:replaced@127.0.0.1:{stack.ports['redis']}"
    bundle = stack.compose_run(
        "exec", "-T", "control", "fedq", "worker", "add", "w1", "--queues", "cpu",
        "--broker-url", f"{reach}/0?{tls}", "--result-backend", f"{reach}/1?{tls}",
        "--blob-url", "s3://fedq/blobs",
        "--s3-endpoint-url", f"https://127.0.0.1:{stack.ports['s3']}")
    services = json.loads(bundle)["services"]
    assert services["broker_url"].startswith("rediss://fedq-w-w1:"), services
    pki = stack.home / "pki" / "workers" / "w1"
    _write_secrets(worker_dir, {"bundle": bundle,
                                **{p.name: p.read_text() for p in pki.iterdir()}})
    # a join whose keys folder the image's user cannot write (a root-owned volume): the
    # container exits non-zero with its one-line reason, celery never starts, and the
    # invitation stays open for the join below with the same bundle
    locked = stack.home / "locked-keys"
    locked.mkdir(mode=0o755)
    refused = subprocess.run(
        ["docker", "run", "--rm", "--network", "host",
         *(a for name in ("ca.crt", "client.crt", "client.key")
           for a in ("-v", f"{worker_dir / name}:/etc/fedq/{name}:ro")),
         "-v", f"{worker_dir / 'bundle'}:/run/fedq.bundle:ro",
         "-v", f"{locked}:/home/fedq/.fedq/keys", "fedq-worker:cpu",
         "sh", "-c", "fedq worker join /run/fedq.bundle && exec celery -A fedq worker "
         "-Q cpu -c 1 -n w1@%h -l INFO"],
        env=stack.docker, capture_output=True, text=True, timeout=180, check=False)
    assert refused.returncode != 0, refused.stdout[-2000:]
    assert "the invitation is unused" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    assert "celery@" not in refused.stdout + refused.stderr, refused.stdout[-2000:]
    container = f"{stack.project}-w1"
    stack.run("docker", "run", "-d", "--name", container, "--network", "host",
              *(a for name in ("ca.crt", "client.crt", "client.key")
                for a in ("-v", f"{worker_dir / name}:/etc/fedq/{name}:ro")),
              "-v", f"{worker_dir / 'bundle'}:/run/fedq.bundle:ro",
              "-e", "AWS_CA_BUNDLE=/etc/fedq/ca.crt",  # its presigned URLs are https
              "fedq-worker:cpu",
              "sh", "-c", "fedq worker join /run/fedq.bundle && exec celery -A fedq worker "
              "-Q cpu -c 1 -n w1@%h -l INFO")
    wait_until(lambda: "ready." in stack.logs(container), 180, interval=1,
               what=lambda: f"{container} to join and be ready:\n"
                            f"{stack.logs(container)[-3000:]}")
    assert "joined as w1" in stack.logs(container)

    job = cli.submit({**JOB, "name": "secure", "rounds": 2})
    try:
        view = cli.wait(job, timeout=400)
    except AssertionError as exc:  # say what the control worker and the worker saw
        raise AssertionError(f"{exc}\ncontrol:\n{stack.logs(control)[-4000:]}\n"
                             f"{container}:\n{stack.logs(container)[-4000:]}") from None
    assert view.status == "completed", f"{view.error}\n{stack.logs(container)[-3000:]}"
    rows = [u for u in cli.updates(job) if u.status == "ok"]
    assert len(rows) == 4 and {u.signer for u in rows} == {"w1"}, rows
    # the worker's machine holds no S3 key and no database URL
    env = json.loads(stack.run("docker", "inspect", "-f", "{{json .Config.Env}}", container))
    assert not [e for e in env if e.startswith(("AWS_SECRET", "FEDQ_DATABASE"))], env
