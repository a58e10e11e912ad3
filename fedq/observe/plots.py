"""Figures of a job (``fedq plot``): progress, a timeline of every client task, bytes
per round per client, and staleness for buffered jobs; for an inference job, its
shards on a timeline per worker and each worker's throughput.

Each ``*_figure`` function takes the rows ``fedq results --json`` prints (rounds and
client rows, :mod:`fedq.coordinator.jobs`) and returns a matplotlib Figure, so tests
can count what was drawn; :func:`write_figures` saves them as PNG and SVG. matplotlib
is the ``[plot]`` extra and runs on its Agg backend (no display needed).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from fedq.errors import require_extra
from fedq.observe.utilisation import worker_utilisation
from fedq.status import RoundStatus, UpdateStatus

#: Colours of a task's phases in the timeline (matplotlib's tab10 palette).
PHASES = (("queue wait", "#c7c7c7"), ("download", "#1f77b4"), ("train", "#2ca02c"),
          ("upload", "#ff7f0e"))
FINALIZE_COLOR = "#d62728"
FAILED = (UpdateStatus.ERROR, UpdateStatus.MISSING, UpdateStatus.REJECTED)


def _pyplot() -> Any:
    require_extra("matplotlib", "plot", "fedq plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ticks() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _when(iso: str | None) -> float | None:
    return None if iso is None else datetime.fromisoformat(iso).timestamp()


def progress_figure(rounds: list[dict[str, Any]], title: str = "") -> Any:
    """Accuracy and loss per committed round (language models: validation loss in
    nats per token and perplexity)."""
    plt = _pyplot()
    done = [r for r in rounds if r["status"] == RoundStatus.COMMITTED]
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    perplexity = [r for r in done if r.get("perplexity") is not None]
    if perplexity:  # a language model: perplexity says more than next-byte accuracy
        acc_ax.plot([r["round"] for r in perplexity], [r["perplexity"] for r in perplexity],
                    marker="o", label="perplexity")
        acc_ax.set_ylabel("validation perplexity")
    else:
        evaluated = [r for r in done if r.get("accuracy") is not None]
        acc_ax.plot([r["round"] for r in evaluated], [r["accuracy"] for r in evaluated],
                    marker="o", label="accuracy")
        acc_ax.set_ylabel("accuracy")
    acc_ax.set_xlabel("round")
    acc_ax.grid(alpha=0.3)
    for ax in (acc_ax, loss_ax):
        ax.xaxis.set_major_locator(_ticks())
    train = [r for r in done if r.get("train_loss") is not None]
    loss_ax.plot([r["round"] for r in train], [r["train_loss"] for r in train], marker=".",
                 label="training loss (clients' mean)")
    held = [r for r in done if r.get("eval_loss") is not None]
    loss_ax.plot([r["round"] for r in held], [r["eval_loss"] for r in held], marker="o",
                 label="validation loss")
    loss_ax.set_xlabel("round")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    fig.suptitle(title or "progress")
    return fig


def timeline_figure(rounds: list[dict[str, Any]], clients: list[dict[str, Any]],
                    title: str = "", last: int = 12) -> Any:
    """One bar per client task of the last ``last`` rounds: queue wait, model download,
    training, upload; a red bar for each round's finalize step; failed and missing
    tasks marked with a cross. Seconds on the x axis count from the first round shown.

    Times come from the workers' clocks (task start) and the coordinator's (dispatch,
    commit); machines whose clocks disagree by more than a task's length show it."""
    plt = _pyplot()
    shown = sorted({r["round"] for r in rounds})[-last:]
    opened = {r["round"]: _when(r.get("started_at")) for r in rounds}
    closed = {r["round"]: (_when(r.get("finished_at")), r.get("finalize_seconds"))
              for r in rounds}
    tasks = [c for c in clients if c["round"] in shown]
    origin: float = min([t for n in shown if (t := opened.get(n)) is not None] or [0.0])
    height = max(3.0, 0.28 * len(tasks) + 1.5)
    fig, ax = plt.subplots(figsize=(11, min(height, 40)), constrained_layout=True)
    labels: list[str] = []
    for y, task in enumerate(tasks):
        labels.append(f"r{task['round']} c{task['client']}"
                      + (f" t{task['task']}" if task.get("task") else "")
                      + f"  {(task.get('worker') or '-').split('@')[0]}")
        sent, start = _when(task.get("dispatched_at")), _when(task.get("started_at"))
        if start is None or sent is None:
            ax.plot([(closed[task["round"]][0] or origin) - origin], [y], "x",  # never ran
                    color=FINALIZE_COLOR, markersize=8)
            continue
        train = task.get("train_seconds") or 0.0
        download = task.get("download_seconds") or 0.0
        upload = task.get("upload_seconds") or 0.0
        spans = [(sent, max(start - sent, 0.0)), (start, download),
                 (start + download, train), (start + download + train, upload)]
        for (left, width), (_, color) in zip(spans, PHASES):
            ax.barh(y, width, left=left - origin, color=color, height=0.7)
        if task["status"] in FAILED:
            ax.plot([start - origin], [y], "x", color=FINALIZE_COLOR, markersize=8)
    for n in shown:
        finished, seconds = closed.get(n, (None, None))
        if finished is not None and seconds:
            ax.axvspan(finished - seconds - origin, finished - origin, color=FINALIZE_COLOR,
                       alpha=0.25, lw=0)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for _, c in PHASES]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=FINALIZE_COLOR, alpha=0.25))
    ax.legend(handles, [n for n, _ in PHASES] + ["finalize"], loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or "where each round's time went")
    return fig


def bytes_figure(clients: list[dict[str, Any]], title: str = "") -> Any:
    """Bytes each client uploaded (stacked) and downloaded, per round."""
    plt = _pyplot()
    up: dict[int, dict[int, int]] = defaultdict(dict)
    down: dict[int, int] = defaultdict(int)
    for c in clients:
        up[c["client"]][c["round"]] = up[c["client"]].get(c["round"], 0) + (c["bytes_up"] or 0)
        down[c["round"]] += c["bytes_down"] or 0
    numbers = sorted({c["round"] for c in clients})
    fig, (up_ax, down_ax) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    bottom = [0.0] * len(numbers)
    for client in sorted(up):
        heights = [up[client].get(n, 0) / 1e6 for n in numbers]
        up_ax.bar(numbers, heights, bottom=bottom, label=f"client {client}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    for ax in (up_ax, down_ax):
        ax.xaxis.set_major_locator(_ticks())
    up_ax.set_xlabel("round")
    up_ax.set_ylabel("MB uploaded")
    if len(up) <= 12:
        up_ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    down_ax.bar(numbers, [down[n] / 1e6 for n in numbers], color="#1f77b4")
    down_ax.set_xlabel("round")
    down_ax.set_ylabel("MB downloaded (all clients)")
    fig.suptitle(title or "bytes per round")
    return fig


def utilisation_figure(workers: list[dict[str, Any]], title: str = "") -> Any:
    """Each worker's window (its first task's start to its last task's end) split into
    computing, moving the model and its update, other work in a task, and waiting
    between tasks (fedq.observe.utilisation), as stacked horizontal bars."""
    plt = _pyplot()
    parts = (("compute_s", "computing", "#2ca02c"), ("transfer_s", "moving the model", "#1f77b4"),
             ("other_s", "other work in a task", "#bcbd22"),
             ("waiting_s", "waiting between tasks", "#d62728"))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(workers)), constrained_layout=True)
    names = [w["worker"] for w in workers]
    left = [0.0] * len(workers)
    for key, label, color in parts:
        widths = [w[key] for w in workers]
        ax.barh(names, widths, left=left, label=label, color=color)
        left = [a + b for a, b in zip(left, widths)]
    for y, w in enumerate(workers):
        if w["utilisation"] is not None:
            ax.text(left[y], y, f" {w['utilisation']:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds of the worker's window (its share computing at the right)")
    fig.legend(fontsize=7, loc="outside lower center", ncol=4)
    fig.suptitle(title or "where each worker's time went")
    return fig


def staleness_figure(clients: list[dict[str, Any]], title: str = "") -> Any:
    """Buffered jobs: how stale the updates were (histogram) and per version (mean)."""
    plt = _pyplot()
    used = [c for c in clients if c.get("staleness") is not None and c["status"] == "ok"]
    fig, (hist_ax, line_ax) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    values = [c["staleness"] for c in used]
    top = max(values, default=0)
    hist_ax.hist(values, bins=range(0, top + 2), align="left", rwidth=0.8)
    hist_ax.xaxis.set_major_locator(_ticks())
    hist_ax.set_xlabel("staleness (versions behind)")
    hist_ax.set_ylabel("updates used")
    per: dict[int, list[int]] = defaultdict(list)
    for c in used:
        per[c["round"]].append(c["staleness"])
    versions = sorted(per)
    line_ax.plot(versions, [sum(per[v]) / len(per[v]) for v in versions], marker="o")
    line_ax.xaxis.set_major_locator(_ticks())
    line_ax.set_xlabel("version")
    line_ax.set_ylabel("mean staleness")
    line_ax.grid(alpha=0.3)
    fig.suptitle(title or "staleness")
    return fig


Band = tuple[Any, bool, str | None]  # (datetime, available, reason)


def availability_figure(bands: dict[str, list[Band]], start: float, end: float,
                        title: str = "") -> Any:
    """One band per worker with a run policy over [start, end] (Unix seconds): green
    while its owner's conditions let it train, grey while it stepped aside (the
    reason is written on the first few grey spans). Seconds on the x axis count from
    ``start``."""
    plt = _pyplot()
    hosts = sorted(bands)
    fig, ax = plt.subplots(figsize=(11, max(2.0, 0.45 * len(hosts) + 1.2)),
                           constrained_layout=True)
    for y, host in enumerate(hosts):
        changes = [(at.timestamp(), free, why) for at, free, why in bands[host]]
        for i, (at, free, why) in enumerate(changes):
            until = changes[i + 1][0] if i + 1 < len(changes) else end
            left, right = max(at, start), min(until, end)
            if right <= left:
                continue
            ax.barh(y, right - left, left=left - start, height=0.6,
                    color="#2ca02c" if free else "#bbbbbb")
            if not free and why and right - left > 0.08 * (end - start):
                ax.text(left - start + 0.5, y, why[:48], va="center", fontsize=7)
    ax.set_yticks(range(len(hosts)), [h.split("@")[0] for h in hosts], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(end - start, 1.0))
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#2ca02c", "#bbbbbb")]
    ax.legend(handles, ["may train", "stepped aside for its owner"], loc="lower right",
              fontsize=8)
    ax.set_title(title or "when each worker's owner let it train")
    return fig


def figures(job: dict[str, Any], rounds: list[dict[str, Any]],
            clients: list[dict[str, Any]],
            availability: dict[str, list[Band]] | None = None) -> dict[str, Any]:
    """Name -> Figure for one job (``staleness`` only for buffered jobs;
    ``availability`` only where workers with a run policy reported during it)."""
    name = f"{job['name']} ({job['id']})"
    out = {"progress": progress_figure(rounds, f"{name}: progress"),
           "timeline": timeline_figure(rounds, clients, f"{name}: where the time went"),
           "bytes": bytes_figure(clients, f"{name}: bytes per round")}
    workers = worker_utilisation(clients)
    if workers:
        out["utilisation"] = utilisation_figure(workers, f"{name}: where each worker's "
                                                         "time went")
    if any(c.get("staleness") is not None for c in clients):
        out["staleness"] = staleness_figure(clients, f"{name}: staleness")
    begun = _when(job.get("created_at"))
    ended = max([t for r in rounds if (t := _when(r.get("finished_at"))) is not None]
                or [begun or 0.0])
    if availability and begun is not None:
        out["availability"] = availability_figure(
            availability, begun, ended, f"{name}: when each worker's owner let it train")
    return out


def write_figures(figs: dict[str, Any], folder: Path, stem: str,
                  formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save each figure as ``folder/stem-NAME.FORMAT``; each file appears whole (written
    beside, then renamed) so a crash leaves no half-written figure."""
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        for fmt in formats:
            path = folder / f"{stem}-{name}.{fmt}"
            partial = path.with_name(f".{path.name}.partial")
            fig.savefig(partial, format=fmt, dpi=110)
            partial.replace(path)
            paths.append(path)
        plt.close(fig)
    return paths


def close(figs: dict[str, Any]) -> None:
    plt = _pyplot()
    for fig in figs.values():
        plt.close(fig)


#: Colours of the hardware classes in the inference figures (tab10).
CLASS_COLORS = {"gpu_new": "#2ca02c", "gpu_sm61": "#1f77b4", "cpu": "#ff7f0e"}


def shard_timeline_figure(shards: list[dict[str, Any]], start: float, title: str = "") -> Any:
    """One row per worker, one bar per shard it answered (from its start to its answer,
    coloured by the queue it came from); a cross for a shard that failed or is still
    out. Seconds from the job's creation on the x axis."""
    plt = _pyplot()
    workers = sorted({r["worker"] for r in shards if r.get("worker")})
    rows = {w: i for i, w in enumerate(workers)}
    fig, ax = plt.subplots(figsize=(11, max(2.5, 0.45 * len(workers) + 1.5)),
                           constrained_layout=True)
    for r in shards:
        if not r.get("worker") or r.get("started") is None:
            continue
        y = rows[r["worker"]]
        left = r["started"] - start
        if r["status"] == "done" and r.get("done") is not None:
            ax.barh(y, max(r["done"] - r["started"], 0.0), left=left, height=0.7,
                    color=CLASS_COLORS.get(r.get("queue") or "", "#7f7f7f"),
                    edgecolor="white", linewidth=0.5)
        else:
            ax.plot([left], [y], "x", color=FINALIZE_COLOR, markersize=8)
    ax.set_yticks(range(len(workers)), [w.split("@")[0] for w in workers], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the job was submitted")
    queues = sorted({r["queue"] for r in shards if r.get("queue")})
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=CLASS_COLORS.get(q, "#7f7f7f"))
               for q in queues], queues, loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or "shards per worker")
    return fig


def throughput_figure(workers: list[Any], title: str = "") -> Any:
    """Items per second of each worker (its items over its shards' own seconds), with
    the items it did written on the bar."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.45 * len(workers) + 1.2)),
                           constrained_layout=True)
    names = [w.worker.split("@")[0] for w in workers]
    rates = [w.items_per_s for w in workers]
    bars = ax.barh(range(len(workers)), rates, color="#2ca02c")
    for bar, w in zip(bars, workers):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {w.items} items, {w.shards} shards ({w.device})", va="center", fontsize=8)
    ax.set_yticks(range(len(workers)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("items per second")
    ax.set_xlim(0, max(rates, default=1.0) * 1.5 or 1.0)
    ax.set_title(title or "throughput per worker")
    return fig


def inference_figures(view: Any) -> dict[str, Any]:
    """Name -> Figure for one inference job (a ``fedq.inference.jobs.InferenceView``)."""
    name = f"{view.name} ({view.id})"
    return {"timeline": shard_timeline_figure(view.shard_rows, view.created,
                                              f"{name}: shards per worker"),
            "throughput": throughput_figure(view.workers, f"{name}: throughput per worker")}
