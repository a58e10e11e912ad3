"""Jobs survive machines that come and go. Real processes, killed with SIGKILL.

Each test also records a row of docs/reliability.md (`python -m bench.reliability`
runs these tests and writes the table)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from fedq.db import ClientUpdate, WatchdogAction, session_scope
from fedq.db.models import aware
from fedq.inference import jobs
from fedq.testing.cluster import DIGITS, SLOWED, Cluster, record_outcome
from fedq.testing.hold import Holds
from fedq.testing.procs import WorkerProcess
from fedq.testing.wait import wait_until
from tests.conftest import migrated_cluster, missing, private_redis

# Tasks that train for a fixed 1.5 s, so that a kill lands mid-task. A gentle optimizer:
# 1.5 s is as many steps as the clock allows (1,705 on a fast day at full speed), and
# DIGITS' lr 0.05 with momentum 0.9 diverged to a NaN loss there (a client's every
# attempt rejected, the job failed: bench.reliability, 2026-11-30); off the clock, 3,000
# steps of it on a sixth of digits end at a loss near 1.8 on three shards of six, lr 0.01
# near 0.06 on all. The tests run them on workers slowed by SLOWED.
SLOW_TASKS = {**DIGITS, "num_clients": 6, "clients_per_round": 3, "local_epochs": 1000,
              "time_budget_s": 1.5, "min_clients": 3, "round_timeout_s": 6,
              "max_redispatch": 3, "queues": {"cpu": 3},
              "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9}}


def _assert_each_round_once(cluster: Cluster, job: str, rounds: int, per_round: int) -> int:
    """Every round committed exactly once with all its clients; returns updates lost."""
    rows = cluster.rounds(job)
    assert [(r.number, r.status) for r in rows] == [(n, "committed")
                                                   for n in range(1, rounds + 1)]
    updates = cluster.updates(job)
    keys = [(u.round_number, u.client) for u in updates]
    assert len(keys) == len(set(keys)) == rounds * per_round
    return sum(1 for u in updates if u.status != "ok")


def _task_in_hand(worker: WorkerProcess, job: str, number: int) -> int | None:
    """The client whose training task of round ``number`` the worker's log shows
    received and not finished (the worker is mid-task), or None."""
    log = worker.log_path.read_text(errors="replace")
    received = re.findall(rf"Task fedq.train\[fedq-{job}-g\d+-r{number}-c(\d+)-a\d+\] received",
                          log)
    finished = set(re.findall(rf"Task fedq.train\[fedq-{job}-g\d+-r{number}-c(\d+)-a\d+\] "
                              r"succeeded", log))
    open_ = [int(c) for c in received if c not in finished]
    return open_[-1] if open_ else None


def _claimed(cluster: Cluster, worker: WorkerProcess, job: str, number: int,
             client: int) -> bool:
    """Whether the worker's claim on its task for ``client`` of round ``number`` is in
    the result backend (fedq/worker/heartbeat.py): it is past "received" and beating,
    so a pause from now on stops a heartbeat the coordinator has seen start."""
    import redis

    log = worker.log_path.read_text(errors="replace")
    ids = re.findall(rf"Task fedq.train\[(fedq-{job}-g\d+-r{number}-c{client}-a\d+)\] "
                     r"received", log)
    if not ids:
        return False
    conn = redis.Redis.from_url(cluster.env["FEDQ_RESULT_BACKEND"])
    try:
        raw = conn.get(f"celery-task-meta-{ids[-1]}")
    finally:
        conn.close()
    meta = json.loads(raw) if raw else {}
    return meta.get("status") == "STARTED" and \
        (meta.get("result") or {}).get("hostname") == worker.name


def _kill_mid_round(cluster: Cluster, holds: Holds, job: str, number: int, victim: str
                    ) -> tuple[int, str, float]:
    """SIGKILL a training worker while it holds a client of round ``number`` at the
    start of its training, claimed and beating (fedq.testing.hold: the tasks of the
    round are held there until the kill; ``victim`` if it holds one, else whichever
    does: the broker's prefetch may hand a round's tasks to the other workers); the
    round's other tasks are let go. Returns the client, the worker and when (epoch s)."""
    pattern = rf"^fedq-{job}-g\d+-r{number}-c\d+-a1$"
    held = wait_until(lambda: holds.waiting(pattern), 60,
                      what=lambda: f"a task of round {number} held\n" +
                      "\n".join(w.tail() for w in cluster.workers))
    by_worker = {w.split("@")[0]: t for t, w in sorted(held.items())}
    name = victim if victim in by_worker else sorted(by_worker)[0]
    task = by_worker[name]
    client = int(re.search(r"-c(\d+)-a1$", task).group(1))  # type: ignore[union-attr]
    worker = cluster.by_name(name)
    worker.kill()  # mid-task: claimed, beating, not trained
    killed_at = time.time()
    holds.let_go(pattern)  # the round's other tasks train on
    cluster.replace(name)
    return client, worker.name, killed_at


def _lost_redispatches(cluster: Cluster, job: str) -> dict[int, float]:
    """Round -> when (epoch s) the watchdog re-dispatched a lost worker's client."""
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        return {a.round_number: aware(a.at).timestamp()
                for a in s.scalars(select(WatchdogAction).where(
                    WatchdogAction.job_id == job,
                    WatchdogAction.action.startswith("redispatch (lost"))
                    .order_by(WatchdogAction.id.desc()))
                if a.round_number is not None}


def _worker_kill_scenario(cluster: Cluster, broker: str, rounds: int,
                          kills: dict[int, str]) -> None:
    """With the shipped default deadline (600 s): the job completes only because each
    killed worker's client is re-dispatched once its heartbeat stops (Redis redelivers
    an unacked task only after its visibility timeout, 2 h; RabbitMQ at once)."""
    cluster.env.update(SLOWED)
    holds = Holds(cluster.home / "holds")
    rounds_held = "|".join(str(n) for n in kills)
    cluster.env.update(holds.env("training", rf"-r({rounds_held})-c\d+-a1$"))
    cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"], control=["control"])
    cluster.start_beat()
    spec = {k: v for k, v in SLOW_TASKS.items() if k != "round_timeout_s"}
    job = cluster.submit({**spec, "rounds": rounds})
    try:
        killed = {number: _kill_mid_round(cluster, holds, job, number, victim)
                  for number, victim in kills.items()}
        view = cluster.wait(job, timeout=240)
    finally:
        holds.close()
    assert view.status == "completed", view.error
    lost = _assert_each_round_once(cluster, job, rounds=rounds, per_round=3)
    assert lost == 0
    rows = {(u.round_number, u.client): u for u in cluster.updates(job)}
    for number, (client, _, _) in killed.items():  # the killed task's client trained again
        row = rows[(number, client)]
        assert row.status == "ok" and row.worker is not None, row.error
    times = []
    if broker == "Redis":
        # by a re-dispatched attempt (the replacement worker has the victim's name)
        assert all(rows[(n, c)].attempt > 1 for n, (c, _, _) in killed.items())
        redispatched = _lost_redispatches(cluster, job)
        for number, (_, _, at) in killed.items():
            assert number in redispatched, f"round {number} was not re-dispatched as lost"
            times.append(redispatched[number] - at)
        assert all(0 < t <= 30 for t in times), times
    where = " and ".join(str(n) for n in kills)
    record_outcome(f"{rounds}-round job, default 600 s deadline, a worker SIGKILLed "
                   f"mid-task in round(s) {where} ({broker})",
                   "a training worker's process group, each time", "completed",
                   len(cluster.rounds(job)), lost, times)


@pytest.mark.slow
def test_worker_killed_mid_task_in_rounds_2_and_4_on_redis(redis_cluster: Cluster) -> None:
    """FEDQ_BENCH_KILLS=N (bench.reliability): N kills, one a round, for a sample of
    kill-to-re-dispatch times."""
    n = int(os.environ.get("FEDQ_BENCH_KILLS", "0"))
    kills = {2 + i: f"w{1 + i % 3}" for i in range(n)} if n else {2: "w1", 4: "w2"}
    _worker_kill_scenario(redis_cluster, "Redis", rounds=max(kills) + 2, kills=kills)


@pytest.fixture
def rabbit_vhost() -> Iterator[str]:
    """A RabbitMQ vhost of its own on the local server (guest/guest)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        missing("RabbitMQ", "rabbitmqctl not found")
    vhost = f"fedq-test-{uuid.uuid4().hex[:8]}"
    made = subprocess.run([ctl, "add_vhost", vhost], capture_output=True, text=True,
                          timeout=60, check=False)
    if made.returncode != 0:
        missing("RabbitMQ", made.stderr.strip() or made.stdout.strip())
    subprocess.run([ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
                   capture_output=True, timeout=60, check=True)
    yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    subprocess.run([ctl, "delete_vhost", vhost], capture_output=True, timeout=60, check=False)


@pytest.mark.slow
def test_worker_killed_mid_task_on_rabbitmq(tmp_path: Path, rabbit_vhost: str, redis_db: str,
                                            pg_url: str) -> None:
    cluster = migrated_cluster(tmp_path, rabbit_vhost, redis_db, pg_url)
    try:
        # RabbitMQ re-queues a dead consumer's task at once: no deadline to wait for
        _worker_kill_scenario(cluster, "RabbitMQ", rounds=4, kills={2: "w1"})
    finally:
        cluster.stop()


@pytest.mark.slow
def test_control_worker_killed_during_finalize(redis_cluster: Cluster) -> None:
    cluster = redis_cluster
    cluster.env.update(SLOWED)
    cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"])
    # round 2's finalize is held where it would aggregate (fedq.testing.hold) until the
    # control worker is killed there
    holds = Holds(cluster.home / "holds")
    control = cluster.add("control", ["control"], **holds.env("finalize", r"-r2$"))
    cluster.start_beat()
    # A long deadline: only the watchdog's stuck-round check can repair round 2 (with
    # the 6 s deadline a slow restart would leave it to the deadline path instead).
    job = cluster.submit({**SLOW_TASKS, "rounds": 3, "time_budget_s": 0.5,
                          "round_timeout_s": 60})
    try:
        wait_until(lambda: holds.waiting(rf"^{job}-r2$"), 120,
                   what=lambda: f"the control worker to aggregate\n{control.tail()}")
        control.kill()  # mid-finalize: nothing committed yet
    finally:
        holds.close()
    assert [r.status for r in cluster.rounds(job)] == ["committed", "training"]
    time.sleep(1.0)
    cluster.replace("control")  # restarted without the hold
    view = cluster.wait(job, timeout=180)
    assert view.status == "completed", view.error
    lost = _assert_each_round_once(cluster, job, rounds=3, per_round=3)
    assert lost == 0
    # The killed finalize was never acknowledged, but Redis redelivers only after the
    # visibility timeout: the watchdog found the stuck round and finalized it.
    assert b"'action': 'finalize (stuck)'" in cluster.by_name("control").log_path.read_bytes()
    record_outcome("control worker SIGKILLed during finalize, then restarted",
                   "the control worker while it finalized round 2", "completed",
                   len(cluster.rounds(job)), lost)


@pytest.mark.slow
def test_control_worker_killed_mid_lean_commit_of_a_big_model(redis_cluster: Cluster,
                                                              redis_db: str) -> None:
    """A model the store keeps as chunks (2 KB here) is committed the lean way: the
    server step (DiLoCo's) writes the new model into the accumulator piece by piece from
    the stored one, and its new momentum to the store as it is made
    (fedq/coordinator/lean.py). The control worker is SIGKILLed there, one piece into
    round 2's step; a restarted one commits the round again from the stored updates and
    round 1's momentum, and the job ends with the model an uninterrupted run of it
    gives, bit for bit (round 3 steps with round 2's momentum)."""
    import torch

    from fedq.blobs import BlobRef, open_store
    from fedq.db import Job
    from fedq.weights import loads

    cluster = redis_cluster
    cluster.env.update(FEDQ_BLOB_URL=redis_db, FEDQ_BLOB_CHUNK_MB="0.002")
    cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"])
    holds = Holds(cluster.home / "holds")
    spec = {**DIGITS, "name": "lean", "clients_per_round": 3, "num_clients": 3,
            "rounds": 3, "round_timeout_s": 60, "queues": {"cpu": 3},
            "server": {"name": "diloco"}}
    control = cluster.add("control", ["control"], **holds.env("server step", r"-r2$"))
    cluster.start_beat()
    killed = cluster.submit(spec)
    try:
        wait_until(lambda: holds.waiting(rf"^{killed}-r2$"), 120,
                   what=lambda: f"the control worker's lean server step\n{control.tail()}")
        control.kill()  # one piece of the new model written into the accumulator
    finally:
        holds.close()
    assert [r.status for r in cluster.rounds(killed)] == ["committed", "training"]
    cluster.replace("control")  # restarted without the hold
    view = cluster.wait(killed, timeout=180)
    assert view.status == "completed", view.error
    lost = _assert_each_round_once(cluster, killed, rounds=3, per_round=3)
    assert lost == 0
    again = cluster.submit(spec)  # the same job, not interrupted
    assert cluster.wait(again, timeout=180).status == "completed"
    store = open_store(redis_db, chunk_bytes=2048)
    finals = []
    with session_scope(cluster.settings.database_url) as s:
        for job_id in (killed, again):
            job = s.get(Job, job_id)
            assert job is not None and job.global_size and job.global_size > 2048
            finals.append(loads(store.get(BlobRef(job.global_key, job.global_sha256 or "",
                                                  job.global_size))))
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    record_outcome("control worker SIGKILLed mid-commit of a big model (lean), restarted",
                   "the control worker one piece into round 2's server step", "completed",
                   len(cluster.rounds(killed)), lost)


@pytest.mark.slow
def test_redis_restarted_mid_job(tmp_path: Path, pg_url: str) -> None:
    with private_redis() as (url, restart):
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        cluster.env.update(SLOWED)
        try:
            cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"], control=["control"])
            cluster.start_beat()
            # a 15 s deadline: on a loaded CI machine three workers' first tasks (each
            # loading its shard) once outlasted 6 s, round after round. Six clients a
            # round on three workers: when Redis dies, three tasks are in the workers'
            # hands (their answers are stored once Redis is back: the result backend
            # retries its one round trip) and three wait in the queue, which the restart
            # empties: those must be sent again.
            job = cluster.submit({**SLOW_TASKS, "rounds": 4, "round_timeout_s": 15,
                                  "clients_per_round": 6, "min_clients": 6,
                                  "queues": {"cpu": 6}})
            cluster.wait_for_round(job, 2, timeout=240)
            time.sleep(0.7)
            restart()
            view = cluster.wait(job, timeout=240)
            assert view.status == "completed", view.error
            lost = _assert_each_round_once(cluster, job, rounds=4, per_round=6)
            assert lost == 0
            assert any(r.attempt > 1 for r in cluster.rounds(job))  # lost tasks were re-sent
            record_outcome("Redis (broker + results) SIGKILLed mid-job, restarted empty",
                           "the Redis server during round 2", "completed",
                           len(cluster.rounds(job)), lost)
        finally:
            cluster.stop()


def test_a_round_the_broker_refuses_starts_again_once_it_answers(tmp_path: Path,
                                                                 pg_url: str) -> None:
    """The broker refuses a round's tasks (a real Redis error: an ACL that denies the
    ``cpu`` queue's key, as a Redis out of memory would refuse them): the round
    row is withdrawn, and once the broker answers the watchdog starts the round again
    in seconds, not at its 600 s deadline."""
    import redis

    with private_redis() as (url, _):
        admin = redis.Redis.from_url(url)
        # every key but ``cpu`` (Redis' ACL globs: ^ negates a character class)
        admin.execute_command("ACL", "SETUSER", "default", "resetkeys", "~[^c]*", "~c[^p]*",
                              "~cp[^u]*", "~cpu?*", "~c", "~cp")
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        try:
            job = cluster.submit({**DIGITS, "num_clients": 2, "clients_per_round": 2,
                                  "rounds": 2, "round_timeout_s": 600})
            control = cluster.add("control", ["control"])
            cluster.start_beat()
            wait_until(lambda: "could not be sent" in control.log_path.read_text(
                errors="replace"), 120, what="the control worker to be refused")
            assert "no permissions" in control.log_path.read_text(errors="replace")
            admin.execute_command("ACL", "SETUSER", "default", "resetkeys", "~*")
            cluster.add("w1", ["cpu"])
            view = cluster.wait(job, timeout=150)
            assert view.status == "completed", view.error
            assert [(r.number, r.attempt) for r in cluster.rounds(job)] == [(1, 1), (2, 1)]
            record_outcome("the broker refused a round's tasks (a Redis ACL denied the queue)",
                           "the control worker's send of round 1", "completed",
                           len(cluster.rounds(job)), 0)
        finally:
            cluster.stop()


def _deny_cpu(admin: Any) -> None:
    """Every key but ``cpu`` (the cpu queue's list) for the Redis user ``ctl`` (^
    negates a character class)."""
    admin.execute_command("ACL", "SETUSER", "ctl", "resetkeys", "~[^c]*", "~c[^p]*",
                          "~cp[^u]*", "~cpu?*", "~c", "~cp")


def _allow_all(admin: Any) -> None:
    admin.execute_command("ACL", "SETUSER", "ctl", "resetkeys", "~*")


def _control_as_ctl(cluster: Cluster, url: str, admin: Any) -> None:
    """The control worker as its own Redis user ``ctl`` (all keys for now)."""
    admin.execute_command("ACL", "SETUSER", "ctl", "on", ">ctl-pw", "~*", "&*", "+@all")
    as_ctl = url.replace("redis://", "redis://ctl:ctl-pw@")
    cluster.add("control", ["control"], FEDQ_BROKER_URL=as_ctl, FEDQ_RESULT_BACKEND=as_ctl)


def _refusals(cluster: Cluster) -> int:
    return cluster.by_name("control").log_path.read_text(errors="replace").count(
        "no permissions")


def test_a_redispatch_the_broker_refuses_is_undone_and_tried_again(tmp_path: Path,
                                                                   pg_url: str) -> None:
    """A worker is SIGKILLed mid-task and the broker refuses the control worker's
    re-dispatch of its client (a Redis ACL on the control worker's own user denies the
    ``cpu`` queue's key): each refused attempt is undone, the watchdog tries again every
    pass, and once the broker answers the client goes out as attempt 2, not at the
    600 s deadline and without spending ``max_redispatch`` (3) on the refusals."""
    import redis

    with private_redis() as (url, _):
        admin = redis.Redis.from_url(url)
        admin.execute_command("ACL", "SETUSER", "ctl", "on", ">ctl-pw", "~*", "&*", "+@all")
        as_ctl = url.replace("redis://", "redis://ctl:ctl-pw@")
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        cluster.env.update(FEDQ_HEARTBEAT_S="1", FEDQ_WORKER_LOST_S="3", **SLOWED)
        holds = Holds(cluster.home / "holds")  # round 2's tasks held until the kill
        cluster.env.update(holds.env("training", r"-r2-c\d+-a1$"))
        try:
            cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"])
            cluster.add("control", ["control"], FEDQ_BROKER_URL=as_ctl,
                        FEDQ_RESULT_BACKEND=as_ctl)
            cluster.start_beat()
            spec = {k: v for k, v in SLOW_TASKS.items() if k != "round_timeout_s"}
            job = cluster.submit({**spec, "rounds": 3})
            # round 2, not 1: round 1's tasks once all ended before `fedq submit`'s
            # process had exited on a loaded machine, leaving no worker mid-task to kill
            client, _, _ = _kill_mid_round(cluster, holds, job, 2, "w1")
            _deny_cpu(admin)  # before the re-dispatch: the heartbeat is lost after 3 s

            def refusals() -> int:
                with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
                    return len(list(s.scalars(select(WatchdogAction.id).where(
                        WatchdogAction.job_id == job,
                        WatchdogAction.action == "error (repair)"))))

            wait_until(lambda: refusals() >= 4, 120,
                       what=lambda: "four refused re-dispatches\n" +
                       cluster.by_name("control").tail())
            assert "no permissions" in cluster.by_name("control").log_path.read_text(
                errors="replace")
            _allow_all(admin)
            view = cluster.wait(job, timeout=150)
            assert view.status == "completed", view.error
            assert [(r.number, r.attempt) for r in cluster.rounds(job)] == [(1, 1), (2, 2),
                                                                             (3, 1)]
            row = {(u.round_number, u.client): u for u in cluster.updates(job)}[(2, client)]
            assert (row.status, row.attempt) == ("ok", 2), row.error
            record_outcome("the broker refused the re-dispatch of a SIGKILLed worker's client "
                           "(a Redis ACL denied the queue to the control worker), 4 times",
                           "a training worker mid-task, then the control worker's sends",
                           "completed: the client went out once the broker answered, as "
                           "attempt 2", len(cluster.rounds(job)), 0)
        finally:
            holds.close()
            cluster.stop()


def test_buffered_tasks_the_broker_refuses_go_out_at_the_next_pass(tmp_path: Path,
                                                                   pg_url: str) -> None:
    """A buffered job whose tasks the broker refuses to the control worker (a Redis ACL
    denies the ``cpu`` queue to its own user; `fedq submit`'s process is another user):
    each refused task is made due at once and the watchdog sends it at its next pass, so
    once the broker answers the job goes on, not at the tasks' 600 s deadline."""
    import redis

    with private_redis() as (url, _):
        admin = redis.Redis.from_url(url)
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        try:
            cluster.start(w1=["cpu"], w2=["cpu"])
            _control_as_ctl(cluster, url, admin)
            cluster.start_beat()
            _deny_cpu(admin)  # from the start: a short job could end before a later denial
            job = cluster.submit({**DIGITS, "num_clients": 8, "clients_per_round": 2,
                                  "rounds": 4, "round_timeout_s": 600, "max_redispatch": 2,
                                  "aggregation": {"mode": "buffered", "buffer": 2}})
            wait_until(lambda: _refusals(cluster) >= 3, 120,
                       what=lambda: "three refused sends\n" + cluster.by_name("control").tail())
            _allow_all(admin)
            view = cluster.wait(job, timeout=120)
            assert view.status == "completed", view.error
            assert [r.number for r in cluster.rounds(job)] == [1, 2, 3, 4]
            assert "could not be sent" in cluster.by_name("control").log_path.read_text(
                errors="replace")
            record_outcome("the broker refused a buffered job's replacement tasks (a Redis "
                           "ACL denied the queue to the control worker), 3 times or more",
                           "the control worker's sends",
                           "completed: each refused task went out at the watchdog's next "
                           "pass once the broker answered", len(cluster.rounds(job)), 0)
        finally:
            cluster.stop()


def test_inference_shards_the_broker_refuses_wait_queued_and_go_out_again(
        tmp_path: Path, pg_url: str) -> None:
    """An inference job whose next shards the broker refuses to the control worker: each
    refused shard goes back to the queue, the refusal is not counted against
    ``max_redispatch`` (1 here), and the watchdog's fill sends it once the broker
    answers, not at its 600 s ``shard_timeout_s``; the outputs are all there, in order."""
    import redis

    from tests.test_inference import _classifier_file, _read_out, _spec

    with private_redis() as (url, _):
        admin = redis.Redis.from_url(url)
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        try:
            cluster.start(w1=["cpu"])
            _control_as_ctl(cluster, url, admin)
            cluster.start_beat()
            _deny_cpu(admin)
            weights = _classifier_file(tmp_path)
            spec = _spec(tmp_path, model={"weights": weights.name, "name": "small_cnn",
                                          "dataset": "digits"},
                         inputs={"dataset": "digits", "limit": 32}, op="classify",
                         shard_size=8, batch_size=8, in_flight=1, shard_timeout_s=600,
                         max_redispatch=1, backups=False)
            # `fedq infer` as the same Redis user: its first shard is refused too, and it
            # says so in one line
            as_ctl = url.replace("redis://", "redis://ctl:ctl-pw@")
            plain = dict(cluster.env)
            cluster.env.update(FEDQ_BROKER_URL=as_ctl, FEDQ_RESULT_BACKEND=as_ctl)
            try:
                started = cluster.fedq("infer", str(spec), "--no-wait")
            finally:
                cluster.env.clear()
                cluster.env.update(plain)
            job = started.stdout.strip()
            said = [x for x in started.stderr.splitlines() if "refused" in x]
            assert len(said) == 1 and said[0].startswith("warning: the broker refused to "
                                                         "send it: ") and \
                "no permissions" in said[0] and "Traceback" not in started.stderr, \
                started.stderr
            wait_until(lambda: _refusals(cluster) >= 3, 120,
                       what=lambda: "three refused sends\n" + cluster.by_name("control").tail())

            def none_out() -> bool:  # (a fill in progress holds one out for a moment)
                view = jobs.find(cluster.settings, job)
                assert view is not None and view.status == "running", view
                return "running" not in [r["status"] for r in view.shard_rows]

            wait_until(none_out, 20, interval=0.05, what="the refused shards to be queued")
            _allow_all(admin)
            watched = cluster.fedq("watch", job, timeout=120)
            assert "completed" in watched.stdout, watched.stdout + watched.stderr
            out = tmp_path / "out.jsonl"
            cluster.fedq("results", job, "--out", str(out))
            assert [r["i"] for r in _read_out(out)] == list(range(32))
            with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
                fills = list(s.scalars(select(WatchdogAction.result).where(
                    WatchdogAction.job_id == job, WatchdogAction.action == "fill")))
            assert any("refused" in (r or "") for r in fills), fills
            record_outcome("the broker refused an inference job's shards (a Redis ACL denied "
                           "the queue to `fedq infer` and the control worker), 3 times or "
                           "more",
                           "the control worker's sends",
                           "completed: each refused shard waited queued and went out once "
                           "the broker answered; 32 outputs in order", 1, 0)
        finally:
            cluster.stop()


@pytest.mark.slow
def test_worker_paused_past_the_deadline_is_late_and_never_averaged(
        redis_cluster: Cluster) -> None:
    """A laptop that sleeps: SIGSTOP a worker mid-task, past the round's deadline; the
    round commits without it; SIGCONT; its update arrives, is recorded late and is in no
    model; the next round runs as usual."""
    cluster = redis_cluster  # not SLOWED: see the next test
    cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"], control=["control"])
    cluster.start_beat()
    job = cluster.submit({**SLOW_TASKS, "rounds": 3, "min_clients": 2})
    cluster.wait_for_round(job, 2)
    sleeper = cluster.by_name("w1")
    wait_until(lambda: _task_in_hand(sleeper, job, 2) is not None, 30, what=sleeper.tail)
    client = _task_in_hand(sleeper, job, 2)  # (client 0 is falsy: read it after the wait)
    assert client is not None
    sleeper.kill(signal.SIGSTOP)
    try:
        wait_until(lambda: [r.status for r in cluster.rounds(job)][:2] ==
                   ["committed", "committed"], 90, interval=0.2,
                   what="round 2 to commit without the sleeper")
    finally:
        sleeper.kill(signal.SIGCONT)
    view = cluster.wait(job, timeout=180)
    assert view.status == "completed", view.error
    rounds = {r.number: r for r in cluster.rounds(job)}
    assert rounds[2].participants == 2
    def late() -> ClientUpdate | None:
        row = {(u.round_number, u.client): u for u in cluster.updates(job)}[(2, client)]
        assert row.status in ("missing", "late"), row.status
        return row if row.status == "late" else None

    row = wait_until(late, 30, interval=0.2, what="the sleeper's update to be recorded late")
    assert row.worker == "w1@test" and row.blob_key is not None
    # never averaged: round 2's model is the mean of the two on-time updates
    assert rounds[2].participants == 2 and rounds[3].participants == 3
    assert all(u.status == "ok" for u in cluster.updates(job) if u.round_number == 3)
    record_outcome("a worker paused (SIGSTOP) mid-task past the deadline, then resumed",
                   "SIGSTOP/SIGCONT of a training worker in round 2",
                   "committed without it; its update recorded late", 3, 0)


@pytest.mark.slow
def test_worker_paused_past_the_heartbeat_bound_is_redispatched(
        redis_cluster: Cluster) -> None:
    """A laptop that sleeps, with the shipped 600 s deadline: SIGSTOP a worker mid-task;
    its heartbeat stops, so its client is re-dispatched to another worker and the round
    commits with every client; SIGCONT; the sleeper's copy is never counted a second
    time."""
    # Not SLOWED: FEDQ_TEST_SLOWDOWN sleeps after a step 19 times the step's wall time, and a
    # pause inside a step would count (a SIGSTOP of 20 s: a sleep of 6 minutes after the
    # SIGCONT, and the late copy never came within the test's wait).
    cluster = redis_cluster
    cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"], control=["control"])
    cluster.start_beat()
    spec = {k: v for k, v in SLOW_TASKS.items() if k != "round_timeout_s"}
    job = cluster.submit({**spec, "rounds": 3})
    cluster.wait_for_round(job, 2)
    sleeper = cluster.by_name("w1")
    wait_until(lambda: _task_in_hand(sleeper, job, 2) is not None, 30, what=sleeper.tail)
    client = _task_in_hand(sleeper, job, 2)
    assert client is not None
    # paused between "received" and its claim, the task would look never started and
    # only the 600 s deadline could settle it (a flake in CI's loaded run): wait for the
    # claim, which comes within milliseconds of "received"
    wait_until(lambda: _claimed(cluster, sleeper, job, 2, client), 10, interval=0.01,
               what="the sleeper's claim on its task")
    sleeper.kill(signal.SIGSTOP)
    paused_at = time.time()
    try:
        wait_until(lambda: [r.status for r in cluster.rounds(job)][:2] ==
                   ["committed", "committed"], 90, interval=0.2,
                   what="round 2 to commit without the sleeper")
    finally:
        sleeper.kill(signal.SIGCONT)
    view = cluster.wait(job, timeout=180)
    assert view.status == "completed", view.error
    rounds = {r.number: r for r in cluster.rounds(job)}
    assert rounds[2].participants == 3  # every client, the sleeper's trained elsewhere
    row = {(u.round_number, u.client): u for u in cluster.updates(job)}[(2, client)]
    assert row.status == "ok" and row.attempt > 1 and row.worker != sleeper.name, \
        (row.status, row.attempt, row.worker)
    _assert_each_round_once(cluster, job, rounds=3, per_round=3)
    at = _lost_redispatches(cluster, job)[2] - paused_at
    # lost after FEDQ_WORKER_LOST_S (15 s) without a heartbeat, long before the 600 s
    # deadline; the margin is for a loaded machine (CI runs two suites side by side)
    assert 0 < at <= 60, at

    def late_copies() -> list[str]:
        with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
            return [f"{a.round_number} {a.action} {a.result}" for a in s.scalars(
                select(WatchdogAction).where(WatchdogAction.job_id == job,
                                             WatchdogAction.action.startswith("late copy")))]

    # the sleeper finishes its copy after SIGCONT: recorded, once, and in no model
    copies = wait_until(late_copies, 120, interval=0.5, what="the sleeper's late copy")
    assert copies == [f"2 late copy of client {client} (attempt 1) from {sleeper.name} "
                      "not used"], copies
    shown = cluster.fedq("status", job).stdout
    assert f"round 2: late copy of client {client} (attempt 1)" in shown, shown
    assert f"round 2: redispatch (lost {sleeper.name})" in shown, shown
    assert rounds[2].participants == 3 and \
        {(r.number, r.participants) for r in cluster.rounds(job)} == {(1, 3), (2, 3), (3, 3)}
    record_outcome("a worker paused (SIGSTOP) mid-task, default 600 s deadline, resumed "
                   "after its client was re-dispatched",
                   "SIGSTOP/SIGCONT of a training worker in round 2",
                   "re-dispatched; committed with every client, none twice", 3, 0, [at])


@pytest.mark.slow
def test_quorum_failure_redispatches_then_fails_then_resumes(redis_cluster: Cluster) -> None:
    cluster = redis_cluster
    cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
    cluster.start_beat()
    spec = {**DIGITS, "num_clients": 6, "clients_per_round": 3, "rounds": 2,
            "queues": {"cpu": 2, "gpu_sm61": 1}, "min_clients": 3, "round_timeout_s": 8,
            "max_redispatch": 1}  # 8 s: the cpu tasks arrive in time on a loaded machine
    job = cluster.submit(spec)
    view = cluster.wait(job, timeout=120)
    assert view.status == "failed"
    assert view.error is not None
    assert "round 1: 2 usable update(s) of 3 after 2 attempt(s); quorum is 3" in view.error
    assert "no live worker consumes gpu_sm61" in view.error
    assert f"fedq resume {job}" in view.error
    [rnd] = cluster.rounds(job)
    assert rnd.status == "failed" and rnd.attempt == 2
    missing_rows = [u for u in cluster.updates(job) if u.status == "missing"]
    assert [u.queue for u in missing_rows] == ["gpu_sm61"]
    record_outcome("a queue with no worker; quorum needs it",
                   "nothing killed: the gpu_sm61 task is never consumed",
                   "re-dispatched once, then failed with the reason", 0, 1)

    # Fix what the message says, then resume: the job finishes from round 1.
    cluster.start(gpu=["gpu_sm61"])
    out = cluster.fedq("resume", job)
    assert "resumed at round 1" in out.stdout
    view = cluster.wait(job, timeout=120)
    assert view.status == "completed", view.error
    assert [(r.number, r.status) for r in cluster.rounds(job)] == [(1, "committed"),
                                                                  (2, "committed")]
    record_outcome("the same job after `fedq resume` with a gpu_sm61 worker started",
                   "-", "completed", 2, 0)


@pytest.mark.slow
def test_a_worker_killed_mid_upload_leaves_no_half_blob(tmp_path: Path, redis_db: str,
                                                        pg_url: str) -> None:
    """A big model's update is written as chunks, then its manifest (fedq/blobs/chunks.py).
    A worker SIGKILLed once its first chunk is stored (fedq.testing.hold's ``upload``
    point) leaves nothing a reader takes for the update, only chunks; its client is
    trained again by the other worker and the job completes; and the round's settle
    (``keep_updates: 0``) deletes the dead attempt's chunks with the round's updates."""
    import redis

    from fedq.blobs import BlobRef, update_key
    from fedq.blobs.factory import open_store
    from fedq.blobs.redis import KEY_PREFIX
    from fedq.errors import BlobNotFound

    cluster = migrated_cluster(tmp_path, redis_db, redis_db, pg_url)
    holds = Holds(cluster.home / "holds")
    try:
        # ~2 KB chunks: a digits update (about 150 KB) is some 70 of them
        cluster.env.update(FEDQ_BLOB_URL=redis_db, FEDQ_BLOB_CHUNK_MB="0.002")
        cluster.start(control=["control"])
        cluster.start_beat()
        cluster.add("w1", ["cpu"], **holds.env("upload", r"-r2-c\d+-a1$"))
        cluster.add("w2", ["cpu"])
        job = cluster.submit({**DIGITS, "name": "upload-kill", "rounds": 3,
                              "keep_updates": 0, "max_redispatch": 3})
        held = wait_until(lambda: holds.waiting(rf"^upload-{job}-r2-c\d+-a1$"), 120,
                          what=lambda: "w1 to hold an upload of round 2\n" +
                          "\n".join(w.tail() for w in cluster.workers))
        task = sorted(held)[0]
        client = int(re.search(r"-c(\d+)-a1$", task).group(1))  # type: ignore[union-attr]
        cluster.by_name("w1").kill()  # chunk 1 stored, the manifest not
        key = update_key(job, 2, client, 1, None)
        root = redis.Redis.from_url(redis_db)
        assert root.exists(KEY_PREFIX + key + ".chunk00000") == 1  # the chunk it stored
        assert root.exists(KEY_PREFIX + key) == 0  # no manifest: no blob to read
        with pytest.raises(BlobNotFound):
            open_store(redis_db).get(BlobRef(key, "0" * 64, 1))
        view = cluster.wait(job, timeout=240)
    finally:
        holds.close()
        cluster.stop()
    assert view.status == "completed", view.error
    row = {(u.round_number, u.client): u for u in cluster.updates(job)}[(2, client)]
    assert row.status == "ok" and row.attempt > 1, (row.status, row.attempt, row.error)
    left = [k.decode() for k in root.scan_iter(match=f"{KEY_PREFIX}jobs/{job}/*updates*")]
    assert not left, left[:5]  # the dead attempt's chunks went with the round's updates
    record_outcome("big model: a 3-round job whose updates are written as ~2 KB chunks "
                   "on Redis, a worker SIGKILLed after the first chunk of a round-2 update",
                   "a training worker, mid-upload (no manifest written)", view.status,
                   len(cluster.rounds(job)), 0)
