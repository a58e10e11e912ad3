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
from pathlib import Path

import pytest

from fedq.testing.cluster import DIGITS, record

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
