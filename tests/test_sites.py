"""Clients bound to the machines that hold their data (``sites`` in the job spec,
docs/owners.md): a client's task goes only to its site's queue, rounds and buffered
slots take the clients of sites that can train now first, and a spec that places a
client nowhere, twice or out of range is refused with one line."""

from __future__ import annotations

import math
import re
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select, update

from fedq.coordinator.buffered import _new_tasks, pick_client
from fedq.coordinator.jobs import get_job
from fedq.coordinator.planning import job_queues, open_clients, plan_round
from fedq.coordinator.roster import (
    back,
    gone_sites,
    list_workers,
    mark_lost,
    open_sites,
    record_availability,
    record_worker,
)
from fedq.db import ClientUpdate, Job, WatchdogAction, Worker, session_scope
from fedq.db.models import Availability, aware
from fedq.db.session import ensure_schema
from fedq.spec import JobSpec
from fedq.status import UpdateStatus
from fedq.testing.cluster import DIGITS, Cluster, base_env, power_supply, record_outcome
from fedq.testing.procs import WorkerProcess, run_module
from fedq.testing.wait import wait_until

SITES = {"north": [0, 1], "south": [2, 3], "east": [4, 5]}
SPEC = {**DIGITS, "name": "sites", "num_clients": 6, "clients_per_round": 4,
        "rounds": 2, "sites": SITES}
HOLDER = {c: site for site, cs in SITES.items() for c in cs}


def test_a_spec_places_every_client_at_one_site() -> None:
    spec = JobSpec.model_validate(SPEC)
    assert [spec.site_queue_of(c) for c in range(6)] == \
        ["site.north"] * 2 + ["site.south"] * 2 + ["site.east"] * 2
    assert JobSpec.model_validate({**SPEC, "sites": None}).site_queue_of(0) is None
    # unset, it is not in the spec a task carries: a worker of an earlier fedq reads it
    assert "sites" not in JobSpec.model_validate({**SPEC, "sites": None}).to_json()
    assert JobSpec.stored(spec.to_json()).sites == SITES
    assert job_queues(spec) == ["site.east", "site.north", "site.south"]  # fedq submit's
    assert job_queues(JobSpec.model_validate({**SPEC, "sites": None})) == ["cpu"]  # warning
    for sites, says in (
            ({"north": [0, 1, 2], "south": [2, 3, 4, 5]}, "client 2 is at two sites"),
            ({"north": [0, 1], "south": [2, 3]}, "client 4 is at no site"),
            ({"north": [0, 1, 2, 3, 4, 5, 6]}, "north: client 6 out of range 0..5"),
            ({"North.1": [0, 1, 2, 3, 4, 5]}, "site name 'North.1'"),
            ({}, "name at least one site")):
        with pytest.raises(ValueError, match=f"sites: {says}"):
            JobSpec.model_validate({**SPEC, "sites": sites})
    with pytest.raises(ValueError, match="queues: not used with sites"):
        JobSpec.model_validate({**SPEC, "queues": {"gpu_new": -1}})


def test_rounds_and_buffered_slots_take_the_clients_of_open_sites_first(
        tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    with session_scope(db) as s:
        s.add_all([Worker(hostname="n@a", queues=["cpu", "site.north"], hardware={},
                          available=None),
                   Worker(hostname="s@b", queues=["site.south"], hardware={}, available=True),
                   Worker(hostname="e@c", queues=["site.east"], hardware={}, available=False),
                   Worker(hostname="x@d", queues=["cpu"], hardware={})])
    with session_scope(db) as s:
        opened = open_sites(s, SITES)
    assert opened == {"north", "south"}  # east's only worker stepped aside
    spec = JobSpec.model_validate(SPEC)
    for n in range(1, 6):
        plan = plan_round(spec, n, None, None, opened)
        assert {a.client for a in plan} == {0, 1, 2, 3}  # four open: all of them
        assert all(a.queue == f"site.{HOLDER[a.client]}" for a in plan)
        assert plan == plan_round(spec, n, None, None, opened)  # planned again: the same
    # fewer open than a round takes: the open ones, then others (they wait for their site)
    plan = plan_round(spec, 1, None, None, frozenset({"east"}))
    assert {4, 5} <= {a.client for a in plan} and len(plan) == 4
    # unknown (no sites open known): a seeded draw over every client, as without sites
    assert len(plan_round(spec, 1)) == 4
    clients = open_clients(spec, opened)
    assert clients == {0, 1, 2, 3}
    picked = {pick_client(spec, t, {0, 2}, clients) for t in range(1, 40)}
    assert picked == {1, 3}  # open and not training
    assert pick_client(spec, 1, {0, 1, 2, 3}, clients) in {4, 5}  # none such: any free
    # a buffered slot refilled after its task was handed back by north's worker goes to
    # another open site, although north's worker row still reads open (its away report
    # not in yet): the `closed` shortcut of buffered._new_tasks
    for seed in range(6):
        seeded = JobSpec.model_validate({**SPEC, "seed": seed})
        with session_scope(db) as s:
            s.add(Job(id=f"j{seed}", name="t", spec=seeded.to_json(), status="running",
                      total_rounds=9, global_key="k", global_sha256="0" * 64, global_size=1))
        for closed, allowed in (("site.north", {2, 3}), (None, {0, 1, 2, 3})):
            with session_scope(db) as s:
                job = s.get(Job, f"j{seed}")
                assert job is not None
                refills = [_new_tasks(s, job, seeded, ["cpu"], closed=closed)[0]
                           for _ in range(2)]
                assert {d.client for d in refills} <= allowed and \
                    len({d.client for d in refills}) == 2, (seed, closed, refills)
                assert all(d.queue == f"site.{HOLDER[d.client]}" for d in refills)
                s.rollback()
    with session_scope(db) as s:
        s.get(Worker, "e@c").available = True  # type: ignore[union-attr]
    with session_scope(db) as s:
        assert open_sites(s, SITES) == {"north", "south", "east"}
    assert {w["hostname"] for w in list_workers(db)} == {"n@a", "s@b", "e@c", "x@d"}


def test_a_buffered_slot_follows_the_machines_that_can_train(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffered job with sites keeps clients_per_round tasks training on machines
    that can train: a task waiting at a site whose machine is away holds no slot, so a
    refill sends its slot to a free client of an open site; never to a client already
    training, never to an away site (its waiting tasks are those queued before it went
    away); with no site open, every task holds its slot."""
    import fedq.coordinator.buffered as buffered

    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    db = settings.database_url
    ensure_schema(db)
    spec = JobSpec.model_validate({**SPEC, "aggregation": {"mode": "buffered", "buffer": 2}})
    with session_scope(db) as s:
        s.add_all([Worker(hostname="n@a", queues=["site.north"], hardware={}, available=True),
                   Worker(hostname="s@b", queues=["site.south"], hardware={}, available=True),
                   Worker(hostname="e@c", queues=["site.east"], hardware={}, available=False,
                          away_reason="on battery"),
                   Job(id="jb", name="t", spec=spec.to_json(), status="running",
                       total_rounds=9, global_key="k", global_sha256="0" * 64,
                       global_size=1)])
        s.flush()  # the job before its tasks' rows
        # east went away with two tasks queued; north and south train one each
        s.add_all([ClientUpdate(job_id="jb", round_number=0, client=c, queue=q,
                                status=UpdateStatus.TRAINING, task_index=i, attempt=1,
                                base_version=0)
                   for i, (c, q) in enumerate(((4, "site.east"), (5, "site.east"),
                                               (0, "site.north"), (2, "site.south")), 1)])
    sent: list[list[int]] = []
    monkeypatch.setattr(buffered, "_send", lambda _s, _j, _sp, tasks: sent.append(
        [d.client for d in tasks]))
    buffered.start(settings, "jb")  # two slots free at open sites: 1 and 3
    assert sorted(sent[-1]) == [1, 3]
    buffered.start(settings, "jb")  # every open client trains: nothing more
    assert sent[-1] == []
    with session_scope(db) as s:  # east is back: its two tasks hold slots again
        s.get(Worker, "e@c").available = True  # type: ignore[union-attr]
        s.get(Worker, "n@a").available = False  # type: ignore[union-attr]
        s.get(Worker, "s@b").available = False  # type: ignore[union-attr]
    buffered.start(settings, "jb")  # six training, two at the one open site
    assert sent[-1] == []
    with session_scope(db) as s:
        for c in (0, 1, 2, 3):  # north's and south's answered
            s.execute(update(ClientUpdate).where(ClientUpdate.job_id == "jb",
                                                 ClientUpdate.client == c)
                      .values(status=UpdateStatus.BUFFERED))
        s.get(Worker, "e@c").available = False  # type: ignore[union-attr]
    buffered.start(settings, "jb")  # no site open: east's two hold their slots
    assert len(sent[-1]) == 2 and set(sent[-1]) <= {0, 1, 2, 3}  # two wait elsewhere


def test_a_lost_claim_closes_only_a_site_its_worker_took_the_task_from(
        tmp_path: Path) -> None:
    """roster.mark_lost trusts the claim's host only as far as the coordinator's own
    facts go: the host must be registered on the site queue the task was sent to."""
    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    with session_scope(db) as s:
        s.add_all([Worker(hostname="n@a", queues=["cpu", "site.north"], hardware={}),
                   Worker(hostname="s@b", queues=["site.south"], hardware={}, available=True)])
    with session_scope(db) as s:
        # a south task whose claim names north's worker (a lie, or a bug): nothing closes
        assert mark_lost(s, [("n@a", "site.south"), ("nobody@x", "site.south")]) == []
        assert open_sites(s, SITES) == {"north", "south"}
        assert mark_lost(s, [("s@b", "site.south")]) == ["s@b"]
    with session_scope(db) as s:
        assert open_sites(s, SITES) == {"north"}
        # gone (a buffered job moves its waiting tasks): south, its only worker lost;
        # not east, away for its owner (its queued tasks are the first it trains when
        # it is back), nor north
        s.add(Worker(hostname="e@c", queues=["site.east"], hardware={}, available=False,
                     away_reason="on battery"))
        s.flush()
        assert gone_sites(s, SITES) == {"south"}
        back(s, ["n@a"])  # another host's heartbeat: south stays closed
        assert open_sites(s, SITES) == {"north"}
        back(s, ["s@b"])  # its heartbeat moves again
        assert open_sites(s, SITES) == {"north", "south"}
        assert mark_lost(s, [("s@b", "site.south")]) == ["s@b"]
    assert record_worker(db, "s@b", ["site.south"], {"cpus": 2}) == "s@b"  # registers again
    with session_scope(db) as s:
        assert open_sites(s, SITES) == {"north", "south"} and gone_sites(s, SITES) == set()
        s.add(Worker(hostname="s2@b", queues=["site.south"], hardware={}, available=False,
                     away_reason="worker stopped"))
        s.flush()
        assert gone_sites(s, SITES) == set()  # one of its two workers is still there
        s.get(Worker, "s@b").available = False  # type: ignore[union-attr]
        s.get(Worker, "s@b").away_reason = "heartbeat lost"  # type: ignore[union-attr]
        s.flush()
        assert gone_sites(s, SITES) == {"south"}
        s.rollback()
    with session_scope(db) as s:
        w = s.get(Worker, "s@b")
        assert w is not None and w.available is None and w.away_reason is None


@pytest.mark.slow
def test_each_clients_task_trains_at_its_site_and_an_away_site_waits(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """Three sites, one worker each (each also consumes ``cpu``, so a task sent
    anywhere but its site's queue would be taken by any of them); east's worker is on
    an unplugged laptop. A synchronous job of four clients a round and a buffered
    job train only north's and south's clients, each on its own site's worker; once
    the laptop is plugged in, a round of all six trains east's on east's worker."""
    cluster = redis_cluster
    power = power_supply(tmp_path / "power_supply", online=False)
    cluster.start(control=["control"])
    cluster.start_beat()
    for site in ("north", "south"):
        cluster.add(site, ["cpu", f"site.{site}"])
    laptop = cluster.add("east", ["cpu", "site.east"], FEDQ_AC_ONLY="1",
                         FEDQ_RESUME_AFTER_S="1", FEDQ_POWER_SUPPLY_DIR=str(power))
    db = cluster.env["FEDQ_DATABASE_URL"]

    def east_is(free: bool) -> bool:
        return any(w["hostname"] == "east@test" and w["available"] is free
                   for w in list_workers(db))

    wait_until(lambda: east_is(False), 60, what=laptop.tail)
    spec_file = tmp_path / "sites.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    submitted = cluster.fedq("submit", str(spec_file))
    sync = submitted.stdout.strip()
    # the away site's queue has no consumer: `fedq submit` names it (planning.job_queues)
    assert "no live worker consumes queue 'site.east'" in submitted.stderr, submitted.stderr
    buffered = cluster.submit({**SPEC, "name": "sites-buffered", "clients_per_round": 2,
                               "rounds": 3, "aggregation": {"mode": "buffered", "buffer": 2}})
    for job in (sync, buffered):
        view = cluster.wait(job, timeout=240)
        assert view.status == "completed", view.error
        rows = cluster.updates(job)
        shown = [(u.client, u.queue, u.worker, u.status) for u in rows]
        assert rows and all(u.client in (0, 1, 2, 3) for u in rows), shown
        assert all(u.queue == f"site.{HOLDER[u.client]}" for u in rows), shown
        assert all(u.worker == f"{HOLDER[u.client]}@test" for u in rows
                   if u.status in (UpdateStatus.OK, UpdateStatus.BUFFERED)), shown
    (power / "AC" / "online").write_text("1\n")
    wait_until(lambda: east_is(True), 60, what=laptop.tail)
    everyone = cluster.submit({**SPEC, "name": "sites-all", "clients_per_round": 6,
                               "rounds": 1})
    assert cluster.wait(everyone, timeout=240).status == "completed"
    ok = {u.client: u.worker for u in cluster.updates(everyone) if u.status == UpdateStatus.OK}
    assert ok == {c: f"{site}@test" for c, site in HOLDER.items()}
    # north's worker is stopped (Celery's warm shutdown, as Ctrl-C or `systemctl stop`
    # does): it says so as it goes, and north is closed at once, not at a deadline;
    # started again, it registers and north is open
    def sites_open() -> frozenset[str]:
        with session_scope(db) as s:
            return open_sites(s, SITES)

    cluster.by_name("north").stop(timeout=30, sig=signal.SIGTERM)
    wait_until(lambda: sites_open() == {"south", "east"}, 30, what=lambda: str(list_workers(db)))
    north = next(w for w in list_workers(db) if w["hostname"] == "north@test")
    assert north["available"] is False and north["away_reason"] == "worker stopped", north
    run = run_module("fedq.cli", ["workers", "--timeout", "2"],
                     {**cluster.env, "COLUMNS": "300"}, 120)
    run.check_returncode()
    shown = run.stdout
    assert "stopped" in next(x for x in shown.splitlines() if "north@test" in x), shown
    cluster.replace("north")
    wait_until(lambda: sites_open() == set(SITES), 60, what=lambda: str(list_workers(db)))


@pytest.mark.slow
def test_a_task_that_yielded_goes_on_where_it_stopped_when_its_machine_is_back(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """Leave in memory on a real worker: one site, one laptop (slowed 20x). Unplugged
    mid-task, it yields with too little done to send (FEDQ_PARTIAL_MIN=1) and keeps
    the task in memory; the task is sent again to its site's queue, where it waits
    for the laptop; plugged in, the laptop goes on from the step it stopped at. Twice:
    the update trains every planned step once, and is counted once."""
    cluster = redis_cluster
    power = power_supply(tmp_path / "power_supply", online=True)
    cluster.start(control=["control"])
    cluster.start_beat()
    laptop = cluster.add("home", ["site.home"], FEDQ_AC_ONLY="1", FEDQ_RESUME_AFTER_S="1",
                         FEDQ_POWER_SUPPLY_DIR=str(power), FEDQ_TEST_SLOWDOWN="20",
                         FEDQ_PARTIAL_MIN="1")
    job = cluster.submit({**DIGITS, "name": "kept", "num_clients": 2, "clients_per_round": 1,
                          "rounds": 1, "local_epochs": 4, "sites": {"home": [0, 1]}})

    def seen(text: bytes, times: int) -> bool:
        return laptop.log_path.read_bytes().count(text) >= times

    def yields_with_steps() -> int:
        return len(re.findall(rb"\] yielded: [^\n]*?after [1-9][0-9]* of",
                              laptop.log_path.read_bytes()))

    # trains a little, is unplugged, waits away, is plugged in again: until two yields
    # stopped after some steps (on a busy machine the first, slowed step can outlast the
    # second it is given: a yield after 0 steps goes on from 0, and it is unplugged again)
    n = 0
    while yields_with_steps() < 2:
        n += 1
        assert n <= 5, laptop.tail()
        wait_until(lambda: seen(b"training: client", n), 120, what=laptop.tail)  # noqa: B023
        time.sleep(1.0)
        (power / "AC" / "online").write_text("0\n")
        wait_until(lambda: seen(b"'status': 'yielded'", n), 30, what=laptop.tail)  # noqa: B023
        time.sleep(1.5)  # away: the task sent again waits in site.home
        (power / "AC" / "online").write_text("1\n")
        wait_until(lambda: seen(b"resuming:", n), 60, what=laptop.tail)  # noqa: B023
    view = cluster.wait(job, timeout=240)
    assert view.status == "completed", view.error
    log = laptop.log_path.read_text()
    stopped = [int(k) for k in re.findall(r"\] yielded: .*?after (\d+) of \d+ steps", log)]
    kept = [int(k) for k in re.findall(r"resuming: (\d+) steps kept", log)]
    some = [k for k in stopped if k > 0]  # each yield goes on from the one before
    assert len(stopped) == n and stopped == kept and stopped == sorted(stopped), log[-3000:]
    assert len(some) == 2 and some[0] < some[1], log[-3000:]
    assert f"({some[0]} of them kept from before)" in log
    (ok,) = [u for u in cluster.updates(job) if u.status == UpdateStatus.OK]
    assert ok.attempt == n + 1 and ok.worker == "home@test"
    trained = re.findall(r"trained: \d+ samples, (\d+) steps", log)
    assert trained and int(trained[-1]) == ok.steps == 4 * math.ceil(ok.samples / 16)
    assert len(cluster.rounds(job)) == 1 and view.status == "completed"
    record_outcome("a laptop at a data site unplugged mid-task twice, plugged in again each "
                   "time (sites, leave in memory; Redis)", "its power-supply probe reads "
                   "battery, twice", "yielded twice; each time sent again to its site, "
                   "resumed at the step it stopped; one update with every planned step "
                   "once", 1, 0)


def test_a_worker_saying_it_is_here_reopens_only_a_lost_site(tmp_path: Path) -> None:
    """``fedq.worker_state`` with ``available`` None (a worker's presence beat):
    seen now; back if it was recorded lost; left away for its owner or stopped;
    refused for a hostname that never registered, and for a malformed state."""
    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    long_ago = datetime(2020, 1, 1, tzinfo=UTC)
    with session_scope(db) as s:
        s.add_all([Worker(hostname=h, queues=[f"site.{site}"], hardware={}, available=False,
                          away_reason=why, last_seen=long_ago)
                   for h, site, why in (("n@a", "north", "heartbeat lost"),
                                        ("s@b", "south", "on battery"),
                                        ("e@c", "east", "worker stopped"))])
    with session_scope(db) as s:
        assert open_sites(s, SITES) == set()
    for host in ("n@a", "s@b", "e@c"):
        assert record_availability(db, host, None, None) == host
    assert record_availability(db, "x@y", None, None) == "refused x@y: not a registered worker"
    assert record_availability(db, "n@a", "yes", None) == \
        "refused n@a: available is not true, false or null"
    with session_scope(db) as s:
        assert open_sites(s, SITES) == {"north"}
        rows = {w.hostname: w for w in s.scalars(select(Worker))}
        assert set(rows) == {"n@a", "s@b", "e@c"}
        assert all(aware(w.last_seen) > long_ago for w in rows.values())
        assert (rows["s@b"].available, rows["s@b"].away_reason) == (False, "on battery")
        assert (rows["e@c"].available, rows["e@c"].away_reason) == (False, "worker stopped")


TWO_SITES = {"a": [0, 1], "b": [2, 3]}


def _sites_open(db: str) -> Callable[[], frozenset[str]]:
    def sites_open() -> frozenset[str]:
        with session_scope(db) as s:
            return open_sites(s, TWO_SITES)
    return sites_open


def _a_row(db: str) -> Callable[[], dict[str, object]]:
    return lambda: next(w for w in list_workers(db) if w["hostname"] == "a@test")


def _history(db: str, hostname: str) -> list[tuple[object, ...]]:
    """``hostname``'s availability rows, oldest first: (at, available, reason)."""
    with session_scope(db) as s:
        return [(a.at.strftime("%H:%M:%S.%f"), a.available, a.reason) for a in s.scalars(
            select(Availability).where(Availability.hostname == hostname)
            .order_by(Availability.id))]


def _two_sites(cluster: Cluster, **env: str) -> WorkerProcess:
    """Sites a and b of TWO_SITES, one worker each, the control worker and beat (the
    watchdog each second): b's worker trains at full speed, a's, returned, 20× slower
    (the one a test pauses or kills); returns once both sites are open."""
    cluster.env.update(FEDQ_WATCHDOG_INTERVAL="1", FEDQ_HEARTBEAT_S="1", **env)
    cluster.start(control=["control"], b=["site.b"])
    cluster.start_beat()
    worker = cluster.add("a", ["site.a"], FEDQ_TEST_SLOWDOWN="20")
    sites_open = _sites_open(cluster.env["FEDQ_DATABASE_URL"])
    wait_until(lambda: sites_open() == set(TWO_SITES), 60, what=worker.tail)
    return worker


@pytest.mark.slow
def test_a_paused_site_worker_reopens_its_site_when_it_wakes(
        redis_cluster: Cluster) -> None:
    """A laptop whose lid closes mid-task: a's only worker is SIGSTOPped while it trains
    a buffered job's task. Its heartbeat stops, it is recorded lost and its site
    closed, and b trains on alone. Resumed (SIGCONT, the same process: it does not
    register again), it stops the task whose slot went elsewhere at its next step (its
    heartbeat reads the stopping revocation), says it is here once idle
    (FEDQ_PRESENCE_S) and site a opens."""
    cluster = redis_cluster
    sleeper = _two_sites(cluster, FEDQ_WORKER_LOST_S="4", FEDQ_PRESENCE_S="1")
    sites, db = TWO_SITES, cluster.env["FEDQ_DATABASE_URL"]
    sites_open, a_row = _sites_open(db), _a_row(db)
    job = cluster.submit({**DIGITS, "name": "paused-site", "num_clients": 4, "sites": sites,
                          "clients_per_round": 2, "rounds": 40, "round_timeout_s": 600,
                          "aggregation": {"mode": "buffered", "buffer": 2}})
    mine = re.compile(rb"training: client \d+, round \d+ of job " + job.encode())
    wait_until(lambda: mine.search(sleeper.log_path.read_bytes()), 120, what=sleeper.tail)
    sleeper.kill(signal.SIGSTOP)
    try:
        wait_until(lambda: a_row()["away_reason"] == "heartbeat lost", 60,
                   what=lambda: f"{a_row()} {get_job(cluster.settings, job).status}")
        assert sites_open() == {"b"}
        wait_until(lambda: len(cluster.rounds(job)) >= 6, 120, what=cluster.by_name("b").tail)
        cluster.fedq("cancel", job)  # b trained on alone
        registered = sleeper.log_path.read_bytes().count(b"ready.")
    finally:
        sleeper.kill(signal.SIGCONT)
    wait_until(lambda: sites_open() == set(sites), 60, what=sleeper.tail)
    assert b"stopped: revoked while it trained" in sleeper.log_path.read_bytes()
    assert a_row()["available"] is None and sleeper.alive()
    assert sleeper.log_path.read_bytes().count(b"ready.") == registered  # not restarted
    with session_scope(db) as s:
        history = [(a.available, a.reason) for a in s.scalars(
            select(Availability).where(Availability.hostname == "a@test")
            .order_by(Availability.id))]
    assert history[-2:] == [(False, "heartbeat lost"), (True, None)], history
    record_outcome("a site's only worker paused (SIGSTOP) mid-task, resumed once the other "
                   "site had trained on (sites, buffered; Redis)",
                   "SIGSTOP/SIGCONT of the worker",
                   "its site closed once its heartbeat stopped, the other site trained on; "
                   "open again once the same process was idle and said it was here",
                   len(cluster.rounds(job)), 0)


@pytest.mark.slow
def test_a_killed_site_worker_closes_its_site_until_it_is_back(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """Two sites, one worker each; a's worker is slowed and SIGKILLed mid-task (no
    shutdown, no report). Its heartbeat stops, the watchdog records it lost ("heartbeat
    lost"), and its site is closed: a buffered job (600 s deadline) gives the killed
    task's slot, and any task waiting in site.a, to b's clients at once; started again,
    the worker registers and a is open; a synchronous round whose a-worker is killed
    commits at its deadline with b's update, and the next round takes b's clients only."""
    cluster = redis_cluster
    victim = _two_sites(cluster, FEDQ_WORKER_LOST_S="5")
    sites, db = TWO_SITES, cluster.env["FEDQ_DATABASE_URL"]
    sites_open, a_row = _sites_open(db), _a_row(db)
    base = {**DIGITS, "name": "lost-site", "num_clients": 4, "sites": sites}

    def kill_a_while_it_trains(job: str) -> None:
        # this job's task (a restarted worker may first be handed the killed task of
        # the job before, redelivered by Redis)
        mine = re.compile(rb"training: client \d+, round \d+ of job " + job.encode())
        wait_until(lambda: mine.search(victim.log_path.read_bytes())
                   or get_job(cluster.settings, job).status != "running", 120,
                   what=victim.tail)
        assert mine.search(victim.log_path.read_bytes()), f"a never trained {job}"
        victim.kill()

    buffered = cluster.submit({**base, "name": "lost-buffered", "clients_per_round": 2,
                               "rounds": 4, "round_timeout_s": 600,
                               "aggregation": {"mode": "buffered", "buffer": 2}})
    kill_a_while_it_trains(buffered)
    view = cluster.wait(buffered, timeout=150)  # its deadline is 600 s: the watchdog did it
    assert view.status == "completed", view.error
    assert a_row()["available"] is False and a_row()["away_reason"] == "heartbeat lost"
    assert sites_open() == {"b"}
    rows = cluster.updates(buffered)
    moved = [u for u in rows if u.queue == "site.a" and u.status == UpdateStatus.MISSING]
    assert moved and all("the workers of site.a are lost or stopped" in (u.error or "")
                         for u in moved), [(u.client, u.status, u.error) for u in rows]
    with session_scope(db) as s:
        actions = [a.action for a in s.scalars(select(WatchdogAction).where(
            WatchdogAction.job_id == buffered))]
    assert any("(site.a closed)" in a for a in actions), actions
    run = run_module("fedq.cli", ["workers", "--timeout", "1"],
                     {**cluster.env, "COLUMNS": "300"}, 120)
    run.check_returncode()
    shown = run.stdout
    assert "lost: heartbeat stopped" in next(x for x in shown.splitlines() if "a@test" in x), \
        shown
    # (the buffered job's tasks moved from site.a still wait there, revoked: the
    # restarted worker refuses them at once, untrained, fedq/engine/revoke.py; before,
    # it trained them first and held the synchronous job's task past its deadline)
    # started again: it registers, and a is open
    victim = cluster.replace("a", FEDQ_TEST_SLOWDOWN="20")
    wait_until(lambda: sites_open() == set(sites), 60, what=victim.tail)
    assert a_row()["available"] is None
    # synchronous: a seed whose first round trains one client at each site and whose
    # second, both sites open, would take one of a's
    def clients(spec: JobSpec, n: int) -> set[int]:
        return {x.client for x in plan_round(spec, n, None, None, frozenset(sites))}

    spec = next(c for seed in range(100) if (c := JobSpec.model_validate(
        {**base, "name": "lost-sync", "clients_per_round": 2, "rounds": 2, "min_clients": 1,
         "round_timeout_s": 25, "seed": seed}))
        and len(clients(c, 1) & {0, 1}) == 1 and clients(c, 2) & {0, 1})
    sync = cluster.submit(spec.to_json())
    kill_a_while_it_trains(sync)
    view = cluster.wait(sync, timeout=150)
    assert view.status == "completed", view.error
    assert a_row()["away_reason"] == "heartbeat lost", _history(db, "a@test")
    trained = {(u.round_number, u.client) for u in cluster.updates(sync)
               if u.status == UpdateStatus.OK}
    assert {c for r, c in trained if r == 2} <= {2, 3} and len(trained) >= 2, trained
    record_outcome("a site's only worker SIGKILLed mid-task (sites; buffered with a 600 s "
                   "deadline, then synchronous; Redis)", "the worker's process group",
                   "its site closed once its heartbeat stopped: buffered slots went to the "
                   "other site at once; the next synchronous round took the other site's "
                   "clients; open again once restarted", len(cluster.rounds(sync)), 0)
