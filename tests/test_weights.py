"""The safetensors writer and the in-place reader (fedq/weights.py), and the Redis
store's bulk reader (fedq/blobs/redis.py) against real Redis servers."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fedq.blobs import BlobRef, open_store
from fedq.errors import BlobNotFound, BlobTooLarge, UpdateRejected
from fedq.weights import dumps, loads, loads_with_meta

from .conftest import free_port, missing

WEIGHTS = {"conv.weight": torch.randn(4, 3, 3, 3), "bn.num_batches_tracked": torch.tensor(7),
           "half": torch.randn(5).half(), "bf": torch.randn(3).bfloat16(),
           "empty": torch.empty(0, 2), "mask": torch.tensor([True, False, True])}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])
                                    for k in a)


def test_dumps_is_safetensors_and_both_readers_agree() -> None:
    data = dumps(WEIGHTS, {"job": "j"})
    assert _equal(st_load(data), WEIGHTS)  # the reference implementation reads it
    assert _equal(loads(data), WEIGHTS)
    views = loads(bytearray(data))
    assert _equal(views, WEIGHTS)
    assert loads_with_meta(bytearray(data))[1] == {"job": "j"}
    # and fedq reads what the reference implementation writes
    assert _equal(loads(bytearray(st_save(WEIGHTS))), WEIGHTS)


def test_bytearray_is_read_in_place() -> None:
    buf = bytearray(dumps({"w": torch.zeros(1000)}))
    w = loads(buf)["w"]
    buf[-4:] = struct.pack("<f", 2.5)  # the last element's bytes
    assert float(w[-1]) == 2.5


def _file(header: dict, data: bytes = b"") -> bytearray:
    head = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize("blob, reason", [
    (bytearray(b"\x01\x02"), "shorter than its header"),
    (bytearray(struct.pack("<Q", 1 << 40) + b"{}"), "exceeds the file"),
    (bytearray(struct.pack("<Q", 3) + b"abc"), "not JSON"),
    (_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
     "do not fit"),
    (_file({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     "do not fit"),
    (_file({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "bad entry"),
    (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
     "overlaps"),
    (_file({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
     "does not fill"),
])
def test_malformed_files_are_rejected(blob: bytearray, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason):
        loads(blob, what="blob x")


def test_large_blob_through_redis(redis_db: str) -> None:
    store = open_store(redis_db)
    weights = {"w": torch.randn(3_000_000), "n": torch.tensor(2)}  # 12 MB: many recv calls
    ref = store.put("jobs/j/r00001/global.safetensors", dumps(weights))
    data = store.get(ref)
    assert isinstance(data, bytearray)  # the bulk reader, not redis-py
    assert _equal(loads(data), weights)


def test_bulk_reader_reconnects_after_the_server_drops_it(redis_db: str) -> None:
    import redis

    store = open_store(redis_db)
    ref = store.put("k", b"value")
    assert bytes(store.get(ref)) == b"value"
    redis.Redis.from_url(redis_db).client_kill_filter(_type="normal", skipme=True)
    assert bytes(store.get(ref)) == b"value"
    with pytest.raises(BlobNotFound, match="missing"):
        store._read("missing")


def test_a_bounded_read_is_refused_from_the_replys_length(redis_db: str) -> None:
    """The bulk reader knows a value's length before its bytes: a value over the limit
    is refused unread in the one GET (no size query first), and the store reads on."""
    store = open_store(redis_db)
    assert store.bounds_reads
    ref = store.put("jobs/j/u.safetensors", b"x" * (2 << 20))
    small = store.put("jobs/j/v.safetensors", b"y" * 1000)
    with pytest.raises(BlobTooLarge, match=f"is {2 << 20} bytes, more than the 1000 it may "
                                           "be: not read"):
        store.get(ref, limit=1000)
    assert bytes(store.get(small, limit=1000)) == b"y" * 1000  # on a new connection
    assert len(store.get(ref, limit=2 << 20)) == 2 << 20
    with pytest.raises(BlobNotFound):
        store.get(BlobRef("jobs/j/gone", "0" * 64, 1), limit=1)


@pytest.fixture
def password_redis() -> Iterator[int]:
    """A redis-server of its own that requires a password."""
    server = shutil.which("redis-server")
    if server is None:
        missing("redis-server binary", "not on PATH")
    port = free_port()
    proc = subprocess.Popen([str(server), "--port", str(port), "--bind", "127.0.0.1",
                             "--requirepass", "s3cret", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port, password="s3cret")
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield port
    finally:
        proc.kill()
        proc.wait(5)


def test_bulk_reader_authenticates_and_selects_the_database(password_redis: int) -> None:
    store = open_store(f"redis://:s3cret@127.0.0.1:{password_redis}/3")
    ref = store.put("k", b"x" * 100_000)
    assert bytes(store.get(ref)) == b"x" * 100_000
    import redis

    assert redis.Redis(port=password_redis, password="s3cret", db=3).exists("fedq:blob:k")
    wrong = open_store(f"redis://:nope@127.0.0.1:{password_redis}/3")
    with pytest.raises(Exception, match="cannot read k: .*(WRONGPASS|invalid)"):
        wrong.get(ref)


def test_pooled_read_buffers_are_never_reused_while_viewed(redis_db: str) -> None:
    store = open_store(redis_db)
    refs = [store.put(f"b{i}", dumps({"w": torch.full((600_000,), float(i))})) for i in range(3)]
    kept = loads(store.get(refs[0]))["w"]  # a view into the first buffer
    for _ in range(3):  # later reads reuse free buffers, never the viewed one
        for ref in refs[1:]:
            assert float(loads(store.get(ref))["w"][-1]) == float(refs.index(ref))
    assert torch.equal(kept, torch.zeros(600_000))
    data = store.get(refs[2])
    assert store.get(refs[1]) is not data  # a caller's reference also keeps it


def test_put_parts_writes_the_same_blob_as_put(redis_db: str, tmp_path: Path) -> None:
    from fedq.weights import dump_parts

    whole = dumps(WEIGHTS, {"job": "j"})
    for store in (open_store(redis_db), open_store(str(tmp_path / "blobs"))):
        ref = store.put_parts("p", dump_parts(WEIGHTS, {"job": "j"}))
        same = store.put("q", whole)
        assert (ref.sha256, ref.size) == (same.sha256, same.size)
        assert bytes(store.get(ref)) == whole
