"""Benchmarks 3-5: real digits jobs and scale runs on fedq's Redis deployment.

3. Bytes per round for update codecs none / fp16 / int8 / int8+zstd, with each job's
   final test accuracy.
4. Heterogeneous time-to-accuracy: 4 workers, one slowed 4x (FEDQ_TEST_SLOWDOWN=4); wall
   time from submit to the first round whose global model reaches 90% test accuracy,
   waiting for every client vs a per-task time budget.
5. Scale: 1,000 clients per round on local workers (round time, the control worker's
   peak memory), and 100 rounds of a tiny model (the control worker's memory over
   the rounds).
6. Buffered asynchronous aggregation (FedBuff) vs synchronous rounds, with worker
   speeds drawn log-normal: time to a target accuracy and final accuracy.
7. The same on the language-model task (a small GPT on Shakespeare and Milton): time
   to a target validation loss and the final loss.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import BenchError, Context, Section, Stat
from bench.fedq_run import JobRun, fedq_cluster, run_job, run_jobs, zero_compute_spec

DIGITS: dict[str, Any] = {"model": "small_cnn", "dataset": "digits", "batch_size": 16,
                          "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                          "seed": 3}


def compression(ctx: Context) -> Section:
    codecs = [("none", False), ("fp16", False), ("int8", False), ("int8", True)]
    if ctx.smoke:
        codecs = [codecs[0], codecs[-1]]
    rounds = 2 if ctx.smoke else 8
    sec = Section(
        "3. Bytes per round by update codec",
        f"Digits, small_cnn, 8 clients all in every round, {rounds} rounds, 1 local "
        "epoch, 4 training workers on Redis + PostgreSQL. Bytes: update blobs uploaded "
        "per round (safetensors header included), mean over the rounds; fp32 is what "
        "the same deltas take uncompressed. Accuracy: the final global model on the "
        "held-out test split.",
        ["codec", "bytes up per round", "vs fp32", "final test accuracy",
         "vs none (points)"])
    names = [codec + ("+zstd" if zstd else "") for codec, zstd in codecs]
    specs = [{**DIGITS, "name": f"bench-{name}", "num_clients": 8, "clients_per_round": 8,
              "rounds": rounds, "local_epochs": 1,
              "compression": {"codec": codec, "zstd": zstd}}
             for name, (codec, zstd) in zip(names, codecs)]
    with fedq_cluster(ctx, "codecs", 4) as cluster:
        # Side by side: bytes and accuracy do not depend on timing (same seed, same model).
        ctx.say(f"codecs: {', '.join(names)}")
        runs: list[tuple[str, JobRun]] = list(zip(names, run_jobs(cluster, specs)))
    base_acc = runs[0][1].rounds[-1]["accuracy"]
    for name, run in runs:
        done = [r for r in run.rounds if r["status"] == "committed"]
        up = statistics.mean(r["bytes_up"] for r in done)
        raw = statistics.mean(r["raw_bytes_up"] for r in done)
        acc = done[-1]["accuracy"]
        sec.rows.append([name, f"{up / 1e3:.1f} kB", f"{up / raw * 100:.0f}%", f"{acc:.4f}",
                         f"{(acc - base_acc) * 100:+.1f}"])
    return sec


def heterogeneous(ctx: Context) -> Section:
    rounds = 3 if ctx.smoke else 20
    target = 0.9
    # A slow learning rate, so that 90% takes several rounds rather than one.
    common = {**DIGITS, "num_clients": 4, "clients_per_round": 4, "rounds": rounds,
              "optimizer": {"name": "sgd", "lr": 0.01}}
    sec = Section(
        "4. Heterogeneous time-to-accuracy",
        "Digits, small_cnn, 4 clients on 4 training workers, one of them slowed 4× "
        "(FEDQ_TEST_SLOWDOWN=4: each training step takes four times as long), after a "
        "one-round warm-up job; SGD with learning rate 0.01, so that 90% takes several "
        "rounds. Wait-for-all: 2 local epochs per task, every round "
        "waits for the slow worker. Time-budgeted: each task trains until "
        "`time_budget_s` (set to the fast workers' median task time in the wait-for-all "
        "run), `weight_by: processed`. The global model is evaluated every round. "
        "Time: from "
        f"the start of round 1 to the commit of the first round whose global model reaches "
        f"{target:.0%} test accuracy.",
        ["mode", "time to 90% (s)", "round reaching it", "median round (s)",
         "final accuracy", "speed-up"])
    results: dict[str, tuple[float | None, int | None, Stat, float]] = {}
    epochs = 1 if ctx.smoke else 2
    with fedq_cluster(ctx, "hetero", 4, slow={3: 4.0}) as cluster:
        if not ctx.smoke:  # (the smoke deployment's workers have loaded it already)
            ctx.say("heterogeneous: warm-up (each worker loads the data set once)")
            run_job(cluster, {**common, "name": "bench-warm-up", "rounds": 1,
                              "local_epochs": 1})
        ctx.say("heterogeneous: wait-for-all")
        wait_all = run_job(cluster, {**common, "name": "bench-wait-all",
                                     "local_epochs": epochs})
        fast = _fast_seconds(cluster, wait_all.job)
        budget = round(statistics.median(fast), 2) if fast else 1.0
        ctx.say(f"heterogeneous: time-budgeted ({budget} s per task)")
        budgeted = run_job(cluster, {**common, "name": "bench-budget", "local_epochs": 50,
                                     "time_budget_s": budget, "weight_by": "processed"})
        for mode, run in (("wait for all", wait_all), (f"time budget {budget} s", budgeted)):
            results[mode] = _time_to(run, target)
    base = results["wait for all"][0]
    for mode, (t, rnd, per_round, final) in results.items():
        speed = f"{base / t:.2f}×" if base and t else "—"
        sec.rows.append([mode, f"{t:.1f}" if t else f"not reached in {rounds} rounds",
                         str(rnd) if rnd else "—", per_round.fmt(".2f"), f"{final:.4f}",
                         speed])
    t_budget = list(results.values())[1][0]
    sec.target("time-budgeted ≥ 2× faster to 90%",
               bool(base and t_budget and base / t_budget >= 2),
               f"{base / t_budget:.2f}×" if base and t_budget else "90% not reached")
    return sec


def _rss_between(run: JobRun, first: int, last: int) -> float:
    """Median RSS of the control worker while rounds ``first``..``last`` ran.

    A window shorter than the sampling interval (the smoke run's tiny rounds take
    ~0.03 s) may hold no sample: then the sample nearest to the window stands for it.
    """
    done = {r["round"]: r["finished_at"] for r in run.rounds}
    samples = run.control_rss_mb or []
    if not samples or last not in done:
        raise BenchError(f"scale: no memory samples for rounds {first}–{last}")
    hi = done[last]
    lo = done.get(max(first, 1), hi)
    window = [mb for t, mb in samples if lo <= t <= hi]
    if not window:
        middle = (lo + hi) / 2
        window = [min(samples, key=lambda s: abs(s[0] - middle))[1]]
    return statistics.median(window)


def _fast_seconds(cluster: Any, job: str, slow: tuple[str, ...] | list[str] = ("w3@",)
                  ) -> list[float]:
    """Seconds of the tasks that did not run on a slowed worker (w3 by default)."""
    return [u.seconds for u in cluster.updates(job)
            if u.status == "ok" and u.worker and not u.worker.startswith(tuple(slow))
            and u.seconds]


def _time_to(run: JobRun, target: float) -> tuple[float | None, int | None, Stat, float]:
    done = [r for r in run.rounds if r["status"] == "committed"]
    start = run.started_at
    hit = next((r for r in done if (r["accuracy"] or 0) >= target), None)
    per_round = Stat.of([r["seconds"] for r in done])
    return ((hit["finished_at"] - start, hit["round"], per_round, done[-1]["accuracy"])
            if hit else (None, None, per_round, done[-1]["accuracy"]))


def scale(ctx: Context) -> Section:
    wide = [20, 50] if ctx.smoke else [100, 1000, 10_000]
    long_rounds = 10 if ctx.smoke else 100
    sec = Section(
        "5. Scale",
        f"Zero-compute tiny model (mlp on digits), Redis + PostgreSQL, 2 training workers "
        f"and a control worker. Wide: {', '.join(f'{n:,}' for n in wide)} clients in every "
        f"round (3 rounds; {wide[-1]:,}: 2), each a task of its own. Long: 4 clients, "
        f"{long_rounds} rounds. Round time: from a round's dispatch to its commit. Memory: "
        "resident set of the control worker (sampled every 0.05 s; peak from the kernel's "
        "high-water mark); early: the median while the second tenth of the rounds ran, "
        "late: while the last tenth ran.",
        ["run", "round time (s)", "per client (ms)", "control worker peak (MB)",
         "control RSS early → late (MB)"])
    measured: dict[int, tuple[float, float]] = {}
    for clients in wide:
        with fedq_cluster(ctx, "scale", 2) as cluster:
            ctx.say(f"scale: {clients} clients per round")
            rounds = 2 if clients >= 10_000 else 3
            run = run_job(cluster, zero_compute_spec("tiny", rounds, clients,
                                                     round_timeout_s=1800),
                          timeout=3600, sample_control=True)
        seconds = Stat.of([r["seconds"] for r in run.rounds])
        measured[clients] = (seconds.median, run.control_peak_mb)
        sec.rows.append([f"{clients:,} clients/round × {rounds} rounds", seconds.fmt(".2f"),
                         f"{1000 * seconds.median / clients:.1f}",
                         f"{run.control_peak_mb:.0f}", "—"])
    for clients, bound in ((1000, 1.5), (10_000, 15.0)):
        if clients in measured:
            took, _ = measured[clients]
            sec.target(f"{clients:,} clients per round ≤ {bound:g} s (issue 33)",
                       took <= bound, f"{took:.2f} s a round")
    if 10_000 in measured:
        peak = measured[10_000][1]
        sec.target("10,000 clients: control worker peak ≤ 1 GB", peak <= 1024,
                   f"{peak:.0f} MB")
    with fedq_cluster(ctx, "long", 2) as cluster:
        ctx.say(f"scale: {long_rounds} rounds")
        long = run_job(cluster, zero_compute_spec("tiny", long_rounds, 4), timeout=3600,
                       sample_control=True)
    tenth = max(1, long_rounds // 10)
    early = _rss_between(long, tenth, 2 * tenth)
    late = _rss_between(long, long_rounds - tenth, long_rounds)
    per_round = Stat.of(long.intervals())
    sec.rows.append([f"4 clients × {long_rounds} rounds", per_round.fmt(".3f"),
                     f"{1000 * per_round.median / 4:.1f}", f"{long.control_peak_mb:.0f}",
                     f"{early:.1f} → {late:.1f} ({late - early:+.1f})"])
    sec.target(f"{long_rounds} rounds: no memory growth of the control worker",
               late - early <= 1.0,
               f"{late - early:+.1f} MB between rounds {tenth}–{2 * tenth} and the last "
               f"{tenth} rounds "
               f"(growth allowed: ≤ 1 MB, the sampling noise)")
    return sec


def lognormal_slowdowns(workers: int, sigma: float = 1.0, seed: int = 0) -> list[float]:
    """Per-worker FEDQ_TEST_SLOWDOWN: speeds drawn log-normal(0, sigma) (seeded), scaled so
    the fastest worker runs at full speed (slowdown 1)."""
    speed = np.exp(np.random.default_rng(seed).normal(0.0, sigma, workers))
    return [round(float(speed.max() / v), 2) for v in speed]


def buffered(ctx: Context) -> Section:
    workers = 2 if ctx.smoke else 6
    # x4: six emulated machines on this 2-core one would otherwise queue for the CPUs
    # (the emulated slowness is sleep, which does not).
    slow = [4 * x for x in lognormal_slowdowns(workers)]
    with fedq_cluster(ctx, "buffered", workers,
                      slow={i: x for i, x in enumerate(slow) if x > 1.0}) as cluster:
        return buffered_modes(ctx, cluster, slow, "6. Buffered asynchronous vs synchronous",
                              "on Redis + PostgreSQL")


def buffered_modes(ctx: Context, cluster: Any, slow: list[float], title: str,
                   where: str) -> Section:
    """Time to accuracy: synchronous (wait for all, time-budgeted) against buffered, on
    ``cluster``, whose training workers ``w{i}@...`` run ``slow[i]`` times slower
    (bench/wan.py runs it with each worker on an emulated WAN host)."""
    workers = len(slow)
    rounds = 2 if ctx.smoke else 15
    k = workers // 2
    sizes = [k] if ctx.smoke else [workers // 3, k]  # K = C/3 and C/2
    target = 0.9
    common = {**DIGITS, "num_clients": 2 * workers, "local_epochs": 2,
              "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
              "round_timeout_s": 300}
    sec = Section(
        title,
        f"Digits, small_cnn, {2 * workers} clients, {workers} training workers {where} "
        "whose speeds are drawn log-normal (sigma = 1, seed 0), times 4 so "
        "that the six emulated machines do not queue for this machine's two cores "
        f"(FEDQ_TEST_SLOWDOWN {', '.join(f'{x:g}' for x in sorted(slow))}), after a one-round "
        "warm-up job. Synchronous: "
        f"{workers} clients per round, {rounds} rounds; wait-for-all trains 2 local epochs "
        "per task, time-budgeted trains until `time_budget_s` (the fast workers' median "
        "task time in the wait-for-all run, `weight_by: processed`). Buffered (FedBuff): "
        f"{workers} tasks in flight, a version every K = "
        f"{' or '.join(map(str, sizes))} updates, weight "
        f"(1+staleness)^-0.5, {rounds * workers} / K versions (the same "
        f"{rounds * workers} updates as the synchronous runs), 2 local epochs per task "
        "or, in the rows that say so, the synchronous run's time budget per task "
        "(`weight_by: processed`), server step K/C (fedq's default for buffered FedAvg). "
        "The global model is evaluated after every round or version. Time: from the "
        "first round's (version's) start to the first commit whose global model reaches "
        f"{target:.0%} test accuracy.",
        ["mode", f"time to {target:.0%} (s)", "round / version reaching it",
         "total time (s)", "final accuracy", "speed-up"])
    if not ctx.smoke:
        ctx.say("buffered: warm-up (each worker loads the data set once)")
        run_job(cluster, {**common, "name": "bench-warm-up", "rounds": 1,
                          "clients_per_round": workers})
    ctx.say("buffered: synchronous, wait for all")
    wait_all = run_job(cluster, {**common, "name": "bench-sync", "rounds": rounds,
                                 "clients_per_round": workers})
    fast = _fast_seconds(cluster, wait_all.job, [f"w{i}@" for i, x in enumerate(slow)
                                                 if x > 1.5 * min(slow)])
    budget = round(statistics.median(fast), 2) if fast else 1.0
    ctx.say(f"buffered: synchronous, time budget {budget} s")
    budgeted = run_job(cluster, {**common, "name": "bench-sync-budget", "rounds": rounds,
                                 "clients_per_round": workers, "local_epochs": 50,
                                 "time_budget_s": budget, "weight_by": "processed"})
    runs = [("synchronous, wait for all", wait_all),
            (f"synchronous, time budget {budget} s", budgeted)]
    for size in sizes:
        ctx.say(f"buffered: FedBuff K={size}")
        runs.append((f"buffered K={size}", run_job(cluster, {
            **common, "name": f"bench-buffered-{size}", "rounds": rounds * workers // size,
            "clients_per_round": workers,
            "aggregation": {"mode": "buffered", "buffer": size}})))
        # the time budget and the buffer together: every task lasts the budget, so no
        # update is made from a model much older than the others
        ctx.say(f"buffered: FedBuff K={size}, time budget {budget} s")
        runs.append((f"buffered K={size}, time budget {budget} s", run_job(cluster, {
            **common, "name": f"bench-buffered-budget-{size}",
            "rounds": rounds * workers // size, "clients_per_round": workers,
            "local_epochs": 50, "time_budget_s": budget, "weight_by": "processed",
            "aggregation": {"mode": "buffered", "buffer": size}})))
    curves = {mode: _curve(run, "accuracy") for mode, run in runs}
    hits, best_sync = _speed_rows(sec, curves, lambda accuracy: accuracy >= target)
    when = {m: hit[0] for m, hit in hits.items() if hit}
    best = min((m for m in curves if m.startswith("buffered")),
               key=lambda m: when.get(m, math.inf))
    t_buf = when.get(best)
    acc_buf = curves[best][-1][2]
    acc_sync = max(c[-1][2] for m, c in curves.items() if m.startswith("sync"))
    sec.target(f"buffered (best: {best}) ≥ 1.5× faster to the target than the best "
               "synchronous mode",
               bool(best_sync and t_buf and best_sync / t_buf >= 1.5),
               f"{best_sync / t_buf:.2f}×" if best_sync and t_buf else "target not reached")
    sec.target("buffered final accuracy within 1 point of synchronous",
               not math.isnan(acc_buf) and acc_buf >= acc_sync - 0.01,
               f"{(acc_buf - acc_sync) * 100:+.1f} points")
    sec.notes.append("Speed-up: the best synchronous time to the target over this mode's. "
                     "Final accuracy: after the same number of updates in every mode.")
    return sec


LM: dict[str, Any] = {"model": "gpt", "model_args": {"n_layer": 2, "n_head": 2, "n_embd": 64},
                      "dataset": "shakespeare",
                      "dataset_args": {"block_size": 32, "eval_windows": 256},
                      "batch_size": 16, "seed": 0,
                      "optimizer": {"name": "adamw", "lr": 0.003, "beta2": 0.95,
                                    "grad_clip": 1.0}}


def _curve(run: JobRun, metric: str) -> list[tuple[float, int, float]]:
    """(seconds since the start, round or version, ``metric``) of each committed round or
    version that was evaluated; a run with none is a failed benchmark."""
    curve = [(r["finished_at"] - run.started_at, r["round"], r[metric])
             for r in run.rounds if r["status"] == "committed" and r[metric] is not None]
    if not curve:
        raise BenchError(f"job {run.job}: no committed round with a {metric}")
    return curve


def _speed_rows(sec: Section, curves: dict[str, list[tuple[float, int, float]]],
                reached: Callable[[float], bool]
                ) -> tuple[dict[str, tuple[float, int] | None], float | None]:
    """One row of ``sec`` per mode: the time to its first commit whose metric ``reached``
    the target, that round or version, the total time, the final metric and the speed-up
    over the best synchronous mode (modes named ``synchronous...``). Returns each mode's
    (time, round) at the target, None where not reached, and the best synchronous time."""
    hits = {m: next(((t, n) for t, n, value in c if reached(value)), None)
            for m, c in curves.items()}
    best_sync = min((h[0] for m, h in hits.items() if m.startswith("sync") and h),
                    default=None)
    for mode, curve in curves.items():
        hit = hits[mode]
        speed = f"{best_sync / hit[0]:.2f}×" if best_sync and hit else "—"
        sec.rows.append([mode, f"{hit[0]:.1f}" if hit else "not reached",
                         str(hit[1]) if hit else "—", f"{curve[-1][0]:.1f}",
                         f"{curve[-1][2]:.4f}", speed])
    return hits, best_sync


def buffered_lm(ctx: Context) -> Section:
    """Section 6's comparison on the language model: the same six log-normal workers,
    time to a validation loss instead of an accuracy."""
    workers = 2 if ctx.smoke else 6
    slow = [4 * x for x in lognormal_slowdowns(workers)]
    rounds = 2 if ctx.smoke else 15
    steps = 2 if ctx.smoke else 10
    k = max(1, workers // 3)
    common = {**LM, "num_clients": 2 * workers, "local_steps": steps, "round_timeout_s": 600}
    sec = Section(
        "7. Buffered asynchronous vs synchronous: the language model",
        f"A GPT (2 layers, 2 heads, width 64, context 32 bytes; AdamW lr 0.003) on "
        f"Shakespeare and Milton, {2 * workers} clients (IID), {workers} training workers on "
        "Redis + PostgreSQL with section 6's log-normal speeds (FEDQ_TEST_SLOWDOWN "
        f"{', '.join(f'{x:g}' for x in sorted(slow))}), after a one-round warm-up job. "
        f"Synchronous: {workers} clients per round, {rounds} rounds of {steps} inner steps "
        "each (wait for all), or until the time budget (the fast workers' median task "
        "time in the wait-for-all run, `weight_by: processed`). Buffered (FedBuff): "
        f"{workers} tasks in flight of {steps} inner steps, a version every K = {k} updates, "
        f"weight (1+staleness)^-0.5, server step K/C, {rounds * workers // k} versions (the "
        f"same {rounds * workers} updates). Validation loss in nats per byte on 256 "
        "held-out windows after every round or version. Target: the validation loss the "
        f"wait-for-all run reached after {2 * rounds // 3} of its {rounds} rounds; time "
        "from the first round's (version's) start to the first commit at or below it.",
        ["mode", "time to the target (s)", "round / version reaching it", "total time (s)",
         "final validation loss", "speed-up"])
    with fedq_cluster(ctx, "buffered-lm", workers,
                      slow={i: x for i, x in enumerate(slow) if x > 1.0}) as cluster:
        if not ctx.smoke:
            ctx.say("buffered-lm: warm-up (each worker loads the text once)")
            run_job(cluster, {**common, "name": "bench-lm-warm-up", "rounds": 1,
                              "clients_per_round": workers})
        ctx.say("buffered-lm: synchronous, wait for all")
        wait_all = run_job(cluster, {**common, "name": "bench-lm-sync", "rounds": rounds,
                                     "clients_per_round": workers}, timeout=1800)
        fast = _fast_seconds(cluster, wait_all.job, [f"w{i}@" for i, x in enumerate(slow)
                                                     if x > 1.5 * min(slow)])
        budget = round(statistics.median(fast), 2) if fast else 1.0
        ctx.say(f"buffered-lm: synchronous, time budget {budget} s")
        budgeted = run_job(cluster, {**common, "name": "bench-lm-budget", "rounds": rounds,
                                     "clients_per_round": workers, "local_steps": 100 * steps,
                                     "time_budget_s": budget, "weight_by": "processed"},
                           timeout=1800)
        ctx.say(f"buffered-lm: FedBuff K={k}")
        buffered = run_job(cluster, {**common, "name": "bench-lm-buffered",
                                     "rounds": rounds * workers // k,
                                     "clients_per_round": workers,
                                     "aggregation": {"mode": "buffered", "buffer": k}},
                           timeout=1800)
    curves = {"synchronous, wait for all": _curve(wait_all, "eval_loss"),
              f"synchronous, time budget {budget} s": _curve(budgeted, "eval_loss"),
              f"buffered K={k}": _curve(buffered, "eval_loss")}
    base = curves["synchronous, wait for all"]
    target = base[min(len(base), 2 * rounds // 3) - 1][2]
    hits, best_sync = _speed_rows(sec, curves, lambda loss: loss <= target)
    mine = hits[f"buffered K={k}"]
    sec.target("buffered ≥ 1.5× faster to the target than the best synchronous mode",
               bool(best_sync and mine and best_sync / mine[0] >= 1.5),
               f"{best_sync / mine[0]:.2f}×" if best_sync and mine else "target not reached")
    final_sync = min(c[-1][2] for m, c in curves.items() if m.startswith("sync"))
    final_buf = curves[f"buffered K={k}"][-1][2]
    sec.target("buffered final validation loss within 2% of the best synchronous one",
               final_buf <= 1.02 * final_sync,
               f"{(final_buf / final_sync - 1) * 100:+.1f}%")
    sec.notes.append(f"The target, {target:.4f} nats/byte, comes from this run's "
                     "wait-for-all curve. Speed-up: the best synchronous time to the target "
                     "over this mode's.")
    return sec
