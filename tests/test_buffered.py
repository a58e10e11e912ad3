"""Buffered asynchronous aggregation (FedBuff): the staleness weights, the spec, and
real jobs on the embedded default and on Redis + PostgreSQL, with duplicate callbacks,
a worker SIGKILLed mid-task, the control worker SIGKILLed mid-apply, cancel and resume.

Every job is checked for the same invariants (:func:`_assert_versions`): each version
committed once from exactly K updates, no task counted twice, every used update's
staleness equal to (version - 1) - the version it trained from, and its weight the
normalised samples x s(staleness)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from fedq.aggregate.staleness import staleness_factor
from fedq.cli.output import describe
from fedq.coordinator.roster import list_workers
from fedq.db import WatchdogAction, session_scope
from fedq.db.models import aware
from fedq.engine.names import ABSORB_UPDATE_TASK, CONTROL_QUEUE
from fedq.errors import SpecError
from fedq.observe.plots import close, figures
from fedq.spec import parse_spec
from fedq.testing.cluster import DIGITS, SLOWED, Cluster, base_env, record_outcome
from fedq.testing.hold import Holds
from fedq.testing.wait import wait_until
from tests.conftest import migrated_cluster, private_redis

K, C = 2, 4
BUFFERED = {**DIGITS, "num_clients": 8, "clients_per_round": C, "rounds": 5,
            "aggregation": {"mode": "buffered", "buffer": K}}
# Tasks that train for a fixed 1.5 s, so a kill lands mid-task. The gradient clipped:
# as many steps as the clock allows at lr 0.05 once diverged to NaN in a CI run.
SLOW = {**BUFFERED, "local_epochs": 1000, "time_budget_s": 1.5, "round_timeout_s": 6,
        "max_redispatch": 3, "optimizer": {**DIGITS["optimizer"], "grad_clip": 1.0}}


def test_staleness_factors() -> None:
    assert staleness_factor("constant", 7) == 1.0
    assert staleness_factor("polynomial", 0) == 1.0
    assert staleness_factor("polynomial", 3, a=0.5) == pytest.approx(0.5)
    assert staleness_factor("hinge", 10, a=0.5, b=10) == 1.0
    assert staleness_factor("hinge", 14, a=0.5, b=10) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="staleness -1"):
        staleness_factor("polynomial", -1)


def test_buffered_spec_validates_and_describes_itself() -> None:
    spec = parse_spec({**BUFFERED, "aggregation": {
        "mode": "buffered", "buffer": 3, "max_staleness": 4,
        "staleness": {"kind": "hinge", "a": 0.5, "b": 2}}})
    assert spec.buffered and spec.quorum == 3
    assert describe(spec).startswith("buffered K=3 C=4 staleness hinge a=0.5 b=2 max 4")
    assert not parse_spec(DIGITS).buffered
    with pytest.raises(SpecError, match="min_clients: not used by a buffered job"):
        parse_spec({**BUFFERED, "min_clients": 2})
    with pytest.raises(SpecError, match="aggregation.buffer"):
        parse_spec({**BUFFERED, "aggregation": {"mode": "buffered", "buffer": 0}})
    with pytest.raises(SpecError, match="aggregation.staleness.kind"):
        parse_spec({**BUFFERED, "aggregation": {"mode": "buffered",
                                                "staleness": {"kind": "linear"}}})


def test_buffered_fedavg_steps_k_over_c_unless_told() -> None:
    """A version comes every K updates, not every C: FedAvg's server step defaults to
    K / C there (and stays as written when the spec sets it)."""
    import torch

    from fedq.coordinator.pipeline import apply_server

    w, d = {"x": torch.zeros(3)}, {"x": torch.ones(3)}
    spec = parse_spec(BUFFERED)
    assert apply_server(spec, w, d, {})[0]["x"].tolist() == [K / C] * 3
    told = parse_spec({**BUFFERED, "server": {"name": "fedavg", "lr": 0.8}})
    assert apply_server(told, w, d, {})[0]["x"].tolist() == pytest.approx([0.8] * 3)
    assert apply_server(parse_spec(DIGITS), w, d, {})[0]["x"].tolist() == [1.0] * 3
    adam = parse_spec({**BUFFERED, "server": {"name": "fedadam"}})
    assert adam.aggregation.server_lr(adam.server, C) is None  # its own default


def _assert_versions(cluster: Cluster, job: str, versions: int, k: int = K,
                     max_staleness: int | None = None, a: float = 0.5) -> list:
    """The invariants of a completed buffered job; returns its update rows."""
    rounds = cluster.rounds(job)
    assert [(r.number, r.status) for r in rounds] == [(v, "committed")
                                                     for v in range(1, versions + 1)]
    rows = cluster.updates(job)
    indexes = [u.task_index for u in rows]
    assert len(indexes) == len(set(indexes)) and min(indexes) >= 1, "a task counted twice"
    used = [u for u in rows if u.status == "ok"]
    per_version = Counter(u.round_number for u in used)
    assert per_version == {v: k for v in range(1, versions + 1)}, per_version
    for v in range(1, versions + 1):
        mine = [u for u in used if u.round_number == v]
        assert sum(u.weight for u in mine) == pytest.approx(1.0)
        raw = {u.task_index: u.samples * (1 + u.staleness) ** -a for u in mine}
        total = sum(raw.values())
        for u in mine:
            assert u.staleness == (v - 1) - u.base_version
            assert u.weight == pytest.approx(raw[u.task_index] / total)
        assert {r.participants for r in rounds if r.number == v} == {k}
    if max_staleness is not None:
        assert all(u.staleness <= max_staleness for u in used)
        stale = [u for u in rows if u.status == "stale"]
        assert all(u.staleness > max_staleness for u in stale)
    assert not [u for u in rows if u.status in ("training", "buffered")], "left open"
    return rows


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp_path = tmp_path_factory.mktemp("buffered")
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
    cluster.add("w3", ["cpu"], FEDQ_TEST_SLOWDOWN="4")  # a slower machine: stale updates
    yield cluster
    cluster.stop()


@pytest.mark.slow
def test_buffered_job_on_the_embedded_default(embedded: Cluster) -> None:
    cluster = embedded
    job = cluster.submit(BUFFERED)
    view = cluster.wait(job, timeout=240)
    assert view.status == "completed", view.error
    rows = _assert_versions(cluster, job, versions=5)
    assert max(u.staleness for u in rows if u.status == "ok") >= 1, "never asynchronous"
    assert {u.worker.split("@")[0] for u in rows if u.status == "ok"} >= {"w1", "w2"}
    data = cluster.results_json(job)
    assert "buffered K=2 C=4" in data["job"]["strategy"]
    means = [r["staleness_mean"] for r in data["rounds"]]
    assert all(m is not None for m in means) and max(means) > 0
    watched = cluster.fedq("watch", job).stdout
    assert "version   5  committed" in watched and "staleness" in watched
    table = cluster.fedq("results", job, "--clients").stdout
    assert "version" in table and "staleness of the used updates:" in table
    assert "updates/s" in table
    # The staleness figure counts every update used, at its staleness.
    figs = figures(data["job"], data["rounds"], data["clients"])
    hist = figs["staleness"].axes[0]
    used = [c["staleness"] for c in data["clients"] if c["status"] == "ok"]
    assert sum(bar.get_height() for bar in hist.patches) == len(used) == 5 * 2
    assert [round(bar.get_height()) for bar in hist.patches][:max(used) + 1] == \
        [used.count(s) for s in range(max(used) + 1)]
    assert list(figs["staleness"].axes[1].lines[0].get_xdata()) == [1, 2, 3, 4, 5]
    close(figs)
    # The commands, on the embedded default.
    plots = cluster.fedq("plot", job, "--out", str(cluster.home / "plots")).stdout.split()
    assert sorted(Path(p).name for p in plots if p.endswith(".png")) == sorted(
        f"{job}-{n}.png" for n in ("progress", "timeline", "bytes", "utilisation",
                                   "staleness"))
    report = cluster.home / "report.html"
    cluster.fedq("report", job, "--out", str(report))
    assert report.read_text().count('src="data:image/png;base64,') == 5
    # fedq metrics on the embedded default (SQLite, filesystem broker): versions count
    # as rounds; the queue depths come from the broker's folder.
    scrape = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(cluster.fedq("metrics", "--once").stdout)
              for s in f.samples}
    assert scrape[("fedq_rounds_total", (("job", job), ("status", "committed")))] == 5
    assert scrape[("fedq_broker_up", ())] == 1
    assert scrape[("fedq_queue_depth", (("queue", "cpu"),))] >= 0

    # A duplicate callback for a task already absorbed changes nothing.
    app = cluster.client_app()
    first = next(u for u in rows if u.status == "ok")
    meta = app.backend.get_task_meta(f"fedq-{job}-b{first.task_index}-a{first.attempt}")
    assert meta["status"] == "SUCCESS"
    again = app.send_task(ABSORB_UPDATE_TASK, args=(meta["result"], job, first.task_index),
                          queue=CONTROL_QUEUE)
    assert again.get(timeout=60) == {"status": "skipped", "reason": "absorbed already"}
    assert [(u.task_index, u.status, u.round_number) for u in cluster.updates(job)] == \
        [(u.task_index, u.status, u.round_number) for u in rows]


@pytest.mark.slow
def test_buffered_on_redis_with_max_staleness_cancel_and_resume(redis_cluster: Cluster) -> None:
    """max_staleness 0: only updates trained from the newest model are used, the rest
    are recorded as stale; a cancelled buffered job resumes and completes."""
    cluster = redis_cluster
    cluster.env.update(SLOWED)
    cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
    spec = {**SLOW, "time_budget_s": 1.0, "rounds": 10,
            "aggregation": {"mode": "buffered", "buffer": K, "max_staleness": 0}}
    job = cluster.submit(spec)
    cluster.wait_for_round(job, 2)
    # the training workers frozen mid-job, so `fedq cancel` (a new process: seconds
    # under load) lands while tasks are in flight, never after the job has completed
    trainers = [cluster.by_name("w1"), cluster.by_name("w2")]
    for worker in trainers:
        worker.kill(signal.SIGSTOP)
    try:
        assert [u for u in cluster.updates(job) if u.status == "training"]
        cluster.fedq("cancel", job)
    finally:
        for worker in trainers:
            worker.kill(signal.SIGCONT)
    rows = cluster.updates(job)
    assert not [u for u in rows if u.status == "training"], "cancel left tasks open"
    assert "resumed at round" in cluster.fedq("resume", job).stdout
    view = cluster.wait(job, timeout=240)
    assert view.status == "completed", view.error
    rows = _assert_versions(cluster, job, versions=10, max_staleness=0)
    assert [u for u in rows if u.status == "stale"], "with C > K some update must go stale"


@pytest.mark.slow
def test_buffered_worker_killed_mid_task(redis_cluster: Cluster) -> None:
    cluster = redis_cluster
    cluster.env.update(SLOWED)
    # task 3 (of the first four sent) is held at the start of its training, claimed and
    # beating, by whichever worker takes it (fedq.testing.hold), until its worker is
    # killed there
    holds = Holds(cluster.home / "holds")
    cluster.env.update(holds.env("training", r"-b3-a1$"))
    cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
    cluster.start_beat()
    # The shipped 600 s deadline and 30 versions (~45 s): only the lost worker's
    # heartbeat (never the deadline, never the job completing first) can settle the
    # killed task's row.
    job = cluster.submit({**SLOW, "rounds": 30, "round_timeout_s": 600})
    pattern = rf"^fedq-{job}-b3-a1$"
    try:
        held = wait_until(lambda: holds.waiting(pattern), 60,
                          what=lambda: "\n".join(w.tail() for w in cluster.workers))
        name = next(iter(held.values())).split("@")[0]
        victim = cluster.by_name(name)
        killed = 3
        victim.kill()
        killed_at = time.time()
        holds.let_go(pattern)
        cluster.replace(name)
        view = cluster.wait(job, timeout=240)
    finally:
        holds.close()
    assert view.status == "completed", view.error
    rows = _assert_versions(cluster, job, versions=30)
    # Redis redelivers the killed task only after its visibility timeout: the watchdog
    # sent it again once its heartbeat stopped (or gave its slot to another client).
    row = next(u for u in rows if u.task_index == killed)
    assert row.attempt > 1 or row.status == "missing", (row.status, row.attempt)
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        resent = [aware(a.at).timestamp() - killed_at for a in s.scalars(
            select(WatchdogAction).where(WatchdogAction.job_id == job,
                                         WatchdogAction.action.contains(
                                             f"(lost {name}@test)")))]
    assert len(resent) == 1 and 0 < resent[0] <= 30, resent
    lost = sum(1 for u in rows if u.status in ("training", "buffered"))  # 0: asserted
    record_outcome("buffered job (K=2, C=4), default 600 s deadline, a worker SIGKILLed "
                   "mid-task (Redis)", "a training worker's process group", "completed",
                   len(cluster.rounds(job)), lost, resent)


@pytest.mark.slow
def test_buffered_control_killed_mid_apply(redis_cluster: Cluster) -> None:
    cluster = redis_cluster
    cluster.env.update(SLOWED)
    cluster.start(w1=["cpu"], w2=["cpu"])
    # version 2's apply is held where it would aggregate (fedq.testing.hold) until the
    # control worker is killed there
    holds = Holds(cluster.home / "holds")
    control = cluster.add("control", ["control"], **holds.env("apply", r"-v2$"))
    cluster.start_beat()
    job = cluster.submit({**SLOW, "time_budget_s": 0.5, "rounds": 3, "round_timeout_s": 60})
    try:
        wait_until(lambda: holds.waiting(rf"^{job}-v2$"), 120,
                   what=lambda: f"the control worker to apply\n{control.tail()}")
        control.kill()  # mid-apply: nothing committed yet
    finally:
        holds.close()
    assert [r.status for r in cluster.rounds(job)][:2] == ["committed", "training"]
    time.sleep(1.0)
    cluster.replace("control")  # restarted without the hold
    view = cluster.wait(job, timeout=180)
    assert view.status == "completed", view.error
    rows = _assert_versions(cluster, job, versions=3)
    # the watchdog logs what it did after its apply returns, which may be after the
    # job reads completed
    restarted = cluster.by_name("control")
    wait_until(lambda: b"'action': 'apply (stuck)'" in restarted.log_path.read_bytes(), 30,
               what=lambda: f"the watchdog to log its apply\n{restarted.tail()}")
    lost = sum(1 for u in rows if u.status in ("training", "buffered"))  # 0: asserted
    record_outcome("buffered job (K=2, C=4), control worker SIGKILLed mid-apply, restarted",
                   "the control worker while it applied version 2", "completed",
                   len(cluster.rounds(job)), lost)



@pytest.mark.slow
def test_buffered_redis_restarted_mid_job(tmp_path: Path, pg_url: str) -> None:
    """Redis (broker and results) SIGKILLed mid-job and restarted empty: queued tasks,
    results and absorb callbacks are gone; the watchdog re-sends the tasks still
    training at their deadline and the job completes, each version once."""
    with private_redis() as (url, restart):
        cluster = migrated_cluster(tmp_path, url, url, pg_url)
        cluster.env.update(SLOWED)
        try:
            cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
            cluster.start_beat()
            job = cluster.submit({**SLOW, "rounds": 10})  # outlasts the 6 s deadline
            cluster.wait_for_round(job, 2)
            time.sleep(0.7)
            restart()
            view = cluster.wait(job, timeout=240)
            assert view.status == "completed", view.error
            rows = _assert_versions(cluster, job, versions=10)
            assert [u for u in rows if u.attempt > 1 or u.status == "missing"], "none re-sent"
            lost = sum(1 for u in rows if u.status in ("training", "buffered"))
            record_outcome("buffered job (K=2, C=4), Redis (broker + results) SIGKILLed "
                           "mid-job, restarted empty", "the Redis server during version 2",
                           "completed", len(cluster.rounds(job)), lost)
        finally:
            cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("where,status", [("a-file/store", "error"), ("elsewhere", "rejected")])
def test_buffered_job_whose_tasks_all_fail_stops_with_a_reason(redis_cluster: Cluster,
                                                              tmp_path: Path, where: str,
                                                              status: str) -> None:
    """A worker that can neither read nor write its blob store (a folder under a file)
    fails every task; one that uploads to another store (it still trains: round 0 is
    rebuilt from the seed) has every update rejected. After clients_per_round x
    (max_redispatch + 1) such tasks in a row the job fails with the error and the
    queue, instead of sending tasks forever."""
    cluster = redis_cluster
    cluster.start(control=["control"])
    (tmp_path / "a-file").write_text("not a folder")
    cluster.add("w1", ["cpu"], FEDQ_BLOB_URL=str(tmp_path / where))
    job = cluster.submit({**BUFFERED, "clients_per_round": 2, "max_redispatch": 1})
    view = cluster.wait(job, timeout=120)
    assert view.status == "failed"
    assert view.error is not None and "the last 4 training tasks all failed" in view.error
    assert "on queue(s) cpu" in view.error and f"fedq resume {job}" in view.error
    rows = cluster.updates(job)
    assert [u.status for u in rows].count(status) >= 4
    assert not [u for u in rows if u.status == "training"]
    assert not [r for r in cluster.rounds(job) if r.status == "committed" and r.number > 0]
    if status == "error":
        workers = {w["hostname"]: w for w in list_workers(cluster.settings.database_url)}
        assert workers["w1@test"]["tasks_failed"] == [u.status for u in rows].count("error")


def test_an_update_absorbed_before_its_signer_was_revoked_is_not_applied(
        tmp_path: Path) -> None:
    """A buffered version applies only updates whose signer is still active when it is
    applied (FEDQ_IDENTITY=required): one absorbed from a worker revoked since is
    rejected then, saying so, and the version waits for another. Remove _still_signed
    from apply_version and this fails."""
    from fedq.coordinator.buffered import _still_signed
    from fedq.db import upgrade
    from fedq.db.models import ClientUpdate, RegisteredWorker
    from fedq.settings import load_settings

    settings = load_settings({"FEDQ_HOME": str(tmp_path / ".fedq"), "FEDQ_IDENTITY": "required",
                              "FEDQ_KEYS_DIR": str(tmp_path / "keys")})
    upgrade(settings.database_url)
    with session_scope(settings.database_url) as s:
        s.add_all([RegisteredWorker(name="w1", queues="cpu", state="active", public_key="k1"),
                   RegisteredWorker(name="w2", queues="cpu", state="revoked", public_key="k2")])
    rows = [ClientUpdate(task_index=i, signer=signer, status="buffered")
            for i, signer in enumerate(["w1", "w2", "w1"])]
    kept = _still_signed(settings, rows, 3)
    assert [r.task_index for r in kept] == [0, 2]
    assert (rows[1].status, rows[1].error) == (
        "rejected", "signature: signed by w2, which was revoked before version 3 was applied")
    off = load_settings({"FEDQ_HOME": str(tmp_path / ".fedq")})  # identity off: all kept
    assert len(_still_signed(off, [ClientUpdate(task_index=0, signer="w2")], 3)) == 1
