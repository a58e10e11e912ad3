"""Batch inference and ``fedq serve`` measured: write the tables into docs/inference.md.

    .venv/bin/python -m bench.inference          # about 3 minutes on 2 cores

Real deployments on Redis + PostgreSQL with real workers (``FEDQ_TORCH_THREADS=1``):

- batch: a GPT ``generate`` job (the tiny GPT, ``--prompts`` prompts, 48 bytes each)
  on two ``cpu`` workers, one slowed 4x (``FEDQ_SLOWDOWN=4``: it sleeps three times
  its compute after each shard). Each worker alone first (its standalone items/s), then
  both: fedq's items/s against the sum of the standalone ones, against a static equal
  split (half the items each: the slow worker's half decides, computed from its
  standalone rate), and the tail (the share of the job's time the last 5% of items took).
- served: ``fedq serve`` with the small CNN on digits and two ``cpu`` workers; one
  image per request at concurrency 1, 8 and 64: p50/p99 latency and requests/s, against
  the model called in the bench's own process (one image: the latency floor; batches
  of 32: the throughput floor).

Ray Data and Ray Serve are not measured here yet (docs/inference.md, "Not done").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench.common import BenchError, pg_database, redis_database, write_section
from fedq.data import load_dataset
from fedq.inference import jobs
from fedq.models import build_model, seeded_model
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.wait import wait_until
from fedq.weights import dumps, state_of

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "inference.md"
BEGIN, END = "<!-- inference tables -->", "<!-- end of inference tables -->"
TEXT = {"block_size": 32, "max_works": 3, "eval_windows": 64}
GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32}


def _cluster(home: Path, redis_url: str, pg_url: str) -> Cluster:
    env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                   FEDQ_DATABASE_URL=pg_url, FEDQ_BLOB_URL=str(home / "blobs"),
                   FEDQ_WATCHDOG_INTERVAL="1")
    (home / "logs").mkdir(parents=True, exist_ok=True)
    cluster = Cluster(home, env)
    cluster.fedq("db", "upgrade")
    return cluster


def _job(cluster: Cluster, spec: Path) -> dict[str, Any]:
    job = cluster.fedq("infer", str(spec), "--no-wait").stdout.strip()
    view = jobs.wait(cluster.settings, job, timeout=600, interval=0.2)
    if view.status != "completed":
        raise BenchError(f"inference job {job} {view.status}: {view.error}")
    done = sorted((r["done"], r["stop"] - r["start"]) for r in view.shard_rows)
    started = min(r["started"] for r in view.shard_rows if r["started"])
    total = sum(n for _, n in done)
    seen, tail_from = 0, done[-1][0]
    for t, n in done:  # when 95% of the items were done
        seen += n
        if seen >= 0.95 * total:
            tail_from = t
            break
    wall = done[-1][0] - started
    return {"items": total, "wall_s": wall, "items_per_s": total / wall,
            "tail_share": (done[-1][0] - tail_from) / wall,
            "by_worker": {w.worker.split("@")[0]: w.items for w in view.workers}}


def batch(home: Path, redis_url: str, pg_url: str, prompts: int) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    ds = load_dataset("shakespeare", None, TEXT)
    weights = home / "gpt.safetensors"
    weights.write_bytes(dumps(state_of(seeded_model("gpt", ds.input_shape, ds.num_classes,
                                                    5, **GPT))))
    text = bytes(ds.x_test[:prompts, :].clamp(0, 255).to(torch.uint8).flatten().tolist())
    lines = [text[i * 32:(i + 1) * 32].decode("latin-1").replace("\n", " ") + " and"
             for i in range(prompts)]
    (home / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    spec = home / "batch.yaml"
    spec.write_text(yaml.safe_dump({
        "kind": "inference", "name": "bench", "op": "generate",
        "model": {"weights": weights.name, "name": "gpt", "dataset": "shakespeare",
                  "args": GPT, "dataset_args": TEXT},
        "inputs": {"prompts": "prompts.jsonl"}, "generate": {"max_tokens": 48, "seed": 1},
        "shard_size": 8, "batch_size": 8, "in_flight": 2}))
    out: dict[str, Any] = {"prompts": prompts}
    for name, env in (("fast", {}), ("slow", {"FEDQ_SLOWDOWN": "4"})):
        cluster = _cluster(home / name, redis_url, pg_url)
        try:
            cluster.start(control=["control"])
            cluster.add(name, ["cpu"], **env)
            out[name] = _job(cluster, spec)
        finally:
            cluster.stop()
    cluster = _cluster(home / "both", redis_url, pg_url)
    try:
        cluster.start(control=["control"], fast=["cpu"])
        cluster.add("slow", ["cpu"], FEDQ_SLOWDOWN="4")
        out["both"] = _job(cluster, spec)
    finally:
        cluster.stop()
    rates = [out["fast"]["items_per_s"], out["slow"]["items_per_s"]]
    out["sum_standalone"] = sum(rates)
    out["static_s"] = max(prompts / 2 / r for r in rates)
    return out


def _post(port: int, body: bytes) -> float:
    start = time.perf_counter()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/predict", data=body)
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()
    return time.perf_counter() - start


def served(home: Path, redis_url: str, pg_url: str, requests: int) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    ds = load_dataset("digits")
    weights = home / "cnn.safetensors"
    state = state_of(seeded_model("small_cnn", ds.input_shape, ds.num_classes, 3))
    weights.write_bytes(dumps(state))
    torch.set_num_threads(1)
    model = build_model("small_cnn", ds.input_shape, ds.num_classes).eval()
    model.load_state_dict(state)
    x = ds.x_test
    with torch.no_grad():
        one = []
        for i in range(200):
            t = time.perf_counter()
            model(x[i % len(x)][None])
            one.append(time.perf_counter() - t)
        t = time.perf_counter()
        for i in range(0, 320, 32):
            model(x[i:i + 32])
        floor_rps = 320 / (time.perf_counter() - t)
    cluster = _cluster(home / "serve", redis_url, pg_url)
    port = 18000 + os.getpid() % 1000
    log = open(home / "serve.log", "wb")
    gateway = None
    try:
        cluster.start(w1=["cpu"], w2=["cpu"])
        gateway = subprocess.Popen(
            [sys.executable, "-m", "fedq.cli", "serve", "--weights", str(weights), "--model",
             "small_cnn", "--dataset", "digits", "--queues", "cpu", "--port", str(port),
             "--max-batch", "32", "--max-wait-ms", "5"], env=cluster.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)

        def up() -> bool:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                return True
            except OSError:
                return False

        wait_until(up, 90, what="fedq serve to listen")
        bodies = [json.dumps({"inputs": [x[i % len(x)].tolist()]}).encode()
                  for i in range(requests)]
        for body in bodies[:20]:  # warm: the workers load the model
            _post(port, body)
        rows = []
        for conc in (1, 8, 64):
            with ThreadPoolExecutor(conc) as pool:
                t = time.perf_counter()
                lat = list(pool.map(lambda b: _post(port, b), bodies))
                wall = time.perf_counter() - t
            rows.append({"concurrency": conc, "p50_ms": float(np.quantile(lat, 0.5)) * 1e3,
                         "p99_ms": float(np.quantile(lat, 0.99)) * 1e3,
                         "rps": len(lat) / wall})
    finally:
        if gateway is not None and gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
        cluster.stop()
    return {"floor_p50_ms": float(np.quantile(one, 0.5)) * 1e3, "floor_rps": floor_rps,
            "rows": rows, "requests": requests}


def table(b: dict[str, Any], s: dict[str, Any]) -> list[str]:
    both = b["both"]
    ratio = both["items_per_s"] / b["sum_standalone"]
    vs_static = b["static_s"] / both["wall_s"]
    lines = [
        f"Generated by `.venv/bin/python -m bench.inference` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} ({platform.machine()}, {os.cpu_count()} "
        f"cores, torch {torch.__version__}; every worker 1 torch thread).",
        "",
        f"Batch: GPT generate, {b['prompts']} prompts x 48 bytes, two cpu workers, one "
        "slowed 4x.",
        "",
        "| run | items/s | wall s | items per worker | tail (last 5% of items) |",
        "|---|---|---|---|---|"]
    for name, label in (("fast", "fast worker alone"), ("slow", "slow worker alone"),
                        ("both", "fedq, both workers")):
        r = b[name]
        lines.append(f"| {label} | {r['items_per_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(r['by_worker'].items()))} | "
                     f"{100 * r['tail_share']:.1f}% of the time |")
    lines += [
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| fedq ÷ sum of standalone items/s | {ratio:.2f} | ≥ 0.9 | "
        f"{'met' if ratio >= 0.9 else 'not met'} |",
        f"| static equal split's time ÷ fedq's (split computed from standalone rates) | "
        f"{vs_static:.2f}x | ≥ 1.5x | {'met' if vs_static >= 1.5 else 'not met'} |",
        f"| tail: share of the job's time the last 5% of items took | "
        f"{100 * both['tail_share']:.1f}% | ≤ 5% | "
        f"{'met' if both['tail_share'] <= 0.05 else 'not met'} |",
        "",
        f"Served: `fedq serve`, small CNN on digits, one image per request, "
        f"{s['requests']} requests per row, two cpu workers, --max-batch 32, --max-wait-ms 5; "
        f"in-process floor: one image {s['floor_p50_ms']:.2f} ms (p50), batches of 32 "
        f"{s['floor_rps']:.0f} images/s.",
        "",
        "| concurrency | p50 ms | p99 ms | requests/s | added p50 over in-process |",
        "|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['concurrency']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['rps']:.0f} | {r['p50_ms'] - s['floor_p50_ms']:.1f} ms |")
    added = s["rows"][0]["p50_ms"] - s["floor_p50_ms"]
    share = s["rows"][-1]["rps"] / s["floor_rps"]
    lines += [
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| added p50 latency at concurrency 1 | {added:.1f} ms | ≤ 5 ms | "
        f"{'met' if added <= 5 else 'not met'} |",
        f"| requests/s at concurrency 64 ÷ in-process batched floor | {share:.2f} | ≥ 0.8 | "
        f"{'met' if share >= 0.8 else 'not met'} |"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--no-write", action="store_true", help="print, do not edit the doc")
    args = parser.parse_args()
    try:
        with tempfile.TemporaryDirectory() as tmp, redis_database() as redis_url, \
                pg_database() as pg_url:
            b = batch(Path(tmp) / "batch", redis_url, pg_url, args.prompts)
            s = served(Path(tmp) / "served", redis_url, pg_url, args.requests)
    except BenchError as exc:
        sys.exit(f"bench.inference: {exc}")
    lines = table(b, s)
    print("\n".join(lines))
    if not args.no_write:
        write_section(DOC, BEGIN, END, lines)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
