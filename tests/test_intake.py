"""The checks at the trust boundary, one by one, with no services (docs/security.md):
admitting a result (fedq/coordinator/intake.py), the strict result model and the task
check (fedq/protocol/envelope.py), decoding and decompression bounds, the blob size check, the
worker's paths, redaction, the version handshake and the watchdog's per-job guard.
tests/test_security.py runs the same attacks through real workers."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from fedq.aggregate.compression import ZSTD_MAGIC, decode, encode, maybe_decompress, zstd_compress
from fedq.blobs import BlobRef, global_key, open_store
from fedq.blobs.cache import HostCache
from fedq.coordinator.intake import Limits, Sent, admit, limits
from fedq.errors import BlobTooLarge, UpdateRejected
from fedq.protocol.envelope import MESSAGE_FORMAT, FormatError
from fedq.protocol.training import TrainRef, check_task
from fedq.redaction import redact, redact_text, remember
from fedq.spec import parse_spec
from fedq.testing.procs import run_module
from fedq.worker.inner import state_path

SENT = Sent(job="j1", round=3, client=2, attempt=1, gen=7, queue="cpu")
BOUND = Limits(samples=100, steps=20, seen=500)


def result(**kw: Any) -> dict[str, Any]:
    """What an honest worker returns for SENT."""
    return {"status": "ok", "job": "j1", "round": 3, "client": 2, "queue": "cpu",
            "worker": "w@h", "key": SENT.update_key, "sha256": "a" * 64, "samples": 100,
            "steps": 20, "loss": 0.5, "seconds": 1.0, "bytes_up": 10, "bytes_down": 10,
            "error": None, "attempt": 1, "gen": 7, "format": MESSAGE_FORMAT,
            "version": "0.1.0", "stats": {"seen": 500}, **kw}


@pytest.mark.parametrize(("raw", "status", "reason"), [
    (result(), "ok", None),
    (result(samples=40, steps=5), "ok", None),  # a result may report less
    (result(status="error", key=None, sha256=None, error="boom"), "error", "boom"),
    # identity comes from the task (intake.admit's identity loop)
    (result(client=3), "rejected", "identity: the result names client 3, its task was client 2"),
    (result(round=2), "rejected", "identity: the result names round 2"),
    (result(job="j2"), "rejected", "identity: the result names job 'j2'"),
    (result(attempt=2), "rejected", "identity: the result names attempt 2"),
    (result(gen=6), "rejected", "identity: the result names gen 6"),
    # the key fedq derives for the task (the key check)
    (result(key="jobs/j1/r00003/updates/c000001-a1.safetensors"), "rejected", "key: the update"),
    # the weight is bounded by the shard (intake._beyond)
    (result(samples=10**9), "rejected", "weight: reports 1000000000 samples, client 2's shard"),
    (result(samples=0), "rejected", "weight: reports 0 samples"),
    (result(steps=21), "rejected", "weight: reports 21 local steps"),
    (result(stats={"seen": 501}), "rejected", "weight: reports 501 samples processed"),
    # the version handshake
    (result(format=1), "rejected", "version: worker w@h speaks message format 1"),
    # the strict model: types, ranges, lengths, finite floats, unknown fields
    ("garbage", "rejected", "result is a str, not an object"),
    (result(loss=float("nan")), "rejected", "malformed result: loss"),
    (result(seconds=-1.0), "rejected", "malformed result: seconds"),
    (result(bytes_up=2**64), "rejected", "malformed result: bytes_up"),
    (result(worker="x" * 201), "rejected", "malformed result: worker"),
    (result(samples="100"), "rejected", "malformed result: samples"),
    (result(samples=True), "rejected", "malformed result: samples"),
    (result(sha256="../x"), "rejected", "malformed result: sha256"),
    (result(extra=1), "rejected", "malformed result: extra"),
    (result(stats={"gpu_util": 1e9}), "rejected", "malformed result: stats.gpu_util"),
    (result(error="e" * 5000, status="error"), "rejected", "malformed result: error"),
])
def test_admit(raw: Any, status: str, reason: str | None) -> None:
    ref = admit(raw, SENT, BOUND)
    assert ref.status == status, ref.error
    if reason is not None:
        assert reason in (ref.error or ""), ref.error
    # whatever the body said, the row is the task's
    assert (ref.job, ref.round, ref.client, ref.attempt, ref.gen, ref.queue) == \
        ("j1", 3, 2, 1, 7, "cpu")


BUFFERED_SENT = Sent(job="j1", round=4, client=2, attempt=1, gen=0, queue="cpu", task=9)


@pytest.mark.parametrize(("change", "status", "reason"), [
    ({}, "ok", None),
    # a buffered task is named by its number, never by a round
    ({"task": 8}, "rejected", "identity: the result names task 8, its task was task 9"),
    ({"task": 0, "round": 9}, "rejected", "identity: the result names task 0"),
    # the version it trained from is the worker's to report: a re-sent task trains from
    # a newer one, and its first attempt's late result still counts
    ({"round": 3}, "ok", None),
])
def test_admit_a_buffered_task(change: dict[str, Any], status: str, reason: str | None) -> None:
    raw = result(**{"round": 4, "task": 9, "gen": 0, "key": BUFFERED_SENT.update_key,
                    **change})
    ref = admit(raw, BUFFERED_SENT, BOUND)
    assert ref.status == status, ref.error
    if reason is not None:
        assert reason in (ref.error or ""), ref.error
    assert BUFFERED_SENT.task_id == "fedq-j1-b9-a1"
    assert BUFFERED_SENT.update_key != SENT.update_key


def test_admit_redacts_a_workers_error() -> None:
    ref = admit(result(status="error", key=None, sha256=None,
                       error="blob store redis://:p@ss/w@h:1/0 down"), SENT, BOUND)
    assert ref.error == "blob store redis://:***@h:1/0 down"


def test_limits_follow_the_partition() -> None:
    spec = parse_spec({"name": "t", "model": "small_cnn", "dataset": "digits",
                       "num_clients": 6, "clients_per_round": 3, "rounds": 1,
                       "batch_size": 16, "local_epochs": 2})
    sizes = [limits(spec, c).samples for c in range(6)]
    assert sum(sizes) == 1437 and max(sizes) - min(sizes) <= 1  # digits' train split, iid
    got = limits(spec, 0)
    assert got.steps == 2 * -(-got.samples // 16) and got.seen == got.steps * 16


# -- decoding (fedq/aggregate/compression.py) --------------------------------------

SHAPES = {"w": (4, 100)}


def int8_blob() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    return encode({"w": torch.randn(4, 100)}, "int8", 64)


def test_decode_refuses_a_bad_chunk() -> None:
    stored, meta = int8_blob()
    for chunk in ("0", "-1", "x", "32"):
        with pytest.raises(UpdateRejected, match="codec: int8 chunk"):
            decode(stored, {**meta, "fedq.chunk": chunk}, SHAPES, 64)
    assert decode(stored, meta, SHAPES, 64)["w"].shape == (4, 100)


def test_decode_refuses_wrong_lengths_and_dtypes() -> None:
    stored, meta = int8_blob()
    short = {**stored, "w.__q": stored["w.__q"][:-1].clone()}
    with pytest.raises(UpdateRejected, match="399 int8 values for a tensor of shape"):
        decode(short, meta, SHAPES, 64)
    wide = {**stored, "w.__q": stored["w.__q"].to(torch.float32)}
    with pytest.raises(UpdateRejected, match="int8 values of dtype torch.float32"):
        decode(wide, meta, SHAPES, 64)
    few = {**stored, "w.__s": stored["w.__s"][:-1].clone()}
    with pytest.raises(UpdateRejected, match="scales for 400 values"):
        decode(few, meta, SHAPES, 64)
    with pytest.raises(UpdateRejected, match="unknown codec"):
        decode(stored, {**meta, "fedq.codec": "zip"}, SHAPES, 64)


def test_zstd_is_bounded_and_damage_is_a_rejection() -> None:
    bomb = zstd_compress(bytes(64 << 20))  # 64 MiB of zeros in a few KiB
    assert len(bomb) < 64 << 10
    with pytest.raises(UpdateRejected, match="decompresses to more than 1048576 bytes"):
        maybe_decompress(bomb, 1 << 20)
    with pytest.raises(UpdateRejected, match="zstd: damaged frame"):
        maybe_decompress(ZSTD_MAGIC + bytes(range(200)), 1 << 20)
    assert maybe_decompress(zstd_compress(b"x" * 1000), 1000) == b"x" * 1000


def test_blob_reads_are_bounded_before_they_happen(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    ref = store.put("jobs/j/u.safetensors", b"x" * 1000)
    assert store.get(ref, limit=1000) == b"x" * 1000
    with pytest.raises(BlobTooLarge, match="is 1000 bytes, more than the 999 it may be: not read"):
        store.get(ref, limit=999)


# -- what a worker is sent (fedq/protocol/training.py check_task) ------------------------------


def task(**kw: Any) -> dict[str, Any]:
    spec = parse_spec({"name": "t", "model": "small_cnn", "dataset": "digits",
                       "num_clients": 4, "clients_per_round": 2, "rounds": 1})
    base = TrainRef("abc123", 1, 0, "cpu", spec.to_json(),
                    BlobRef(global_key("abc123", 0), "0" * 64, 10)).to_json()
    return {**base, **kw}


@pytest.mark.parametrize(("data", "reason"), [
    (task(job="../../etc"), "is not a fedq job id"),
    (task(job="a" * 33), "is not a fedq job id"),
    (task(format=1), "task message format 1, this worker speaks"),
    (task(round=-1), "task field 'round'"),
    (task(client="0"), "task field 'client'"),
    (task(queue="cpu/../x"), "is not a queue name"),
    (task(model={"key": "jobs/abc123/../../x", "sha256": "0" * 64, "size": 1}),
     "is not a model key of job abc123"),
    (task(model={"key": global_key("other", 0), "sha256": "0" * 64, "size": 1}),
     "is not a model key of job abc123"),
    (task(model={"key": global_key("abc123", 0), "sha256": "../../x", "size": 1}),
     "is not a blob digest"),
    (task(model={"key": global_key("abc123", 0), "sha256": "b3-../" + "A" * 40, "size": 1}),
     "is not a blob digest"),
    (task(model={"key": global_key("abc123", 0), "sha256": "b3-" + "A" * 42, "size": 1}),
     "is not a blob digest"),
    (task(step={"key": global_key("abc123", 0), "sha256": "0" * 64, "size": 1,
                "base": "/etc/passwd"}), "step base"),
    ([], "task is a list"),
])
def test_check_task(data: Any, reason: str) -> None:
    with pytest.raises(FormatError, match=reason.replace("(", r"\(")):
        check_task(data)


def test_check_task_accepts_what_fedq_sends() -> None:
    check_task(task())
    check_task(task(model={"key": global_key("abc123", 0), "sha256": "b3-" + "_-A9" * 10 + "abc",
                           "size": 1}))  # BLAKE3's form (fedq/digest.py)
    assert TrainRef.from_json(task()).job == "abc123"


def test_worker_paths_stay_in_its_folders(tmp_path: Path) -> None:
    with pytest.raises(FormatError):
        state_path(tmp_path, "../../x", 0)
    assert state_path(tmp_path, "abc", 1).is_relative_to(tmp_path)
    cache = HostCache(tmp_path / "cache")
    with pytest.raises(FormatError, match="is not a blob digest"):
        cache.get(open_store(str(tmp_path / "blobs")), BlobRef("k", "../../victim", 1))


# -- redaction (fedq/redaction.py) ---------------------------------------------------


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:p@ss@h/1", "redis://user:***@h/1"),  # '@' in the password
    ("redis://:pa/ss@h/1", "redis://:***@h/1"),  # '/' in the password, written raw
    ("redis://h:6379/0?password=abc&db=2", "redis://h:6379/0?password=***&db=2"),
    ("postgresql+psycopg://postgres:s%40cret@h:5432/db", "postgresql+psycopg://postgres:***@h:5432/db"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("redis://h:6379", "redis://h:6379"),
    ("not a url", "not a url"),
])
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_redact_text_finds_urls_and_remembered_secrets() -> None:
    assert redact_text("could not reach redis://:p@ss/w@h:1/0: refused") == \
        "could not reach redis://:***@h:1/0: refused"
    remember(["amqp://u:Zebra-Secret-99@h//"])
    assert redact_text("login failed with Zebra-Secret-99") == "login failed with ***"


# -- the version handshake and the worker roster ------------------------------------


def test_roster_refuses_malformed_registrations_and_names_incompatible_workers(
        tmp_path: Path) -> None:
    from fedq.coordinator.roster import list_workers, record_worker

    db = f"sqlite:///{tmp_path / 'f.db'}"
    assert record_worker(db, "x" * 300, ["cpu"], {}).startswith("refused")
    assert record_worker(db, "w", ["cpu", {"a": 1}], {}).startswith("refused")
    assert record_worker(db, "w", ["cpu"], "nope").startswith("refused")
    assert record_worker(db, "new@h", ["cpu"], {"cpus": 2}, "0.1.0", MESSAGE_FORMAT) == "new@h"
    assert record_worker(db, "old@h", ["cpu"], {"cpus": 2}) == "old@h"
    assert record_worker(db, "next@h", ["cpu"], {"cpus": 2}, "9.0", MESSAGE_FORMAT + 1)
    rows = {w["hostname"]: w for w in list_workers(db)}
    assert set(rows) == {"new@h", "old@h", "next@h"}
    assert rows["new@h"]["problem"] is None
    assert "no message format (a fedq from before the version handshake)" in \
        rows["old@h"]["problem"]
    assert f"message format {MESSAGE_FORMAT + 1} (fedq 9.0)" in rows["next@h"]["problem"]


# -- the watchdog's per-job guard (fedq/coordinator/watchdog.py) ---------------------


def test_watchdog_repairs_every_job_whatever_one_does(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose spec cannot be read and one whose repair raises are each recorded
    with their error; the healthy job beside them is repaired in the same pass.
    Delete the try/except in run_watchdog and this fails. The unreadable one (a field
    a newer fedq wrote) is failed once, saying what to do, not reported every pass."""
    from sqlalchemy import select

    from fedq.coordinator.watchdog import run_watchdog
    from fedq.db import Job, Round, WatchdogAction, session_scope, upgrade
    from fedq.db.models import utcnow
    from fedq.settings import get_settings

    monkeypatch.setenv("FEDQ_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:
        settings = get_settings()
        upgrade(settings.database_url)
        spec = parse_spec({"name": "t", "model": "small_cnn", "dataset": "digits",
                           "num_clients": 4, "clients_per_round": 2, "rounds": 2})
        old = utcnow() - timedelta(minutes=5)
        with session_scope(settings.database_url) as s:
            for job_id, body in (("unreadable", {**spec.to_json(), "a_newer_field": 2}),
                                 ("broken", spec.to_json()), ("healthy", spec.to_json())):
                s.add(Job(id=job_id, name="t", spec=body, status="running", total_rounds=2,
                          committed_round=0, global_key=global_key(job_id, 0),
                          global_sha256="0" * 64, global_size=10, updated_at=old))
            s.flush()
            # 'broken': training past its deadline, its plan damaged (two clients, one
            # queue): finalizing it raises
            s.add(Round(job_id="broken", number=1, status="training", attempt=1,
                        deadline=old, started_at=old,
                        planned={"clients": [0, 1], "queues": ["cpu"]}))
        actions = {a["job"]: a for a in run_watchdog(settings)}
        assert actions["unreadable"]["action"] == "error (read)"
        assert actions["broken"]["action"] == "error (repair)"
        assert "ValueError" in actions["broken"]["error"]
        assert actions["healthy"]["action"] == "start"  # its lost start, repaired
        said = actions["unreadable"]["error"]
        assert "cannot read the job's spec: a_newer_field: Extra inputs" in said, said
        assert "`fedq resume unreadable`" in said
        assert "unreadable" not in {a["job"] for a in run_watchdog(settings)}  # once
        with session_scope(settings.database_url) as s:
            recorded = {a.job_id: a for a in s.scalars(select(WatchdogAction))}
            assert recorded["broken"].result == "error"
            assert "ValueError" in (recorded["broken"].error or "")
            assert recorded["healthy"].action == "start"
            job = s.get(Job, "unreadable")
            assert job is not None and job.status == "failed" and job.error == said
    finally:
        get_settings.cache_clear()


def test_sent_derives_the_update_key() -> None:
    assert SENT.update_key == "jobs/j1/r00003/updates/c000002-a1.safetensors"
    assert dataclasses.replace(SENT, attempt=2).update_key.endswith("-a2.safetensors")


def test_doctor_names_an_incompatible_worker(tmp_path: Path) -> None:
    """`fedq doctor --services` on the coordinator's host lists, in one line, a worker
    that registered with another message format."""
    import json
    import os

    from fedq.coordinator.roster import record_worker
    from fedq.settings import load_settings

    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env["FEDQ_HOME"] = str(tmp_path)
    settings = load_settings(env)
    record_worker(settings.database_url, "old@h", ["cpu"], {"cpus": 2}, "0.0.9", 1)
    proc = run_module("fedq.cli", ["doctor", "--services", "--json"], env, 300)
    report = json.loads(proc.stdout)
    assert report["fedq"]["message_format"] == MESSAGE_FORMAT
    assert any(p.startswith("worker old@h: incompatible: it speaks message format 1 (fedq "
                            "0.0.9)") for p in report["problems"]), report["problems"]
    assert proc.returncode == 1
