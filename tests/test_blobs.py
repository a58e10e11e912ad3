"""Blob stores against the real backends: a local folder, Redis, and an S3 server."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from fedq.blobs import BlobRef, BlobStore, global_key, open_store, update_key
from fedq.errors import BlobIntegrityError, BlobNotFound, ServiceUnavailable
from fedq.weights import dumps, loads


@pytest.fixture(params=["local", "redis", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    if request.param == "local":
        yield open_store(str(tmp_path / "blobs"))
    elif request.param == "redis":
        yield open_store(request.getfixturevalue("redis_db"))
    else:
        env = request.getfixturevalue("s3_env")
        yield open_store(f"s3://fedq/t-{tmp_path.name}", env["FEDQ_S3_ENDPOINT_URL"])


def _tamper(store: BlobStore, key: str, data: bytes) -> None:
    store._write(key, data)  # behind the ref's back, as a corrupt disk or attacker would


def test_roundtrip_weights(store: BlobStore) -> None:
    weights = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(3)}
    ref = store.put(global_key("j1", 0), dumps(weights, {"job": "j1"}))
    got = loads(store.get(ref))
    assert torch.equal(got["w"], weights["w"]) and int(got["n"]) == 3
    assert ref.size == len(dumps(weights, {"job": "j1"}))
    assert BlobRef.from_json(ref.to_json()) == ref


def test_tampered_blob_is_rejected_naming_its_key(store: BlobStore) -> None:
    key = update_key("j1", 2, 5)
    ref = store.put(key, dumps({"w": torch.ones(4)}))
    _tamper(store, key, dumps({"w": torch.full((4,), 9.0)}))
    with pytest.raises(BlobIntegrityError, match=r"blob jobs/j1/r00002/updates/c000005"):
        store.get(ref)


@pytest.mark.parametrize("size", [3 << 20, (1 << 20) + 7])
def test_large_blob_hashed_as_it_arrives_is_checked(store: BlobStore, size: int) -> None:
    # Prepare: a blob large enough that the Redis store hashes it on a second thread
    # while it is received; then the same blob with one byte changed near its end.
    key = update_key("j5", 1, 1)
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    ref = store.put(key, data)
    # Execute / Assert: read back whole and checked; a one-byte change is refused.
    assert bytes(store.get(ref)) == data
    _tamper(store, key, data[:-3] + b"?" + data[-2:])
    with pytest.raises(BlobIntegrityError, match="digest mismatch"):
        store.get(ref)


def _b3(data: bytes) -> str:
    return "b3-" + base64.urlsafe_b64encode(blake3.blake3(data).digest()).rstrip(b"=").decode()


@pytest.mark.parametrize("size", [1000, 3 << 20])
def test_blobs_are_named_by_blake3_and_a_sha256_ref_of_an_older_job_still_reads(
        store: BlobStore, size: int) -> None:
    """A blob written now is named by its BLAKE3 digest (fedq/digest.py); a ref that
    names it by its SHA-256 (a job begun before, its models' digests in SQL) is
    checked with SHA-256 (the form of the ref's digest decides) and still reads; a
    changed byte is refused under either form. Small and large (hashed as it is
    received, on Redis) blobs alike."""
    key = update_key("j7", 1, 1)
    data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    ref = store.put(key, data)
    assert ref.sha256 == _b3(data) and len(ref.sha256) == 46
    old = BlobRef(key, hashlib.sha256(data).hexdigest(), len(data))
    assert bytes(store.get(ref)) == data and bytes(store.get(old)) == data
    _tamper(store, key, data[:-1] + b"?")
    for r in (ref, old):
        with pytest.raises(BlobIntegrityError, match="digest mismatch"):
            store.get(r)


def test_the_host_cache_checks_a_file_by_its_refs_digest_form(tmp_path: Path) -> None:
    """The workers' shared cache (fedq/blobs/cache.py) names a file by its ref's digest
    and checks it by that digest's form on every read: a BLAKE3 ref and the SHA-256 ref
    of an older job each read from the cache once fetched, and a file changed on disk
    under either name is dropped and fetched again, never handed back."""
    from fedq.blobs.cache import HostCache

    store = open_store(str(tmp_path / "blobs"))
    data = bytes(range(256)) * 40
    ref = store.put(update_key("j9", 1, 0), data)
    old = BlobRef(ref.key, hashlib.sha256(data).hexdigest(), len(data))
    cache = HostCache(tmp_path / "cache")
    for r in (ref, old):
        assert cache.get(store, r) == (data, True)
        assert cache.get(store, r) == (data, False)  # from the file, checked
        (tmp_path / "cache" / r.sha256).write_bytes(data[:-1] + b"?")
        assert cache.get(store, r) == (data, True)  # damaged: fetched anew
        assert (tmp_path / "cache" / r.sha256).read_bytes() == data


def test_deterministic_key_overwrites(store: BlobStore) -> None:
    key = update_key("j2", 1, 0)
    store.put(key, b"first")
    second = store.put(key, b"second")
    assert store.get(second) == b"second"


def test_missing_blob_and_prefix_delete(store: BlobStore) -> None:
    a = store.put("jobs/j3/r00000/global.safetensors", b"a")
    b = store.put("jobs/j4/r00000/global.safetensors", b"b")
    store.delete_prefix("jobs/j3/")
    with pytest.raises(BlobNotFound, match="jobs/j3/r00000/global.safetensors"):
        store.get(a)
    assert store.get(b) == b"b"
    store.check()


def test_unwritable_local_store_fails_check(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ServiceUnavailable, match="not writable"):
        open_store(str(tmp_path / "file" / "blobs")).check()


def test_unreachable_redis_store_fails_check() -> None:
    with pytest.raises(ServiceUnavailable, match="not reachable"):
        open_store("redis://127.0.0.1:1/0").check()


def test_store_init_creates_the_bucket_once(s3_env: dict[str, str], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`fedq store init` (the compose file's s3-init step) on the real S3 server: a new
    bucket is created, then found; the store is writable after it."""
    from click.testing import CliRunner

    from fedq.cli.commands import main
    from fedq.settings import get_settings

    bucket = f"init-{tmp_path.name.lower().replace('_', '-')}"[:60]
    monkeypatch.setenv("FEDQ_HOME", str(tmp_path))
    monkeypatch.setenv("FEDQ_BLOB_URL", f"s3://{bucket}/fedq")
    get_settings.cache_clear()
    try:
        first = CliRunner().invoke(main, ["store", "init", "--wait", "0"])
        second = CliRunner().invoke(main, ["store", "init", "--wait", "0"])
    finally:
        get_settings.cache_clear()
    assert first.exit_code == 0, first.output
    assert f"bucket {bucket}: created" in first.output
    assert f"bucket {bucket}: exists" in second.output
    ref = open_store(f"s3://{bucket}/fedq", s3_env["FEDQ_S3_ENDPOINT_URL"]).put("k", b"v")
    assert ref.size == 1


def test_store_init_on_a_dead_server_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    from click.testing import CliRunner

    from fedq.cli.commands import main
    from fedq.settings import get_settings

    monkeypatch.setenv("FEDQ_HOME", str(tmp_path))
    monkeypatch.setenv("FEDQ_BLOB_URL", "s3://fedq/x")
    monkeypatch.setenv("FEDQ_S3_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(main, ["store", "init", "--wait", "0"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    assert "cannot create the bucket" in result.output


def test_write_hashing_hashes_small_blobs_first_and_large_ones_beside_the_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Either way the digest is the parts' BLAKE3 and the write runs once; a blob under
    HASH_BESIDE_BYTES starts no thread (its start and join cost more than the hash)."""
    import fedq.blobs.base as base

    started: list[int] = []
    real_pool = base.ThreadPoolExecutor

    def pool(**kwargs: Any) -> Any:
        started.append(1)
        return real_pool(**kwargs)

    monkeypatch.setattr(base, "ThreadPoolExecutor", pool)
    writes: list[int] = []
    for size, threads in ((19_000, 0), (base.HASH_BESIDE_BYTES, 1)):
        parts = [bytes(range(256)) * (size // 512), memoryview(b"\x07" * (size - size // 2))]
        writes.clear()
        digest = base.write_hashing(lambda: writes.append(1), parts)
        assert digest == _b3(b"".join(bytes(p) for p in parts))
        assert writes == [1] and len(started) == threads, size
        started.clear()


def test_a_blob_redis_cannot_keep_in_one_value_is_refused_unchunked(redis_db: str) -> None:
    """Without chunks (chunk_bytes None) a blob over Redis's 512 MiB value limit is one
    line naming its size and what to set, before a byte is sent (before chunks,
    `fedq submit` stopped on 'Error 104 while writing to socket'); a chunk size Redis
    cannot keep is refused when the store is opened. The parts are one 64 MiB buffer
    nine times over (576 MiB named, 64 MiB held)."""
    import redis

    from fedq.blobs.redis import RedisBlobStore
    from fedq.errors import BlobTooLarge, ConfigError

    store = RedisBlobStore(redis_db, chunk_bytes=None)
    chunk = bytes(64 << 20)
    for write in (lambda: store.put_parts("jobs/big/r00000/global.safetensors", [chunk] * 9),
                  lambda: store.put("jobs/big/r00000/global.safetensors", b"".join([chunk] * 9))):
        with pytest.raises(BlobTooLarge, match=r"576 MiB, more than the 512 MiB Redis keeps"
                                               r".*FEDQ_BLOB_CHUNK_MB"):
            write()
    key = "fedq:blob:jobs/big/r00000/global.safetensors"
    assert redis.Redis.from_url(redis_db).exists(key) == 0
    assert store.put_parts("jobs/big/small", [chunk]).size == 64 << 20  # under it: written
    with pytest.raises(ConfigError, match=r"FEDQ_BLOB_CHUNK_MB: a Redis chunk is 1 byte to 512"):
        RedisBlobStore(redis_db, chunk_bytes=513 << 20)


CHUNK = 4096


@pytest.fixture(params=["local", "redis", "s3"])
def chunked(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    """Each store with a chunk size of 4 KB (S3: parts of its 5 MiB least; the local
    store keeps one file a blob, and is given chunks here only to show that the
    manifest is the store's, not the backend's)."""
    if request.param == "local":
        store = open_store(str(tmp_path / "blobs"))
        store.chunk_bytes = CHUNK
    elif request.param == "redis":
        store = open_store(request.getfixturevalue("redis_db"), chunk_bytes=CHUNK)
    else:
        env = request.getfixturevalue("s3_env")
        store = open_store(f"s3://fedq/t-{tmp_path.name}", env["FEDQ_S3_ENDPOINT_URL"],
                           chunk_bytes=CHUNK)
    yield store


def _blob(size: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(size))


def test_a_chunked_blob_reads_back_whole_and_its_ref_is_the_unchunked_ones(
        chunked: BlobStore, redis_db: str, tmp_path: Path) -> None:
    """A blob over the chunk size is written as chunks and a manifest (Redis, local) or
    in parts (S3), and reads back byte for byte; its ref (digest, size) is the one a
    store without chunks gives, so messages, SQL and the host cache cannot tell."""
    from fedq.blobs import chunks

    data = _blob(6 << 20 if chunked.chunk_bytes is None else 5 * CHUNK + 123)
    ref = chunked.put_parts(update_key("jc", 1, 0), [data[:1000], memoryview(data)[1000:]])
    plain = open_store(str(tmp_path / "plain")).put("x", data)
    assert (ref.sha256, ref.size) == (plain.sha256, plain.size)
    assert bytes(chunked.get(ref)) == data
    assert bytes(chunked.get(chunked.put("jobs/jc/r00001/global.safetensors", data))) == data
    if chunked.chunk_bytes is not None:  # six chunks, the manifest under the key itself
        head = chunked._read(ref.key)
        assert head.startswith(chunks.MAGIC) and len(chunks.keys_of(ref.key, head)) == 6
        assert len(chunked._read(chunks.chunk_key(ref.key, 5))) == 123
    small = chunked.put("jobs/jc/small", data[:CHUNK])  # at the size: one value, as before
    assert chunked._read(small.key) == data[:CHUNK]


def test_a_blob_written_as_one_value_before_chunks_still_reads(redis_db: str) -> None:
    """An older job's blob (one value, larger than today's chunk size) reads as it
    was written, through a store that chunks."""
    from fedq.blobs.redis import RedisBlobStore

    data = _blob(3 * CHUNK)
    ref = RedisBlobStore(redis_db, chunk_bytes=None).put("jobs/old/r00001/global", data)
    assert bytes(RedisBlobStore(redis_db, chunk_bytes=CHUNK).get(ref)) == data


def _chunked_ref(store: BlobStore, key: str) -> tuple[BlobRef, bytes]:
    data = _blob(3 * CHUNK + 10, seed=sum(key.encode()))
    return store.put(key, data), data


@pytest.mark.parametrize("store_kind", ["local", "redis"])
def test_a_bad_chunk_or_manifest_is_refused_in_one_line(store_kind: str, redis_db: str,
                                                        tmp_path: Path) -> None:
    """What a hostile or broken writer can leave: a corrupted chunk, a missing one, one
    longer than its manifest says, a manifest of another blob, one too large, one that
    lists chunks adding up to another size, one that is not JSON. Each read fails with
    one BlobError line naming the key; none returns bytes."""
    import json

    from fedq.blobs import chunks
    from fedq.errors import BlobError

    store = open_store(redis_db, chunk_bytes=CHUNK) if store_kind == "redis" \
        else open_store(str(tmp_path / "blobs"))
    store.chunk_bytes = CHUNK
    ref, _ = _chunked_ref(store, "jobs/j1/r00001/updates/c000001")
    other, _ = _chunked_ref(store, "jobs/j2/r00001/updates/c000001")
    manifest = store._read(ref.key)
    listed = json.loads(manifest[len(chunks.MAGIC):])

    def manifest_with(**fields: Any) -> bytes:
        return chunks.MAGIC + json.dumps({**listed, **fields}).encode()

    second = chunks.chunk_key(ref.key, 1)
    good = store._read(second)
    cases: list[tuple[str, Any, str]] = [
        ("corrupted chunk", lambda: store._write(second, good[:-1] + b"\x00"),
         r"c000001\.chunk00001: digest mismatch"),
        ("missing chunk", lambda: store.delete_keys([second]) if store_kind == "local"
         else store._client.delete("fedq:blob:" + second), r"chunk00001: not found"),
        ("chunk longer than declared", lambda: store._write(second, good + b"x"),
         r"chunk00001 is 4097 bytes, more than the 4096 it may be"),
        ("another blob's manifest", lambda: store._write(ref.key, store._read(other.key)),
         r"its manifest names another blob"),
        ("manifest too large", lambda: store._write(
            ref.key, chunks.MAGIC + b" " * chunks.MAX_MANIFEST_BYTES),
         r"its manifest is \d+ bytes, more than 1048576"),
        ("chunks of another size", lambda: store._write(ref.key, manifest_with(
            chunks=listed["chunks"][:-1] + [[11, listed["chunks"][-1][1]]])),
         r"lists chunks of \d+ bytes for a blob of"),
        ("not JSON", lambda: store._write(ref.key, chunks.MAGIC + b"{nope"),
         r"its manifest is not JSON"),
    ]
    for what, spoil, message in cases:
        store._write(ref.key, manifest)
        store._write(second, good)
        spoil()
        with pytest.raises(BlobError, match=message) as caught:
            store.get(ref)
        assert "\n" not in str(caught.value) and ref.key in str(caught.value), what
        with pytest.raises(BlobError, match=message):  # read in pieces: the same refusal
            for _ in store.stream(ref):
                pass
    store._write(ref.key, manifest)
    store._write(second, good)
    assert len(store.get(ref)) == ref.size  # as written: it reads again
    assert sum(len(piece) for piece in store.stream(ref)) == ref.size


def test_deleting_a_chunked_blob_removes_its_chunks(redis_db: str) -> None:
    """Settle deletes a round's updates by key (fedq/coordinator/commit.py): a chunked
    one's chunks go with its manifest, and nothing else does."""
    import redis

    store = open_store(redis_db, chunk_bytes=CHUNK)
    doomed, _ = _chunked_ref(store, "jobs/jd/r00001/updates/c000001")
    kept, data = _chunked_ref(store, "jobs/jd/r00001/updates/c000002")
    small = store.put("jobs/jd/r00001/updates/c000003", b"tiny")
    client = redis.Redis.from_url(redis_db)
    assert len(client.keys("fedq:blob:jobs/jd/*")) == 2 * 5 + 1
    store.delete_keys([doomed.key, small.key, "jobs/jd/never"])
    assert sorted(k.decode() for k in client.keys("fedq:blob:jobs/jd/*")) == sorted(
        ["fedq:blob:" + kept.key] + [f"fedq:blob:{kept.key}.chunk{i:05d}" for i in range(4)])
    assert bytes(store.get(kept)) == data


def test_a_writer_stopped_mid_blob_leaves_nothing_once_its_key_is_deleted(
        redis_db: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    """A worker killed mid-upload leaves no blob anyone reads (the manifest, or S3's
    completion, comes last) but did leave its chunks: Redis chunks with no manifest, an
    unfinished S3 multipart upload. Deleting the key (a round's settle deletes its
    updates by key: fedq/coordinator/commit.py) removes them, and nothing else."""
    import redis

    from fedq.blobs import chunks

    store = open_store(redis_db, chunk_bytes=CHUNK)
    key, other = "jobs/jo/r00002/updates/c000001-a1", "jobs/jo/r00002/updates/c000001-a10"
    client = redis.Redis.from_url(redis_db)
    for i in range(3):  # its first three chunks written, then the writer was killed
        client.set("fedq:blob:" + chunks.chunk_key(key, i), b"x" * CHUNK)
    kept, data = _chunked_ref(store, other)  # a neighbour whose key begins the same
    store.delete_keys([key])
    assert sorted(k.decode() for k in client.keys("fedq:blob:jobs/jo/*")) == sorted(
        ["fedq:blob:" + kept.key] + [f"fedq:blob:{kept.key}.chunk{i:05d}" for i in range(4)])
    assert bytes(store.get(kept)) == data

    s3 = open_store(f"s3://fedq/t-{tmp_path.name}", s3_env["FEDQ_S3_ENDPOINT_URL"],
                    chunk_bytes=CHUNK)
    full = s3.prefix + key
    started = s3._client.create_multipart_upload(Bucket=s3.bucket, Key=full)
    s3._client.upload_part(Bucket=s3.bucket, Key=full, PartNumber=1,
                           UploadId=started["UploadId"], Body=b"x" * (5 << 20))
    s3._client.create_multipart_upload(Bucket=s3.bucket, Key=s3.prefix + other)

    def unfinished() -> set[str]:
        listed = s3._client.list_multipart_uploads(Bucket=s3.bucket, Prefix=s3.prefix)
        return {u["Key"][len(s3.prefix):] for u in listed.get("Uploads", [])}

    assert unfinished() == {key, other}
    s3.delete_keys([key])
    assert unfinished() == {other}
