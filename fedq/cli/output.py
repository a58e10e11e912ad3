"""What the CLI prints: consoles, the live follow of a job, tables and number formats."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Column, Table

from fedq.errors import WatchTimeout
from fedq.spec import JobSpec
from fedq.status import JobStatus, RoundStatus, UpdateStatus

# Piped output (CI logs, `| tee`) gets a fixed width wide enough for the results table.
# Not a terminal: 120 columns unless COLUMNS says otherwise (rich reads it).
out = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def follow(job_id: str, *, interval: float = 0.5, timeout: float | None = None,
           console: Console = out) -> Any:
    """Show a progress bar and a line per committed round until JOB finishes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedq.coordinator.jobs import FINISHED, get_job, round_results
    from fedq.coordinator.liveness import describe as describe_claim
    from fedq.coordinator.liveness import held
    from fedq.settings import get_settings

    settings = get_settings()
    view = get_job(settings, job_id)
    shown = 0
    said: set[tuple[str, bool]] = set()  # lost claims already reported
    deadline = time.monotonic() + timeout if timeout else None
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[acc]}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        bar = progress.add_task(f"job {job_id}", total=view.total_rounds, acc="")
        while True:
            view = get_job(settings, job_id)
            rows = round_results(settings, job_id)
            for row in rows[shown:]:
                if row["status"] == RoundStatus.TRAINING:
                    break
                buffered = row["staleness_mean"] is not None
                progress.console.print(
                    f"{'version' if buffered else 'round'} {row['round']:>3}  "
                    f"{status_style(row['status'])}  "
                    f"accuracy {fmt(row['accuracy'], '.4f')}  "
                    + (f"updates {row['participants'] or 0}  staleness "
                       f"{row['staleness_mean']:.1f} (max {row['staleness_max']})  "
                       if buffered else
                       f"clients {row['participants'] or 0}/{row['planned']}  ")
                    + f"{fmt(row['seconds'], '.2f')}s"
                    + (f"  val loss {fmt(row['eval_loss'], '.3f')}  "
                       f"{row['tokens_per_second']:,.0f} tokens/s  "
                       f"{mb(row['bytes_up'])} MB up" if row["tokens_per_second"] else ""),
                    highlight=False)
                shown += 1
            for claim in held(settings, job_id):  # a lost worker, as soon as it is
                key = (claim.task_id, claim.resent)
                if (claim.resent or claim.silent_s >= settings.worker_lost_s) and \
                        key not in said:
                    said.add(key)
                    progress.console.print(describe_claim(claim, settings.worker_lost_s),
                                           style="yellow", highlight=False)
            acc = f"accuracy {view.accuracy:.4f}" if view.accuracy is not None else ""
            progress.update(bar, completed=view.committed_round, acc=acc)
            if view.status in FINISHED:
                break
            if deadline and time.monotonic() > deadline:
                raise WatchTimeout(f"job {job_id} still {view.status} after {timeout:.0f}s")
            time.sleep(interval)
    style = "green" if view.status == JobStatus.COMPLETED else "red"
    console.print(f"job {job_id} [{style}]{view.status}[/] at round "
                  f"{view.committed_round}/{view.total_rounds}"
                  + (f": {view.error}" if view.error else ""), highlight=False)
    return view


def results_table(view: Any, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"job {view.id} ({view.name}): {view.status}, "
                        f"{view.committed_round}/{view.total_rounds} rounds\n"
                        f"{describe(JobSpec.stored(view.spec))}")
    compressed = any((r["compression_ratio"] or 1) > 1.001 for r in rows)
    private = any(r["epsilon"] is not None for r in rows)
    text = any(r["tokens"] for r in rows)
    buffered = any(r.get("staleness_mean") is not None for r in rows)
    names = ["version" if buffered else "round", "status", "accuracy", "eval loss",
             "train loss", "seconds", "updates" if buffered else "clients", "samples",
             "MB up", "MB down"]
    names += ["staleness mean/max"] if buffered else []
    names += ["perplexity", "tokens/s"] if text else []
    names += ["ratio"] if compressed else []
    names += ["epsilon"] if private else []
    for name in names:
        table.add_column(name, justify="left" if name == "status" else "right")
    for r in rows:
        cells = [str(r["round"]), status_style(r["status"]), fmt(r["accuracy"], ".4f"),
                 fmt(r["eval_loss"], ".4f"), fmt(r["train_loss"], ".4f"),
                 fmt(r["seconds"], ".2f"), f"{r['participants'] or 0}/{r['planned']}",
                 str(r["samples"] or 0), mb(r["bytes_up"]), mb(r["bytes_down"])]
        cells += [f"{fmt(r['staleness_mean'], '.1f')}/{r['staleness_max']}"
                  if r.get("staleness_mean") is not None else "-"] if buffered else []
        cells += [fmt(r["perplexity"], ".2f"), fmt(r["tokens_per_second"], ",.0f")] if text \
            else []
        cells += [fmt(r["compression_ratio"], ".2f") + "x"] if compressed else []
        cells += [fmt(r["epsilon"], ".3f")] if private else []
        table.add_row(*cells)
    return table


def clients_table(rows: list[dict[str, Any]]) -> Table:
    """One line per client update: how it trained and what happened to it."""
    text = any(r.get("tokens") for r in rows)
    buffered = any(r.get("task") for r in rows)
    names = ["version", "task", "from", "stale", "weight"] if buffered else ["round"]
    workers = max((len(r["worker"] or "-") for r in rows), default=6)
    table = Table(*names, "client", "status", Column("worker", min_width=min(workers, 32)),
                  "device", "amp", "steps", "tokens/s" if text else "samples/s",
                  "down+up s", "train s", "MB up", "norm", "GPU MB", "GPU %", "note")
    for r in rows:
        first = [str(r["round"] or "-"), str(r["task"]), str(r["base_version"]),
                 "-" if r["staleness"] is None else str(r["staleness"]),
                 fmt(r["weight"], ".3f")] if buffered else [str(r["round"])]
        done = (r.get("tokens") or 0) if text else r["processed"]
        rate = done / r["train_seconds"] if r.get("train_seconds") else None
        note = r["error"] or ("stopped by time budget" if r.get("stopped_by_budget") else "") \
            or ("partial: stopped for the owner" if r.get("yielded") else "")
        table.add_row(*first, str(r["client"]), status_style(r["status"]),
                      r["worker"] or "-", r.get("device") or "-", r.get("amp") or "-",
                      str(r["steps"]), fmt(rate, ".0f"), _transfer(r),
                      fmt(r.get("train_seconds"), ".2f"),
                      mb(r["bytes_up"]), fmt(r["update_norm"], ".3g"),
                      fmt(r.get("gpu_peak_mb"), ".0f"), fmt(r.get("gpu_util"), ".0f"),
                      (note or "")[:60])
    return table


def _transfer(row: dict[str, Any]) -> str:
    """Model download + update upload seconds of one task, e.g. '0.01+0.03'."""
    down, up = row.get("download_seconds"), row.get("upload_seconds")
    return "-" if down is None and up is None else f"{fmt(down, '.2f')}+{fmt(up, '.2f')}"


def buffered_summary(rows: list[dict[str, Any]], seconds: float | None) -> str:
    """A buffered job's updates in a few lines: what happened to them, how stale the
    used ones were (a text histogram) and how fast they arrived."""
    from collections import Counter

    tasks = [r for r in rows if r.get("task")]
    if not tasks:
        return ""
    states = Counter(r["status"] for r in tasks)
    lines = ["updates: " + ", ".join(f"{n} {state}" for state, n in states.most_common())]
    used = Counter(r["staleness"] for r in tasks if r["status"] == UpdateStatus.OK)
    if used:
        top = max(used.values())
        lines.append("staleness of the used updates:")
        lines += [f"  {tau:>3} | {'#' * max(1, round(40 * n / top))} {n}"
                  for tau, n in sorted(used.items())]
    if seconds:
        done = sum(n for state, n in states.items()
                   if state not in (UpdateStatus.TRAINING, UpdateStatus.CANCELLED))
        lines.append(f"throughput: {done / seconds:.2f} updates/s over {seconds:.1f} s")
    return "\n".join(lines)


def utilisation_lines(workers: list[dict[str, Any]]) -> list[str]:
    """Where each worker's time went (fedq.observe.utilisation), one line each."""
    return [f"{w['worker']}: {w['utilisation']:.0%} computing ({w['compute_s']:.1f} s of "
            f"{w['window_s']:.1f} s; moving the model {w['transfer_s']:.1f} s, waiting "
            f"{w['waiting_s']:.1f} s)" for w in workers if w["utilisation"] is not None]


#: How each status is shown: done well green, under way cyan, not used yellow, failed red.
STATUS_COLORS: dict[str, str] = {
    JobStatus.RUNNING: "cyan", JobStatus.COMPLETED: "green", JobStatus.FAILED: "red",
    JobStatus.CANCELLED: "yellow", RoundStatus.COMMITTED: "green",
    UpdateStatus.OK: "green", UpdateStatus.ERROR: "red", UpdateStatus.REJECTED: "red",
    UpdateStatus.MISSING: "yellow", UpdateStatus.LATE: "yellow", UpdateStatus.YIELDED: "yellow",
    UpdateStatus.TRAINING: "cyan", UpdateStatus.BUFFERED: "cyan", UpdateStatus.STALE: "yellow",
}


def describe(spec: JobSpec) -> str:
    """One line naming the strategy, for `fedq results`."""
    parts = [f"server {spec.server.summary()}", f"reducer {spec.reducer.summary()}"]
    if spec.buffered:
        a = spec.aggregation
        st = a.staleness
        weight = {"constant": "constant", "polynomial": f"(1+s)^-{st.a:g}",
                  "hinge": f"hinge a={st.a:g} b={st.b}"}[st.kind]
        lr = a.server_lr(spec.server, spec.clients_per_round)
        parts.insert(0, f"buffered K={a.buffer} C={spec.clients_per_round} "
                        f"staleness {weight}"
                     + (f" max {a.max_staleness}" if a.max_staleness is not None else ""))
        if lr is not None and "lr" not in spec.server.params():
            parts[1] += f" (lr {lr:g} = K/C)"
    if spec.clip_norm:
        parts.append(f"clip {spec.clip_norm}")
    if spec.dp:
        parts.append(f"DP z={spec.dp.noise_multiplier} C={spec.dp.clip_norm} "
                     f"delta={spec.dp.delta}")
    codec = spec.compression.codec + ("+zstd" if spec.compression.zstd else "")
    if spec.compression.codec == "auto":
        codec += f" (int8 below {spec.compression.slow_link_mbit:g} Mbit/s uplink)"
    parts.append(f"updates {codec}")
    if spec.compression.downlink != "none":
        parts.append(f"model down as {spec.compression.downlink} steps")
    if spec.streaming:
        parts.append(f"streaming: 1 of {spec.streaming.fragments} fragments per round"
                     + (f", mixing {spec.streaming.mixing:g}" if spec.streaming.mixing else ""))
    if spec.prox_mu:
        parts.append(f"FedProx mu {spec.prox_mu}")
    return ", ".join(parts)


def job_json(view: Any) -> dict[str, Any]:
    """A job's JSON for `fedq status --json` and `fedq results --json`."""
    return {**view.to_json(), "strategy": describe(JobSpec.stored(view.spec))}


def status_style(status: str) -> str:
    color = STATUS_COLORS.get(status, "white")
    return f"[{color}]{status}[/]"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"
