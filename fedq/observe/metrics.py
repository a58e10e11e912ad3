"""Federated-learning metrics for Prometheus, read from the database at each scrape.

``fedq metrics`` serves them (one process per deployment); nothing is added to the
round's path: every number here is already in SQL (rounds, client rows, workers,
watchdog actions) or asked of the broker (queue depths). Names follow Prometheus'
conventions (``_total`` counters, ``_seconds`` units); see docs/observability.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, or_, select

from fedq.db import ClientUpdate, Job, Round, WatchdogAction, Worker, session_scope
from fedq.db.models import aware
from fedq.db.session import ensure_schema
from fedq.errors import require_extra
from fedq.observe.utilisation import worker_utilisation
from fedq.settings import Settings
from fedq.status import JobStatus, RoundStatus

log = logging.getLogger(__name__)

#: Round duration histogram buckets, seconds: a tiny zero-compute round to an hour.
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


#: Besides the running jobs, the newest this many jobs have their workers' utilisation
#: in a scrape (each costs a read of its finished tasks' timings).
UTILISATION_JOBS = 5

class FedqCollector:
    """A prometheus-client collector: each scrape reads the database once.

    ``queues`` lists the hardware queues whose depth is reported (the broker is asked;
    when it does not answer, ``fedq_broker_up`` is 0 and no depth is reported)."""

    def __init__(self, settings: Settings, queues: list[str], broker: bool = True) -> None:
        self.settings, self.queues, self.broker = settings, queues, broker
        self._conn: Any = None  # one broker connection, kept across scrapes
        self._schema_checked = False

    def _depths(self) -> dict[str, int]:
        from fedq.engine.app import app
        from fedq.engine.broker import queue_depths

        if self._conn is None:
            self._conn = app.connection_for_read()
        try:
            return queue_depths(self.queues, self._conn)
        except Exception:
            self._conn.release()  # reconnect on the next scrape
            self._conn = None
            raise

    def describe(self) -> list[Any]:
        return []  # families are only known at scrape time (no registry-time query)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        started = time.perf_counter()
        if not self._schema_checked:  # once per process, not per scrape
            ensure_schema(self.settings.database_url)
            self._schema_checked = True
        with session_scope(self.settings.database_url) as s:
            jobs = s.execute(select(Job.id, Job.name, Job.status, Job.committed_round,
                                    Job.total_rounds)).all()
            rounds = s.execute(select(Round.job_id, Round.number, Round.status, Round.seconds,
                                      Round.bytes_up, Round.bytes_down, Round.accuracy,
                                      Round.eval_loss, Round.train_loss)
                               .order_by(Round.job_id, Round.number)).all()
            clients = s.execute(select(ClientUpdate.job_id, ClientUpdate.status, func.count())
                                .group_by(ClientUpdate.job_id, ClientUpdate.status)).all()
            last_clients = s.execute(
                select(ClientUpdate.job_id, ClientUpdate.status, func.count())
                .join(Job, Job.id == ClientUpdate.job_id)
                .where(ClientUpdate.round_number == Job.committed_round)
                .group_by(ClientUpdate.job_id, ClientUpdate.status)).all()
            # where each worker's time went, in the running jobs and the newest few
            recent = select(Job.id).order_by(Job.created_at.desc()).limit(UTILISATION_JOBS)
            timed = s.execute(
                select(ClientUpdate.job_id, ClientUpdate.worker, ClientUpdate.started_at,
                       ClientUpdate.seconds, ClientUpdate.train_seconds,
                       ClientUpdate.download_seconds, ClientUpdate.upload_seconds)
                .join(Job, Job.id == ClientUpdate.job_id)
                .where(or_(Job.status == JobStatus.RUNNING, Job.id.in_(recent)),
                       ClientUpdate.train_seconds.is_not(None))).all()
            workers = s.scalars(select(Worker)).all()
            repairs = s.execute(select(WatchdogAction.action, func.count())
                                .group_by(WatchdogAction.action)).all()
            worker_rows = [(w.hostname, ",".join(w.queues or []), w.tasks_done or 0,
                            w.tasks_failed or 0, w.samples_per_second, w.gpu_peak_mb,
                            w.gpu_util, aware(w.last_seen).timestamp(), w.available)
                           for w in workers]

        job_status = GaugeMetricFamily("fedq_jobs", "Jobs by status", labels=["status"])
        for status in JobStatus:
            job_status.add_metric([status], sum(1 for j in jobs if j.status == status))
        yield job_status
        progress = GaugeMetricFamily("fedq_job_committed_rounds",
                                     "Rounds (buffered: versions) committed so far",
                                     labels=["job", "name"])
        planned = GaugeMetricFamily("fedq_job_planned_rounds", "Rounds the job will run",
                                    labels=["job", "name"])
        for j in jobs:
            progress.add_metric([j.id, j.name], j.committed_round)
            planned.add_metric([j.id, j.name], j.total_rounds)
        yield progress
        yield planned

        by_job: dict[str, list[Any]] = {}
        for r in rounds:
            by_job.setdefault(r.job_id, []).append(r)
        finished = CounterMetricFamily("fedq_rounds", "Rounds finished, by outcome",
                                       labels=["job", "status"])
        duration = HistogramMetricFamily("fedq_round_duration_seconds",
                                         "Committed rounds' wall time, start to commit",
                                         labels=["job"])
        up = CounterMetricFamily("fedq_bytes_up", "Update bytes workers uploaded",
                                 labels=["job"])
        down = CounterMetricFamily("fedq_bytes_down", "Model bytes workers downloaded",
                                   labels=["job"])
        accuracy = GaugeMetricFamily("fedq_accuracy", "Accuracy of the last evaluated round",
                                     labels=["job"])
        eval_loss = GaugeMetricFamily("fedq_eval_loss",
                                      "Validation loss of the last evaluated round",
                                      labels=["job"])
        train_loss = GaugeMetricFamily("fedq_train_loss",
                                       "Training loss of the last committed round",
                                       labels=["job"])
        for job_id, rows in by_job.items():
            committed = [r for r in rows if r.status == RoundStatus.COMMITTED]
            for closed in (RoundStatus.COMMITTED, RoundStatus.FAILED):
                finished.add_metric([job_id, closed], sum(1 for r in rows if r.status == closed))
            seconds = [r.seconds for r in committed if r.seconds is not None]
            buckets = [(str(bound), float(sum(1 for x in seconds if x <= bound)))
                       for bound in ROUND_BUCKETS] + [("+Inf", float(len(seconds)))]
            duration.add_metric([job_id], buckets, sum(seconds))
            up.add_metric([job_id], float(sum(r.bytes_up or 0 for r in committed)))
            down.add_metric([job_id], float(sum(r.bytes_down or 0 for r in committed)))
            evaluated = [r for r in committed if r.accuracy is not None or r.eval_loss is not None]
            if evaluated and evaluated[-1].accuracy is not None:
                accuracy.add_metric([job_id], evaluated[-1].accuracy)
            if evaluated and evaluated[-1].eval_loss is not None:
                eval_loss.add_metric([job_id], evaluated[-1].eval_loss)
            if committed and committed[-1].train_loss is not None:
                train_loss.add_metric([job_id], committed[-1].train_loss)
        yield from (finished, duration, up, down, accuracy, eval_loss, train_loss)

        updates = CounterMetricFamily(
            "fedq_client_updates", "Client task outcomes (ok, missing, late, rejected, error, "
            "stale; buffered jobs also training, buffered)", labels=["job", "status"])
        for job_id, status, count in clients:
            updates.add_metric([job_id, status], count)
        yield updates
        last = GaugeMetricFamily("fedq_last_round_clients",
                                 "Clients of the last committed round, by outcome",
                                 labels=["job", "status"])
        for job_id, status, count in last_clients:
            last.add_metric([job_id, status], count)
        yield last

        rate = GaugeMetricFamily("fedq_worker_samples_per_second",
                                 "Measured training throughput (moving average)",
                                 labels=["worker", "queues"])
        tasks = CounterMetricFamily("fedq_worker_tasks", "Training tasks by result",
                                    labels=["worker", "result"])
        seen = GaugeMetricFamily("fedq_worker_last_seen_timestamp_seconds",
                                 "When the worker last registered or finished a task",
                                 labels=["worker"])
        gpu_mem = GaugeMetricFamily("fedq_worker_gpu_peak_bytes",
                                    "Peak GPU memory torch allocated in the last task",
                                    labels=["worker"])
        gpu_util = GaugeMetricFamily("fedq_worker_gpu_utilization_ratio",
                                     "Mean GPU utilisation sampled during the last task",
                                     labels=["worker"])
        available = GaugeMetricFamily("fedq_worker_available",
                                      "1 while the worker's run policy lets it train, 0 while "
                                      "it steps aside for its owner (docs/owners.md)",
                                      labels=["worker"])
        for host, queues, done, failed, sps, peak, util, last_seen, free in worker_rows:
            if free is not None:
                available.add_metric([host], 1.0 if free else 0.0)
            if sps is not None:
                rate.add_metric([host, queues], sps)
            tasks.add_metric([host, "done"], done)
            tasks.add_metric([host, "failed"], failed)
            seen.add_metric([host], last_seen)
            if peak is not None:
                gpu_mem.add_metric([host], peak * 2**20)
            if util is not None:
                gpu_util.add_metric([host], util / 100)
        yield from (rate, tasks, seen, gpu_mem, gpu_util, available)

        busy = GaugeMetricFamily("fedq_worker_utilization_ratio",
                                 "Share of a worker's window in a job spent computing "
                                 "(running jobs and the newest few; "
                                 "fedq.observe.utilisation)",
                                 labels=["job", "worker"])
        per_job: dict[str, list[dict[str, Any]]] = {}
        for row in timed:
            per_job.setdefault(row.job_id, []).append(row._asdict())
        for job_id, job_rows in per_job.items():
            for w in worker_utilisation(job_rows):
                if w["utilisation"] is not None:
                    busy.add_metric([job_id, w["worker"]], w["utilisation"])
        yield busy

        repaired = CounterMetricFamily("fedq_watchdog_repairs", "Repairs the watchdog made",
                                       labels=["action"])
        for action, count in repairs:
            repaired.add_metric([action], count)
        yield repaired

        if self.broker:
            broker_up = GaugeMetricFamily("fedq_broker_up",
                                          "1 when the broker answered this scrape")
            depth = GaugeMetricFamily("fedq_queue_depth", "Tasks waiting in each queue",
                                      labels=["queue"])
            try:
                for name, n in self._depths().items():
                    depth.add_metric([name], n)
                broker_up.add_metric([], 1)
                yield depth
            except Exception as exc:  # the scrape still reports the database's numbers
                log.warning("fedq metrics: broker did not answer: %s", exc)
                broker_up.add_metric([], 0)
            yield broker_up
        scrape = GaugeMetricFamily("fedq_scrape_duration_seconds",
                                   "Time this scrape took to read the database and broker")
        scrape.add_metric([], time.perf_counter() - started)
        yield scrape


def registry(settings: Settings, queues: list[str], broker: bool = True) -> Any:
    """A registry holding only fedq's collector (no process or platform metrics)."""
    require_extra("prometheus_client", "metrics", "fedq metrics")
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(FedqCollector(settings, queues, broker))  # type: ignore[arg-type]
    return reg


def exposition(settings: Settings, queues: list[str], broker: bool = True) -> str:
    """One scrape, as Prometheus' text format."""
    from prometheus_client import generate_latest

    return generate_latest(registry(settings, queues, broker)).decode()


def serve(settings: Settings, queues: list[str], host: str, port: int) -> Any:
    """Serve /metrics on ``host:port`` from a background thread; returns the server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host,
                                        registry=registry(settings, queues))
    return server
