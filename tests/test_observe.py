"""Seeing a job: figures, the HTML report, Prometheus metrics, JSON logs and worker
diagnostics, on a real job over Redis + PostgreSQL + S3 with real worker processes."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedq.blobs import store_for
from fedq.coordinator.jobs import client_results, job_record, round_results
from fedq.coordinator.roster import list_workers
from fedq.engine.logs import CONTEXT_FIELDS, TaskContext, json_formatter, task_context
from fedq.errors import ConfigError
from fedq.observe.plots import PHASES, figures, write_figures
from fedq.observe.report import render
from fedq.observe.utilisation import job_utilisation, worker_utilisation
from fedq.settings import load_settings
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.testing.procs import run_module
from tests.conftest import free_port

# Three clients train on cpu; the fourth lands on a worker whose blob store can be
# neither read nor written (a folder under a file), so its task fails every round (an
# error row, a failed task per round; in round 1 at the upload, as the worker rebuilds
# round 0's model from the seed).
SPEC = {**DIGITS, "name": "observed", "queues": {"cpu": 3, "gpu_sm61": 1},
        "max_redispatch": 0, "eval_every": 1}
ROUNDS = DIGITS["rounds"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory, module_redis_db: str,
             module_pg_url: str, s3_server: str) -> Iterator[tuple[Cluster, str]]:
    tmp_path = tmp_path_factory.mktemp("observe")
    env = base_env(tmp_path, FEDQ_BROKER_URL=module_redis_db,
                   FEDQ_RESULT_BACKEND=module_redis_db, FEDQ_DATABASE_URL=module_pg_url,
                   FEDQ_BLOB_URL=f"s3://fedq/{tmp_path.name}", FEDQ_S3_ENDPOINT_URL=s3_server,
                   FEDQ_LOG_FORMAT="json")
    env.update({"AWS_ACCESS_KEY_ID": "fedq", "AWS_SECRET_ACCESS_KEY": "fedq-secret",
                "AWS_DEFAULT_REGION": "us-east-1"})
    cluster = Cluster(tmp_path, env)
    cluster.fedq("db", "upgrade")
    cluster.start(cpu=["cpu"], control=["control"])
    (tmp_path / "a-file").write_text("not a folder")
    cluster.add("bad", ["gpu_sm61"], FEDQ_BLOB_URL=str(tmp_path / "a-file" / "store"))
    job = cluster.submit(SPEC)
    view = cluster.wait(job, timeout=240)
    assert view.status == "completed", view.error
    yield cluster, job
    cluster.stop()


def _data(cluster: Cluster, job: str) -> tuple[dict[str, Any], list[dict], list[dict]]:
    settings = cluster.settings
    return job_record(settings, job), round_results(settings, job), client_results(settings, job)


@pytest.mark.slow
def test_task_rows_say_where_the_time_went(observed: tuple[Cluster, str]) -> None:
    cluster, job = observed
    _, rounds, clients = _data(cluster, job)
    assert all(r["finalize_seconds"] and r["finalize_seconds"] > 0 for r in rounds)
    ok = [c for c in clients if c["status"] == "ok"]
    assert len(ok) == 3 * ROUNDS
    for c in ok:
        start = c["started_at"]
        assert start is not None and c["dispatched_at"] <= start, c
        assert c["download_seconds"] is not None and c["upload_seconds"] > 0
        assert c["train_seconds"] > 0
        assert c["download_seconds"] + c["train_seconds"] + c["upload_seconds"] \
            <= c["seconds"] + 1e-6
    failed = [c for c in clients if c["status"] == "error"]
    assert len(failed) == ROUNDS and all(c["started_at"] for c in failed)
    shown = run_module("fedq.cli", ["results", job, "--clients"],
                       {**cluster.env, "COLUMNS": "300"}, 120)
    shown.check_returncode()
    table = shown.stdout
    assert "down+up s" in table and "train s" in table
    assert re.search(r"│ \d+\.\d\d\+\d+\.\d\d │", table), table  # download+upload
    # where each worker's time went: the cpu worker's compute is its tasks' training;
    # the bad worker's tasks never reported how they trained
    out = json.loads(cluster.fedq("results", job, "--json").stdout)
    [cpu] = out["workers"]
    assert cpu["worker"] == "cpu@test" and cpu["tasks"] == 3 * ROUNDS
    assert cpu["compute_s"] == pytest.approx(sum(c["train_seconds"] for c in ok), abs=0.01)
    assert cpu["transfer_s"] == pytest.approx(
        sum(c["download_seconds"] + c["upload_seconds"] for c in ok), abs=0.01)
    assert 0 < cpu["utilisation"] <= 1 and out["utilisation"] == cpu["utilisation"]
    assert cpu["window_s"] >= cpu["compute_s"] + cpu["transfer_s"] + cpu["waiting_s"] - 0.01
    assert f"cpu@test: {cpu['utilisation']:.0%} computing" in table, table


@pytest.mark.slow
def test_figures_draw_every_round_and_task(observed: tuple[Cluster, str],
                                           tmp_path: Path) -> None:
    cluster, job = observed
    record, rounds, clients = _data(cluster, job)
    figs = figures(record, rounds, clients)
    # not buffered: no staleness
    assert set(figs) == {"progress", "timeline", "bytes", "utilisation"}
    accuracy = figs["progress"].axes[0].lines[0]
    assert list(accuracy.get_xdata()) == [1, 2, 3]
    assert list(accuracy.get_ydata()) == [r["accuracy"] for r in rounds]
    assert len(figs["progress"].axes[1].lines) == 2  # training and validation loss
    timeline = figs["timeline"].axes[0]
    ok = [c for c in clients if c["status"] == "ok"]
    # one bar per phase per task that ran (failed tasks ran too: they downloaded nothing)
    assert len(timeline.containers) == len(PHASES) * len(clients)
    assert [t.get_text() for t in timeline.get_yticklabels()][0].startswith("r1 c")
    crosses = [line for line in timeline.lines if line.get_marker() == "x"]
    assert len(crosses) == ROUNDS  # the failed task of each round is marked
    up = figs["bytes"].axes[0]
    drawn = sum(bar.get_height() for container in up.containers for bar in container)
    assert drawn == pytest.approx(sum(c["bytes_up"] for c in clients) / 1e6)
    assert len(up.containers) == len({c["client"] for c in clients})
    # where the cpu worker's time went: its window, split four ways
    [share] = worker_utilisation(clients)
    bars = [bar.get_width() for c in figs["utilisation"].axes[0].containers for bar in c]
    assert bars == pytest.approx([share[k] for k in ("compute_s", "transfer_s", "other_s",
                                                     "waiting_s")])
    paths = write_figures(figs, tmp_path, job)
    assert len(paths) == 8
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") if path.suffix == ".png" else b"<svg" in data
    assert not list(tmp_path.glob(".*partial"))
    assert ok  # the figures are of a job that trained

    # The CLI writes the same files; bad input is one line and exit 2.
    cli = cluster.fedq("plot", job, "--out", str(tmp_path / "cli"), "--format", "png")
    assert sorted(Path(p).name for p in cli.stdout.split()) == sorted(
        f"{job}-{n}.png" for n in ("progress", "timeline", "bytes", "utilisation"))
    bad = cluster.fedq("plot", job, "--format", "gif", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "gif" in bad.stderr
    missing = cluster.fedq("plot", "nosuchjob", check=False)
    assert missing.returncode == 4 and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_report_is_one_self_contained_page(observed: tuple[Cluster, str],
                                           tmp_path: Path) -> None:
    cluster, job = observed
    out = tmp_path / "report.html"
    cluster.fedq("report", job, "--out", str(out))
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert len(re.findall(r'<img alt="[a-z]+" src="data:image/png;base64,', page)) == 4
    used = re.search(r'<table id="utilisation">(.*?)</table>', page, re.S)
    assert used and "cpu@test" in used.group(1) and "bad@test" not in used.group(1)
    rounds = re.search(r'<table id="rounds">(.*?)</table>', page, re.S)
    assert rounds and rounds.group(1).count("<tr") == 1 + ROUNDS
    clients = re.search(r'<table id="clients">(.*?)</table>', page, re.S)
    assert clients and clients.group(1).count("<tr") == 1 + 4 * ROUNDS
    assert clients.group(1).count("<tr class=failed>") == ROUNDS
    workers = re.search(r'<table id="workers">(.*?)</table>', page, re.S)
    assert workers and "cpu@test" in workers.group(1) and "bad@test" in workers.group(1)
    assert "control@test" not in workers.group(1)  # only machines that trained for it
    assert "name: observed" in page  # the spec
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from elsewhere


@pytest.mark.slow
def test_metrics_endpoint_scraped(observed: tuple[Cluster, str]) -> None:
    cluster, job = observed
    # Two tasks wait on gpu_new, which no worker consumes: the depth counts them as
    # kombu itself does (fedq reads Redis' lists directly, in one round trip).
    app = cluster.client_app()
    for _ in range(2):
        app.send_task("fedq.train", args=[{}], queue="gpu_new")
    with app.connection_for_read() as conn:
        waiting = conn.default_channel.queue_declare(queue="gpu_new", passive=True)
    assert waiting.message_count == 2
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fedq.cli", "metrics", "--host",
                             "127.0.0.1", "--port", str(port)], env=cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        text = _scrape(f"http://127.0.0.1:{port}/metrics", proc)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    samples: dict[str, list[Any]] = {}
    served: set[str] = set()  # every series name, with or without samples now
    for family in text_string_to_metric_families(text):
        served.add(family.name + ("_total" if family.type == "counter" else ""))
        for s in family.samples:
            served.add(s.name)
            samples.setdefault(s.name, []).append(s)

    def value(metric: str, **labels: str) -> float:
        found = [s.value for s in samples.get(metric, [])
                 if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (metric, labels, samples.get(metric))
        return float(found[0])

    _, rounds, clients = _data(cluster, job)
    assert value("fedq_rounds_total", job=job, status="committed") == ROUNDS
    assert value("fedq_round_duration_seconds_count", job=job) == ROUNDS
    assert value("fedq_round_duration_seconds_sum", job=job) == pytest.approx(
        sum(r["seconds"] for r in rounds))
    assert value("fedq_client_updates_total", job=job, status="ok") == 3 * ROUNDS
    assert value("fedq_client_updates_total", job=job, status="error") == ROUNDS
    assert value("fedq_last_round_clients", job=job, status="ok") == 3
    assert value("fedq_accuracy", job=job) == pytest.approx(rounds[-1]["accuracy"])
    assert value("fedq_bytes_up_total", job=job) == sum(r["bytes_up"] for r in rounds)
    assert value("fedq_job_committed_rounds", job=job, name="observed") == ROUNDS
    assert value("fedq_jobs", status="completed") >= 1
    assert value("fedq_worker_tasks_total", worker="cpu@test", result="done") == 3 * ROUNDS
    assert value("fedq_worker_tasks_total", worker="bad@test", result="failed") == ROUNDS
    assert value("fedq_worker_samples_per_second", worker="cpu@test", queues="cpu") > 0
    [share] = worker_utilisation(clients)
    assert value("fedq_worker_utilization_ratio", job=job, worker="cpu@test") == \
        pytest.approx(share["utilisation"])
    assert value("fedq_broker_up") == 1
    assert value("fedq_queue_depth", queue="cpu") == 0
    assert value("fedq_queue_depth", queue="gpu_new") == 2
    import redis

    redis.Redis.from_url(cluster.env["FEDQ_BROKER_URL"]).delete("gpu_new")

    # The Grafana dashboard in docker/ queries only series this endpoint serves.
    dashboard = json.loads((ROOT / "docker" / "grafana" / "fedq-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(fedq_[a-z_]+)", target["expr"])}
    assert len(queried) >= 12
    assert queried <= served, queried - served


def _scrape(url: str, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.read().decode()
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode() if proc.stdout else ""
                raise AssertionError(f"fedq metrics did not serve: {out}") from None
            time.sleep(0.3)


@pytest.mark.slow
def test_every_log_line_is_json_with_its_task_context(observed: tuple[Cluster, str]) -> None:
    cluster, job = observed
    logs = {w.hostname: w.log_path.read_text().splitlines() for w in cluster.workers}
    trained: list[dict[str, Any]] = []
    committed: list[dict[str, Any]] = []
    for host, lines in logs.items():
        # Celery's own text format ("[2026-... INFO/MainProcess] ...") must not appear:
        # every log record went through the JSON formatter.
        assert not [line for line in lines if re.match(r"\[\d{4}-\d\d-\d\d .*(INFO|WARNING)/",
                                                       line)], host
        for line in lines:
            if not line.startswith("{"):
                continue  # the worker's start-up banner is printed, not logged
            entry = json.loads(line)
            assert {"time", "level", "logger", "message", *CONTEXT_FIELDS} <= set(entry)
            if entry["message"].startswith("trained:"):
                trained.append(entry)
            if entry["logger"] == "fedq.coordinator.finalize" and entry["job"] == job \
                    and "committed" in entry["message"]:
                committed.append(entry)
    assert len(trained) >= 3 * ROUNDS
    mine = [e for e in trained if e["job"] == job]
    assert sorted((e["round"], e["client"]) for e in mine) == sorted(
        (c["round"], c["client"]) for c in client_results(cluster.settings, job)
        if c["status"] == "ok")
    for entry in mine:
        assert entry["worker"] == "cpu@test" and entry["queue"] == "cpu"
        assert entry["task_id"].startswith(f"fedq-{job}-") and entry["task"] == "fedq.train"
    assert sorted(e["round"] for e in committed) == [1, 2, 3]
    assert {e["task"] for e in committed} == {"fedq.finalize_round"}
    failed = [json.loads(line) for line in logs["bad@test"] if line.startswith("{")
              and "training failed" in line]
    assert len(failed) == ROUNDS and all(e["level"] == "WARNING" for e in failed)


@pytest.mark.slow
def test_workers_show_failures_and_throughput(observed: tuple[Cluster, str]) -> None:
    cluster, _ = observed
    rows = {w["hostname"]: w for w in list_workers(cluster.settings.database_url)}
    assert rows["cpu@test"]["tasks_done"] == 3 * ROUNDS and rows["cpu@test"]["tasks_failed"] == 0
    assert rows["bad@test"]["tasks_failed"] == ROUNDS
    assert rows["cpu@test"]["last_task"] is not None
    assert rows["cpu@test"]["hardware"]["cpus"] >= 1
    shown = run_module("fedq.cli", ["workers", "--timeout", "3"],
                       {**cluster.env, "COLUMNS": "250"}, 120)
    shown.check_returncode()
    table = shown.stdout
    for header in ("failed", "samples/s", "last task", "GPU"):
        assert header in table, table
    line = next(line for line in table.splitlines() if "bad@test" in line)
    assert re.search(rf"│\s*0\s*│\s*{ROUNDS}\s*│", line), line  # 0 done, 3 failed


def test_task_context_from_a_task_call() -> None:
    class Request:
        id, hostname, delivery_info = "t-1", "w@host", {"routing_key": "cpu"}

    class Train:
        name, request = "fedq.train", Request()

        def run(self, ref: dict[str, Any]) -> None: ...

    class Finalize:
        name, request = "fedq.finalize_round", Request()

        def run(self, results: list[Any], job_id: str, round_number: int) -> None: ...

    ref = {"job": "j1", "round": 4, "client": 2, "queue": "cpu"}
    assert task_context(Train(), (ref,), {}) == {
        "task_id": "t-1", "task": "fedq.train", "worker": "w@host", "queue": "cpu",
        "job": "j1", "round": 4, "client": 2}
    assert task_context(Finalize(), ([], "j2", 7), {}) | {"client": None} == {
        "task_id": "t-1", "task": "fedq.finalize_round", "worker": "w@host",
        "queue": "cpu", "job": "j2", "round": 7, "client": None}


def test_json_formatter_writes_one_object_with_every_field() -> None:
    record = logging.LogRecord("fedq.x", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    TaskContext().filter(record)
    entry = json.loads(json_formatter().format(record))
    assert entry["message"] == "hello you" and entry["level"] == "INFO"
    assert entry["logger"] == "fedq.x" and set(CONTEXT_FIELDS) <= set(entry)


def test_log_format_setting_is_checked() -> None:
    assert load_settings({"FEDQ_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(ConfigError, match="FEDQ_LOG_FORMAT"):
        load_settings({"FEDQ_LOG_FORMAT": "xml"})


def test_report_escapes_what_it_shows() -> None:
    job = {"id": "j", "name": "<b>x</b>", "status": "failed", "committed_round": 0,
           "total_rounds": 1, "error": "<script>", "spec": {"name": "<i>"}}
    page = render(job, [], [], [], {})
    assert "<script>" not in page and "&lt;script&gt;" in page and "<b>x</b>" not in page


@pytest.mark.slow
def test_doctor_times_the_broker_and_a_blob_each_way(observed: tuple[Cluster, str]) -> None:
    cluster, _ = observed
    report = json.loads(cluster.fedq("doctor", "--services", "--json").stdout)
    links = report["services"]
    assert links["problems"] == [] and links["blob_bytes"] == 10 * 2**20
    assert links["upload_seconds"] > 0 and links["download_seconds"] > 0
    assert links["broker_connect_seconds"] > 0 and "fedq-secret" not in json.dumps(report)
    # how the store keeps a blob, and at what size it chunks (FEDQ_BLOB_CHUNK_MB)
    env = {**cluster.env, "FEDQ_BLOB_URL": cluster.env["FEDQ_BROKER_URL"],
           "FEDQ_BLOB_CHUNK_MB": "8"}
    shown = run_module("fedq.cli", ["doctor", "--services"], env, 120)
    assert shown.returncode == 0, shown.stderr
    assert "one value a blob up to 8 MiB, a larger one as chunks of that size and a " \
        "manifest, at most 10,000 chunks" in shown.stdout
    assert links["blob_layout"] == store_for(cluster.settings).layout()
    bad = run_module("fedq.cli", ["doctor", "--services"],
                     {**cluster.env, "FEDQ_BROKER_URL": "redis://127.0.0.1:1/0"}, 120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "broker redis://127.0.0.1:1/0 is not reachable" in bad.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_a_rounds_measurements_fold_into_each_worker_in_order(tmp_path: Path,
                                                              shared: bool) -> None:
    """A round's throughput and task rows, workers interleaved as results arrive, fold
    into each worker's row as if applied one by one: the moving average in order, every
    task and failure counted, the last task's GPU figures kept; rows of tasks still
    training or missing, or of no worker, count nothing. The workers' rows are read in
    one SELECT for each call, or one for both when the caller reads them (``shared``,
    as a round's commit does)."""
    from sqlalchemy import event

    from fedq.coordinator.roster import ema, record_tasks, record_throughput, worker_rows
    from fedq.db import ClientUpdate, Worker, session_scope
    from fedq.db.session import connect, ensure_schema
    from fedq.status import UpdateStatus

    db = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(db)
    with session_scope(db) as s:
        s.add(Worker(hostname="a@x", queues=["cpu"], hardware={}, tasks_done=3,
                     samples_per_second=50.0))
    measured = [("a@x", 100, 1.0), ("b@y", 30, 1.0), ("a@x", 200, 1.0), ("b@y", 0, 1.0),
                ("a@x", 10, 0.0), ("b@y", 60, 2.0)]

    def row(worker: str, status: str, gpu: float | None = None) -> ClientUpdate:
        return ClientUpdate(job_id="j", round_number=1, client=0, worker=worker,
                            status=status, gpu_peak_mb=gpu)

    rows = [row("a@x", UpdateStatus.OK, 10.0), row("b@y", UpdateStatus.REJECTED),
            row("a@x", UpdateStatus.ERROR, 20.0), row("b@y", UpdateStatus.MISSING),
            row("?", UpdateStatus.ERROR)]
    reads: list[str] = []

    def count(conn: object, cursor: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM workers" in statement:
            reads.append(statement)

    event.listen(connect(db), "before_cursor_execute", count)
    try:
        with session_scope(db) as s:
            workers = worker_rows(s, ["a@x", "b@y"]) if shared else None
            record_throughput(s, measured, workers)
            record_tasks(s, rows, workers)
    finally:
        event.remove(connect(db), "before_cursor_execute", count)
    assert len(reads) == (1 if shared else 2), reads
    with session_scope(db) as s:
        a, b = s.get(Worker, "a@x"), s.get(Worker, "b@y")
        assert a is not None and b is not None
        assert a.samples_per_second == pytest.approx(ema(ema(50.0, 100.0), 200.0))
        assert b.samples_per_second == pytest.approx(ema(ema(None, 30.0), 30.0))
        assert (a.tasks_done, b.tasks_done) == (5, 2)  # only measurements with work in them
        assert (a.tasks_failed, b.tasks_failed) == (1, 1) and a.gpu_peak_mb == 20.0
        assert s.get(Worker, "?") is None


def test_a_workers_window_splits_into_compute_transfer_other_and_waiting() -> None:
    """Two tasks of w1 four seconds apart, one of w2, and rows that say nothing of how
    they trained (an error, a task never started): each worker's window runs from its
    first task's start to its last one's end on its own clock."""
    rows = [
        {"worker": "w1", "started_at": "2026-01-01T00:00:00+00:00", "seconds": 10.0,
         "train_seconds": 6.0, "download_seconds": 1.0, "upload_seconds": 2.0},
        {"worker": "w1", "started_at": "2026-01-01T00:00:14+00:00", "seconds": 10.0,
         "train_seconds": 8.0, "download_seconds": 0.0, "upload_seconds": 1.0},
        {"worker": "w2", "started_at": "2026-01-01T05:00:00+00:00", "seconds": 4.0,
         "train_seconds": 2.0, "download_seconds": None, "upload_seconds": 1.0},
        {"worker": "w2", "started_at": "2026-01-01T05:00:09+00:00", "seconds": 1.0,
         "train_seconds": None},  # an error: it never said how it trained
        {"worker": "w3", "started_at": None, "seconds": 0.0, "train_seconds": None},
    ]
    w1, w2 = worker_utilisation(rows)
    assert w1 == {"worker": "w1", "tasks": 2, "window_s": 24.0, "compute_s": 14.0,
                  "transfer_s": 4.0, "other_s": 2.0, "waiting_s": 4.0,
                  "utilisation": round(14 / 24, 4)}
    assert (w2["window_s"], w2["utilisation"], w2["waiting_s"]) == (4.0, 0.5, 0.0)
    assert job_utilisation([w1, w2]) == round(16 / 28, 4)
    assert worker_utilisation([]) == [] and job_utilisation([]) is None
