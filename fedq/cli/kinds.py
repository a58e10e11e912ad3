"""The kinds of job a person works with — training (rounds or buffered) and batch
inference — behind one interface. A command asks :func:`kind_of` which kind a job id
is and calls that kind's method; no command tests a job's kind itself. A new kind is a
subclass of :class:`JobKind` and an entry in :data:`KINDS`."""

from __future__ import annotations

import csv
import json
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import click

from fedq.cli.output import (
    buffered_summary,
    clients_table,
    follow,
    job_json,
    out,
    results_table,
    utilisation_lines,
)
from fedq.errors import ConfigError, FedqError, JobNotFound
from fedq.settings import Settings


class JobKind(ABC):
    """What the CLI can do with a job of one kind. ``view``: what :meth:`find`
    returned for the job."""

    name: str

    @abstractmethod
    def find(self, settings: Settings, job_id: str) -> Any | None:
        """The job's view if ``job_id`` is a job of this kind, else None."""

    @abstractmethod
    def show(self, settings: Settings, job_id: str, view: Any, as_json: bool) -> None:
        """``fedq status JOB``: the job, what it waits for and what was repaired."""

    @abstractmethod
    def follow(self, settings: Settings, job_id: str, interval: float,
               timeout: float | None) -> Any:
        """``fedq watch``: follow the job until it ends or ``timeout``; its last view
        (with ``status``)."""

    @abstractmethod
    def cancel(self, settings: Settings, job_id: str) -> int:
        """Stop the job; the number of tasks revoked."""

    @abstractmethod
    def resume(self, settings: Settings, job_id: str) -> str:
        """Restart a failed or cancelled job; what to tell the person."""

    @abstractmethod
    def results(self, settings: Settings, job_id: str, view: Any, *, as_json: bool,
                as_csv: bool, per_client: bool, out_path: Path | None) -> None:
        """``fedq results``: print the job's results (or write its outputs)."""

    @abstractmethod
    def figures(self, settings: Settings, job_id: str, view: Any,
                required: bool) -> dict[str, Any]:
        """The job's figures; with ``required``, a ConfigError when there is nothing to
        draw yet."""

    @abstractmethod
    def page(self, settings: Settings, job_id: str, view: Any,
             figs: dict[str, Any]) -> str:
        """``fedq report``: the job's HTML page with ``figs``."""


class Training(JobKind):
    name = "training"

    def find(self, settings: Settings, job_id: str) -> Any | None:
        from fedq.coordinator.jobs import get_job

        try:
            return get_job(settings, job_id)
        except JobNotFound:
            return None

    def show(self, settings: Settings, job_id: str, view: Any, as_json: bool) -> None:
        from rich.table import Table

        from fedq.cli.output import fmt, status_style

        if as_json:
            click.echo(json.dumps([job_json(view)], indent=2))
            return
        table = Table("job", "name", "status", "round", "accuracy", "created", "error")
        table.add_row(view.id, view.name, status_style(view.status),
                      f"{view.committed_round}/{view.total_rounds}", fmt(view.accuracy, ".4f"),
                      view.created_at, (view.error or "")[:80])
        out.print(table)
        _waits(settings, job_id)  # each started task's worker and heartbeat

    def follow(self, settings: Settings, job_id: str, interval: float,
               timeout: float | None) -> Any:
        return follow(job_id, interval=interval, timeout=timeout)

    def cancel(self, settings: Settings, job_id: str) -> int:
        from fedq.coordinator.jobs import cancel

        return cancel(settings, job_id)

    def resume(self, settings: Settings, job_id: str) -> str:
        from fedq.coordinator.jobs import resume

        return f"job {job_id} resumed at round {resume(settings, job_id)}"

    def results(self, settings: Settings, job_id: str, view: Any, *, as_json: bool,
                as_csv: bool, per_client: bool, out_path: Path | None) -> None:
        from fedq.coordinator.jobs import ROUND_FIELDS, client_results, round_results

        if out_path is not None:
            raise FedqError(f"--out: job {job_id} is a training job; --out writes an "
                            "inference job's outputs")
        from fedq.observe.utilisation import job_utilisation, worker_utilisation

        rows = round_results(settings, job_id)
        if as_json:
            clients = client_results(settings, job_id)
            workers = worker_utilisation(clients)
            click.echo(json.dumps({"job": job_json(view), "rounds": rows, "clients": clients,
                                   "workers": workers,
                                   "utilisation": job_utilisation(workers)}, indent=2))
        elif as_csv:
            writer = csv.DictWriter(sys.stdout, fieldnames=ROUND_FIELDS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        else:
            out.print(results_table(view, rows))
            clients = client_results(settings, job_id)
            summary = buffered_summary(clients, sum(r["seconds"] or 0 for r in rows))
            if summary:
                out.print(summary, highlight=False)
            for line in utilisation_lines(worker_utilisation(clients)):
                out.print(line, highlight=False)
            if per_client:
                out.print(clients_table(clients))

    def _data(self, settings: Settings, job_id: str
              ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
        from fedq.coordinator.jobs import client_results, job_record, round_results

        return (job_record(settings, job_id), round_results(settings, job_id),
                client_results(settings, job_id))

    def figures(self, settings: Settings, job_id: str, view: Any,
                required: bool) -> dict[str, Any]:
        from fedq.observe.plots import figures

        job, rounds, clients = self._data(settings, job_id)
        if not rounds:
            if required:
                raise ConfigError(f"job {job_id} has no rounds yet: nothing to plot")
            return {}
        return figures(job, rounds, clients, _availability(settings, job))

    def page(self, settings: Settings, job_id: str, view: Any,
             figs: dict[str, Any]) -> str:
        from fedq.coordinator.roster import list_workers
        from fedq.observe.report import render

        job, rounds, clients = self._data(settings, job_id)
        return render(job, rounds, clients, list_workers(settings.database_url), figs)


class Inference(JobKind):
    name = "inference"

    def find(self, settings: Settings, job_id: str) -> Any | None:
        from fedq.inference.jobs import find

        return find(settings, job_id)

    def show(self, settings: Settings, job_id: str, view: Any, as_json: bool) -> None:
        from fedq.cli.infer import summary

        if as_json:
            click.echo(json.dumps([{"kind": "inference", **view.to_json()}], indent=2))
            return
        out.print(summary(view))
        _waits(settings, job_id, "shard", "running")  # each shard out: worker, heartbeat

    def follow(self, settings: Settings, job_id: str, interval: float,
               timeout: float | None) -> Any:
        from fedq.cli import infer as infer_cli

        return infer_cli.follow(settings, job_id, interval=interval, timeout=timeout)

    def cancel(self, settings: Settings, job_id: str) -> int:
        from fedq.inference.jobs import cancel

        return cancel(settings, job_id)

    def resume(self, settings: Settings, job_id: str) -> str:
        from fedq.inference.jobs import resume

        return f"job {job_id} resumed: {resume(settings, job_id)} shard(s) to go"

    def results(self, settings: Settings, job_id: str, view: Any, *, as_json: bool,
                as_csv: bool, per_client: bool, out_path: Path | None) -> None:
        from fedq.cli.infer import summary
        from fedq.inference.jobs import merge

        if out_path is not None:
            lines = merge(settings, job_id, out_path)
            click.echo(f"{lines} outputs of job {job_id} written to {out_path}")
        elif as_json:
            click.echo(json.dumps(view.to_json(), indent=2))
        else:
            out.print(summary(view))

    def figures(self, settings: Settings, job_id: str, view: Any,
                required: bool) -> dict[str, Any]:
        from fedq.observe.plots import inference_figures

        if not any(r.get("started") for r in view.shard_rows):
            if required:
                raise ConfigError(f"job {job_id} has no shard started yet: nothing to plot")
            return {}
        return inference_figures(view)

    def page(self, settings: Settings, job_id: str, view: Any,
             figs: dict[str, Any]) -> str:
        from fedq.observe.report import render_inference as render_page

        return render_page(view, figs)


#: The kinds, in the order a job id is looked up.
KINDS: tuple[JobKind, ...] = (Inference(), Training())


def kind_of(settings: Settings, job_id: str) -> tuple[JobKind, Any]:
    """The kind of job ``job_id`` and its view; JobNotFound (exit 4) when no kind has
    it."""
    for kind in KINDS:
        view = kind.find(settings, job_id)
        if view is not None:
            return kind, view
    raise JobNotFound(f"no job {job_id!r} in {settings.database_url.split('@')[-1]}")


def _waits(settings: Settings, job_id: str, *what: str) -> None:
    """What a job waits for (each claimed task's worker and heartbeat; ``what``: how a
    task is named, fedq.coordinator.liveness.describe) and what the watchdog and
    finalize did to it."""
    from fedq.coordinator.jobs import repairs
    from fedq.coordinator.liveness import describe, held

    for claim in held(settings, job_id):
        out.print(describe(claim, settings.worker_lost_s, *what), highlight=False)
    for line in repairs(settings, job_id):
        out.print(line, highlight=False)


def _availability(settings: Settings, job: dict[str, Any]) -> dict[str, Any]:
    """Each worker's availability changes from the job's start (workers with a run
    policy; docs/owners.md), with the state it was in when the job began."""
    from datetime import datetime

    from fedq.coordinator.roster import availability

    begun = datetime.fromisoformat(job["created_at"])
    bands = availability(settings.database_url)
    return {host: [c for i, c in enumerate(changes)
                   if c[0] >= begun or (i + 1 < len(changes) and changes[i + 1][0] > begun)
                   or i + 1 == len(changes)]
            for host, changes in bands.items()}
