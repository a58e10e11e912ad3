"""``fedq plot``, ``fedq report`` and ``fedq metrics``: seeing a job."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import click

from fedq.cli.commands import _settings, expected_errors, main
from fedq.cli.kinds import kind_of
from fedq.cli.output import out
from fedq.errors import ConfigError, require_extra


@main.command()
@click.argument("job_id")
@click.option("--out", "folder", default="fedq-plots", show_default=True,
              type=click.Path(file_okay=False, path_type=Path), help="folder for the figures")
@click.option("--format", "formats", default="png,svg", show_default=True,
              help="comma-separated: png, svg, pdf")
@expected_errors
def plot(job_id: str, folder: Path, formats: str) -> None:
    """Write the job's figures: progress, task timeline, bytes, staleness (buffered),
    and when each worker's owner let it train (workers with a run policy)."""
    from fedq.observe.plots import write_figures

    require_extra("matplotlib", "plot", "fedq plot")
    wanted = tuple(f.strip().lower() for f in formats.split(",") if f.strip())
    bad = [f for f in wanted if f not in ("png", "svg", "pdf")]
    if bad or not wanted:
        raise ConfigError(f"--format: {', '.join(bad) or 'nothing'} is not one of png, svg, "
                          "pdf")
    settings = _settings()
    kind, view = kind_of(settings, job_id)
    figs = kind.figures(settings, job_id, view, required=True)
    for path in write_figures(figs, folder, job_id, wanted):
        click.echo(path)


@main.command()
@click.argument("job_id")
@click.option("--out", "path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="the HTML file (default: fedq-report-JOB.html)")
@expected_errors
def report(job_id: str, path: Path | None) -> None:
    """Write one self-contained HTML page about the job: figures, spec, tables, workers."""
    from fedq.observe.plots import close

    require_extra("matplotlib", "plot", "fedq report")
    settings = _settings()
    kind, view = kind_of(settings, job_id)
    figs = kind.figures(settings, job_id, view, required=False)
    page = kind.page(settings, job_id, view, figs)
    close(figs)
    path = path or Path(f"fedq-report-{job_id}.html")
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(page, encoding="utf-8")
    partial.replace(path)
    click.echo(path)


@main.command()
@click.option("--host", default="0.0.0.0", show_default=True, help="address to listen on")
@click.option("--port", default=9464, show_default=True, help="port for /metrics")
@click.option("--once", is_flag=True, help="print one scrape to stdout and exit")
@expected_errors
def metrics(host: str, port: int, once: bool) -> None:
    """Serve fedq's Prometheus metrics on http://HOST:PORT/metrics (reads the database
    and the broker at each scrape; run one per deployment)."""
    from fedq.engine.names import TRAINING_QUEUES
    from fedq.observe.metrics import exposition, serve

    require_extra("prometheus_client", "metrics", "fedq metrics")
    settings = _settings()
    queues = [*TRAINING_QUEUES, "control"]
    if once:
        click.echo(exposition(settings, queues), nl=False)
        return
    try:
        server = serve(settings, queues, host, port)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    out.print(f"fedq metrics on http://{host}:{port}/metrics", highlight=False)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    os._exit(0)  # prometheus-client's server thread is not a daemon everywhere
