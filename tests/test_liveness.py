"""Lost workers (fedq/coordinator/liveness.py, fedq/worker/heartbeat.py): the claim a
training task writes, read with bounds; the heartbeat thread; the coordinator's own
clock for when a heartbeat moved. The whole path, with real workers killed and paused,
is in tests/test_faults.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from fedq.cli import main
from fedq.coordinator import liveness
from fedq.db import Claim, Job, Worker, session_scope, upgrade
from fedq.db.models import utcnow
from fedq.engine.names import LOST_REASON
from fedq.protocol.envelope import Beat, read_claim
from fedq.settings import get_settings
from fedq.worker.heartbeat import Heartbeat

SPEC = {"name": "t", "model": "small_cnn", "dataset": "digits", "num_clients": 4,
        "clients_per_round": 2, "rounds": 1}


@pytest.mark.parametrize(("meta", "expected"), [
    ({"status": "STARTED", "result": {"hostname": "w1@a", "pid": 3, "beat": 2}},
     Beat("w1@a", 2)),
    ({"status": "PENDING", "result": None}, None),  # queued, not started
    ({"status": "SUCCESS", "result": {"hostname": "w1@a", "beat": 2}}, None),  # finished
    ({"status": "STARTED", "result": {"hostname": "", "beat": 2}}, None),
    ({"status": "STARTED", "result": {"hostname": "h" * 201, "beat": 2}}, None),
    ({"status": "STARTED", "result": {"hostname": ["w1"], "beat": 2}}, None),
    ({"status": "STARTED", "result": {"hostname": "w1@a", "beat": True}}, None),
    ({"status": "STARTED", "result": {"hostname": "w1@a", "beat": -1}}, None),
    ({"status": "STARTED", "result": {"hostname": "w1@a", "beat": 2**40}}, None),
    ({"status": "STARTED", "result": {"hostname": "w1@a", "beat": 1.5}}, None),
    ({"status": "STARTED", "result": "w1@a"}, None),
    ("STARTED", None),
])
def test_a_claim_is_read_with_bounds(meta: Any, expected: Beat | None) -> None:
    assert read_claim(meta) == expected


def test_heartbeat_beats_while_the_work_runs_and_never_after() -> None:
    written: list[dict[str, Any]] = []
    with Heartbeat(written.append, "w1@a", 0.05) as beat:
        assert written[0]["beat"] == 0 and written[0]["hostname"] == "w1@a"  # the claim
        time.sleep(0.3)
    after = len(written)
    assert after >= 3 and [w["beat"] for w in written] == list(range(after))
    time.sleep(0.2)
    assert len(written) == after == beat.beats  # stopped and joined: no beat after exit
    assert not [t for t in threading.enumerate() if t.name == "fedq-heartbeat"]


def test_a_heartbeat_whose_claim_is_stored_goes_on_from_it() -> None:
    """The training task stores its claim with its revocation check (one round trip,
    fedq/engine/revoke.py): its heartbeat writes nothing on entry and counts on."""
    written: list[dict[str, Any]] = []
    with Heartbeat(written.append, "w1@a", 0.05, written=True):
        assert written == []
        time.sleep(0.2)
    assert written and [w["beat"] for w in written] == list(range(1, len(written) + 1))


def test_a_failing_heartbeat_never_fails_the_task() -> None:
    def broken(meta: dict[str, Any]) -> None:
        raise ConnectionError("backend down")

    with Heartbeat(broken, "w1@a", 0.05) as beat:
        time.sleep(0.15)
    assert beat.beats == 0


def test_silence_is_timed_by_the_coordinators_clock(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat that moves resets the silence; one that stands still grows it; a
    task no longer waited for is forgotten. Nothing of the worker's clock is used."""
    monkeypatch.setenv("FEDQ_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:
        settings = get_settings()
        upgrade(settings.database_url)
        with session_scope(settings.database_url) as s:
            s.add(Job(id="j", name="t", spec=SPEC, status="running", total_rounds=1,
                      committed_round=0, global_key="k", global_sha256="0" * 64,
                      global_size=1))
        backend = {"t1": {"status": "STARTED", "result": {"hostname": "w1@a", "beat": 0}},
                   "t2": {"status": "STARTED", "result": {"hostname": "w2@a", "beat": 0}},
                   "t3": {"status": "PENDING", "result": None}}
        t0 = utcnow()

        def look(seconds: float, tasks: dict[str, int]) -> dict[str, float]:
            holders = liveness.observe(settings, "j", tasks, t0 + timedelta(seconds=seconds),
                                       meta=backend.__getitem__)
            return {h.task_id: h.silent_s for h in holders}

        tasks = {"t1": 0, "t2": 1, "t3": 2}
        assert look(0, tasks) == {"t1": 0.0, "t2": 0.0}  # t3 is queued: no claim
        with session_scope(settings.database_url) as s:  # both recorded lost (sites)
            s.add_all([Worker(hostname=h, queues=["site.x"], hardware={}, available=False,
                              away_reason=LOST_REASON) for h in ("w1@a", "w2@a")])
        backend["t1"]["result"] = {"hostname": "w1@a", "beat": 1}
        assert look(10, tasks) == {"t1": 0.0, "t2": 10.0}
        with session_scope(settings.database_url) as s:  # w1's heartbeat moved: back
            assert [(w.hostname, w.available) for w in s.query(Worker).order_by(
                Worker.hostname)] == [("w1@a", None), ("w2@a", False)]
        assert look(20, tasks) == {"t1": 10.0, "t2": 20.0}
        liveness.mark_resent(settings, ["t2"])
        holders = liveness.observe(settings, "j", {"t1": 0}, t0 + timedelta(seconds=21),
                                   meta=backend.__getitem__)
        assert [(h.task_id, h.resent) for h in holders] == [("t1", False)]
        with session_scope(settings.database_url) as s:  # t2 is no longer waited for
            assert [c.task_id for c in s.query(Claim)] == ["t1"]
        line = liveness.describe(liveness.Holder("t2", 1, "w2@a", 18.4, True), 15.0)
        assert line == "client 1 on w2@a: heartbeat lost 18 s ago, re-dispatched"
        shown = CliRunner().invoke(main, ["status", "j"])  # what the round waits for
        assert shown.exit_code == 0, shown.output
        assert "client 0 on w1@a: training, heartbeat" in shown.output
        with session_scope(settings.database_url) as s:
            s.get(Job, "j").status = "completed"  # type: ignore[union-attr]
        liveness.forget_stopped(settings)
        assert liveness.held(settings, "j") == []
    finally:
        get_settings.cache_clear()


def test_two_watchdog_passes_at_once_repair_once(redis_cluster: Any) -> None:
    """A watchdog pass holds the database-wide pass lock (watchdog.single_pass): a
    second pass started while one runs does nothing, so a lost client is never sent
    twice by two passes (beat's tick landing on two control processes). Here a job
    whose round no worker takes needs repairing; a pass run inside another's lock
    does nothing, the next one repairs. Remove single_pass from run_watchdog and the
    nested pass repairs too: this fails."""
    import json
    import subprocess
    import sys

    from fedq.testing.cluster import DIGITS

    cluster = redis_cluster
    job = cluster.submit({**DIGITS, "rounds": 1, "round_timeout_s": 1})
    time.sleep(2.5)  # its round's deadline passed; no worker ever ran
    script = (
        "import json\n"
        "from fedq.settings import get_settings\n"
        "from fedq.coordinator.watchdog import run_watchdog, single_pass\n"
        "s = get_settings()\n"
        "with single_pass(s) as mine:\n"
        "    nested = run_watchdog(s)\n"
        "after = run_watchdog(s)\n"
        "print(json.dumps({'mine': mine, 'nested': nested,\n"
        "                  'after': [a['job'] for a in after]}))\n")
    proc = subprocess.run([sys.executable, "-c", script], env=cluster.env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["mine"] is True and got["nested"] == [], got
    assert job in got["after"], got
