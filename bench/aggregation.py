"""Benchmark 2: aggregating K ResNet-18-size updates held in memory.

Each measurement runs in a fresh process (bench/agg_worker.py) so its peak memory is
its own: the updates are built first, the peak is reset (/proc/self/clear_refs), and
the aggregation's time and the resident memory it adds above the updates are read.
"""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import ROOT, BenchError, Context, Section, Stat
from bench.overhead import model_shapes

IMPLS = {
    "fedq": "fedq `Accumulator.mean` (what finalize runs)",
    "flower": "Flower `aggregate_arrayrecords` (its FedAvg)",
    "flower_legacy": "Flower legacy `aggregate`",
    "axpy": "bound: axpy over one contiguous buffer",
}


def run(ctx: Context) -> Section:
    ks = [3] if ctx.smoke else [8, 32]
    repeats = 2 if ctx.smoke else 7
    model = "tiny" if ctx.smoke else "resnet18"
    shapes, nbytes = model_shapes(model)
    shapes_file = ctx.work / "agg-shapes.json"
    shapes_file.write_text(json.dumps(shapes))
    sec = Section(
        "2. Aggregation",
        f"Unweighted FedAvg of K updates of {nbytes / 1e6:.2f} MB (the tensor shapes of "
        f"{'the tiny mlp' if ctx.smoke else 'ResNet-18'}) already in memory. Time: median over "
        f"{repeats} repeats (min–max); GB/s: bytes of the K updates read per second. "
        "Extra peak: resident memory the aggregation adds above the updates, in models "
        "(1.0 = one model), measured during the first repeat. The bound is a vectorized "
        "axpy (torch `add_` with alpha, 2 threads) over the same bytes laid out in one "
        "contiguous buffer. fedq and the bound both keep their accumulator from one "
        "repeat to the next (fedq's control worker keeps it from round to round); fedq's "
        "updates are parsed from safetensors files, as finalize reads them.",
        ["K", "implementation", "seconds", "GB/s", "extra peak (MiB)", "extra peak (models)",
         "÷ bound time"])
    for k in ks:
        results = {}
        for impl in IMPLS:
            ctx.say(f"aggregation: K={k} {impl}")
            results[impl] = _measure(ctx, impl, k, shapes_file, repeats)
        bound = Stat.of(results["axpy"]["seconds"])
        for impl, label in IMPLS.items():
            r = results[impl]
            t = Stat.of(r["seconds"])
            peak = r["extra_peak_mb"]
            sec.rows.append([str(k), label, t.fmt(".3f"), f"{k * nbytes / t.median / 1e9:.1f}",
                             f"{peak:.0f}", f"{peak * 2**20 / nbytes:.2f}",
                             f"{t.median / bound.median:.2f}"])
        fedq = Stat.of(results["fedq"]["seconds"])
        gbs = k * nbytes / fedq.median / 1e9
        sec.target(f"K={k}: ≥ 10 GB/s of update bytes", gbs >= 10,
                   f"{gbs:.1f} GB/s (bound {k * nbytes / bound.median / 1e9:.1f} GB/s)")
        share = bound.median / fedq.median
        sec.target(f"K={k}: ≥ 0.9× the axpy bound's GB/s (same run)", share >= 0.9,
                   f"{share:.2f}×")
        models = results["fedq"]["extra_peak_mb"] * 2**20 / nbytes
        sec.target(f"K={k}: extra peak ≤ 1.2× one model", models <= 1.2, f"{models:.2f}×")
    return sec


def _measure(ctx: Context, impl: str, k: int, shapes_file: object, repeats: int) -> dict:
    if impl.startswith("flower"):
        if ctx.flower_python is None:
            raise BenchError("the Flower environment is missing (scripts/bench.sh builds it)")
        python = str(ctx.flower_python)
    else:
        python = sys.executable
    proc = subprocess.run([python, str(ROOT / "bench" / "agg_worker.py"), impl, str(k),
                           str(shapes_file), str(repeats)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise BenchError(f"aggregation {impl} K={k} failed: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
