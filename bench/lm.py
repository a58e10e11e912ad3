"""Language-model baselines against DiLoCo, and time-budgeted inner steps with a slow
worker; writes the tables of docs/lm.md.

    .venv/bin/python -m bench.lm                 # about 20 minutes on 2 cores
    .venv/bin/python -m bench.lm --smoke --out /tmp/lm.md   # seconds (the test suite)

The runs compare algorithms, so they run in this process with fedq's own pieces (the
local training loop with its inner AdamW, warm-up/cosine schedule and kept state, the
int8 codec, the mean and FedNova reducers, the DiLoCo outer step) and no Celery: the
same model (GPT, ~0.83M parameters, byte-level, context 64), the same tokens processed
(4 workers x STEPS inner steps x batch 16 x 64 bytes), the same seed. Bytes are counted
as fedq moves them: per outer step each worker downloads the global model (fp32) and
uploads its encoded update; synchronous data parallel moves a gradient up and the
averaged one down per worker per step. Validation loss is nats per byte on held-out
text (the last 10% of every work), 2,048 windows.

The slow-worker table uses simulated time: one step takes the median step time measured
here, four times that on the slow worker; a fixed-H round lasts as long as the slow
worker's H steps, a time-budgeted round as long as the budget (fast workers take more
steps, the outer step is FedNova-normalised).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
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
from fedq.aggregate.reducers import Contribution, StreamReducer, make_reducer
from fedq.aggregate.server import make_server
from fedq.coordinator.evaluation import evaluate
from fedq.data import client_indices, load_dataset
from fedq.data.datasets import Dataset
from fedq.models import build_model
from fedq.spec import OptimizerSpec, parse_spec
from fedq.weights import raw_size, state_of
from fedq.worker.inner import state_path
from fedq.worker.loop import local_train, lr_at, task_loss

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "lm.md"
BEGIN, END = "<!-- begin generated tables -->", "<!-- end generated tables -->"
WORKERS, BATCH, BLOCK, SEED = 4, 16, 64, 0
LR, WARMUP = 2e-3, 50


@dataclass
class Run:
    name: str
    val_loss: float = math.nan
    bytes_moved: int = 0
    curve: list[tuple[float, float]] = field(default_factory=list)  # (time or step, loss)


def optimizer(steps: int, cosine: bool = True) -> OptimizerSpec:
    return OptimizerSpec(name="adamw", lr=LR, beta2=0.95, weight_decay=0.1,
                         warmup_steps=min(WARMUP, steps // 10),
                         schedule="cosine" if cosine else "constant", schedule_steps=steps,
                         grad_clip=1.0, keep_state=True)


def fresh_model(ds: Dataset) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model("gpt", ds.input_shape, ds.num_classes)


def val_loss(model: torch.nn.Module, ds: Dataset) -> float:
    return evaluate(model, ds.x_test, ds.y_test, device=torch.device("cpu"), batch_size=256)[1]


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
                batch_size=BATCH, epochs=None, steps=WORKERS * steps, seed=SEED,
                device=torch.device("cpu"), schedule_steps=WORKERS * steps,
                state_path=scratch / "single.safetensors")
    return Run("1. one worker alone, all data", val_loss(model, ds), 0)


def data_parallel(ds: Dataset, parts: list[torch.Tensor], steps: int) -> Run:
    """Baseline 2: synchronous data parallel: every step the 4 workers' gradients are
    averaged and one AdamW step is taken."""
    model = fresh_model(ds)
    spec = optimizer(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    gens = [torch.Generator().manual_seed(SEED + c) for c in range(WORKERS)]
    size = raw_size(state_of(model))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec, steps)
        opt.zero_grad(set_to_none=True)
        for c, idx in enumerate(parts):
            pick = idx[torch.randint(len(idx), (BATCH,), generator=gens[c])]
            (task_loss(model(ds.x_train[pick]), ds.y_train[pick]) / WORKERS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return Run("2. synchronous data parallel (H = 1)", val_loss(model, ds),
               2 * WORKERS * size * steps)


def diloco(ds: Dataset, parts: list[torch.Tensor], steps: int, h: int, codec: str,
           scratch: Path, name: str, *, slow: int | None = None, budget: bool = False,
           step_time: float = 1.0, target: float | None = None,
           max_time: float | None = None) -> Run:
    """DiLoCo: H inner AdamW steps per worker from the global model, the deltas averaged
    (FedNova-normalised when their step counts differ), the outer Nesterov step (lr 0.7,
    momentum 0.9). ``slow``: that worker's steps take 4x as long (simulated time); with
    ``budget`` a round lasts H fast steps and each worker takes the steps that fit, until
    ``target`` is reached or ``max_time`` passes; without it, steps / H rounds."""
    weights = state_of(fresh_model(ds))
    model = fresh_model(ds)
    server, server_state = make_server("diloco"), dict[str, torch.Tensor]()
    reducer = make_reducer("fednova" if budget else "mean")
    acc, run, clock = Accumulator(), Run(name), 0.0
    spec = optimizer(steps)
    done = [0] * WORKERS
    folder = scratch / name.replace(" ", "_").replace(",", "")
    round_time = h * step_time * (4 if slow is not None and not budget else 1)
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    rnd = 0
    while budget or rnd < steps // h:
        rnd += 1
        contributions = []
        for c, idx in enumerate(parts):
            take = max(1, h // 4) if budget and c == slow else h
            local = build_model("gpt", ds.input_shape, ds.num_classes)
            local.load_state_dict(weights)
            stats = local_train(local, ds.x_train[idx], ds.y_train[idx], optimizer=spec,
                                batch_size=BATCH, epochs=None, steps=take,
                                seed=SEED * 1000 + rnd * 10 + c, device=torch.device("cpu"),
                                schedule_steps=steps, first_step=done[c],
                                state_path=state_path(folder, "bench", c))
            done[c] = stats.inner_step
            delta = {k: v.detach() - weights[k] for k, v in local.state_dict().items()}
            stored, meta = encode(delta, codec, 256)
            run.bytes_moved += raw_size(stored) + raw_size(weights)
            contributions.append(Contribution(1.0, stats.steps, decode(stored, meta, shapes)))
        assert isinstance(reducer, StreamReducer)
        weights, server_state = server.step(weights, reducer.reduce(contributions, acc),
                                            server_state)
        clock += round_time
        if slow is not None or not (budget or rnd < steps // h):
            model.load_state_dict(weights)
            run.curve.append((clock, val_loss(model, ds)))
        if budget and ((target is not None and run.curve[-1][1] <= target)
                       or (max_time is not None and clock >= max_time)):
            break
    run.val_loss = run.curve[-1][1]
    return run


def step_seconds(ds: Dataset) -> float:
    model = fresh_model(ds)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        local_train(model, ds.x_train, ds.y_train, optimizer=optimizer(10), batch_size=BATCH,
                    epochs=None, steps=10, seed=SEED, device=torch.device("cpu"))
        times.append((time.perf_counter() - t) / 10)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lm")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per worker")
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    steps = 20 if args.smoke else args.steps
    hs = [5, 10] if args.smoke else [50, 100, 500]
    ds = load_dataset("shakespeare", None, {"block_size": BLOCK,
                                            "eval_windows": 64 if args.smoke else 2048,
                                            **({"max_works": 6} if args.smoke else {})})
    started = time.perf_counter()
    iid, by_work = shards(ds, {"kind": "iid"}), shards(ds, {"kind": "by_group"})
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        base1 = single(ds, steps, scratch)
        print(f"{base1.name}: {base1.val_loss:.4f}", flush=True)
        base2 = data_parallel(ds, iid, steps)
        print(f"{base2.name}: {base2.val_loss:.4f}", flush=True)
        runs = []
        for h in hs:
            for codec in ("none", "int8"):
                run = diloco(ds, iid, steps, h, codec, scratch,
                             f"3. DiLoCo H = {h}, {'fp32' if codec == 'none' else 'int8'}")
                print(f"{run.name}: {run.val_loss:.4f}", flush=True)
                runs.append(run)
        h_mid = hs[len(hs) // 2]
        non_iid = diloco(ds, by_work, steps, h_mid, "none", scratch,
                         f"DiLoCo H = {h_mid}, fp32, each client whole works (non-IID)")
        iid_mid = next(r for r in runs if r.name == f"3. DiLoCo H = {h_mid}, fp32")
        t = step_seconds(ds)
        fixed = diloco(ds, iid, steps, h_mid, "none", scratch,
                       f"fixed H = {h_mid} on every worker", slow=3, step_time=t)
        timed = diloco(ds, iid, steps, h_mid, "none", scratch,
                       f"time budget of {h_mid} fast steps, FedNova-normalised", slow=3,
                       budget=True, step_time=t, target=base2.val_loss,
                       max_time=fixed.curve[-1][0])
    elapsed = time.perf_counter() - started
    write(args.out, steps, hs, base1, base2, runs, iid_mid, non_iid, fixed, timed, t, elapsed,
          args.smoke)
    print(f"wrote {args.out} ({elapsed:.0f} s)")
    return 0


def _reach(run: Run, target: float) -> float | None:
    return next((when for when, loss in run.curve if loss <= target), None)


def write(out: Path, steps: int, hs: list[int], base1: Run, base2: Run, runs: list[Run],
          iid_mid: Run, non_iid: Run, fixed: Run, timed: Run, step_time: float,
          elapsed: float, smoke: bool) -> None:
    tokens = WORKERS * steps * BATCH * BLOCK
    command = "python -m bench.lm" + (" --smoke" if smoke else
                                      ("" if steps == 1000 else f" --steps {steps}"))
    lines = [BEGIN, "",
             f"Generated {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/{command}` on "
             f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, in "
             f"{elapsed / 60:.1f} min. {WORKERS} workers x {steps} inner steps x batch "
             f"{BATCH} x {BLOCK} bytes = {tokens:,} tokens per run, seed {SEED}.", "",
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
              f"{(non_iid.val_loss / iid_mid.val_loss - 1) * 100:+.1f}% |", "",
              f"One worker 4x slower (simulated time; one step measured at "
              f"{step_time * 1000:.1f} ms here). Target: baseline 2's validation loss "
              f"{base2.val_loss:.4f}.", "",
              "| run | final validation loss | simulated seconds to the target | rounds |",
              "|---|---|---|---|"]
    for r in (fixed, timed):
        when = _reach(r, base2.val_loss)
        lines.append(f"| {r.name} | {r.val_loss:.4f} | "
                     f"{'not reached' if when is None else f'{when:.1f}'} | {len(r.curve)} |")
    lines += ["", END]
    text = out.read_text() if out.exists() else f"# Language models\n\n{BEGIN}\n{END}\n"
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text[:start] + "\n".join(lines) + text[stop:])
    os.replace(tmp, out)


if __name__ == "__main__":
    sys.exit(main())
