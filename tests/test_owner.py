"""The owner comes first (fedq/worker/owner.py): the run policy's probes and its watch,
a training loop that stops at the next step, the coordinator's handling of a yielded
task, and real workers that step aside for real CPU load and for a time window, let
the job finish elsewhere, and come back.

The CPU-load and time-window conditions use real load and the real clock; the input
and battery probes read a folder laid out as Linux's /dev/input and
/sys/class/power_supply (this machine has neither), through the same code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import select

from bench.owners import stopped_after
from fedq.cli import main
from fedq.coordinator.policy import RoundState, Wait, absorb_status, decide
from fedq.coordinator.roster import availability
from fedq.db import ClientUpdate, session_scope
from fedq.db.models import utcnow
from fedq.errors import ConfigError
from fedq.protocol.training import UpdateRef
from fedq.settings import get_settings
from fedq.spec import OptimizerSpec
from fedq.status import FAILED_UPDATES, UpdateStatus
from fedq.testing.cluster import DIGITS, Cluster, record, record_outcome
from fedq.testing.procs import run_module
from fedq.testing.wait import wait_until
from fedq.worker import owner
from fedq.worker.loop import local_train
from fedq.worker.owner import CpuLoad, Policy, Watch, in_window, parse_days, parse_window

# -- the probes and the policy ---------------------------------------------------------


def test_windows_and_days_parse_and_wrap_midnight() -> None:
    assert parse_window("22:00-07:00") == (22 * 3600, 7 * 3600)
    assert parse_window("09:30:15 - 17:00") == (9 * 3600 + 30 * 60 + 15, 17 * 3600)
    assert parse_days("mon-fri") == frozenset(range(5))
    assert parse_days("sat,sun") == frozenset({5, 6})
    assert parse_days("fri-mon") == frozenset({4, 5, 6, 0})
    night = parse_window("22:00-07:00")
    weekdays = parse_days("mon-fri")
    assert in_window(datetime(2026, 11, 23, 23, 0), night, weekdays)  # Monday night
    assert in_window(datetime(2026, 11, 24, 6, 59), night, weekdays)  # ... its morning
    assert not in_window(datetime(2026, 11, 24, 7, 0), night, weekdays)
    assert not in_window(datetime(2026, 11, 28, 23, 0), night, weekdays)  # Saturday
    assert in_window(datetime(2026, 11, 28, 3, 0), night, weekdays)  # Friday's night
    assert not in_window(datetime(2026, 11, 30, 3, 0), night, weekdays)  # Sunday's
    for bad, says in (("22-07", "not a window"), ("10:00-10:00", "starts where it ends"),
                      ("25:00-07:00", "not a window")):
        with pytest.raises(ConfigError, match=says):
            parse_window(bad)
    with pytest.raises(ConfigError, match="FEDQ_RUN_DAYS: 'mo-fri' is not a day"):
        parse_days("mo-fri")


def _supply(root: Path, name: str, kind: str, online: str | None) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "type").write_text(kind + "\n")
    if online is not None:
        (root / name / "online").write_text(online + "\n")


def test_power_and_input_probes_read_linux_layouts(tmp_path: Path) -> None:
    power = tmp_path / "power_supply"
    assert owner.on_mains(power) is None  # nothing to read: treated as mains
    _supply(power, "BAT0", "Battery", None)
    _supply(power, "AC", "Mains", "0")
    assert owner.on_mains(power) is False
    (power / "AC" / "online").write_text("1\n")
    assert owner.on_mains(power) is True
    inputs = tmp_path / "input"
    inputs.mkdir()
    assert owner.input_idle_s(inputs) is None  # no devices: cannot tell
    (inputs / "event3").write_text("")
    old = time.time() - 600
    os.utime(inputs / "event3", (old, old))
    assert 590 < owner.input_idle_s(inputs) < 700  # type: ignore[operator]
    (inputs / "event3").touch()  # the owner pressed a key
    assert owner.input_idle_s(inputs) < 5  # type: ignore[operator]


def _fake(folder: Path, name: str, script: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n" + script)
    (folder / name).chmod(0o755)


def test_without_input_devices_idle_comes_from_logind_or_ioreg(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /dev/input has no devices (a container, a remote-desktop session), the
    idle time is logind's (IdleHint/IdleSinceHint of the user sessions, greeters
    ignored) or, on macOS, IOKit's HIDIdleTime; no logind at all: cannot tell. The
    commands are fakes on PATH (this machine runs neither logind nor macOS)."""
    bin_dir, inputs = tmp_path / "bin", tmp_path / "input"
    inputs.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(owner, "PLATFORM_IDLE_EVERY_S", 0.0)
    since = int((time.time() - 700) * 1e6)

    def logind(sessions: str, shown: str) -> None:
        _fake(bin_dir, "loginctl", f'if [ "$1" = list-sessions ]; then printf "{sessions}"; '
                                   f'else printf "{shown}"; fi\n')

    logind("c1 1000 alice seat0 tty2\\n c2 120 gdm seat0 tty1\\n",
           f"Class=user\\nIdleHint=yes\\nIdleSinceHint={since}\\n\\n"
           f"Class=greeter\\nIdleHint=no\\nIdleSinceHint=0\\n")
    assert 690 < owner.input_idle_s(inputs) < 720  # type: ignore[operator]
    probe = owner.probes(owner.Policy(input_dir=inputs))[0]
    assert probe.works and probe.reads.startswith("logind IdleHint over 1 user session(s)")
    watch = owner.Watch(owner.Policy(when="idle", idle_after_s=600, input_dir=inputs))
    assert watch.check() is None  # idle for 700 s > 10 min: may train
    logind("c1 1000 alice seat0 tty2\\n", "Class=user\\nIdleHint=no\\nIdleSinceHint=0\\n")
    assert owner.input_idle_s(inputs) == 0.0  # alice is at the machine
    assert watch.check() == "owner active (input 0 s ago)"
    logind("", "")
    assert owner.input_idle_s(inputs) == float("inf")  # no one is logged in
    (bin_dir / "loginctl").unlink()
    assert owner.platform_idle_s() == (None, "no logind (loginctl) answers here")
    assert owner.input_idle_s(inputs) is None and watch.check() is None  # cannot tell
    # macOS: IOHIDSystem's HIDIdleTime in nanoseconds
    _fake(bin_dir, "ioreg", 'printf \'  |   "HIDIdleTime" = 42000000000\\n\'\n')
    assert owner._hid_idle_s() == (42.0, "macOS IOHIDSystem HIDIdleTime")
    # evdev devices, when there are any, come first
    (inputs / "event0").write_text("")
    assert owner.input_idle_s(inputs) < 5  # type: ignore[operator]


def test_the_watch_steps_aside_at_once_and_returns_after_the_conditions_held(
        tmp_path: Path) -> None:
    power = tmp_path / "power"
    _supply(power, "AC", "Mains", "1")
    _supply(power, "BAT0", "Battery", None)
    inputs = tmp_path / "input"
    inputs.mkdir()
    (inputs / "event0").write_text("")
    old = time.time() - 3600
    os.utime(inputs / "event0", (old, old))
    changes: list[str | None] = []
    watch = Watch(Policy(when="idle", idle_after_s=60, ac_only=True, resume_after_s=0.3,
                         input_dir=inputs, power_dir=power), listeners=[changes.append])
    watch.tick()
    assert watch.reason is None and changes == []
    (power / "AC" / "online").write_text("0")  # unplugged
    watch.tick()
    assert watch.reason == "on battery" and changes == ["on battery"]
    (power / "AC" / "online").write_text("1")
    watch.tick()
    assert watch.reason == "on battery"  # not yet: the conditions must hold a while
    time.sleep(0.35)
    watch.tick()
    assert watch.reason is None and changes == ["on battery", None]
    (inputs / "event0").touch()  # the owner is back at the keyboard
    watch.tick()
    assert watch.reason is not None and watch.reason.startswith("owner active")


def test_a_schedule_outside_its_window_keeps_the_worker_away() -> None:
    now = datetime(2026, 11, 25, 12, 0)
    policy = Policy(when="schedule", window=parse_window("22:00-07:00"), resume_after_s=0)
    assert Watch(policy, clock=lambda: now).check() == "outside 22:00-07:00"
    assert Watch(policy, clock=lambda: now.replace(hour=23)).check() is None


def _spin(*argv: str) -> subprocess.Popen[bytes]:
    """A process that keeps one CPU busy (the owner's program), named by ``argv``."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass", *argv])


@pytest.mark.quiet
def test_other_cpu_counts_the_owners_programs_not_fedqs_workers() -> None:
    ncpu = os.cpu_count() or 1
    load = CpuLoad()

    def settle() -> float:
        reading = None
        for _ in range(8):
            time.sleep(owner.TICK_S)
            reading = load.read()
        assert reading is not None
        return reading

    def measure() -> tuple[float, float]:
        fedq_like = _spin("celery", "-A", "fedq", "worker")  # another fedq worker: not the owner
        try:
            ours = settle()
        finally:
            fedq_like.kill()
            fedq_like.wait()
        owners = _spin()
        try:
            theirs = settle()
        finally:
            owners.kill()
            owners.wait()
        return theirs, ours

    # The reading is machine-wide: the test suite's own processes beside it are "other
    # programs" too, and their load moves. Up to three tries; without the exclusion of
    # fedq's workers every try reads the spinning fedq-like process as the owner's.
    one_core = 100 / ncpu
    for _ in range(3):
        theirs, ours = measure()
        if theirs > 0.7 * one_core and ours < theirs - 0.5 * one_core:
            break
    assert theirs > 0.7 * one_core, (theirs, ours)
    assert ours < theirs - 0.5 * one_core, (theirs, ours)


def test_the_training_loop_stops_at_the_next_step_when_asked() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    asked: list[int] = []

    def stop() -> str | None:
        asked.append(1)
        return "owner active" if len(asked) > 3 else None

    stats = local_train(model, x, y, optimizer=OptimizerSpec(name="sgd", lr=0.1),
                        batch_size=8, epochs=2, steps=None, seed=1,
                        device=torch.device("cpu"), should_stop=stop)
    assert (stats.steps, stats.planned_steps, stats.seen) == (3, 16, 24)
    assert stats.yielded == "owner active"


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_loop_that_yielded_goes_on_from_where_it_stopped_as_if_never_stopped(
        name: str, tmp_path: Path) -> None:
    """Leave in memory: a loop stopped at step 5 of 16 (mid-epoch) keeps its model,
    optimizer state, batch order and generator on the CPU; resumed with them, it ends
    with the very weights of a loop that never stopped."""
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    spec = OptimizerSpec(name=name, lr=0.1)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    def train(model: torch.nn.Module, **kw: object) -> Any:
        return local_train(model, x, y, optimizer=spec, batch_size=12, epochs=3, steps=None,
                           seed=1, device=torch.device("cpu"), **kw)  # type: ignore[arg-type]

    whole = fresh()
    assert train(whole).steps == 18
    asked: list[int] = []
    stopped = fresh()
    first = train(stopped, should_stop=lambda: "on battery" if len(asked.append(1) or asked)
                  > 8 else None)
    assert first.yielded == "on battery" and first.steps == 8 and first.kept is not None
    assert first.kept.start == 24 and first.kept.step == 8  # batch 3 of the second epoch
    # FEDQ_LEAVE_ON_DISK: the same record through its file (before the resume below,
    # which trains on in the record's optimizer tensors)
    from fedq.worker import kept as kept_file

    key = ("abc123", 4, "ab" * 32)
    kept_file.save(tmp_path, key, first.kept)
    back = kept_file.load(tmp_path, key)
    assert back is not None and not kept_file.path_for(tmp_path, key).exists()
    resumed = fresh()  # the task's starting weights again: the kept ones replace them
    second = train(resumed, resume=first.kept)
    assert (second.steps, second.resumed_steps, second.seen) == (18, 8, 3 * 64)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(next(stopped.parameters()), next(whole.parameters()))
    from_disk = fresh()  # a restarted worker, from the file
    third = train(from_disk, resume=back)
    assert (third.steps, third.resumed_steps) == (18, 8)
    for a, b in zip(whole.parameters(), from_disk.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_yielded_task_resumes_on_the_same_worker_and_sends_the_same_update(
        tmp_path: Path, worker_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's side (fedq/worker/update.py): a task that yields with too little
    done keeps its training in memory (keyed by job, client and global model); the
    same task sent again goes on from there and sends the update an unstopped task
    sends, byte for byte. FEDQ_LEAVE_IN_MEMORY=0 starts over; with FEDQ_LEAVE_ON_DISK=1
    a restarted worker goes on from the file; another global model does not match what
    was kept. (The owner's reading is faked: it is the input or
    battery probe, which this machine cannot produce.)"""
    from fedq.blobs import global_key, open_store
    from fedq.coordinator.evaluation import initial_weights
    from fedq.coordinator.intake import Sent
    from fedq.process import PROCESS
    from fedq.spec import JobSpec
    from fedq.weights import dumps
    from fedq.worker.update import run_training

    spec = JobSpec.model_validate({**DIGITS, "num_clients": 4, "clients_per_round": 2,
                                   "rounds": 1, "local_epochs": 2, "batch_size": 16,
                                   "optimizer": {"name": "sgd", "lr": 0.05,
                                                 "momentum": 0.9}})
    store = open_store(str(tmp_path / "blobs"))
    blob = store.put(global_key("j", 0), dumps(initial_weights(spec)))
    task = Sent("j", 1, 1, 1, 5, "cpu").train_ref(spec.to_json(), blob).to_json()
    PROCESS.clear()
    steps_asked: list[int] = []
    monkeypatch.setattr(owner, "away", lambda: None)
    whole = run_training(task, store, "w")
    assert whole["status"] == "ok" and whole["steps"] > 8

    def unplugged_after(n: int) -> None:
        steps_asked.clear()
        monkeypatch.setattr(owner, "away", lambda: "on battery" if len(
            steps_asked.append(1) or steps_asked) > n + 1 else None)  # (+1: at the start)

    unplugged_after(4)
    first = run_training(task, store, "w")
    assert first["status"] == "yielded" and "after 4 of" in first["error"]
    assert len(PROCESS.kept) == 1
    unplugged_after(10_000)  # plugged in again: sent again; it trains only what is left
    again = run_training({**task, "attempt": 2}, store, "w")
    assert again["status"] == "ok" and again["sha256"] == whole["sha256"]
    assert again["steps"] == whole["steps"] and not PROCESS.kept
    assert len(steps_asked) == 1 + whole["steps"] - 4
    # a kept task yielded again says how much it carried
    unplugged_after(3)
    run_training(task, store, "w")
    unplugged_after(2)
    twice = run_training(task, store, "w")
    assert "after 5 of" in twice["error"] and "(3 of them kept from before)" in twice["error"]
    @contextlib.contextmanager
    def setting(name: str, value: str) -> Iterator[None]:
        """The worker's settings with ``name`` set, from an empty process cache."""
        PROCESS.clear()
        monkeypatch.setenv(name, value)
        get_settings.cache_clear()
        try:
            yield
        finally:
            monkeypatch.delenv(name)
            get_settings.cache_clear()

    with setting("FEDQ_LEAVE_IN_MEMORY", "0"):
        unplugged_after(4)
        run_training(task, store, "w")
        assert not PROCESS.kept  # not kept: it starts over
    # FEDQ_LEAVE_ON_DISK=1: a worker restarted (nothing in memory) goes on from the
    # file; a file it cannot read is dropped and the task starts over
    with setting("FEDQ_LEAVE_ON_DISK", "1"):
        unplugged_after(4)
        run_training(task, store, "w")
        [path] = (worker_home / "kept").glob("*.safetensors")
        PROCESS.clear()  # the worker restarted
        unplugged_after(10_000)
        restarted = run_training({**task, "attempt": 2}, store, "w")
        assert restarted["sha256"] == whole["sha256"] and not path.exists()
        assert len(steps_asked) == 1 + whole["steps"] - 4  # it trained only what was left
        unplugged_after(4)
        run_training(task, store, "w")
        path.write_bytes(path.read_bytes()[:-9])  # cut short
        PROCESS.clear()
        unplugged_after(10_000)
        over = run_training({**task, "attempt": 2}, store, "w")
        assert over["sha256"] == whole["sha256"] and not path.exists()
        assert len(steps_asked) == 1 + whole["steps"]  # from the start
    unplugged_after(4)
    run_training(task, store, "w")
    other = store.put(global_key("j", 1), dumps({k: v + 0.01 if v.is_floating_point() else v
                                                 for k, v in initial_weights(spec).items()}))
    monkeypatch.setattr(owner, "away", lambda: None)
    moved_on = run_training(Sent("j", 1, 1, 2, 5, "cpu").train_ref(spec.to_json(), other)
                            .to_json(), store, "w")
    assert moved_on["status"] == "ok" and len(PROCESS.kept) == 1  # another model: kept still
    PROCESS.clear()


def test_a_yielded_task_is_not_a_failure_and_its_client_goes_again() -> None:
    assert absorb_status("yielded", False, True, 1, 5, 0, None) == \
        (UpdateStatus.YIELDED, None)
    assert UpdateStatus.YIELDED not in FAILED_UPDATES
    state = RoundState(job="j", number=1, gen=1, attempt=1, clients=(0, 1), deadline=None,
                       quorum=2, max_redispatch=2)
    ok = UpdateRef(status="ok", job="j", round=1, client=0, queue="cpu", worker="w",
                   key="k", sha256="0" * 64)
    yielded = UpdateRef(status="yielded", job="j", round=1, client=1, queue="cpu",
                        worker="w", error="on battery: not started")
    decision = decide(state, {0: ok, 1: yielded}, utcnow())
    assert not isinstance(decision, Wait)  # settled for this attempt: sent again now
    assert list(decision.clients) == [1]  # type: ignore[union-attr]


def test_a_policy_it_cannot_read_is_one_line_from_doctor(tmp_path: Path) -> None:
    env = {"FEDQ_HOME": str(tmp_path), "FEDQ_RUN_WHEN": "schedule",
           "FEDQ_RUN_WINDOW": "22-07"}
    get_settings.cache_clear()
    shown = CliRunner().invoke(main, ["doctor"], env=env)
    assert shown.exit_code == 1
    assert "FEDQ_RUN_WINDOW: '22-07' is not a window such as 22:00-07:00" in shown.output
    env["FEDQ_RUN_WINDOW"] = "22:00-07:00"
    get_settings.cache_clear()
    shown = CliRunner().invoke(main, ["doctor", "--json"], env=env)
    get_settings.cache_clear()
    report = json.loads(shown.output)
    assert report["owner"]["policy"].startswith("inside 22:00-07:00")
    assert [p["name"] for p in report["owner"]["probes"]] == \
        ["input idle", "power", "other CPU", "other GPU"]


# -- real workers ----------------------------------------------------------------------

POLITE = {"FEDQ_TEST_SLOWDOWN": "40", "FEDQ_RESUME_AFTER_S": "2"}
# 20 local epochs: a few seconds on the steady worker, minutes at FEDQ_TEST_SLOWDOWN=40
OWNER_JOB = {**DIGITS, "name": "owner", "num_clients": 2, "clients_per_round": 2,
             "min_clients": 2, "rounds": 1, "local_epochs": 20, "max_redispatch": 3,
             "round_timeout_s": 300}


def _received(cluster: Cluster, name: str) -> bool:
    return re.search(rb"Task fedq\.train\[[^\]]+\] received",
                     cluster.by_name(name).log_path.read_bytes()) is not None


def _owners_wait(pid: int, since: float) -> float:
    """Seconds from ``since`` until the worker ``pid`` stopped training (bench.owners'
    measure, over half a second here: the test's own processes share the cores)."""
    return stopped_after(pid, since, limit=60.0, window=0.5)


def _rows(cluster: Cluster, job: str) -> list[ClientUpdate]:
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        rows = list(s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job)
                              .order_by(ClientUpdate.client, ClientUpdate.attempt)))
        s.expunge_all()
        return rows


@pytest.mark.slow
@pytest.mark.quiet
def test_a_worker_steps_aside_for_cpu_load_and_the_job_completes_elsewhere(
        redis_cluster: Cluster) -> None:
    """The owner starts a program that keeps a core busy while the polite worker
    trains: it yields at the next step (too little done to send), consumes nothing
    while the load lasts, the watchdog re-sends its client, the steady worker trains
    it, and the polite worker comes back when the load ends."""
    cluster = redis_cluster
    cluster.start(control=["control"])
    cluster.start_beat()
    ncpu = os.cpu_count() or 1
    # the owner's programs keep every core busy, six processes a core (so that they
    # hold ~85% of the machine beside a training fedq worker); fedq steps aside above
    # 75% (fedq's CLI and the test's own processes starting can cross it too: the
    # polite worker then comes back, and the test waits)
    polite = cluster.add("polite", ["cpu"], **POLITE, FEDQ_PARTIAL_MIN="1",
                         FEDQ_MAX_OTHER_CPU="75")
    job = cluster.submit(OWNER_JOB)
    wait_until(lambda: _received(cluster, "polite"), 120, what=polite.tail)
    time.sleep(1.0)  # training, slowly
    loads = [_spin() for _ in range(6 * ncpu)]
    started = time.monotonic()
    try:
        assert polite.proc is not None
        waited = _owners_wait(polite.proc.pid, started)
        wait_until(lambda: b"stepping aside: other programs use" in polite.log_path.read_bytes(),
                   10, what=polite.tail)
        cluster.add("steady", ["cpu"])  # the job goes on without the polite worker
        view = cluster.wait(job, timeout=240)
        assert view.status == "completed", view.error
    finally:
        for load in loads:
            load.kill()
            load.wait()
    rows = _rows(cluster, job)
    shown = [(r.client, r.attempt, r.status, r.worker, r.error) for r in rows]
    done = {r.client: r for r in rows if r.status == UpdateStatus.OK}
    assert sorted(done) == [0, 1] and all(r.worker == "steady@test" for r in done.values())
    # what the polite worker took, it yielded; each such client was sent again (a later
    # attempt) and trained once (one ok row per client)
    log = polite.log_path.read_text()
    took = {(int(c), int(a)) for c, a in re.findall(rf"fedq-{job}-g\d+-r1-c(\d+)-a(\d+)\] "
                                                     r"received", log)}
    assert took and log.count("'status': 'yielded'") == len(took), log[-3000:]
    assert "yielded: other programs use" in log
    for client, attempt in took:
        assert done[client].attempt > attempt, shown
    wait_until(lambda: b"training resumes" in polite.log_path.read_bytes(), 30,
               what=polite.tail)

    def bands() -> list[tuple[object, bool, str | None]] | None:
        seen = availability(cluster.env["FEDQ_DATABASE_URL"]).get("polite@test") or []
        return seen if len(seen) >= 3 else None

    changes = wait_until(bands, 20)
    assert [a for _, a, _ in changes][:3] == [True, False, True], changes
    plots = cluster.home / "plots"  # the polite worker's band in fedq plot
    written = cluster.fedq("plot", job, "--out", str(plots), "--format", "png").stdout
    assert f"{job}-availability.png" in written and (plots / f"{job}-availability.png").exists()
    run = run_module("fedq.cli", ["workers"], {**cluster.env, "COLUMNS": "300"}, 120)
    run.check_returncode()
    shown = run.stdout
    line = next(x for x in shown.splitlines() if "polite@test" in x)
    # live, or away again where the machine's other load crossed 75% since (a loaded CI)
    assert "cpu" in line and ("live" in line or "away: other programs use" in line), shown
    record("owners", condition="other programs' CPU (a busy process)",
           outcome="yielded, re-sent, trained elsewhere; came back",
           owners_wait_s=round(waited, 3))
    record_outcome("a polite worker steps aside mid-task for other programs' CPU (Redis)",
                   "six busy processes a core while it trains", "yielded (nothing sent), "
                   "sent again, trained once elsewhere; it consumed again after the load",
                   1, 0)


@pytest.mark.slow
def test_a_worker_stops_at_the_end_of_its_window_with_a_partial_update(
        redis_cluster: Cluster) -> None:
    """The polite worker may train until a window's end a few seconds away: when it
    closes mid-task the worker uploads what it did (FEDQ_PARTIAL_MIN=0) with the samples
    it processed, and takes nothing more while outside the window."""
    cluster = redis_cluster
    cluster.start(control=["control"])
    cluster.start_beat()
    end = datetime.now() + timedelta(seconds=40)
    window = f"{(end - timedelta(hours=2)):%H:%M:%S}-{end:%H:%M:%S}"
    polite = cluster.add("polite", ["cpu"], **POLITE, FEDQ_PARTIAL_MIN="0",
                         FEDQ_RUN_WHEN="schedule", FEDQ_RUN_WINDOW=window)
    job = cluster.submit(OWNER_JOB)
    wait_until(lambda: _received(cluster, "polite"), 30, what=polite.tail)
    wait_until(lambda: b"stepping aside: outside" in polite.log_path.read_bytes(), 60,
               what=polite.tail)
    closed = time.monotonic() - (datetime.now() - end).total_seconds()  # the window's end
    assert polite.proc is not None
    waited = _owners_wait(polite.proc.pid, closed)
    cluster.add("steady", ["cpu"])
    view = cluster.wait(job, timeout=240)
    assert view.status == "completed", view.error
    rows = _rows(cluster, job)
    partial = [r for r in rows if r.status == UpdateStatus.OK and r.worker == "polite@test"]
    assert len(partial) == 1 and partial[0].yielded, \
        [(r.client, r.status, r.worker, r.yielded, r.steps) for r in rows]
    assert 0 < partial[0].processed < 20 * partial[0].samples  # less than its 20 epochs
    steady = [r for r in rows if r.status == UpdateStatus.OK and r.worker == "steady@test"]
    assert len(steady) == 1 and not steady[0].yielded
    log = polite.log_path.read_bytes()
    taken = re.findall(rb"Task fedq\.train\[[^\]]+\] received", log)
    assert len(taken) == 1, log[-3000:]  # nothing taken outside the window
    record("owners", condition="end of the run window (the real clock)",
           outcome="partial update sent; nothing taken outside the window",
           owners_wait_s=round(waited, 3))
    record_outcome("a polite worker's run window ends mid-task (Redis)", "the real clock "
                   "passes the end of FEDQ_RUN_WINDOW", "partial update sent and counted "
                   "once; nothing taken outside the window; completed", 1, 0)


def test_availability_is_kept_for_fedq_workers_and_prometheus(tmp_path: Path) -> None:
    """A worker's reports (typed and bounded on arrival) become its row, its history
    and the fedq_worker_available gauge."""
    from fedq.coordinator.roster import list_workers, record_availability
    from fedq.db import upgrade
    from fedq.observe.metrics import FedqCollector
    from fedq.settings import load_settings

    settings = load_settings({"FEDQ_HOME": str(tmp_path)})
    upgrade(settings.database_url)
    db = settings.database_url
    assert record_availability(db, "w1@a", True, None) == "w1@a"
    assert record_availability(db, "w1@a", False, "on battery") == "w1@a"
    assert record_availability(db, "w2@a", True, "ignored while available") == "w2@a"
    assert record_availability(db, "w1@a", "yes", None).startswith("refused w1@a")
    assert record_availability(db, "x" * 201, True, None).startswith("refused")
    assert record_availability(db, "w1@a", False, ["not", "text"]).startswith("refused")
    rows = {w["hostname"]: w for w in list_workers(db)}
    assert (rows["w1@a"]["available"], rows["w1@a"]["away_reason"]) == (False, "on battery")
    assert (rows["w2@a"]["available"], rows["w2@a"]["away_reason"]) == (True, None)
    assert [(a, r) for _, a, r in availability(db)["w1@a"]] == \
        [(True, None), (False, "on battery")]
    gauges = {tuple(s.labels.values()): s.value
              for family in FedqCollector(settings, [], broker=False).collect()
              if family.name == "fedq_worker_available" for s in family.samples}
    assert gauges == {("w1@a",): 0.0, ("w2@a",): 1.0}


def test_a_worker_refuses_to_start_with_a_policy_it_cannot_read(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env.update({"FEDQ_HOME": str(tmp_path), "FEDQ_RUN_WHEN": "schedule",
                "FEDQ_RUN_DAYS": "weekdays"})
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "fedq", "worker", "-Q", "cpu",
                           "--pool", "solo", "-n", "bad@test"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "fedq: worker bad@test refused to start: FEDQ_RUN_DAYS: 'weekdays' is not a day" \
        in proc.stderr


def test_queues_auto_sends_an_away_workers_share_to_workers_that_can_train(
        tmp_path: Path) -> None:
    """`queues: auto` splits a round's tasks by the throughput of the workers consuming
    each queue; a worker that stepped aside counts nothing (even while Celery's inspect
    still lists its queue), so its queue's share goes where workers can train now."""
    from fedq.coordinator.planning import split_by_throughput
    from fedq.coordinator.roster import queue_throughput
    from fedq.db import Worker, session_scope
    from fedq.db.session import ensure_schema

    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    with session_scope(db) as s:
        s.add_all([Worker(hostname="rtx@a", queues=["gpu_new"], hardware={},
                          samples_per_second=900.0, available=False,
                          away_reason="owner active (input 2 s ago)"),
                   Worker(hostname="box@b", queues=["cpu"], hardware={},
                          samples_per_second=100.0)])
    live = {"gpu_new": ["rtx@a"], "cpu": ["box@b"]}
    assert queue_throughput(db, live) == {"gpu_new": 0.0, "cpu": 100.0}
    assert split_by_throughput(10, queue_throughput(db, live)) == {"cpu": 10}
    with session_scope(db) as s:  # the owner left: it trains again
        s.get(Worker, "rtx@a").available = True  # type: ignore[union-attr]
    assert split_by_throughput(10, queue_throughput(db, live)) == {"gpu_new": 9, "cpu": 1}


def test_a_worker_started_with_c_n_counts_n_times_when_a_round_is_planned(
        tmp_path: Path) -> None:
    """A worker started with `-c N` trains N clients at once: `clients_per_worker` and
    `queues: auto` count the slots it registered (its pool's concurrency), each slot at
    its tasks' measured rate; a claim that is not an integer in 1..64 counts once."""
    from fedq.coordinator.planning import plan_round, split_by_throughput
    from fedq.coordinator.roster import LiveView, hardware_text, list_workers
    from fedq.db import Worker, session_scope
    from fedq.db.session import ensure_schema
    from fedq.spec import JobSpec

    assert hardware_text({"cpus": 16, "concurrency": 4}) == "cpu x16, 4 slots"
    assert hardware_text({"cpus": 16, "concurrency": 1}) == "cpu x16"  # `fedq workers`
    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    with session_scope(db) as s:
        s.add_all([Worker(hostname="big@x", queues=["cpu"], hardware={"concurrency": 4},
                          samples_per_second=50.0),
                   Worker(hostname="rtx@y", queues=["gpu_new"], hardware={"concurrency": 1},
                          samples_per_second=100.0),
                   Worker(hostname="liar@z", queues=["cpu"],
                          hardware={"concurrency": 10 ** 6}, samples_per_second=50.0),
                   Worker(hostname="odd@w", queues=["cpu"], hardware={"concurrency": "8"},
                          samples_per_second=50.0, available=True)])
    live = {"cpu": ["big@x", "liar@z", "odd@w"], "gpu_new": ["rtx@y"]}
    view = LiveView.of(list_workers(db), live)
    assert view.available(["cpu"]) == 6 and view.available(["cpu", "gpu_new"]) == 7
    assert view.throughput == {"cpu": 300.0, "gpu_new": 100.0}
    assert split_by_throughput(8, view.throughput) == {"gpu_new": 2, "cpu": 6}
    spec = JobSpec.model_validate({**DIGITS, "num_clients": 20, "clients_per_round": 10,
                                   "clients_per_worker": 1, "min_clients": 2, "rounds": 1})
    assert len(plan_round(spec, 1, None, view.available(["cpu"]))) == 6
    with session_scope(db) as s:  # its owner came back: its four slots go with it
        s.get(Worker, "big@x").available = False  # type: ignore[union-attr]
    view = LiveView.of(list_workers(db), live)
    assert view.available(["cpu"]) == 2 and view.throughput["cpu"] == 100.0


def test_clients_per_worker_sizes_a_round_by_the_workers_available_now(
        tmp_path: Path) -> None:
    """With `clients_per_worker`, a round takes that many clients per worker consuming
    the job's queues now and not stepped aside, from the quorum up to
    clients_per_round; a spec it cannot follow is refused with one line."""
    from fedq.coordinator.planning import plan_round
    from fedq.coordinator.roster import LiveView, list_workers
    from fedq.db import Worker, session_scope
    from fedq.db.session import ensure_schema
    from fedq.spec import JobSpec

    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    with session_scope(db) as s:
        s.add_all([Worker(hostname=h, queues=["cpu"], hardware={}, available=free)
                   for h, free in (("a@x", True), ("b@y", False), ("c@z", None))])
    view = LiveView.of(list_workers(db), {"cpu": ["a@x", "b@y", "c@z"], "gpu_new": ["a@x"]})
    assert view.available(["cpu"]) == 2  # b@y stepped aside; a@x counts once
    spec = JobSpec.model_validate({**DIGITS, "num_clients": 20, "clients_per_round": 10,
                                   "clients_per_worker": 3, "min_clients": 2, "rounds": 1})
    assert [spec.round_size(n) for n in (None, 0, 1, 2, 3, 4)] == [10, 2, 3, 6, 9, 10]
    plan = plan_round(spec, 1, None, view.available(["cpu"]))
    assert len(plan) == 6 and {a.queue for a in plan} == {"cpu"}
    assert plan == plan_round(spec, 1, None, 2)  # the same clients when planned again
    auto = spec.model_copy(update={"queues": "auto"})
    assert [a.queue for a in plan_round(auto, 1, {"gpu_new": 3.0, "cpu": 1.0}, 1)] \
        == ["gpu_new", "gpu_new", "cpu"]
    for extra, says in (({"aggregation": {"mode": "buffered", "buffer": 2}},
                         "sizes synchronous rounds"),
                        ({"queues": {"cpu": 5, "gpu_new": 5}}, "needs queues: auto or a single"),
                        ({"dp": {"clip_norm": 1.0, "noise_multiplier": 1.0}},
                         "cannot be used with dp")):
        with pytest.raises(ValueError, match=says):
            JobSpec.model_validate({**spec.model_dump(exclude_unset=True), **extra,
                                    "min_clients": 1})


@pytest.mark.slow
def test_a_round_is_sized_by_the_workers_that_can_train_now(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """Two workers, one on a laptop that is unplugged (FEDQ_AC_ONLY): a job with
    `clients_per_worker: 2` plans 2 clients a round; once the laptop is plugged in and
    back, the next job plans 4. Every planned client trains once."""
    from fedq.db import Round

    cluster = redis_cluster
    power = tmp_path / "power_supply"
    _supply(power, "BAT0", "Battery", None)
    _supply(power, "AC", "Mains", "0")  # on battery
    cluster.start(control=["control"])
    cluster.start_beat()
    cluster.add("steady", ["cpu"])
    laptop = cluster.add("laptop", ["cpu"], FEDQ_AC_ONLY="1", FEDQ_RESUME_AFTER_S="1",
                         FEDQ_POWER_SUPPLY_DIR=str(power))
    db = cluster.env["FEDQ_DATABASE_URL"]

    def laptop_is(free: bool) -> bool:
        from fedq.coordinator.roster import list_workers

        return any(w["hostname"] == "laptop@test" and w["available"] is free
                   for w in list_workers(db))

    spec = {**DIGITS, "name": "sized", "num_clients": 8, "clients_per_round": 8,
            "clients_per_worker": 2, "rounds": 1}
    wait_until(lambda: laptop_is(False), 60, what=laptop.tail)
    first = cluster.submit(spec)
    assert cluster.wait(first).status == "completed"
    (power / "AC" / "online").write_text("1\n")
    wait_until(lambda: laptop_is(True), 60, what=laptop.tail)
    wait_until(lambda: b"training resumes" in laptop.log_path.read_bytes(), 30,
               what=laptop.tail)
    second = cluster.submit(spec)
    assert cluster.wait(second).status == "completed"
    with session_scope(db) as s:
        planned = {r.job_id: r.planned["clients"] for r in s.scalars(select(Round))}
    assert len(planned[first]) == 2 and len(planned[second]) == 4, planned
    for job in (first, second):
        ok = sorted(u.client for u in cluster.updates(job) if u.status == UpdateStatus.OK)
        assert ok == planned[job]
    control_log = cluster.by_name("control").log_path.read_text()
    assert "2 worker slot(s) available: 4 client(s) (of 8)" in control_log
