"""Language-model baselines against DiLoCo, and time-budgeted inner steps with a slow
worker; writes the tables of docs/lm.md.

    .venv/bin/python -m bench.lm                 # hours on 2 CPU cores; minutes on a GPU
    .venv/bin/python -m bench.lm --smoke --out /tmp/lm.md   # seconds (the test suite)
    .venv/bin/python -m bench.lm --only downlink --jobs 2     # the downlink table alone
    .venv/bin/python -m bench.lm --only streaming --jobs 2    # the Streaming DiLoCo table
    .venv/bin/python -m bench.lm --device cuda --jobs 8 --warm 1000  # from a warm start

The runs compare algorithms, so they run in this process with fedq's own pieces (the
local training loop with its inner AdamW, warm-up/cosine schedule and kept state, the
int8 codec, the mean and FedNova reducers, the DiLoCo outer step) and no Celery: the
same model (GPT, ~0.83M parameters, byte-level, context 64), the same tokens processed
(4 workers x STEPS inner steps x batch 16 x 64 bytes), the same seed. Bytes are counted
as fedq moves them: per outer step each worker downloads the global model (fp32; the
first, round 0's, it rebuilds from the seed instead) and uploads its encoded update;
synchronous data parallel moves a gradient up and the averaged one down per worker per
step. Validation loss is nats per byte on held-out
text (the last 10% of every work), 2,048 windows.

The slow-worker table uses simulated time: one step takes the median step time measured
here, four times that on the slow worker; a fixed-H round lasts as long as the slow
worker's H steps (the run takes twice baseline 2's steps), a time-budgeted round as long
as the budget (fast workers take more steps, every worker's lr schedule follows the
clock, the outer step is FedNova-normalised) until it reaches baseline 2's loss or the
fixed-H run's time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from fedq.aggregate import Accumulator
from fedq.aggregate.compression import decode, encode
from fedq.aggregate.downlink import compress_step
from fedq.aggregate.reducers import Contribution, StreamReducer, make_reducer
from fedq.aggregate.server import make_server
from fedq.aggregate.streaming import fragment_names
from fedq.coordinator.evaluation import evaluate
from fedq.data import client_indices, load_dataset
from fedq.data.datasets import Dataset
from fedq.models import build_model
from fedq.spec import OptimizerSpec, parse_spec, round_window
from fedq.testing.procs import Forked, start_module
from fedq.weights import dumps, loads, raw_size, state_of
from fedq.worker import replica
from fedq.worker.inner import state_path
from fedq.worker.loop import local_train, lr_at, task_loss

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "lm.md"
GPU_BEGIN, GPU_END = "<!-- begin gpu table -->", "<!-- end gpu table -->"
WORKERS, BATCH, BLOCK, SEED = 4, 16, 64, 0
# --smoke (the test suite: it checks the tables' making, not their figures) steps on a
# quarter of the windows
SMOKE_BATCH = 4
LR, WARMUP = 2e-3, 50


@dataclass
class Config:
    """What this run's command line set (main) and a --one process was handed (run_one);
    read through :data:`CONFIG`."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # --device
    warm: int = 0  # --warm: steps of data parallel every run starts from
    warm_loss: float = math.nan  # the warm start's validation loss
    init: Path | None = None  # the warm start's model, in a --one process
    batch: int = BATCH  # windows a step; SMOKE_BATCH under --smoke


CONFIG = Config()
# the slow-worker table's fixed-H run takes SLOW_SPAN x the steps baseline 2 does (DiLoCo
# needs more tokens than data parallel to reach its loss: at the same tokens it ends above)
SLOW_SPAN = 2
CODECS = {"fp32": "none", "int8": "int8"}  # --codecs name: fedq's codec name
STARTED = time.perf_counter()


def markers(table: str) -> tuple[str, str]:
    """The begin and end markers of one generated table of docs/lm.md ("generated
    tables", "downlink table", "streaming table"); a --warm run writes its own."""
    name = ("warm-start " if CONFIG.warm else "") + table
    return f"<!-- begin {name} -->", f"<!-- end {name} -->"


def progress(name: str, done: int, total: int | None, what: str) -> None:
    """One line on stderr per round (a full CPU run takes tens of minutes each)."""
    of = f"/{total}" if total else ""
    print(f"  {name}: {what} {done}{of} ({time.perf_counter() - STARTED:.0f} s)",
          file=sys.stderr, flush=True)


@dataclass
class Run:
    name: str
    val_loss: float = math.nan
    bytes_moved: int = 0
    curve: list[tuple[float, float]] = field(default_factory=list)  # (time or step, loss)
    bytes_up: int = 0
    peak_up: int = 0  # the largest update blob one worker sent
    rounds: int = 0


def optimizer(steps: int, cosine: bool = True) -> OptimizerSpec:
    return OptimizerSpec(name="adamw", lr=LR, beta2=0.95, weight_decay=0.1,
                         warmup_steps=min(WARMUP, steps // 10),
                         schedule="cosine" if cosine else "constant", schedule_steps=steps,
                         grad_clip=1.0, keep_state=True)


def fresh_model(ds: Dataset) -> torch.nn.Module:
    """The seed's model or, with --warm, the shared warm start's."""
    torch.manual_seed(SEED)
    model = build_model("gpt", ds.input_shape, ds.num_classes)
    if CONFIG.init is not None:
        model.load_state_dict(loads(CONFIG.init.read_bytes(), "the warm start"))
    return model


def val_loss(model: torch.nn.Module, ds: Dataset) -> float:
    return evaluate(model, ds.x_test, ds.y_test, device=CONFIG.device, batch_size=256)[1]


def shards(ds: Dataset, partition: dict[str, Any]) -> list[torch.Tensor]:
    spec = parse_spec({"model": "gpt", "dataset": "shakespeare", "num_clients": WORKERS,
                       "clients_per_round": WORKERS, "rounds": 1, "local_steps": 1,
                       "partition": partition})
    labels = ds.partition_labels()
    return [torch.from_numpy(client_indices(labels, spec.partition, WORKERS, c, SEED))
            for c in range(WORKERS)]


def single(ds: Dataset, steps: int, scratch: Path) -> Run:
    """Baseline 1: one worker, all the data, 4 x steps steps (the same tokens)."""
    model = fresh_model(ds)
    local_train(model, ds.x_train, ds.y_train, optimizer=optimizer(WORKERS * steps),
                batch_size=CONFIG.batch, epochs=None, steps=WORKERS * steps, seed=SEED,
                device=CONFIG.device, schedule_steps=WORKERS * steps,
                state_path=scratch / "single.safetensors")
    return Run("1. one worker alone, all data", val_loss(model, ds), 0)


def data_parallel(ds: Dataset, parts: list[torch.Tensor], steps: int,
                  save: Path | None = None) -> Run:
    """Baseline 2: synchronous data parallel: every step the 4 workers' gradients are
    averaged and one AdamW step is taken. ``save``: write the trained model there (the
    --warm start)."""
    model = fresh_model(ds).to(CONFIG.device)
    spec = optimizer(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    gens = [torch.Generator().manual_seed(SEED + c) for c in range(WORKERS)]
    size = raw_size(state_of(model))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec, steps)
        opt.zero_grad(set_to_none=True)
        for c, idx in enumerate(parts):
            pick = idx[torch.randint(len(idx), (CONFIG.batch,), generator=gens[c])]
            xb, yb = ds.x_train[pick].to(CONFIG.device), ds.y_train[pick].to(CONFIG.device)
            (task_loss(model(xb), yb) / WORKERS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0:
            progress("data parallel" if save is None else "warm start", step + 1, steps,
                     "step")
    if save is not None:
        save.write_bytes(dumps(state_of(model)))
    return Run("2. synchronous data parallel (H = 1)", val_loss(model, ds),
               2 * WORKERS * size * steps)


def diloco(ds: Dataset, parts: list[torch.Tensor], steps: int, h: int, codec: str,
           scratch: Path, name: str, *, slow: int | None = None, budget: bool = False,
           step_time: float = 1.0, target: float | None = None,
           max_time: float | None = None, downlink: str = "none", fragments: int = 1,
           mixing: float = 0.0, rounds: int | None = None) -> Run:
    """DiLoCo: H inner AdamW steps per worker from the global model, the deltas averaged
    (FedNova-normalised when their step counts differ), the outer Nesterov step (lr 0.7,
    momentum 0.9). ``slow``: that worker's steps take 4x as long (simulated time); with
    ``budget`` a round lasts H fast steps and each worker takes the steps that fit, until
    ``target`` is reached or ``max_time`` passes; without it, steps / H rounds.
    ``rounds``: a time-budgeted run's planned rounds, which its cosine spans: round r
    covers ((r - 1) / rounds, r / rounds) of it on every worker, whatever its speed (as
    fedq schedules a job with ``time_budget_s``: JobSpec.schedule_window).
    ``downlink: int8``: after round 1 each worker downloads the new model as an int8
    step (fedq/aggregate/downlink.py: the published model is the previous one plus the
    dequantized step, the residual carried), not the fp32 model. ``fragments`` F > 1:
    Streaming DiLoCo as fedq runs it (fedq/aggregate/streaming.py): H / F inner steps per
    round, round r synchronises fragment (r - 1) % F, each worker trains on from its kept
    replica (fedq/worker/replica.py) and uploads that fragment's outer gradient alone;
    ``mixing``: a fragment synchronised since starts at mixing x the replica's value +
    (1 - mixing) x the global one."""
    weights = state_of(fresh_model(ds))
    # round 0's model is fresh_model's, which every worker rebuilds from the seed instead
    # of downloading it (fedq/worker/update.py, rebuild_initial); a warm start it downloads
    down_bytes = 0 if CONFIG.init is None else raw_size(weights)
    residual = dict[str, torch.Tensor]()
    model = fresh_model(ds)
    server, server_state = make_server("diloco"), dict[str, torch.Tensor]()
    reducer = make_reducer("fednova" if budget else "mean")
    acc, run, clock = Accumulator(), Run(name), 0.0
    spec = optimizer(steps)
    done = [0] * WORKERS
    folder = scratch / name.replace(" ", "_").replace(",", "")
    round_time = h * step_time * (4 if slow is not None and not budget else 1)
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    per_round = h // fragments
    total_rounds = (steps // h) * fragments  # the same inner steps as DiLoCo at this H
    rnd = 0
    while budget or rnd < total_rounds:
        rnd += 1
        contributions = []
        part = fragment_names(weights, rnd, fragments) if fragments > 1 else tuple(weights)
        for c, idx in enumerate(parts):
            take = max(1, h // 4) if budget and c == slow else per_round
            local = build_model("gpt", ds.input_shape, ds.num_classes)
            kept = folder / f"replica{c}.safetensors"
            local.load_state_dict(weights if fragments == 1 else
                                  replica.start_from(weights, kept, rnd, fragments, mixing)[0])
            stats = local_train(local, ds.x_train[idx], ds.y_train[idx], optimizer=spec,
                                batch_size=CONFIG.batch, epochs=None, steps=take,
                                seed=SEED * 1000 + rnd * 10 + c, device=CONFIG.device,
                                schedule_steps=steps, first_step=done[c],
                                schedule_window=round_window(rnd, rounds)
                                if budget and rounds else None,
                                state_path=state_path(folder, "bench", c))
            done[c] = stats.inner_step
            trained = local.state_dict()
            if fragments > 1:
                replica.save(trained, kept, rnd)
            delta = {k: trained[k].detach().cpu() - weights[k] for k in part}
            stored, meta = encode(delta, codec, 256)
            up = raw_size(stored)
            run.bytes_moved += up + down_bytes
            run.bytes_up += up
            run.peak_up = max(run.peak_up, up)
            contributions.append(Contribution(
                1.0, stats.steps, decode(stored, meta, {k: shapes[k] for k in part})))
        assert isinstance(reducer, StreamReducer)
        previous = weights
        weights, server_state = server.step(weights, reducer.reduce(contributions, acc),
                                            server_state)
        weights = {k: v.clone() for k, v in weights.items()}  # acc is reused next round
        if downlink == "int8" or fragments > 1:  # as fedq publishes it (see put_model)
            weights, residual, step, _ = compress_step(previous, weights, residual, 256,
                                                       quantize=downlink == "int8")
            down_bytes = raw_size(step)
        else:  # the whole fp32 model, every round after the first
            down_bytes = raw_size(weights)
        clock += round_time
        progress(name, rnd, None if budget else total_rounds, "round")
        if slow is not None or not (budget or rnd < total_rounds):
            model.load_state_dict(weights)
            run.curve.append((clock, val_loss(model, ds)))
        if budget and ((target is not None and run.curve[-1][1] <= target)
                       or (max_time is not None and clock >= max_time)):
            break
    run.val_loss = run.curve[-1][1]
    run.rounds = rnd
    return run


def gpu_row(steps: int = 300, batch: int = 64, block: int = 256) -> dict[str, Any]:
    """The ~10M-parameter config (6 layers, 6 heads, width 384, context 256) trained on
    one worker for ``steps`` steps: tokens/s, GPU memory and utilisation."""
    ds = load_dataset("shakespeare", None, {"block_size": block, "eval_windows": 256})
    torch.manual_seed(SEED)
    model = build_model("gpt", ds.input_shape, ds.num_classes, n_layer=6, n_head=6, n_embd=384)
    params = sum(p.numel() for p in model.parameters())
    local_train(model, ds.x_train, ds.y_train, optimizer=optimizer(20), batch_size=batch,
                epochs=None, steps=20, seed=SEED, device=CONFIG.device)  # warm-up: kernels, caches
    stats = local_train(model, ds.x_train, ds.y_train, optimizer=optimizer(steps),
                        batch_size=batch, epochs=None, steps=steps, seed=SEED, device=CONFIG.device)
    return {"params": params, "tokens_per_s": stats.seen * block / stats.seconds,
            "amp": stats.amp, "gpu_peak_mb": stats.gpu_peak_mb, "gpu_util": stats.gpu_util,
            "steps": steps, "batch": batch, "block": block,
            "device": torch.cuda.get_device_name(CONFIG.device), "torch": torch.__version__,
            "val_loss": val_loss(model, ds)}


def step_seconds(ds: Dataset) -> float:
    model = fresh_model(ds)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        local_train(model, ds.x_train, ds.y_train, optimizer=optimizer(10),
                    batch_size=CONFIG.batch, epochs=None, steps=10, seed=SEED,
                    device=CONFIG.device)
        times.append((time.perf_counter() - t) / 10)
    return statistics.median(times)


def run_one(job: dict[str, Any], smoke: bool) -> dict[str, Any]:
    """One run of the table, by name (in a process of its own: see main)."""
    CONFIG.init = Path(job["init"]) if job.get("init") else None
    CONFIG.batch = SMOKE_BATCH if smoke else BATCH
    steps, h = job["steps"], job.get("h", 0)
    if job["kind"] == "gpu":
        return gpu_row()
    ds = load_dataset("shakespeare", None, {"block_size": BLOCK,
                                            "eval_windows": 64 if smoke else 2048,
                                            **({"max_works": 6} if smoke else {})})
    if job["kind"] == "step_time":
        return {"seconds": step_seconds(ds)}
    parts = shards(ds, {"kind": "by_group" if job.get("non_iid") else "iid"})
    with tempfile.TemporaryDirectory() as tmp:
        if job["kind"] == "single":
            run = single(ds, steps, Path(tmp))
        elif job["kind"] == "dp":
            run = data_parallel(ds, parts, steps)
        elif job["kind"] == "warm":
            run = data_parallel(ds, parts, steps, save=Path(job["out"]))
        else:
            run = diloco(ds, parts, steps, h, job.get("codec", "none"), Path(tmp), job["name"],
                         slow=job.get("slow"), budget=job.get("budget", False),
                         step_time=job.get("step_time", 1.0), target=job.get("target"),
                         max_time=job.get("max_time"), downlink=job.get("downlink", "none"),
                         fragments=job.get("fragments", 1), mixing=job.get("mixing", 0.0),
                         rounds=job.get("rounds"))
    return {"name": run.name, "val_loss": run.val_loss, "bytes_moved": run.bytes_moved,
            "curve": run.curve, "bytes_up": run.bytes_up, "peak_up": run.peak_up,
            "rounds": run.rounds}


def run_all(jobs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each job in a ``python -m bench.lm --one JOB`` process of its own, ``--jobs`` at a
    time (the runs are independent; results come back as JSON on stdout). A run is told
    how many run beside it, so the cores are shared among those (a lone run takes all).
    Under the test suite (``FEDQ_TEST_ZYGOTE=1``) each is forked from a process that has
    imported torch once (fedq.testing.procs.start_module)."""
    pending = list(enumerate(jobs))
    running: list[tuple[int, subprocess.Popen[bytes] | Forked]] = []
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lm-") as tmp:
        while pending or running:
            while pending and len(running) < args.jobs:
                i, job = pending.pop(0)
                if args.init:
                    job = {**job, "init": args.init}
                cmd = ["--one", json.dumps(job), "--device", args.device,
                       "--jobs", str(min(args.jobs, len(running) + len(pending) + 1)),
                       *(["--smoke"] if args.smoke else [])]
                running.append((i, start_module("bench.lm", cmd, Path(tmp, str(i)), ROOT)))
            for i, proc in list(running):
                if proc.poll() is None:
                    continue
                running.remove((i, proc))
                if proc.returncode != 0:
                    raise SystemExit(f"bench.lm: run {jobs[i].get('name', jobs[i]['kind'])} "
                                     f"failed ({proc.returncode})")
                out = Path(tmp, str(i)).read_text()
                results[i] = json.loads(out.strip().splitlines()[-1])
                print(f"{jobs[i].get('name', jobs[i]['kind'])}: "
                      f"{results[i].get('val_loss', results[i])}", flush=True)
            time.sleep(0.2)
    return [results[i] for i in range(len(jobs))]


def _run(r: dict[str, Any]) -> Run:
    return Run(r["name"], r["val_loss"], r["bytes_moved"], [tuple(c) for c in r["curve"]],
               r.get("bytes_up", 0), r.get("peak_up", 0), r.get("rounds", 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lm")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per worker")
    parser.add_argument("--out", type=Path, default=DOC)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, one process each")
    parser.add_argument("--only", choices=["downlink", "streaming", "parity", "slow"],
                        help="downlink / streaming / parity (baseline 2 against DiLoCo) / "
                             "slow (one worker 4x slower): only that table (its own "
                             "section)")
    parser.add_argument("--hs", help="with --only downlink or parity: the H values, e.g. 100 "
                                     "(default 100,500)")
    parser.add_argument("--codecs", default="fp32,int8",
                        help="with --only parity: the DiLoCo update codecs, fp32 and/or int8")
    parser.add_argument("--warm", type=int, default=0, metavar="N",
                        help="every run starts from a model trained N steps by synchronous "
                             "data parallel (shared; its steps and bytes not counted)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm < 0:
        parser.error(f"--warm must be 0 or more steps, not {args.warm}")
    if not set(args.codecs.split(",")) <= set(CODECS):
        parser.error(f"--codecs takes fp32 and/or int8, comma-separated, not {args.codecs!r}")
    CONFIG.device, CONFIG.warm, args.init = torch.device(args.device), args.warm, None
    CONFIG.batch = SMOKE_BATCH if args.smoke else BATCH
    # the cores shared among the runs at a time (a --one process is told --jobs too;
    # before it was, each run took two threads: four busy threads on a 2-core machine)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.jobs))
    if args.one:
        print(json.dumps({**run_one(json.loads(args.one), args.smoke),
                          "threads": torch.get_num_threads()}))
        return 0
    steps = 20 if args.smoke else args.steps
    hs = [5, 10] if args.smoke else [50, 100, 500]
    h_mid = hs[len(hs) // 2]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.warm:
            start = Path(tmp) / "warm.safetensors"
            [warm] = run_all([{"kind": "warm", "steps": args.warm, "out": str(start)}], args)
            CONFIG.warm_loss, args.init = warm["val_loss"], str(start)
        return _tables(args, steps, hs, h_mid, started)


def _tables(args: argparse.Namespace, steps: int, hs: list[int], h_mid: int,
            started: float) -> int:
    if args.only == "streaming":
        h = 8 if args.smoke else h_mid  # divisible by 2 and 4 fragments
        streams = streaming_runs(steps, h, args)
        write_streaming(args.out, steps, h, streams, time.perf_counter() - started,
                        args.smoke)
        print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
        return 0
    if args.only == "parity":
        chosen = [int(h) for h in args.hs.split(",")] if args.hs else hs[1:]
        runs = parity_runs(steps, chosen, args)
        write_parity(args.out, steps, runs, time.perf_counter() - started, args.smoke,
                     args.hs, args.codecs)
        print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
        return 0
    if args.only == "slow":
        t, base2, fixed, timed = slow_runs(steps, h_mid, args)
        write_slow(args.out, steps, base2, fixed, timed, t, time.perf_counter() - started,
                   _command("slow", steps, args.smoke),
                   _budget_rounds(fixed))
        print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
        return 0
    down = downlink_runs(steps, [0, *map(int, args.hs.split(","))] if args.hs else hs, args)
    if args.only == "downlink":
        write_downlink(args.out, steps, down, time.perf_counter() - started, args.smoke,
                       args.hs)
        print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
        return 0
    [t] = [r["seconds"] for r in run_all([{"kind": "step_time", "steps": steps}], args)]
    grid = [{"kind": "diloco", "steps": steps, "h": h, "codec": codec,
             "name": f"3. DiLoCo H = {h}, {'fp32' if codec == 'none' else 'int8'}"}
            for h in hs for codec in ("none", "int8")]
    first = run_all([
        {"kind": "single", "steps": steps}, {"kind": "dp", "steps": steps}, *grid,
        {"kind": "diloco", "steps": steps, "h": h_mid, "non_iid": True,
         "name": f"DiLoCo H = {h_mid}, fp32, each client whole works (non-IID)"},
        _fixed_job(steps, h_mid, t)], args)
    base1, base2, *runs = [_run(r) for r in first]
    runs, non_iid, fixed = runs[:-2], runs[-2], runs[-1]
    second = run_all([_timed_job(steps, h_mid, t, base2, fixed),
                      *([{"kind": "gpu", "steps": steps}] if CONFIG.device.type == "cuda" else [])],
                     args)
    timed, big = _run(second[0]), (second[1] if len(second) > 1 else None)
    iid_mid = next(r for r in runs if r.name == f"3. DiLoCo H = {h_mid}, fp32")
    elapsed = time.perf_counter() - started
    write(args.out, steps, base1, base2, runs, iid_mid, non_iid, elapsed, args.smoke)
    write_slow(args.out, steps, base2, fixed, timed, t, elapsed,
               _command(None, steps, args.smoke), _budget_rounds(fixed))
    if big is not None:
        write_gpu(args.out, big)
    write_downlink(args.out, steps, down, elapsed, args.smoke)
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    return 0


def _fixed_job(steps: int, h: int, step_time: float) -> dict[str, Any]:
    return {"kind": "diloco", "steps": SLOW_SPAN * steps, "h": h, "slow": 3,
            "step_time": step_time, "name": f"fixed H = {h} on every worker"}


def _timed_job(steps: int, h: int, step_time: float, base2: Run, fixed: Run) -> dict[str, Any]:
    """Rounds of a time budget of ``h`` fast steps, for as long as ``fixed`` ran (or until
    baseline 2's loss), the inner lr schedule following the clock over that time (as
    fedq's ``time_budget_s`` does; a schedule by each worker's own step count left the
    slow worker at a high lr while the fast ones decayed: 1.6741 against 1.5797, the
    2026-11-24 run in docs/lm.md)."""
    return {"kind": "diloco", "steps": steps, "h": h, "slow": 3, "budget": True,
            "step_time": step_time, "target": base2.val_loss, "max_time": fixed.curve[-1][0],
            "rounds": _budget_rounds(fixed),
            "name": f"time budget of {h} fast steps, FedNova-normalised"}


def _budget_rounds(fixed: Run) -> int:
    """The time budget's rounds in the fixed-H run's time: each fixed-H round lasts the
    slow worker's H steps, 4 budget rounds of H fast steps."""
    return 4 * len(fixed.curve)


def slow_runs(steps: int, h: int, args: argparse.Namespace) -> tuple[float, Run, Run, Run]:
    """The slow-worker table alone: the step time, baseline 2 (the target), fixed H, and
    the time budget (which needs both)."""
    [t] = [r["seconds"] for r in run_all([{"kind": "step_time", "steps": steps}], args)]
    base2, fixed = [_run(r) for r in run_all([{"kind": "dp", "steps": steps},
                                              _fixed_job(steps, h, t)], args)]
    [timed] = [_run(r) for r in run_all([_timed_job(steps, h, t, base2, fixed)], args)]
    return t, base2, fixed, timed


def _command(only: str | None, steps: int, smoke: bool, *extra: str) -> str:
    """The command line that makes a table (``extra``: its own flags, e.g. "--hs 100")."""
    return " ".join(["python -m bench.lm", *([f"--only {only}"] if only else []),
                     *(["--smoke"] if smoke else [] if steps == 1000 else [f"--steps {steps}"]),
                     *(e for e in extra if e),
                     *([] if CONFIG.device.type == "cpu" else [f"--device {CONFIG.device.type}"]),
                     *([f"--warm {CONFIG.warm}"] if CONFIG.warm else [])])


def parity_runs(steps: int, hs: list[int], args: argparse.Namespace) -> list[Run]:
    """Baseline 2 (synchronous data parallel) and DiLoCo at each H, fp32 and int8: the
    main table's comparison alone, for longer runs (--steps) than the whole table affords."""
    return [_run(r) for r in run_all([
        {"kind": "dp", "steps": steps},
        *({"kind": "diloco", "steps": steps, "h": h, "codec": CODECS[label],
           "name": f"DiLoCo H = {h}, {label}"}
          for h in hs for label in CODECS if label in args.codecs.split(","))], args)]


def write_parity(out: Path, steps: int, runs: list[Run], elapsed: float, smoke: bool,
                 hs: str | None, codecs: str = "fp32,int8") -> None:
    """Baseline 2 against DiLoCo, between its own markers in ``out``."""
    base, *rest = runs
    command = _command("parity", steps, smoke, f"--hs {hs}" if hs else "",
                       "" if codecs == "fp32,int8" else f"--codecs {codecs}")
    begin, end = markers("parity table")
    lines = [begin, "",
             f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/{command}` on "
             f"{platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, on {CONFIG.device.type}, in {elapsed / 60:.1f} min. {WORKERS} "
             f"workers x {steps} inner steps x batch {CONFIG.batch} x {BLOCK} bytes = "
             f"{WORKERS * steps * CONFIG.batch * BLOCK:,} tokens per run, seed {SEED}."
             + _warm_note(), "",
             "| run | outer steps | validation loss (nats/byte) | vs baseline 2 | MB moved "
             "| fewer bytes than baseline 2 |", "|---|---|---|---|---|---|",
             f"| {base.name} | - | {base.val_loss:.4f} | +0.00% | "
             f"{base.bytes_moved / 1e6:,.1f} | - |"]
    for r in rest:
        lines.append(f"| {r.name} | {r.rounds} | {r.val_loss:.4f} | "
                     f"{(r.val_loss / base.val_loss - 1) * 100:+.2f}% | "
                     f"{r.bytes_moved / 1e6:,.1f} | {base.bytes_moved / r.bytes_moved:,.0f}x |")
    lines += ["", end]
    _write_section(out, begin, end, lines)


def downlink_runs(steps: int, hs: list[int], args: argparse.Namespace) -> list[Run]:
    """DiLoCo with int8 updates, the model sent down as fp32 and as int8 steps."""
    grid = [{"kind": "diloco", "steps": steps, "h": h, "codec": "int8", "downlink": down,
             "name": f"DiLoCo H = {h}, int8 up, {'int8 steps' if down == 'int8' else 'fp32'}"
                     " down"}
            for h in hs[1:] for down in ("none", "int8")]
    return [_run(r) for r in run_all(grid, args)]


def write_downlink(out: Path, steps: int, runs: list[Run], elapsed: float,
                   smoke: bool, hs: str | None = None) -> None:
    """The compressed-downlink table, between its own markers in ``out``."""
    size = raw_size(state_of(fresh_model_shapes()))
    dp_bytes = 2 * WORKERS * size * steps  # baseline 2, as data_parallel counts it
    command = _command("downlink", steps, smoke, f"--hs {hs}" if hs else "")
    begin, end = markers("downlink table")
    lines = [begin, "",
             f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/{command}` "
             f"(or the full run) on {platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, on {CONFIG.device.type}, in {elapsed / 60:.1f} min; the same "
             f"{WORKERS} workers x {steps} inner steps as above. Baseline 2's bytes are "
             f"counted as above: {dp_bytes / 1e6:,.1f} MB." + _warm_note(), "",
             "| run | validation loss | vs fp32 down | MB moved | fewer bytes than "
             "baseline 2 |", "|---|---|---|---|---|"]
    by_name = {r.name: r for r in runs}
    for r in runs:
        plain = by_name.get(r.name.replace("int8 steps down", "fp32 down"), r)
        lines.append(f"| {r.name} | {r.val_loss:.4f} | "
                     f"{(r.val_loss / plain.val_loss - 1) * 100:+.2f}% | "
                     f"{r.bytes_moved / 1e6:,.1f} | {dp_bytes / r.bytes_moved:,.0f}x |")
    lines += ["", end]
    _write_section(out, begin, end, lines)


def streaming_runs(steps: int, h: int, args: argparse.Namespace) -> list[Run]:
    """DiLoCo at one H against Streaming DiLoCo with F = 2 and 4 fragments (each fragment
    synchronised every H steps), fp32; F = 4 with mixing alpha = 0.5 (the midpoint); and
    F = 4 with int8 up and int8 steps down."""
    grid = [{"kind": "diloco", "steps": steps, "h": h, "fragments": f, "codec": codec,
             "downlink": down, "mixing": mixing,
             "name": (f"Streaming DiLoCo F = {f}" if f > 1 else "DiLoCo") + f", H = {h}, "
             + ("fp32" if codec == "none" else "int8 up, int8 steps down")
             + (f", mixing {mixing}" if mixing else "")}
            for f, codec, down, mixing in [(1, "none", "none", 0.0), (2, "none", "none", 0.0),
                                           (4, "none", "none", 0.0), (4, "none", "none", 0.5),
                                           (4, "int8", "int8", 0.0)]]
    return [_run(r) for r in run_all(grid, args)]


def write_streaming(out: Path, steps: int, h: int, runs: list[Run], elapsed: float,
                    smoke: bool) -> None:
    """The Streaming DiLoCo table, between its own markers in ``out``."""
    command = _command("streaming", steps, smoke)
    base = runs[0]
    begin, end = markers("streaming table")
    lines = [begin, "",
             f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/{command}` "
             f"on {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
             f"on {CONFIG.device.type}, in {elapsed / 60:.1f} min; {WORKERS} workers x {steps} "
             f"inner steps, every fragment synchronised every H = {h} inner steps. MB up: "
             "all update blobs; peak: the largest one worker sent in one round (what the "
             "uplink must carry at once). MB moved adds each worker's downloads: "
             + ("none in round 1 (round 0's model is rebuilt from the seed)" if not CONFIG.warm
                else "the warm start's model in round 1") +
             ", then each round's new model (DiLoCo: the whole model in fp32; streaming: "
             "the synchronised fragment, in fp32 or as an int8 step)." + _warm_note(), "",
             "| run | rounds | validation loss | vs DiLoCo | MB up | peak update (MB) | "
             "MB moved |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.name} | {r.rounds} | {r.val_loss:.4f} | "
                     f"{(r.val_loss / base.val_loss - 1) * 100:+.2f}% | "
                     f"{r.bytes_up / 1e6:,.1f} | {r.peak_up / 1e6:,.3f} | "
                     f"{r.bytes_moved / 1e6:,.1f} |")
    lines += ["", end]
    _write_section(out, begin, end, lines)


def _write_section(out: Path, begin: str, end: str, lines: list[str]) -> None:
    """Replace what lies between the ``begin`` and ``end`` markers of ``out`` (appended
    when absent) with ``lines``, which carry the markers; written atomically."""
    text = out.read_text() if out.exists() else "# Language models\n"
    if begin not in text:
        text = text.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    start, stop = text.index(begin), text.index(end) + len(end)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text[:start] + "\n".join(lines) + text[stop:])
    os.replace(tmp, out)


def _warm_flag() -> str:
    return f" --warm {CONFIG.warm}" if CONFIG.warm else ""


def _warm_note() -> str:
    """How the runs start, for the tables' headers."""
    if not CONFIG.warm:
        return ""
    return (f" Every run starts from one model trained {CONFIG.warm} steps by synchronous data "
            f"parallel from the seed (validation loss {CONFIG.warm_loss:.4f}; those steps and "
            "their bytes are not counted, but each DiLoCo worker's download of that model "
            "is).")


def fresh_model_shapes() -> torch.nn.Module:
    """The bench's GPT, for its size (the data set's shapes, without loading it)."""
    return build_model("gpt", (BLOCK,), 256)


def _reach(run: Run, target: float) -> float | None:
    return next((when for when, loss in run.curve if loss <= target), None)


def write(out: Path, steps: int, base1: Run, base2: Run, runs: list[Run], iid_mid: Run,
          non_iid: Run, elapsed: float, smoke: bool) -> None:
    tokens = WORKERS * steps * CONFIG.batch * BLOCK
    command = _command(None, steps, smoke)
    begin, end = markers("generated tables")
    lines = [begin, "",
             f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/{command}` on "
             f"{platform.machine()}, {os.cpu_count()} cores"
             + (f", {torch.cuda.get_device_name(CONFIG.device)}"
                if CONFIG.device.type == "cuda" else "")
             + f", torch {torch.__version__}, on {CONFIG.device.type}, in "
             f"{elapsed / 60:.1f} min. {WORKERS} workers x {steps} inner steps x batch "
             f"{CONFIG.batch} x {BLOCK} bytes = {tokens:,} tokens per run, seed {SEED}."
             + _warm_note(), "",
             "| run | validation loss (nats/byte) | perplexity | vs baseline 2 | MB moved "
             "| fewer bytes than baseline 2 |", "|---|---|---|---|---|---|"]
    for r in [base1, base2, *runs]:
        ratio = f"{base2.bytes_moved / r.bytes_moved:,.0f}x" if r.bytes_moved and \
            r is not base2 else ("-" if r is base2 else "no network")
        lines.append(f"| {r.name} | {r.val_loss:.4f} | {math.exp(r.val_loss):.2f} | "
                     f"{(r.val_loss / base2.val_loss - 1) * 100:+.1f}% | "
                     f"{r.bytes_moved / 1e6:,.1f} | {ratio} |")
    lines += ["", "Non-IID (each client holds whole works, `partition: {kind: by_group}`):", "",
              "| run | validation loss | vs the same run on IID shards |", "|---|---|---|",
              f"| {iid_mid.name} (IID) | {iid_mid.val_loss:.4f} | - |",
              f"| {non_iid.name} | {non_iid.val_loss:.4f} | "
              f"{(non_iid.val_loss / iid_mid.val_loss - 1) * 100:+.1f}% |", "", end]
    _write_section(out, begin, end, lines)


def write_slow(out: Path, steps: int, base2: Run, fixed: Run, timed: Run, step_time: float,
               elapsed: float, command: str, rounds: int) -> None:
    """One worker 4x slower: fixed H against the time budget, in simulated time to
    baseline 2's loss (the time budget stops there)."""
    begin, end = markers("slow-worker table")
    to_base, fixed_base = _reach(timed, base2.val_loss), _reach(fixed, base2.val_loss)
    lines = [begin, "",
             f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/{command}` on "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, on "
             f"{CONFIG.device.type}, in {elapsed / 60:.1f} min. Baseline 2: {WORKERS} workers x "
             f"{steps} steps; fixed H: {WORKERS} workers x {SLOW_SPAN * steps} inner steps "
             f"(DiLoCo needs more tokens to reach data parallel's loss), one of them 4x "
             f"slower (simulated time; one step measured at "
             f"{step_time * 1000:.1f} ms here); the time-budgeted run has as long as the "
             f"fixed-H run took ({rounds} rounds, or until it reaches baseline 2's "
             f"loss), its inner lr schedule following the clock (a cosine over those "
             f"rounds on every worker, as `time_budget_s` schedules a job). "
             f"Baseline 2's validation loss: {base2.val_loss:.4f}."
             + _warm_note(), "",
             "| run | final validation loss | rounds | simulated s | simulated s to "
             "baseline 2's loss |", "|---|---|---|---|---|"]
    for r, when in ((fixed, fixed_base), (timed, to_base)):
        lines.append(f"| {r.name} | {r.val_loss:.4f} | {len(r.curve)} | "
                     f"{r.curve[-1][0]:.1f} | "
                     f"{'not reached' if when is None else f'{when:.1f}'} |")
    if to_base and fixed_base:
        lines += ["", f"To baseline 2's loss, the time budget is "
                      f"{fixed_base / to_base:.1f}x sooner."]
    elif to_base:
        lines += ["", f"Fixed H does not reach baseline 2's loss in its "
                      f"{fixed.curve[-1][0]:.1f} s; the time budget reaches it in "
                      f"{to_base:.1f} s: at least {fixed.curve[-1][0] / to_base:.1f}x sooner."]
    lines += ["", end]
    _write_section(out, begin, end, lines)


def write_gpu(out: Path, big: dict[str, Any]) -> None:
    """The ~10M-parameter config's row, in its own section (a CPU run keeps it)."""
    _write_section(out, GPU_BEGIN, GPU_END, [
        GPU_BEGIN, "",
        f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/python -m bench.lm "
        f"--device cuda --jobs 8{_warm_flag()}`: the ~10M-parameter config on "
        f"{big['device']} (torch {big['torch']}, AMP {big['amp']}): one worker, "
        f"{big['steps']} steps of batch {big['batch']} x {big['block']} bytes after 20 "
        "warm-up steps.", "",
        "| parameters | tokens/s | GPU peak memory (MB) | GPU utilisation (%) "
        "| validation loss after it |", "|---|---|---|---|---|",
        f"| {big['params'] / 1e6:.1f} M | {big['tokens_per_s']:,.0f} | "
        f"{big['gpu_peak_mb']:,.0f} | {big['gpu_util'] or 0:.0f} | {big['val_loss']:.4f} |",
        "", GPU_END])


if __name__ == "__main__":
    sys.exit(main())
