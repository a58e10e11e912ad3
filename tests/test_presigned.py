"""Workers without S3 credentials: each task carries presigned URLs for its own blobs
(fedq/blobs/presigned.py; docs/security.md, "Least privilege").

A real S3 server (SeaweedFS) holds the blobs; the coordinator has its key and
``FEDQ_PRESIGN_ENDPOINT``; the worker has no S3 key at all, trains a job through the
URLs its tasks carry, and a URL for one object and method is refused by S3 for any
other object or method.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedq.testing.cluster import DIGITS, record
from fedq.testing.wait import wait_until

SPEC = {**DIGITS, "num_clients": 4, "clients_per_round": 2, "rounds": 2, "min_clients": 2}


def _status(url: str, method: str = "GET", data: bytes | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method),
                                    timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.slow
def test_a_worker_with_no_s3_key_trains_through_its_tasks_urls(
        tmp_path: Path, s3_env: dict[str, str], pg_url: str) -> None:
    from tests.conftest import private_redis

    with private_redis() as (redis_url, _):
        _run(tmp_path, s3_env["FEDQ_S3_ENDPOINT_URL"], redis_url, pg_url)


def _run(tmp_path: Path, endpoint: str, redis_db: str, pg_url: str) -> None:
    from fedq.blobs import open_store
    from fedq.blobs.s3 import S3BlobStore
    from tests.conftest import migrated_cluster

    cluster = migrated_cluster(tmp_path, redis_db, redis_db, pg_url)
    cluster.env.update(FEDQ_BLOB_URL="s3://fedq/presigned", FEDQ_PRESIGN_ENDPOINT=endpoint,
                       FEDQ_S3_ENDPOINT_URL=endpoint)
    no_key = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "FEDQ_PRESIGN_ENDPOINT": "",
              "FEDQ_BLOB_URL": "s3://fedq/presigned"}
    try:
        cluster.start(control=["control"])
        cluster.start_beat()
        worker = cluster.add("cpu1", ["cpu"], **no_key)
        job = cluster.submit({**SPEC, "name": "presigned"})
        assert cluster.wait(job).status == "completed", worker.tail(40)
    finally:
        cluster.stop()
    rows = [u for u in cluster.updates(job) if u.status == "ok"]
    assert len(rows) == 4 and all(u.blob_key and "/updates/c" in u.blob_key for u in rows)

    store = open_store("s3://fedq/presigned", endpoint)
    assert isinstance(store, S3BlobStore)
    model, update, other = (f"jobs/{job}/r00001/global.safetensors",
                            f"jobs/{job}/r00002/updates/c000000-a9.safetensors",
                            rows[0].blob_key or "")
    links = store.presign(endpoint, 60, [model], [update])
    get, put = links["get"][model], links["put"][update]
    assert _status(get) == 200
    refusals = {
        "another object with a model's GET URL": (get.replace(model, other), "GET", None),
        "a GET with the update's PUT URL": (put, "GET", None),
        "another object with the update's PUT URL": (put.replace(update, model), "PUT", b"x"),
    }
    for what, (url, method, data) in refusals.items():
        code = _status(url, method, data)
        assert code == 403, (what, code)
        record("security", scenario=f"presigned: {what}", did=f"used {what.split(' with')[0]} "
               f"through a URL its task carried", fedq=f"refused by S3: HTTP {code}",
               guard="S3's signature over the object and method (blobs/presigned.py)",
               outcome="refused; the worker held no S3 key and trained the job")


@pytest.mark.slow
def test_a_tasks_headers_and_events_name_it_and_carry_no_url(
        tmp_path: Path, s3_env: dict[str, str], pg_url: str) -> None:
    """A training task's presigned URLs travel in its (sealed) argument only: the
    message headers and the task-sent event, which the dashboard and any event
    listener read, show who the task is for (Celery's ``argsrepr``,
    ``fedq.coordinator.intake.Sent.shown``), not a repr of its argument. No training
    worker runs: a synchronous and a buffered job's tasks wait in the cpu queue."""
    import base64
    import json
    import re

    import redis

    from tests.conftest import migrated_cluster, private_redis

    endpoint = s3_env["FEDQ_S3_ENDPOINT_URL"]
    with private_redis() as (url, _):
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        cluster.env.update(FEDQ_BLOB_URL="s3://fedq/shown", FEDQ_PRESIGN_ENDPOINT=endpoint,
                           FEDQ_S3_ENDPOINT_URL=endpoint)
        client = redis.Redis.from_url(url)
        events = client.pubsub()
        events.psubscribe("*celeryev*")
        try:
            cluster.start(control=["control"])
            sync = cluster.submit({**SPEC, "name": "shown"})
            buffered = cluster.submit({**{k: v for k, v in SPEC.items() if k != "min_clients"},
                                       "name": "shown-buffered",
                                       "aggregation": {"mode": "buffered", "buffer": 2}})
            wait_until(lambda: client.llen("cpu") >= 4, 60,
                       what=lambda: cluster.by_name("control").tail())
            messages = [json.loads(m) for m in client.lrange("cpu", 0, -1)]
            sent = []
            while (event := events.get_message(timeout=1)) is not None:
                if event["type"] == "pmessage":
                    sent.append(event["data"])
        finally:
            events.close()
            client.close()
            cluster.stop()
    shown = [m["headers"]["argsrepr"] for m in messages]
    assert len(shown) == 4, shown
    assert len([x for x in shown if re.fullmatch(
        f"job {sync} round 1 client [0-3] attempt 1", x)]) == 2, shown
    assert len([x for x in shown if re.fullmatch(
        f"job {buffered} task [12] client [0-3] attempt 1", x)]) == 2, shown
    for m in messages:
        assert m["headers"]["kwargsrepr"] == "{}"
        (ref,), _, _ = json.loads(base64.b64decode(m["body"]))
        assert endpoint in json.dumps(ref)  # the URLs are in the argument, where they belong
        assert endpoint not in json.dumps(m["headers"])
    decoded = []  # one event, or a group of them (a worker's; a round's task-sent)
    batches = []
    for e in sent:
        body = json.loads(base64.b64decode(json.loads(e)["body"]))
        decoded += body if isinstance(body, list) else [body]
        batches.append({x.get("uuid") for x in (body if isinstance(body, list) else [body])
                        if x.get("type") == "task-sent"})
    tasks_sent = {e["uuid"]: e["args"] for e in decoded if e.get("type") == "task-sent"}
    assert sorted(tasks_sent[m["headers"]["id"]] for m in messages) == sorted(shown)
    # a round's task-sent events go out together, in one message after its chord
    # (fedq.engine.app.SentEvents), not one broker round trip per task; so do those of
    # the tasks a buffered job sends at once (fedq.engine.app.sending)
    for job, shown_as in ((sync, "round 1"), (buffered, "task")):
        ids = {m["headers"]["id"] for m in messages
               if m["headers"]["argsrepr"].startswith(f"job {job} {shown_as} ")}
        assert len(ids) == 2 and ids in batches, (job, batches)
    assert not [e for e in decoded if endpoint in json.dumps(e) or "X-Amz" in json.dumps(e)]
    record("security", scenario="dashboard: a task's URLs", did="read every training "
           "task's message headers and task-sent event (what Flower and any event "
           "listener see)", fedq="the headers name the task (job, round or task, client, "
           "attempt); no presigned URL", guard="argsrepr set by the coordinator "
           "(intake.Sent.shown)", outcome="no URL outside the sealed argument")


def test_presigned_urls_over_https_trust_only_the_ca_aws_ca_bundle_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker reads and writes through https URLs when AWS_CA_BUNDLE names the CA of
    the S3 server's certificate; it refuses the same server without it (the system's
    CAs do not know a private CA), and an impostor at the same address whose
    certificate another CA signed, saying why, never with the URL's signature."""
    import hashlib

    from fedq.blobs.base import BlobRef
    from fedq.blobs.presigned import PresignedStore
    from fedq.errors import BlobError
    from fedq.provision import provision

    provision(tmp_path / "pki", ["127.0.0.1"], [])
    provision(tmp_path / "impostor", ["127.0.0.1"], [])  # a CA fedq never made
    objects: dict[str, bytes] = {"/jobs/j/global": b"model bytes"}
    ref = BlobRef("global", hashlib.sha256(b"model bytes").hexdigest(), 11)
    with _https_s3(tmp_path / "pki", objects) as base:
        links = {"get": {"global": f"{base}/jobs/j/global?X-Amz-Signature=secret"},
                 "put": {"up": f"{base}/jobs/j/up?X-Amz-Signature=secret"}}
        monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
        with pytest.raises(BlobError, match="CERTIFICATE_VERIFY_FAILED") as refused:
            PresignedStore(links).get(ref)
        assert "secret" not in str(refused.value)
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "pki" / "ca.crt"))
        store = PresignedStore(links)
        assert store.get(ref) == b"model bytes"
        assert store.put_parts("up", [b"an ", b"update"]).size == 9
        assert objects["/jobs/j/up"] == b"an update"
    with _https_s3(tmp_path / "impostor", objects) as base:
        links = {"get": {"global": f"{base}/jobs/j/global?X-Amz-Signature=secret"},
                 "put": {"up": f"{base}/jobs/j/up?X-Amz-Signature=secret"}}
        with pytest.raises(BlobError, match="CERTIFICATE_VERIFY_FAILED") as refused:
            PresignedStore(links).put_parts("up", [b"stolen update"])
        assert "secret" not in str(refused.value) and objects["/jobs/j/up"] == b"an update"
    record("security", scenario="presigned https: an impostor S3 server",
           did="answered the worker's presigned URLs with a certificate of another CA",
           fedq=f"refused before sending a byte: {str(refused.value).split(' (_ssl')[0]}",
           guard="the S3 certificate checked against AWS_CA_BUNDLE (blobs/presigned.py)",
           outcome="refused; the update went to no one")
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.crt"))
    with pytest.raises(BlobError, match="AWS_CA_BUNDLE: cannot read"):
        PresignedStore(links)


def test_a_presigned_read_is_received_into_one_buffer_and_checked_as_it_arrives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A global model read through its presigned URL arrives into one buffer of its
    Content-Length, hashed piece by piece (no second copy joined from pieces); a body
    that ends before its Content-Length, or whose bytes are not the ref's, is one line
    naming the key, never a short or wrong model."""
    import os

    import fedq.digest as digests
    from fedq.blobs.base import BlobRef
    from fedq.blobs.presigned import PresignedStore
    from fedq.errors import BlobError, BlobIntegrityError
    from fedq.provision import provision

    provision(tmp_path / "pki", ["127.0.0.1"], [])
    monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "pki" / "ca.crt"))
    model = os.urandom(3 * (1 << 20) + 17)  # over the 1 MiB pieces, not a multiple
    objects = {"/g": model, "/short": model, "/wrong": model[:-1] + b"x"}
    ref = BlobRef("g", digests.of(model), len(model))
    with _https_s3(tmp_path / "pki", objects, declared={"/short": len(model) + 5}) as base:
        links = {"get": {key: f"{base}/{key}?X-Amz-Signature=secret"
                         for key in ("g", "short", "wrong")}}
        store = PresignedStore(links)
        got = store.get(ref)
        assert isinstance(got, bytearray) and got == model
        with pytest.raises(BlobError, match=r"short .*the body ended after \d+ of its "
                                            rf"{len(model) + 5} bytes") as short:
            store.get(BlobRef("short", ref.sha256, len(model) + 5))
        assert "secret" not in str(short.value)
        with pytest.raises(BlobIntegrityError, match="wrong"):
            store.get(BlobRef("wrong", ref.sha256, len(model)))


@contextmanager
def _https_s3(pki: Path, objects: dict[str, bytes],
              declared: dict[str, int] | None = None) -> Iterator[str]:
    """An https server with ``pki``'s server certificate that GETs and PUTs ``objects``
    by path (the S3 calls a presigned URL makes; no signature is checked here). A path
    in ``declared`` answers with that Content-Length, whatever its body's size."""
    import http.server
    import ssl
    import threading

    class S3(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?")[0]
            body = objects.get(path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str((declared or {}).get(path, len(body))))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self) -> None:  # noqa: N802
            size = int(self.headers["Content-Length"])
            objects[self.path.split("?")[0]] = self.rfile.read(size)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), S3)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki / "server" / "server.crt", pki / "server" / "server.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
