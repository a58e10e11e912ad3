"""fedq's Redis result backend (fedq/engine/backend.py) on a real Redis: Celery's rule
that a stored SUCCESS is never overwritten, kept, in one round trip."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, states

from fedq.engine.backend import RedisBackend
from fedq.testing.wait import wait_until


@pytest.fixture
def backend(redis_db: str) -> RedisBackend:
    app = Celery("test-backend", broker="memory://")
    app.conf.result_serializer = "json"
    app.conf.result_expires = 600
    return RedisBackend(app=app, url=redis_db)


def _commands(backend: RedisBackend) -> list[str]:
    """The names of the commands ``backend``'s client sends from now on."""
    sent: list[str] = []
    send = backend.client.execute_command

    def recording(*args: Any, **kwargs: Any) -> Any:
        sent.append(str(args[0]).upper())
        return send(*args, **kwargs)

    backend.client.execute_command = recording
    return sent


def test_a_state_is_stored_and_published_in_one_round_trip(backend: RedisBackend,
                                                           redis_db: str) -> None:
    plain = redis.Redis.from_url(redis_db)
    listener = plain.pubsub(ignore_subscribe_messages=True)
    key = backend.get_key_for_task("t1")
    listener.subscribe(key)
    backend.store_result("t0", {"warm": True}, states.STARTED)  # loads the script
    sent = _commands(backend)
    backend.store_result("t1", {"hostname": "w1", "beat": 0}, states.STARTED)
    assert sent == ["EVALSHA"]  # Celery's own path: a GET, then SET and PUBLISH
    stored = json.loads(plain.get(key))
    assert stored["status"] == "STARTED" and stored["result"] == {"hostname": "w1", "beat": 0}
    assert stored["task_id"] == "t1"
    assert 0 < plain.ttl(key) <= 600
    heard = None
    deadline = time.monotonic() + 5
    while heard is None and time.monotonic() < deadline:
        heard = listener.get_message(timeout=0.5)
    assert heard is not None and json.loads(heard["data"]) == stored  # the very value
    assert backend.get_task_meta("t1")["result"] == {"hostname": "w1", "beat": 0}


def test_a_late_state_never_overwrites_a_stored_success(backend: RedisBackend,
                                                        redis_db: str) -> None:
    plain = redis.Redis.from_url(redis_db)
    backend.store_result("t2", {"beat": 3}, states.STARTED)
    backend.store_result("t2", {"answer": 42}, states.SUCCESS)
    # a lost worker's heartbeat, or a re-run's answer, after the task succeeded
    backend.store_result("t2", {"beat": 4}, states.STARTED)
    backend.store_result("t2", {"answer": 0}, states.SUCCESS)
    meta = json.loads(plain.get(backend.get_key_for_task("t2")))
    assert meta["status"] == "SUCCESS" and meta["result"] == {"answer": 42}
    # anything else may be overwritten, and a key holding what is not JSON is replaced
    plain.set(backend.get_key_for_task("t3"), b"\x00not json")
    backend.store_result("t3", {"beat": 0}, states.STARTED)
    backend.store_result("t3", "boom", states.FAILURE)
    assert json.loads(plain.get(backend.get_key_for_task("t3")))["status"] == "FAILURE"


def test_another_serializer_takes_celerys_own_path(redis_db: str) -> None:
    app = Celery("test-backend", broker="memory://")
    app.conf.result_serializer = "yaml"
    app.conf.accept_content = app.conf.result_accept_content = ["json", "yaml"]
    backend = RedisBackend(app=app, url=redis_db)
    sent = _commands(backend)
    backend.store_result("t4", {"beat": 0}, states.STARTED)
    assert sent == ["GET"]  # then Celery's pipeline: SET and PUBLISH
    assert backend.get_task_meta("t4")["status"] == "STARTED"


def test_a_claim_is_stored_unless_the_task_was_revoked_in_one_round_trip(
        backend: RedisBackend, redis_db: str) -> None:
    """A training task's revocation check and claim (fedq/tasks/train.py): what
    ``revoked`` would say, and the claim stored only when it says nothing."""
    from fedq.engine import revoke as revoke_mod
    from fedq.worker.heartbeat import beat_meta

    plain = redis.Redis.from_url(redis_db)
    revoke_mod._mark_redis(backend, ["gone"], "its job was cancelled")  # what revoke stores
    backend.store_result("done", {"answer": 1}, states.SUCCESS)
    assert revoke_mod.revoked(backend, "gone") == "its job was cancelled"
    backend.store_result("warm", {"x": 1}, states.STARTED)
    sent = _commands(backend)
    claim = beat_meta("w1@test", 0)
    why = revoke_mod.revoked_else_claim(backend, "gone", claim, "STARTED")
    assert why == "its job was cancelled"
    assert sent == ["EVALSHA"]
    assert json.loads(plain.get(backend.get_key_for_task("gone")))["status"] == "REVOKED"
    assert revoke_mod.revoked_else_claim(backend, "fresh", claim, "STARTED") is None
    stored = json.loads(plain.get(backend.get_key_for_task("fresh")))
    assert stored["status"] == "STARTED" and stored["result"] == claim
    # a task that succeeded already trains (as before: it was not revoked); SUCCESS kept
    assert revoke_mod.revoked_else_claim(backend, "done", claim, "STARTED") is None
    assert json.loads(plain.get(backend.get_key_for_task("done")))["status"] == "SUCCESS"
    assert len(sent) == 3


def test_a_heartbeat_ends_at_a_stopping_revocation_and_beats_over_any_other(
        backend: RedisBackend, redis_db: str) -> None:
    """A running task's beats (fedq/worker/heartbeat.py): a job cancelled or failed marks
    its tasks ``stop``; the next beat writes nothing, ends the beats and says why, so
    training stops (fedq/worker/update.py). A straggler's revocation (no ``stop``)
    is beaten over as before: it trains on and is recorded late."""
    from fedq.engine import revoke as revoke_mod
    from fedq.worker.heartbeat import claim

    plain = redis.Redis.from_url(redis_db)
    straggler = claim(backend, "late", "w1@test", 0.05)
    with straggler:
        revoke_mod._mark_redis(backend, ["late"], "round 3 committed without it")
        wait_until(lambda: json.loads(plain.get(backend.get_key_for_task("late")))
                   ["status"] == "STARTED", 10, what="the straggler's beat over its mark")
    assert straggler.stopped() is None
    beat = claim(backend, "run", "w1@test", 0.05)
    with beat:
        wait_until(lambda: beat.beats >= 2, 10, what="two beats")
        revoke_mod._mark_redis(backend, ["run"], "its job was cancelled", stop=True)
        why = wait_until(beat.stopped, 10, what="the beat to read the stopping mark")
        after = beat.beats
        time.sleep(0.3)  # six intervals: no beat follows the mark
        assert beat.beats == after
    assert why == "its job was cancelled"
    stored = json.loads(plain.get(backend.get_key_for_task("run")))
    assert stored["status"] == "REVOKED" and stored["stop"] is True
    assert revoke_mod.revoked(backend, "run") == "its job was cancelled"


@pytest.mark.parametrize(("message", "reason"), [
    ({"nested": ["x"] * 3}, "revoked"),  # not a text
    (["a", "b"], "revoked"),  # not what revoke stores (one text)
    (["   "], "revoked"),
    (["line one\nFAKE LOG LINE"], "line one FAKE LOG LINE"),  # one line for the log
    (["x" * 5000], "x" * 200),
])
def test_a_revoked_mark_a_worker_wrote_is_read_as_one_bounded_line(
        backend: RedisBackend, redis_db: str, message: Any, reason: str) -> None:
    """A worker's Redis user can write any task's key: the reason its REVOKED mark
    names reaches the worker's log and its refusal only as one line of at most 200
    characters, or as plain "revoked"."""
    from fedq.engine import revoke as revoke_mod

    plain = redis.Redis.from_url(redis_db)
    plain.set(backend.get_key_for_task("t5"), json.dumps(
        {"status": "REVOKED", "result": {"exc_type": "TaskRevokedError",
                                         "exc_message": message}, "task_id": "t5"}))
    assert revoke_mod.revoked_else_claim(backend, "t5", {"beat": 0}, "STARTED") == reason
    assert json.loads(plain.get(backend.get_key_for_task("t5")))["status"] == "REVOKED"


def test_task_states_are_read_a_batch_of_keys_per_round_trip_and_never_a_huge_one(
        backend: RedisBackend, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``task_metas`` (what a round's finalize and the watchdog read states with): what
    ``get_task_meta`` reads, in order, a PENDING for a task with no state, one round
    trip per ``METAS_PER_READ`` tasks on Redis; a state over ``STATE_BYTES`` (anything a
    worker wrote under its task's key) comes back as its length, unread; the embedded
    default's file backend alike."""
    from celery.backends.filesystem import FilesystemBackend

    import fedq.engine.backend as fb

    monkeypatch.setattr(fb, "METAS_PER_READ", 2)
    monkeypatch.setattr(fb, "STATE_BYTES", 4096)
    file_app = Celery("test-file-backend", broker="memory://")
    file_app.conf.result_serializer = "json"
    on_disk = FilesystemBackend(app=file_app, url=f"file://{tmp_path}")
    ids = ["m0", "m1", "none", "m3", "m4", "huge"]
    for b in (backend, on_disk):
        b.store_result("m0", {"n": 0}, states.SUCCESS)
        b.store_result("m1", {"hostname": "w", "beat": 0}, states.STARTED)
        b.store_result("m3", {"n": 3}, states.SUCCESS)
        b.store_result("m4", {"exc_type": "RuntimeError", "exc_message": ["boom"],
                              "exc_module": "builtins"}, states.FAILURE)
        b.store_result("huge", {"pad": "x" * 100_000}, states.SUCCESS)
    fb.task_metas(backend, ["m0"])  # loads the script
    sent = _commands(backend)
    metas = fb.task_metas(backend, ids)
    assert sent == ["EVALSHA"] * 3  # 6 tasks, 2 a read; get_task_meta: 6 GETs
    sizes = [len(redis.Redis.from_url(backend.url).get(backend.get_key_for_task("huge"))),
             Path(on_disk._filename(on_disk.get_key_for_task("huge")).decode()).stat().st_size]
    for b, got, huge in ((backend, metas, sizes[0]),
                         (on_disk, fb.task_metas(on_disk, ids), sizes[1])):
        assert huge > 100_000
        assert [m["status"] for m in got] == ["SUCCESS", "STARTED", "PENDING", "SUCCESS",
                                              "FAILURE", fb.TOO_LARGE]
        assert got[0]["result"] == {"n": 0} and got[3]["result"] == {"n": 3}
        assert got[2]["result"] is None
        assert got[5] == {"status": fb.TOO_LARGE, "result": None, "bytes": huge}
        for tid, meta in zip(ids[:5], got):
            want = b.get_task_meta(tid, cache=False)
            assert meta["status"] == want["status"]
            assert repr(meta["result"]) == repr(want["result"])


def test_a_state_that_does_not_decode_is_no_answer_for_that_task_alone(
        backend: RedisBackend, tmp_path: Any) -> None:
    """Whoever can write a task's key can write anything there. Each of the six forms
    Celery's ``decode_result`` raises on (not JSON, a list, no status, nested 100,000
    deep, a kombu marker that does not parse, an exception state naming os.system)
    comes back from ``task_metas`` as ``UNDECODABLE`` with the reason, and the tasks
    beside it are read as ever, on Redis and on the embedded default's file backend.
    Remove the guard in decode_state and this raises."""
    from celery.backends.filesystem import FilesystemBackend

    import fedq.engine.backend as fb
    from tests.hostile import UNDECODABLE

    file_app = Celery("test-file-backend", broker="memory://")
    file_app.conf.result_serializer = "json"
    on_disk = FilesystemBackend(app=file_app, url=f"file://{tmp_path}")
    ids = [f"bad{n}" for n in range(len(UNDECODABLE))]
    for b in (backend, on_disk):
        b.store_result("before", {"n": 1}, states.SUCCESS)
        for tid, value in zip(ids, UNDECODABLE):
            b.set(b.get_key_for_task(tid), value)
        b.store_result("after", {"n": 2}, states.SUCCESS)
        got = fb.task_metas(b, ["before", *ids, "after"])
        assert got[0]["result"] == {"n": 1} and got[-1]["result"] == {"n": 2}
        bad = got[1:-1]
        assert {m["status"] for m in bad} == {fb.UNDECODABLE}, bad
        reasons = [fb.unread_reason(m) or "" for m in bad]
        assert all(r.startswith("the stored state does not decode (") for r in reasons)
        assert {r.split("(")[1].split(":")[0] for r in reasons} >= {
            "DecodeError", "TypeError", "KeyError", "SecurityError"}, reasons
