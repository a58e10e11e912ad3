"""``fedq report JOB``: one self-contained HTML page to send to a colleague — the
figures (PNG, inline), the spec, the per-round and per-client tables and the
environment of each worker that trained for the job (for an inference job: items and
throughput per worker and per hardware class, time per shard, every shard, failures).
No scripts, no external files.
"""

from __future__ import annotations

import base64
import html
import io
from datetime import datetime, timezone
from importlib.metadata import version
from typing import Any

import yaml

from fedq.observe.utilisation import worker_utilisation
from fedq.status import RoundStatus, UpdateStatus

#: Rows shown as failed.
FAILED = (RoundStatus.FAILED, UpdateStatus.ERROR, UpdateStatus.MISSING)
ROUND_COLUMNS = ("round", "status", "accuracy", "eval_loss", "train_loss", "seconds",
                 "finalize_seconds", "participants", "planned", "samples", "bytes_up",
                 "bytes_down", "tokens_per_second", "staleness_mean", "epsilon", "error")
CLIENT_COLUMNS = ("round", "client", "task", "status", "queue", "worker", "samples",
                  "steps", "loss", "seconds", "download_seconds", "train_seconds",
                  "upload_seconds", "bytes_up", "bytes_down", "device", "gpu_peak_mb",
                  "gpu_util", "staleness", "weight", "error")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 12px; margin-bottom: 2em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; } td.text { text-align: left; }
tr.failed td { background: #fde8e8; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
"""


def _cell(value: Any) -> str:
    if value is None:
        return "<td>-</td>"
    if isinstance(value, float):
        return f"<td>{value:.4g}</td>"
    if isinstance(value, int):
        return f"<td>{value}</td>"
    return f'<td class="text">{html.escape(str(value))}</td>'


def table(rows: list[dict[str, Any]], columns: tuple[str, ...], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        f'<tr{" class=failed" if r.get("status") in FAILED else ""}>'
        + "".join(_cell(r.get(c)) for c in columns) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode()


def render(job: dict[str, Any], rounds: list[dict[str, Any]], clients: list[dict[str, Any]],
           workers: list[dict[str, Any]], figs: dict[str, Any]) -> str:
    """The page, as a string (figures are closed by the caller)."""
    used = {c["worker"] for c in clients if c.get("worker")}
    env_rows = [{"worker": w["hostname"], "queues": ",".join(w["queues"] or []),
                 "hardware": hw.get("hardware_class"), "torch": hw.get("torch"),
                 "cuda": hw.get("cuda"), "gpus": ", ".join(g.get("name", "?")
                                                          for g in hw.get("gpus") or []) or None,
                 "cpus": hw.get("cpus"), "memory_gb": hw.get("memory_gb"),
                 "python": hw.get("python"), "system": hw.get("system"),
                 "samples_per_second": w.get("samples_per_second"),
                 "tasks_done": w.get("tasks_done"), "tasks_failed": w.get("tasks_failed")}
                for w in workers if w["hostname"] in used
                for hw in [w.get("hardware") or {}]]
    images = "".join(f'<h3>{html.escape(name)}</h3><img alt="{html.escape(name)}" '
                     f'src="data:image/png;base64,{_png(fig)}">' for name, fig in figs.items())
    made = datetime.now(timezone.utc).isoformat(timespec="seconds")
    summary = (f"status <b>{html.escape(job['status'])}</b>, round "
               f"{job['committed_round']} of {job['total_rounds']}"
               + (f", error: {html.escape(job['error'])}" if job.get("error") else ""))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>fedq job {html.escape(job['name'])} ({html.escape(job['id'])})</title>
<style>{STYLE}</style></head><body>
<h1>fedq job {html.escape(job['name'])} <small>{html.escape(job['id'])}</small></h1>
<p>{summary}. Made {made} by fedq {version('fedq')}.</p>
<h2>Figures</h2>{images}
<h2>Rounds</h2>{table(rounds, ROUND_COLUMNS, "rounds")}
<h2>Client tasks</h2>{table(clients, CLIENT_COLUMNS, "clients")}
<h2>Where the workers' time went</h2>{table(worker_utilisation(clients), UTILISATION_COLUMNS,
                                            "utilisation")}
<h2>Workers</h2>{table(env_rows, ("worker", "queues", "hardware", "torch", "cuda", "gpus",
                                   "cpus", "memory_gb", "python", "system",
                                   "samples_per_second", "tasks_done",
                                   "tasks_failed"), "workers")}
<h2>Spec</h2><pre>{html.escape(yaml.safe_dump(job['spec'], sort_keys=False))}</pre>
</body></html>
"""


#: fedq.observe.utilisation's entries, as the report shows them.
UTILISATION_COLUMNS = ("worker", "tasks", "utilisation", "compute_s", "transfer_s", "other_s",
                       "waiting_s", "window_s")

SHARD_COLUMNS = ("shard", "start", "stop", "status", "attempt", "backups", "queue", "worker",
                 "device", "seconds", "error")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def render_inference(view: Any, figs: dict[str, Any]) -> str:
    """The page of an inference job (a ``fedq.inference.jobs.InferenceView``)."""
    workers = [{"worker": w.worker, "device": w.device, "shards": w.shards, "items": w.items,
                "seconds": w.seconds, "items_per_s": w.items_per_s} for w in view.workers]
    classes: dict[str, dict[str, Any]] = {}
    for r in view.shard_rows:
        if r["status"] != "done":
            continue
        c = classes.setdefault(r.get("queue") or "?", {"class": r.get("queue") or "?",
                                                        "workers": set(), "shards": 0,
                                                        "items": 0, "seconds": 0.0})
        c["workers"].add(r.get("worker"))
        c["shards"] += 1
        c["items"] += r["stop"] - r["start"]
        c["seconds"] += r.get("seconds") or 0.0
    class_rows = [{**c, "workers": len(c["workers"]),
                   "items_per_s": c["items"] / c["seconds"] if c["seconds"] else None}
                  for c in sorted(classes.values(), key=lambda c: c["class"])]
    times = [r["seconds"] for r in view.shard_rows
             if r["status"] == "done" and r.get("seconds") is not None]
    shard_time = [{"shards": len(times), "p50_s": _percentile(times, 0.5),
                   "p90_s": _percentile(times, 0.9), "max_s": max(times, default=None)}]
    failed = [r for r in view.shard_rows if r["status"] != "done" or r.get("error")]
    rate = view.done_items / view.elapsed_s if view.elapsed_s > 0 else 0.0
    images = "".join(f'<h3>{html.escape(name)}</h3><img alt="{html.escape(name)}" '
                     f'src="data:image/png;base64,{_png(fig)}">' for name, fig in figs.items())
    made = datetime.now(timezone.utc).isoformat(timespec="seconds")
    summary = (f"inference ({html.escape(view.op)}), status <b>{html.escape(view.status)}</b>, "
               f"{view.done_items} of {view.items} items in {view.done_shards} of "
               f"{view.shards} shards, {view.elapsed_s:.1f} s ({rate:.1f} items/s), "
               f"{view.resent} re-sent, {view.backups} backup "
               f"cop{'y' if view.backups == 1 else 'ies'}"
               + (f", error: {html.escape(view.error)}" if view.error else ""))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>fedq job {html.escape(view.name)} ({html.escape(view.id)})</title>
<style>{STYLE}</style></head><body>
<h1>fedq job {html.escape(view.name)} <small>{html.escape(view.id)}</small></h1>
<p>{summary}. Made {made} by fedq {version('fedq')}.</p>
<h2>Figures</h2>{images}
<h2>Workers</h2>{table(workers, ("worker", "device", "shards", "items", "seconds",
                                   "items_per_s"), "workers")}
<h2>Hardware classes</h2>{table(class_rows, ("class", "workers", "shards", "items", "seconds",
                                            "items_per_s"), "classes")}
<h2>Time per shard</h2>{table(shard_time, ("shards", "p50_s", "p90_s", "max_s"), "shard-time")}
<h2>Failures</h2>{table(failed, SHARD_COLUMNS, "failures") if failed else "<p>none</p>"}
<h2>Shards</h2>{table(view.shard_rows, SHARD_COLUMNS, "shards")}
<h2>Spec</h2><pre>{html.escape(yaml.safe_dump(view.spec, sort_keys=False))}</pre>
</body></html>
"""
