"""Benchmark 8: where a ResNet-18-size round's time goes, phase by phase.

The deployment of table 1 (Redis + PostgreSQL, a control worker and 4 training
workers, one process each, zero training compute, no evaluation). Each round's time is
cut into what the database records (the round's dispatch, each task's start on its
worker, its model download, local step and upload) and what finalize logs for each
round it commits (fedq.phases: opening the round, collecting the results,
the current model, waiting for each update's background read, decoding, verifying,
reducing, the server step, encoding and writing the new model, the SQL commit,
settling, dispatching the next round).
"""

from __future__ import annotations

import re
import statistics

from bench.common import Context, Section
from bench.fedq_run import fedq_cluster, run_job, zero_compute_spec
from bench.overhead import CLIENTS

LINE = re.compile(r"job (\w+) round (\d+) finalize phases: ([^\"\n]*)")
PART = re.compile(r"(.+?) ([0-9.]+) ms$")
WHERE = {"open round": "control", "collect results": "control", "current model": "control",
         "read wait": "control", "decode": "control", "verify": "control",
         "updates (rest)": "control: the mean", "server step": "control",
         "evaluate": "control", "encode + write model": "control", "commit (SQL)": "control",
         "settle": "control", "next dispatch": "control"}


def parse(log: str, job: str) -> dict[int, dict[str, float]]:
    """Round -> phase -> seconds, from the control worker's log."""
    out: dict[int, dict[str, float]] = {}
    for j, number, parts in LINE.findall(log):
        if j != job:
            continue
        phases = {}
        for part in parts.split(", "):
            m = PART.match(part.strip())
            if m:
                phases[m.group(1)] = float(m.group(2)) / 1e3
        out[int(number)] = phases
    return out


def run(ctx: Context) -> Section:
    rounds = 4 if ctx.smoke else 11
    model = "tiny" if ctx.smoke else "resnet18"
    sec = Section(
        "8. Where a round's time goes",
        f"{'The tiny mlp' if ctx.smoke else 'ResNet-18 size'}, {CLIENTS} clients, zero "
        f"training compute, {rounds} rounds, the deployment of table 1. Each row: the "
        f"median over rounds 2–{rounds} (milliseconds). Worker rows are per task (the "
        "median task); the rows run one after another on the round's critical path, "
        "except that the tasks run side by side (their median is shown) and the "
        "control worker reads the next update in the background while it decodes, "
        "verifies and adds the current one ('read wait' is the time it still waited); "
        "'settle' (the round's update blobs deleted) runs after the next round's tasks "
        "are sent, beside the next round's tasks.",
        ["phase", "where", "ms (median)", "share of the round"])
    with fedq_cluster(ctx, f"phases-{model}", CLIENTS) as cluster:
        ctx.say(f"phases: {model}, {rounds} rounds")
        result = run_job(cluster, zero_compute_spec(model, rounds, CLIENTS))
        log = cluster.by_name("control").log_path.read_text(errors="replace")
        updates = cluster.updates(result.job)
        db_rounds = {r.number: r for r in cluster.rounds(result.job)}
    logged = parse(log, result.job)
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    intervals = []
    for number in range(2, rounds + 1):
        rnd, before = db_rounds[number], db_rounds[number - 1]
        began = {u.client: u.started_at for u in updates
                 if u.round_number == number and u.started_at is not None}
        tasks = [u for u in updates if u.client in began and u.round_number == number]
        if not tasks or number not in logged or rnd.finished_at is None \
                or before.finished_at is None:
            continue
        intervals.append((rnd.finished_at - before.finished_at).total_seconds())
        opened = rnd.started_at
        starts = [(began[u.client] - opened).total_seconds() for u in tasks]
        ends = [start + (u.download_seconds or 0) + (u.train_seconds or 0)
                + (u.upload_seconds or 0) for start, u in zip(starts, tasks)]
        add("dispatch → task starts on its worker", statistics.median(starts))
        add("model download (read, hash, decode)", statistics.median(
            u.download_seconds or 0 for u in tasks))
        add("local step (zero compute)", statistics.median(u.train_seconds or 0 for u in tasks))
        add("upload (encode, hash, write)", statistics.median(
            u.upload_seconds or 0 for u in tasks))
        add("last task's end after the median one", max(ends) - statistics.median(ends))
        phases = logged[number]
        until_commit = 0.0  # the round's finished_at is taken as the SQL commit starts
        for name in phases:
            if name == "commit (SQL)":
                break
            until_commit += phases[name]
        finalize_start = (rnd.finished_at - opened).total_seconds() - until_commit
        add("last answer → finalize starts (chord callback)", finalize_start - max(ends))
        for name, seconds in phases.items():
            add(f"finalize: {name}", seconds)
    interval = statistics.median(intervals)
    where = {"dispatch → task starts on its worker": "broker, worker",
             "model download (read, hash, decode)": "worker",
             "local step (zero compute)": "worker", "upload (encode, hash, write)": "worker",
             "last task's end after the median one": "workers",
             "last answer → finalize starts (chord callback)": "broker, control"}
    total = 0.0
    for name, values in rows.items():
        value = statistics.median(values)
        total += value
        key = name.removeprefix("finalize: ")
        sec.rows.append([name, where.get(name, WHERE.get(key, "control")),
                         f"{value * 1e3:.1f}", f"{value / interval:.0%}"])
    sec.rows.append(["sum of the rows", "", f"{total * 1e3:.1f}", f"{total / interval:.0%}"])
    sec.rows.append(["round interval (commit to commit)", "", f"{interval * 1e3:.1f}", "100%"])
    sec.notes.append("Medians of each row are taken separately, so the sum of the rows "
                     "need not equal the median interval; a gap between them is time "
                     "no row covers (between the commit of one round and its finalize "
                     "log line, for instance).")
    return sec
