"""Batch inference and ``fedq serve`` measured: write the tables into docs/inference.md.

    .venv/bin/python -m bench.inference          # about 17 minutes on 2 cores
    python -m bench.inference --gpu --json-out F # on a GPU machine: about 6 minutes
    .venv/bin/python -m bench.inference --from-json F   # write F's GPU tables

Real deployments on Redis (the broker and result backend) with real workers:

- batch: a GPT ``generate`` job on ``--workers`` workers (default 2), the last slowed
  4x (``FEDQ_TEST_SLOWDOWN=4``: it sleeps three times its compute after each shard). A fast
  worker alone and the slow one alone first (their standalone items/s), then all of
  them: fedq's items/s against the sum of the standalone ones, against a static equal
  split (the same share of the items each, run on each worker alone: the slowest share
  decides), and the tail (the share of the job's time the last 5% of items took).
- served: ``fedq serve`` with the small CNN on digits and two workers; one image per
  request at concurrency 1, 8 and 64: p50/p99 latency and requests/s, against the
  model called in the bench's own process (one image: the latency floor; batches of
  32: the throughput floor).

On the CPU (the default): the tiny GPT, ``cpu`` workers with one torch thread each and
PostgreSQL as the database. With ``--gpu``: the ~10M-parameter GPT (6 layers, width
384, context 256), workers on this machine's GPU class sharing its GPU, the database a
SQLite file (a GPU machine lent here has no PostgreSQL), and ``fedq serve`` measured
with the GPT too (``/v1/completions``, 16 tokens per request). ``--json-out`` keeps the
measurements; ``--from-json`` writes the tables of such a file into the doc (the GPU
section) without running anything.

In the CPU layout every side of a comparison runs ``--runs`` times (3), the sides
alternated within each run, reported as medians with their range: the combined batch
job against Ray Data's ``map_batches`` on an actor pool of as many actors (the second to
start slowed 4x the same way; ``max_tasks_in_flight_per_actor`` 1 and 2; the job's
sampling), and ``fedq serve`` with 1 and 2 workers against Ray Serve tuned for
throughput (:data:`RAY_SERVE_VARIANTS`: 1 and 2 replicas, a batch wait of 5 ms and 0,
``max_ongoing_requests`` 64, access logs off, ``RAY_SERVE_THROUGHPUT_OPTIMIZED``; each
replica's settings checked before it is measured), the bare HTTP floor and the batched
HTTP floor (bench/http_batched.py) in 1 and 2 processes (bench/ray_app.py, in Ray's own
environment, scripts/ray-env.sh). ``--no-ray`` leaves Ray out; ``--gpu`` always does
(a GPU machine lent here reaches no package index to build Ray's environment).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from bench.common import BenchError, pg_database, redis_database, write_section
from fedq.data import load_dataset
from fedq.inference import jobs
from fedq.inference.run import generate
from fedq.models import build_model, seeded_model
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.wait import wait_until
from fedq.weights import dumps, loads, state_of
from fedq.worker.loop import amp_autocast, device_amp

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "inference.md"
BEGIN, END = "<!-- inference tables -->", "<!-- end of inference tables -->"
MAX_BATCH = 32  # the gateway's --max-batch
GPU_BEGIN, GPU_END = "<!-- inference gpu tables -->", "<!-- end of inference gpu tables -->"


@dataclass
class Setup:
    """What one run measures: the CPU defaults, or :func:`gpu_setup`'s."""

    queue: str = "cpu"
    device: str = "cpu"
    workers: int = 2  # batch workers, the last slowed 4x
    gpt: dict[str, Any] = field(default_factory=lambda: {"n_layer": 1, "n_head": 2,
                                                         "n_embd": 32})
    # a context of 96 bytes: a prompt (36) and its new bytes (48) fit it, so the workers
    # generate through the key-value cache (fedq/models/gpt.py) as they would in use
    text: dict[str, Any] = field(default_factory=lambda: {
        "block_size": 96, "max_works": 3, "eval_windows": 64})
    prompts: int = 384
    max_tokens: int = 48
    shard_size: int = 8
    requests: int = 256
    gpt_requests: int = 0  # 0: the served GPT is not measured
    gpt_tokens: int = 16
    sqlite: bool = False
    command: str = ".venv/bin/python -m bench.inference"
    ray_python: str | None = None  # Ray's own environment (scripts/ray-env.sh)
    # the served comparison (CPU layout): alternated runs of every side, and the
    # requests of each concurrency-64 row
    runs: int = 3
    big_requests: int = 3000
    compare: bool = True  # the CPU layout: alternated runs against Ray and the floors


# On an H200 a fast worker generates 256 prompts in under 5 s, 2-3.5 s of it the first
# shard (the model built, the GPU warmed: docs/inference.md, 2026-11-30): four times as
# many, so that the job measures the split more than the warm-up.
GPU_PROMPTS = 1024


def gpu_setup(prompts: int, requests: int, tiny: bool = False) -> Setup:
    """``--gpu``: the 10M GPT on this machine's GPU class. ``tiny``: the same layout
    (four workers, SQLite, the served GPT) with the tiny GPT on whatever this machine
    is (the test's size)."""
    from fedq.worker.hardware import probe

    queue = probe(run_smoke=False).hardware_class
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tiny:
        return Setup(queue=queue, device=device, workers=4, prompts=prompts,
                     requests=requests, gpt_requests=16, gpt_tokens=4, sqlite=True,
                     command="python -m bench.inference --gpu --tiny", compare=False)
    return Setup(queue=queue, device=device, workers=4,
                 gpt={"n_layer": 6, "n_head": 6, "n_embd": 384},
                 text={"block_size": 256, "max_works": 3, "eval_windows": 64},
                 prompts=prompts, max_tokens=32, shard_size=16, requests=requests,
                 gpt_requests=max(requests // 2, 16), sqlite=True,
                 command="python -m bench.inference --gpu", compare=False)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _cluster(home: Path, redis_url: str, db_url: str) -> Cluster:
    env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                   FEDQ_DATABASE_URL=db_url, FEDQ_BLOB_URL=str(home / "blobs"),
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


def _gpt_weights(home: Path, setup: Setup) -> Path:
    weights = home / "gpt.safetensors"
    if not weights.exists():
        ds = load_dataset("shakespeare", None, setup.text)
        weights.write_bytes(dumps(state_of(seeded_model(
            "gpt", ds.input_shape, ds.num_classes, 5, **setup.gpt))))
    return weights


def _prompts(setup: Setup, n: int) -> list[str]:
    """``n`` prompts of 32 bytes of the corpus and " and": the held-out windows first,
    then training windows (the held-out ones are few: ``eval_windows``)."""
    ds = load_dataset("shakespeare", None, setup.text)
    windows = torch.cat([ds.x_test, ds.x_train])[:n, :32]
    if len(windows) < n:
        raise BenchError(f"the corpus has {len(windows)} windows, not {n} prompts")
    return [bytes(w.clamp(0, 255).to(torch.uint8).tolist()).decode("latin-1")
            .replace("\n", " ") + " and" for w in windows]


def _batched_floor(weights: Path, prompts: list[str], setup: Setup) -> dict[str, Any]:
    """The job's ``generate`` in this process, under the GPU class's AMP mode: items/s one
    prompt at a time and in batches of the job's ``batch_size`` (what a worker does),
    over the first few shards' prompts."""
    ds = load_dataset("shakespeare", None, setup.text)
    dev = torch.device(setup.device)
    model = build_model("gpt", ds.input_shape, ds.num_classes, **setup.gpt).eval()
    model.load_state_dict(loads(weights.read_bytes()))
    model.to(dev)
    some = prompts[:4 * setup.shard_size]
    rates = {}
    with torch.no_grad(), amp_autocast(_amp_modes(dev)[0], dev):
        for size in (1, setup.shard_size):
            def run(size: int = size) -> None:
                generate(model, some, 0, dev, setup.max_tokens, 0.8, 40, 1, batch_size=size)
            run()  # warm-up
            rates[size] = len(some) / _timed(setup.device, run)
    return {"one": rates[1], "batched": rates[setup.shard_size],
            "batch_size": setup.shard_size, "items": len(some)}


def batch(home: Path, redis_url: str, db_url: str, setup: Setup) -> dict[str, Any]:
    home.mkdir(parents=True, exist_ok=True)
    weights = _gpt_weights(home, setup)
    prompts = _prompts(setup, setup.prompts)
    (home / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                for p in prompts))
    # the static equal split: each worker its 1/workers of the prompts, a fast one the
    # first share and the slow one the last (every prompt costs the same: max_tokens)
    share = -(-setup.prompts // setup.workers)
    (home / "share-fast.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                   for p in prompts[:share]))
    (home / "share-slow.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                   for p in prompts[-share:]))

    def spec_file(name: str, inputs: str) -> Path:
        path = home / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "kind": "inference", "name": "bench", "op": "generate",
            "model": {"weights": weights.name, "name": "gpt", "dataset": "shakespeare",
                      "args": setup.gpt, "dataset_args": setup.text},
            "inputs": {"prompts": inputs},
            "generate": {"max_tokens": setup.max_tokens, "seed": 1},
            "queues": [setup.queue], "shard_size": setup.shard_size,
            "batch_size": setup.shard_size}))  # in_flight unset: two per worker
        return path

    spec = spec_file("batch", "prompts.jsonl")
    out: dict[str, Any] = {"prompts": setup.prompts, "workers": setup.workers,
                           "in_process": _batched_floor(weights, prompts, setup)}
    q = [setup.queue]
    for name, env in (("fast", {}), ("slow", {"FEDQ_TEST_SLOWDOWN": "4"})):
        cluster = _cluster(home / name, redis_url, db_url)
        try:
            cluster.start(control=["control"])
            cluster.add(name, q, **env)
            out[name] = _job(cluster, spec)
            out[f"{name}_share"] = _job(cluster, spec_file(f"share-{name}",
                                                           f"share-{name}.jsonl"))
        finally:
            cluster.stop()
    both: list[dict[str, Any]] = []
    ray_runs: dict[int, list[dict[str, Any]]] = {k: [] for k in RAY_DATA_IN_FLIGHT}
    for run in range(setup.runs if setup.compare else 1):  # the sides alternated
        cluster = _cluster(home / f"all-{run}", redis_url, db_url)
        try:
            fast = {"fast" if setup.workers == 2 else f"fast{i}": q
                    for i in range(1, setup.workers)}
            cluster.start(control=["control"], **fast)
            cluster.add("slow", q, FEDQ_TEST_SLOWDOWN="4")
            both.append(_job(cluster, spec))
        finally:
            cluster.stop()
        if setup.ray_python:
            for in_flight in RAY_DATA_IN_FLIGHT:
                ray_runs[in_flight].append(_ray_data(setup, home, weights, in_flight))
    out["both"] = _median_run(both)
    out["both_runs"] = [r["items_per_s"] for r in both]
    if setup.ray_python:
        out["ray_variants"] = {str(k): [r["items_per_s"] for r in v]
                               for k, v in ray_runs.items()}
        best = max(ray_runs, key=lambda k: float(np.median(out["ray_variants"][str(k)])))
        out["ray"] = {**_median_run(ray_runs[best]), "in_flight": best}
    rates = [out["fast"]["items_per_s"]] * (setup.workers - 1) + [out["slow"]["items_per_s"]]
    out["sum_standalone"] = sum(rates)
    out["static_computed_s"] = max(setup.prompts / setup.workers / r for r in rates)
    # run: each share on its worker alone, one after the other (so neither slows the
    # other down, which favours the split); its time is the longer of the two
    out["static_s"] = max(out["fast_share"]["wall_s"], out["slow_share"]["wall_s"])
    return out


#: Ray Data's ``max_tasks_in_flight_per_actor`` in the variants measured.
RAY_DATA_IN_FLIGHT = (1, 2)


def _ray_data(setup: Setup, home: Path, weights: Path, in_flight: int) -> dict[str, Any]:
    """The batch job on Ray Data (bench/ray_app.py): the same model, prompts, sampling
    (temperature 0.8, top-k 40, the job's seed), batch and slowed actor; one run."""
    ds = load_dataset("shakespeare", None, setup.text)
    result = _ray(setup.ray_python or "", "data", home, {
        "weights": str(weights), "model": "gpt", "input_shape": list(ds.input_shape),
        "num_classes": ds.num_classes, "model_args": setup.gpt,
        "prompts": str(home / "prompts.jsonl"), "max_tokens": setup.max_tokens, "seed": 1,
        "temperature": 0.8, "top_k": 40, "in_flight": in_flight,
        "batch_size": setup.shard_size, "actors": setup.workers, "slow": 4,
        "slots": str(_fresh(home / f"ray-slots-{time.monotonic_ns()}")),
        "cpus": os.cpu_count() or 1, "actor_cpus": (os.cpu_count() or 1) / setup.workers})
    if result["distinct"] != setup.prompts:
        raise BenchError(f"Ray Data returned {result['distinct']} of {setup.prompts} prompts")
    return result


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose items/s is the median (the lower middle of an even count)."""
    ordered = sorted(runs, key=lambda r: r["items_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ray_cmd(python: str, mode: str, home: Path, cfg: dict[str, Any]) -> list[str]:
    config = home / f"ray-{mode}.json"
    config.write_text(json.dumps(cfg))
    return [python, str(ROOT / "bench" / "ray_app.py"), mode, str(config)]


def _ray(python: str, mode: str, home: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run Ray Data (bench/ray_app.py) in Ray's environment; its JSON line."""
    proc = subprocess.run(_ray_cmd(python, mode, home, cfg), capture_output=True, text=True,
                          timeout=900, check=False, cwd=home)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not last.startswith("{"):
        raise BenchError(f"Ray {mode} exited {proc.returncode}: "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    result: dict[str, Any] = json.loads(last)
    return result


@contextmanager
def _ray_serve(python: str, home: Path, cfg: dict[str, Any]) -> Iterator[int]:
    """Ray Serve (bench/ray_app.py) listening on cfg's port until the block ends."""
    log = open(home / "ray-serve.log", "ab")
    proc = subprocess.Popen(_ray_cmd(python, "serve", home, cfg), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=home,
                            start_new_session=True)
    log.close()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready PORT", or nothing when it failed
        if not line.startswith("ready"):
            tail = (home / "ray-serve.log").read_text(errors="replace").strip().splitlines()
            raise BenchError(f"Ray Serve did not start: {(tail or ['no output'])[-1]}")
        yield int(line.split()[1])
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # it shuts Serve and Ray down
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@contextmanager
def _listening(cmd: list[str], home: Path, name: str,
               after: list[str] | None = None) -> Iterator[int]:
    """``cmd PORT [AFTER...]`` (an HTTP server) started, answering /health, killed
    afterwards."""
    port = 17000 + os.getpid() % 1000
    log = open(home / f"{name}.log", "ab")
    proc = subprocess.Popen([*cmd, str(port), *(after or [])], stdout=log,
                            stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)
    log.close()

    def up() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return True
        except OSError:
            return proc.poll() is not None  # exited: reported below

    try:
        wait_until(up, 60, what=f"{name} to listen")
        if proc.poll() is not None:
            raise BenchError(f"{name} exited {proc.returncode} (its log: {home / name}.log)")
        yield port
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


_CLIENT = threading.local()  # each client thread's open connection, by port


def _post(port: int, path: str, body: bytes) -> float:
    """One request's seconds, on this thread's kept-alive connection to ``port`` (as an
    HTTP client library keeps its connections: the OpenAI SDK's httpx, requests'
    Session); a connection the server closed is opened again once."""
    start = time.perf_counter()
    conns = _CLIENT.__dict__.setdefault("conns", {})
    for again in (False, True):
        conn = conns.get(port)
        if conn is None:
            conn = conns[port] = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except (ConnectionError, http.client.HTTPException):
            conn.close()
            conns.pop(port, None)
            if again:
                raise
            continue
        if resp.status != 200:
            raise BenchError(f"POST {path} on port {port}: {resp.status} {data[:200]!r}")
        return time.perf_counter() - start
    raise AssertionError("unreachable")


@contextmanager
def _gateway(cluster: Cluster, home: Path, args: list[str]) -> Iterator[int]:
    """``fedq serve ARGS`` on a port of its own, listening; killed afterwards."""
    port = 18000 + (os.getpid() + len(args)) % 1000
    log = open(home / "serve.log", "ab")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "fedq.cli", "serve", *args, "--port", str(port),
         "--max-batch", str(MAX_BATCH), "--max-wait-ms", "5"], env=cluster.env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()

    def up() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return True
        except OSError:
            return False

    try:
        wait_until(up, 90, what="fedq serve to listen")
        yield port
    finally:
        if gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGKILL)
            gateway.wait(10)


def _rows(port: int, path: str, bodies: list[bytes],
          big: list[bytes] | None = None) -> list[dict[str, Any]]:
    """p50/p99 and requests/s at concurrency 1, 8 and 64 (``big``'s requests at 64, when
    given), after 20 requests to warm."""
    for body in bodies[:20]:  # the workers load the model
        _post(port, path, body)
    rows = []
    for conc in (1, 8, 64):
        sent = big if big is not None and conc == 64 else bodies
        with ThreadPoolExecutor(conc) as pool:
            t = time.perf_counter()
            lat = list(pool.map(lambda b: _post(port, path, b), sent))
            wall = time.perf_counter() - t
        rows.append({"concurrency": conc, "p50_ms": float(np.quantile(lat, 0.5)) * 1e3,
                     "p99_ms": float(np.quantile(lat, 0.99)) * 1e3, "rps": len(lat) / wall})
    return rows


def _timed(device: str, call: Callable[[], Any]) -> float:
    _sync(device)
    t = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - t


def served(home: Path, redis_url: str, db_url: str, setup: Setup,
           fedq: bool = True) -> dict[str, Any]:
    """The served CNN: the in-process floors, ``fedq serve`` with two workers (unless
    ``fedq`` is False: the floors alone), the bare HTTP floor, Ray Serve at the
    gateway's batch policy; one run each (the GPU layout's; the CPU layout compares more
    sides, more often: :func:`served_compared`)."""
    home.mkdir(parents=True, exist_ok=True)
    ds = load_dataset("digits")
    weights = home / "cnn.safetensors"
    state = state_of(seeded_model("small_cnn", ds.input_shape, ds.num_classes, 3))
    weights.write_bytes(dumps(state))
    torch.set_num_threads(1)
    dev = torch.device(setup.device)
    model = build_model("small_cnn", ds.input_shape, ds.num_classes).eval()
    model.load_state_dict(state)
    model.to(dev)
    x = ds.x_test
    floors = {}
    for amp in _amp_modes(dev):  # the worker's mode first
        with torch.no_grad(), amp_autocast(amp, dev):
            for i in range(20):  # warm (cuDNN picks its kernels)
                model(x[i:i + 32].to(dev))
            one = [_timed(setup.device, partial(model, x[i % len(x)][None].to(dev)))
                   for i in range(200)]
            seconds = _timed(setup.device, lambda: [model(x[i:i + 32].to(dev))
                                                    for i in range(0, 320, 32)])
        floors[amp] = {"p50_ms": float(np.quantile(one, 0.5)) * 1e3, "rps": 320 / seconds}
    first = max(floors.values(), key=lambda f: f["rps"])  # the worker keeps the faster
    if not fedq:
        return {"floor_p50_ms": first["p50_ms"], "floor_rps": first["rps"], "floors": floors,
                "weights": str(weights)}
    bodies = [json.dumps({"inputs": [x[i % len(x)].tolist()]}).encode()
              for i in range(setup.requests)]
    cluster = _cluster(home / "serve", redis_url, db_url)
    try:
        cluster.start(w1=[setup.queue], w2=[setup.queue])
        with _gateway(cluster, home, ["--weights", str(weights), "--model", "small_cnn",
                                      "--dataset", "digits", "--queues", setup.queue]) as port:
            rows = _rows(port, "/v1/predict", bodies)
    finally:
        cluster.stop()
    with _listening([sys.executable, "-m", "bench.http_floor", str(weights)], home,
                    "http-floor") as port:
        http_rows = _rows(port, "/v1/predict", bodies)
    ray_rows = None
    if setup.ray_python:
        cpus = os.cpu_count() or 1
        with _ray_serve(setup.ray_python, home, {
                "weights": str(weights), "model": "small_cnn",
                "input_shape": list(ds.input_shape), "num_classes": ds.num_classes,
                "port": 19000 + os.getpid() % 1000, "max_batch": 32, "max_wait_ms": 5,
                "replicas": 2, "replica_cpus": cpus / 2, "cpus": cpus,
                "max_ongoing_requests": 64}) as port:
            ray_rows = _rows(port, "/", bodies)
    return {"floor_p50_ms": first["p50_ms"], "floor_rps": first["rps"], "floors": floors,
            "rows": rows, "requests": setup.requests, "ray_rows": ray_rows,
            "http_rows": http_rows}


#: The Ray Serve variants measured: (replicas, batch wait ms).
RAY_SERVE_VARIANTS = ((1, 5.0), (2, 5.0), (1, 0.0), (2, 0.0))


def ray_settings_problem(reported: dict[str, Any], cfg: dict[str, Any]) -> str | None:
    """Why a Ray Serve replica's report of its settings (bench/ray_app.py, ``GET /``)
    does not show what ``cfg`` asked for, or None: its ``max_ongoing_requests`` (at
    least the batch size, else ``@serve.batch`` never fills a batch, and at least the
    concurrency measured), its replicas, its batch policy, the throughput-optimized
    mode."""
    want = {"max_ongoing_requests": cfg["max_ongoing_requests"],
            "replicas": cfg["replicas"], "max_batch_size": cfg["max_batch"],
            "batch_wait_timeout_s": cfg["max_wait_ms"] / 1000,
            "throughput_optimized": "1"}
    for key, value in want.items():
        if reported.get(key) != value:
            return f"Ray Serve's replica reports {key} {reported.get(key)!r}, not {value!r}"
    if reported["max_ongoing_requests"] < max(cfg["max_batch"], 64):
        return (f"max_ongoing_requests {reported['max_ongoing_requests']} is under the batch "
                f"size or the concurrency 64: @serve.batch would never fill its batches")
    return None


#: What Ray Serve logs when its replicas cannot fill their batches (ray/serve/batching.py).
NEVER_FILLS = "will never achieve the configured `max_batch_size`"


def _ray_variant(python: str, home: Path, weights: Path, replicas: int, wait_ms: float,
                 bodies: list[bytes], big: list[bytes]) -> list[dict[str, Any]]:
    """One Ray Serve variant's rows, after checking that its replica runs the settings
    asked (:func:`ray_settings_problem`) and, afterwards, that Ray logged no warning
    that its batches cannot fill."""
    ds = load_dataset("digits")
    cpus = os.cpu_count() or 1
    temp = Path(tempfile.mkdtemp(prefix="fedq-ray-", dir="/tmp"))  # short: Ray's sockets
    cfg = {"weights": str(weights), "model": "small_cnn", "input_shape": list(ds.input_shape),
           "num_classes": ds.num_classes, "port": 19000 + os.getpid() % 1000,
           "max_batch": MAX_BATCH, "max_wait_ms": wait_ms, "replicas": replicas,
           "replica_cpus": cpus / replicas, "cpus": cpus, "max_ongoing_requests": 64,
           "temp_dir": str(temp), "env": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}
    try:
        with _ray_serve(python, home, cfg) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("GET", "/")
            reported = json.loads(conn.getresponse().read())
            conn.close()
            problem = ray_settings_problem(reported, cfg)
            if problem:
                raise BenchError(problem)
            rows = _rows(port, "/", bodies, big)
        warned = [p for p in temp.rglob("*.log")
                  if NEVER_FILLS in p.read_text(errors="replace")]
        if warned:
            raise BenchError(f"Ray Serve warned that its batches never fill ({warned[0]})")
        return rows
    finally:
        import shutil

        shutil.rmtree(temp, ignore_errors=True)


def _fedq_variant(home: Path, redis_url: str, db_url: str, setup: Setup, weights: Path,
                  workers: int, bodies: list[bytes], big: list[bytes]) -> list[dict[str, Any]]:
    """``fedq serve`` with ``workers`` workers of one torch thread: its rows."""
    cluster = _cluster(_fresh(home / f"serve-{workers}-{time.monotonic_ns()}"), redis_url,
                       db_url)
    try:
        cluster.start(**{f"w{i}": [setup.queue] for i in range(1, workers + 1)})
        with _gateway(cluster, home, ["--weights", str(weights), "--model", "small_cnn",
                                      "--dataset", "digits", "--queues", setup.queue]) as port:
            return _rows(port, "/v1/predict", bodies, big)
    finally:
        cluster.stop()


def served_compared(home: Path, redis_url: str, db_url: str, setup: Setup) -> dict[str, Any]:
    """The served CNN, every side ``setup.runs`` times, the sides alternated within each
    run: ``fedq serve`` with 1 and 2 workers; Ray Serve in each of
    :data:`RAY_SERVE_VARIANTS` (``max_ongoing_requests`` 64, access logs off,
    throughput-optimized); the bare HTTP floor (bench/http_floor.py); the batched HTTP
    floor (bench/http_batched.py) in 1 and 2 processes. The in-process floors as
    context."""
    home.mkdir(parents=True, exist_ok=True)
    base = served(home / "floors", redis_url, db_url, replace(setup, ray_python=None),
                  fedq=False)
    weights = Path(base["weights"])
    ds = load_dataset("digits")
    x = ds.x_test
    bodies = [json.dumps({"inputs": [x[i % len(x)].tolist()]}).encode()
              for i in range(setup.requests)]
    big = [json.dumps({"inputs": [x[i % len(x)].tolist()]}).encode()
           for i in range(max(setup.big_requests, setup.requests))]
    sides: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "fedq serve, 1 worker": lambda: _fedq_variant(home, redis_url, db_url, setup,
                                                      weights, 1, bodies, big),
        "fedq serve, 2 workers": lambda: _fedq_variant(home, redis_url, db_url, setup,
                                                       weights, 2, bodies, big)}
    if setup.ray_python:
        python = setup.ray_python
        for replicas, wait in RAY_SERVE_VARIANTS:
            sides[f"Ray Serve, {replicas} replica{'s' if replicas > 1 else ''}, wait "
                  f"{wait:g} ms"] = partial(_ray_variant, python, home, weights, replicas,
                                            wait, bodies, big)
    for processes in (1, 2):
        def batched(processes: int = processes) -> list[dict[str, Any]]:
            with _listening([sys.executable, "-m", "bench.http_batched", str(weights)], home,
                            f"http-batched-{processes}", [str(processes)]) as port:
                return _rows(port, "/v1/predict", bodies, big)
        sides[f"batched HTTP floor, {processes} process{'es' if processes > 1 else ''}"] = \
            batched

    def bare() -> list[dict[str, Any]]:
        with _listening([sys.executable, "-m", "bench.http_floor", str(weights)], home,
                        "http-floor") as port:
            return _rows(port, "/v1/predict", bodies, big)
    sides["bare HTTP floor"] = bare
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in sides}
    for _ in range(setup.runs):
        for name, side in sides.items():
            runs[name].append(side())
    return {**{k: v for k, v in base.items() if k != "weights"}, "sides": runs,
            "requests": setup.requests, "big_requests": len(big)}


def _amp_modes(dev: torch.device) -> list[str]:
    """The GPU class's AMP mode on ``dev``, then float32 when that differs (AMP's gain;
    a worker runs the faster of the two: fedq.worker.loop.measured_amp)."""
    amp = device_amp(dev)
    return [amp] if amp == "off" else [amp, "off"]


def served_gpt(home: Path, redis_url: str, db_url: str, setup: Setup) -> dict[str, Any]:
    """``/v1/completions`` with ``setup.gpt_tokens`` tokens per request. The floors: the
    same ``generate`` the worker runs, in this process in the faster of AMP and float32, for
    one prompt (latency) and for batches of the gateway's ``--max-batch`` prompts
    generated together, as a worker generates a served batch (requests/s)."""
    home.mkdir(parents=True, exist_ok=True)
    weights = _gpt_weights(home, setup)
    ds = load_dataset("shakespeare", None, setup.text)
    dev = torch.device(setup.device)
    model = build_model("gpt", ds.input_shape, ds.num_classes, **setup.gpt).eval()
    model.load_state_dict(loads(weights.read_bytes()))
    model.to(dev)
    prompts = _prompts(setup, setup.gpt_requests)
    floors = {}
    for amp in _amp_modes(dev):
        with torch.no_grad(), amp_autocast(amp, dev):
            for p in prompts[:5]:
                generate(model, [p], 0, dev, setup.gpt_tokens, 1.0, 0, 0)
            one = [_timed(setup.device, partial(generate, model, [p], 0, dev,
                                                setup.gpt_tokens, 1.0, 0, i))
                   for i, p in enumerate(prompts)]
            batched = _timed(setup.device, partial(generate, model, prompts, 0, dev,
                                                   setup.gpt_tokens, 1.0, 0, 0,
                                                   batch_size=MAX_BATCH))
        floors[amp] = {"p50_ms": float(np.quantile(one, 0.5)) * 1e3,
                       "rps": len(prompts) / batched, "one_rps": len(one) / sum(one)}
    cluster = _cluster(home / "serve-gpt", redis_url, db_url)
    try:
        cluster.start(w1=[setup.queue], w2=[setup.queue])
        with _gateway(cluster, home, [
                "--weights", str(weights), "--model", "gpt", "--dataset", "shakespeare",
                "--model-args", json.dumps(setup.gpt),
                "--dataset-args", json.dumps(setup.text), "--queues", setup.queue]) as port:
            bodies = [json.dumps({"prompt": p, "max_tokens": setup.gpt_tokens,
                                  "seed": i}).encode() for i, p in enumerate(prompts)]
            rows = _rows(port, "/v1/completions", bodies)
    finally:
        cluster.stop()
    first = max(floors.values(), key=lambda f: f["rps"])  # the worker keeps the faster
    return {"floor_p50_ms": first["p50_ms"], "floor_rps": first["rps"],
            "floor_one_rps": first["one_rps"], "floors": floors,
            "rows": rows, "requests": setup.gpt_requests, "tokens": setup.gpt_tokens}


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _served_lines(s: dict[str, Any], what: str, floor: str) -> list[str]:
    lines = [
        f"Served: `fedq serve`, {what}, {s['requests']} requests per row, two workers, "
        f"--max-batch {MAX_BATCH}, --max-wait-ms 5, each client thread on a kept-alive HTTP "
        f"connection; in-process floor: {floor}.",
        "",
        "| concurrency | p50 ms | p99 ms | requests/s | added p50 over in-process |",
        "|---|---|---|---|---|"]
    ray = s.get("ray_rows")
    if ray:
        lines[-2] = "| concurrency | p50 ms | p99 ms | requests/s | added p50 over in-process " \
            "| Ray Serve p50 ms | Ray Serve p99 ms | Ray Serve requests/s |"
        lines[-1] = "|---|---|---|---|---|---|---|---|"
    for i, r in enumerate(s["rows"]):
        lines.append(f"| {r['concurrency']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                     f"{r['rps']:.0f} | {r['p50_ms'] - s['floor_p50_ms']:.1f} ms |"
                     + (f" {ray[i]['p50_ms']:.1f} | {ray[i]['p99_ms']:.1f} | "
                        f"{ray[i]['rps']:.0f} |" if ray else ""))
    http = s.get("http_rows")
    if http:
        lines += ["", "The same requests to a bare Starlette + uvicorn process that runs the "
                  "model itself on each request's image (bench/http_floor.py: no batching, no "
                  "broker, no worker; what every HTTP front pays per request):", "",
                  "| concurrency | p50 ms | p99 ms | requests/s |", "|---|---|---|---|"]
        lines += [f"| {r['concurrency']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                  f"{r['rps']:.0f} |" for r in http]
    added = s["rows"][0]["p50_ms"] - s["floor_p50_ms"]
    share = s["rows"][-1]["rps"] / s["floor_rps"]
    lines += [
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| added p50 latency at concurrency 1 | {added:.1f} ms | ≤ 5 ms | {_met(added <= 5)} |",
        f"| requests/s at concurrency 64 ÷ in-process batched floor | {share:.2f} | ≥ 0.8 | "
        f"{_met(share >= 0.8)} |"]
    if http:
        vs_http = s["rows"][-1]["rps"] / http[-1]["rps"]
        lines.append(f"| requests/s at concurrency 64 ÷ the bare HTTP process's | "
                     f"{vs_http:.2f} | (context) | – |")
    if ray:
        vs = s["rows"][-1]["rps"] / ray[-1]["rps"]
        lines.append(f"| requests/s at concurrency 64 ÷ Ray Serve's (same batch policy) | "
                     f"{vs:.2f} | ≥ 1 | {_met(vs >= 1)} |")
    return lines


def _spread(values: list[float], fmt: str = "{:.0f}") -> str:
    """The median of ``values`` and their range: ``1,234 (1,100–1,300)``."""
    med = float(np.median(values))
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def _side(runs: list[list[dict[str, Any]]], i: int, key: str) -> list[float]:
    return [run[i][key] for run in runs]


def _compared_lines(s: dict[str, Any]) -> list[str]:
    """The served comparison (:func:`served_compared`): every side's median and range
    of its runs, per concurrency, and the targets."""
    sides: dict[str, list[list[dict[str, Any]]]] = s["sides"]
    n = len(next(iter(sides.values())))
    lines = [
        f"Served: the small CNN on digits, one image per request, each client thread on a "
        f"kept-alive HTTP connection; every side {n} times, the sides alternated within "
        f"each run (medians, lowest–highest in brackets); {s['requests']} requests per row at "
        f"concurrency 1 and 8, {s['big_requests']} at 64. fedq serve: --max-batch "
        f"{MAX_BATCH}, --max-wait-ms 5, workers of one torch thread."
        + (f" Ray Serve: `@serve.batch(max_batch_size={MAX_BATCH})` at the wait named, "
           f"`max_ongoing_requests=64`, access logs off, `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`, "
           f"replicas of one torch thread sharing the cores; each replica reported these "
           f"settings before it was measured, and Ray logged no warning that its batches "
           f"cannot fill." if any(k.startswith("Ray") for k in sides) else "")
        + f" In-process floor (context): one image {s['floor_p50_ms']:.2f} ms "
        f"(p50), batches of 32 {s['floor_rps']:.0f} images/s.",
        "",
        "| side | c=1 p50 ms | c=1 requests/s | c=8 p50 ms | c=8 requests/s | c=64 p50 ms "
        "| c=64 requests/s |",
        "|---|---|---|---|---|---|---|"]
    for name, runs in sides.items():
        cells = []
        for i in range(3):
            cells += [_spread(_side(runs, i, "p50_ms"), "{:.1f}"),
                      _spread(_side(runs, i, "rps"))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    def med(name: str, i: int = 0, key: str = "rps") -> float:
        return float(np.median(_side(sides[name], i, key)))

    fedq = [k for k in sides if k.startswith("fedq serve")]
    rays = [k for k in sides if k.startswith("Ray Serve")]
    batched = [k for k in sides if k.startswith("batched HTTP floor")]
    best_fedq = max(fedq, key=lambda k: med(k, 2, "rps"))
    lines += ["", "| measure | value | target | met |", "|---|---|---|---|"]
    floor = max(batched, key=lambda k: med(k, 2, "rps"))
    share = med(best_fedq, 2, "rps") / med(floor, 2, "rps")
    lines.append(f"| {best_fedq}, requests/s at concurrency 64 ÷ the better batched HTTP "
                 f"floor's ({floor}) | {share:.2f} | ≥ 0.8 | {_met(share >= 0.8)} |")
    added = min(med(k, 0, "p50_ms") for k in fedq) - med("bare HTTP floor", 0, "p50_ms")
    lines.append(f"| fedq serve's p50 at concurrency 1 over the bare HTTP floor's | "
                 f"{added:.1f} ms | ≤ 3 ms | {_met(added <= 3)} |")
    for i, conc in enumerate((1, 8, 64)):
        if not rays:
            break
        ray = max(rays, key=partial(med, i=i, key="rps"))
        ours = max(med(k, i, "rps") for k in fedq)
        vs = ours / med(ray, i, "rps")
        lines.append(f"| fedq serve ÷ the best Ray Serve variant ({ray}), requests/s at "
                     f"concurrency {conc} | {vs:.2f} | ≥ 1 | {_met(vs >= 1)} |")
    ctx = med(best_fedq, 2, "rps") / s["floor_rps"]
    lines.append(f"| {best_fedq}, requests/s at concurrency 64 ÷ the in-process batched floor "
                 f"| {ctx:.2f} | (context) | – |")
    return lines


def table(result: dict[str, Any]) -> list[str]:
    meta, setup = result["meta"], result["setup"]
    b, s = result["batch"], result["served"]
    both = b["both"]
    ratio = both["items_per_s"] / b["sum_standalone"]
    vs_static = b["static_s"] / both["wall_s"]
    on = f"{meta['machine']}, {meta['cores']} cores, torch {meta['torch']}"
    if meta.get("gpu"):
        on += f", {meta['gpu']}, workers sharing it"
    else:
        on += "; every worker 1 torch thread"
    n = setup["workers"]
    lines = [
        f"Generated by `{setup['command']}` on {meta['date']} ({on}; {meta['minutes']:.1f} "
        f"min).",
        "",
        f"Batch: GPT generate ({meta['gpt_params'] / 1e6:.2f} M parameters, "
        f"{setup['gpt']['n_layer']} layers, width {setup['gpt']['n_embd']}, context "
        f"{setup['text']['block_size']}), "
        f"{b['prompts']} prompts x {setup['max_tokens']} bytes, {n} {setup['queue']} "
        f"workers, one slowed 4x; the sum of standalone rates counts the fast worker's "
        f"{n - 1} time{'s' if n > 2 else ''}.",
        "",
        "| run | items/s | wall s | items per worker | tail (last 5% of items) |",
        "|---|---|---|---|---|"]
    for name, label in (("fast", "fast worker alone"), ("slow", "slow worker alone"),
                        ("both", "fedq, both workers" if n == 2 else f"fedq, all {n} workers")):
        r = b[name]
        rate = _spread(b["both_runs"], "{:.1f}") if name == "both" and \
            len(b.get("both_runs", [])) > 1 else f"{r['items_per_s']:.1f}"
        lines.append(f"| {label} | {rate} | {r['wall_s']:.1f} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(r['by_worker'].items()))} | "
                     f"{100 * r['tail_share']:.1f}% of the time |")
    ray = b.get("ray")
    variants = b.get("ray_variants") or {}
    for k, rates in variants.items():
        run = ray if ray and str(ray.get("in_flight")) == k else None
        lines.append(f"| Ray Data map_batches, actor pool of {n} (actor1 slowed 4x), "
                     f"max_tasks_in_flight_per_actor {k} | {_spread(rates, '{:.1f}')} | "
                     + (f"{run['wall_s']:.1f} | " + ", ".join(
                         f"{a} {c}" for a, c in sorted(run["by_worker"].items())) + " |"
                        if run else "– | – |") + " – |")
    if ray and not variants:
        lines.append(f"| Ray Data map_batches, actor pool of {n} (actor1 slowed 4x) | "
                     f"{ray['items_per_s']:.1f} | {ray['wall_s']:.1f} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(ray['by_worker'].items()))} | "
                     f"– |")
    lines += [
        "",
        "| measure | value | target | met |",
        "|---|---|---|---|",
        f"| fedq ÷ sum of standalone items/s | {ratio:.2f} | ≥ 0.9 | {_met(ratio >= 0.9)} |",
        f"| static equal split's time ÷ fedq's (each worker's equal share run on it "
        f"alone; computed from the standalone rates: "
        f"{b.get('static_computed_s', b['static_s']) / both['wall_s']:.2f}x) | "
        f"{vs_static:.2f}x | ≥ 1.5x | {_met(vs_static >= 1.5)} |",
        f"| tail: share of the job's time the last 5% of items took | "
        f"{100 * both['tail_share']:.1f}% | ≤ 5% | {_met(both['tail_share'] <= 0.05)} |"]
    if ray:
        ours = float(np.median(b.get("both_runs") or [both["items_per_s"]]))
        vs_ray = ours / float(np.median(variants[str(ray["in_flight"])])) if variants \
            else both["items_per_s"] / ray["items_per_s"]
        best = f", the best variant's median (max_tasks_in_flight_per_actor " \
            f"{ray['in_flight']})" if variants else ""
        lines.append(f"| fedq ÷ Ray Data items/s (same model, prompts, sampling, batch, slow "
                     f"actor{best}) | {vs_ray:.2f} | ≥ 1 | {_met(vs_ray >= 1)} |")
    floor = b.get("in_process")
    if floor:
        lines += ["", f"In this process, the same `generate` under the GPU class's AMP mode "
                  f"(none on a CPU), "
                  f"over {floor['items']} of the prompts: one prompt at a time "
                  f"{floor['one']:.1f} items/s, in batches of {floor['batch_size']} (as a "
                  f"worker runs a shard) {floor['batched']:.1f} items/s, "
                  f"{floor['batched'] / floor['one']:.2f}x."]
    lines.append("")
    if "sides" in s:
        lines += _compared_lines(s)
        return lines
    lines += _served_lines(
        s, "small CNN on digits, one image per request",
        f"one image {s['floor_p50_ms']:.2f} ms (p50), batches of 32 "
        f"{s['floor_rps']:.0f} images/s")
    g = result.get("served_gpt")
    amp = [(what, r["floors"]) for what, r in (("small CNN, batches of 32", s),
                                               (f"GPT, batches of {MAX_BATCH}"
                                                if g and "floor_one_rps" in g
                                                else "GPT, one prompt", g or {}))
           if len(r.get("floors", {})) == 2]
    if amp:
        lines += ["", "AMP in the in-process floors (the GPU class's mode against float32, "
                  "same model and inputs; a worker runs the faster of the two, measured on "
                  "its first batch):", "",
                  "| model | mode | items/s | float32 items/s | AMP's gain |",
                  "|---|---|---|---|---|"]
        for what, floors in amp:
            mode = next(m for m in floors if m != "off")
            lines.append(f"| {what} | {mode} | {floors[mode]['rps']:.0f} | "
                         f"{floors['off']['rps']:.0f} | "
                         f"{floors[mode]['rps'] / floors['off']['rps']:.2f}x |")
    if g:
        lines += [""] + _served_lines(
            g, f"the same GPT, `/v1/completions` with {g['tokens']} tokens per request",
            f"`generate` for one prompt {g['floor_p50_ms']:.1f} ms (p50)"
            + (f", {g['floor_one_rps']:.1f} prompts/s one after another, "
               f"{g['floor_rps']:.1f} prompts/s in batches of {MAX_BATCH} generated "
               f"together (as a worker generates a served batch)" if "floor_one_rps" in g
               else f", {g['floor_rps']:.1f} prompts/s one after another"))
    return lines


def measure(setup: Setup, redis_url: str, db_url: str, tmp: Path,
            keep: Path | None = None) -> dict[str, Any]:
    """Every part of the run; with ``keep``, the result so far is written there after
    each part (a run stopped at a time limit leaves the parts it finished)."""
    start = time.perf_counter()
    ds = load_dataset("shakespeare", None, setup.text)
    params = sum(p.numel() for p in build_model(
        "gpt", ds.input_shape, ds.num_classes, **setup.gpt).parameters())
    result: dict[str, Any] = {"setup": asdict(setup), "meta": {
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d}", "machine": platform.machine(),
        "cores": os.cpu_count(), "torch": torch.__version__, "gpt_params": params,
        "gpu": torch.cuda.get_device_name(0) if setup.device == "cuda" else None}}
    parts: list[tuple[str, Callable[..., dict[str, Any]]]] = [
        ("batch", batch), ("served", served_compared if setup.compare else served)]
    if setup.gpt_requests:
        parts.append(("served_gpt", served_gpt))
    for name, run in parts:
        result[name] = run(tmp / name.replace("_", "-"), redis_url, db_url, setup)
        result["meta"]["minutes"] = (time.perf_counter() - start) / 60
        if keep is not None:
            keep.write_text(json.dumps(result, indent=1))
    return result


@contextmanager
def _database(setup: Setup, tmp: Path) -> Iterator[str]:
    if setup.sqlite:
        yield f"sqlite:///{tmp / 'fedq.db'}"
    else:
        with pg_database() as url:
            yield url


@contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    """A temporary folder, or ``keep`` (made, kept afterwards: its logs/ folders)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=None,
                        help="batch job's prompts (default 384; --gpu 1024)")
    parser.add_argument("--requests", type=int, default=256,
                        help="served: requests per row (at concurrency 1 and 8)")
    parser.add_argument("--big-requests", type=int, default=3000,
                        help="served: requests of each concurrency-64 row (CPU layout)")
    parser.add_argument("--runs", type=int, default=3,
                        help="alternated runs of every side compared (CPU layout)")
    parser.add_argument("--gpu", action="store_true",
                        help="the 10M GPT on this machine's GPU, SQLite as the database")
    parser.add_argument("--ray-python", metavar="PYTHON",
                        help="Ray Data and Ray Serve run with this python (default: the "
                             "environment scripts/ray-env.sh builds once, ~2 min)")
    parser.add_argument("--no-ray", action="store_true",
                        help="measure fedq alone (--gpu: always, no Ray there)")
    parser.add_argument("--tiny", action="store_true",
                        help="with --gpu: the tiny GPT, on any machine (the test's size)")
    parser.add_argument("--json-out", type=Path,
                        help="also keep the measurements here (written after each part)")
    parser.add_argument("--from-json", type=Path,
                        help="write this file's tables into the doc; run nothing")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it (the workers' logs)")
    parser.add_argument("--no-write", action="store_true", help="print, do not edit the doc")
    args = parser.parse_args()
    if args.from_json:
        try:
            result = json.loads(args.from_json.read_text())
        except (OSError, ValueError) as exc:
            sys.exit(f"bench.inference: {args.from_json}: {exc}")
    else:
        if args.gpu:
            if not (torch.cuda.is_available() or args.tiny):
                sys.exit("bench.inference: --gpu: torch sees no GPU on this machine "
                         "(--tiny runs the layout on the CPU)")
            setup = gpu_setup(args.prompts or (16 if args.tiny else GPU_PROMPTS), args.requests,
                              args.tiny)
        else:
            if args.runs < 1 or args.big_requests < 1:
                sys.exit("bench.inference: --runs and --big-requests: at least 1")
            setup = Setup(prompts=args.prompts or 384, requests=args.requests,
                          runs=args.runs, big_requests=args.big_requests)
        setup.ray_python = args.ray_python
        if not (args.ray_python or args.gpu or args.no_ray):
            built = subprocess.run(["bash", str(ROOT / "scripts" / "ray-env.sh")],
                                   capture_output=True, text=True, check=False)
            if built.returncode != 0:
                sys.exit(f"bench.inference: Ray's environment (scripts/ray-env.sh): "
                         f"{(built.stderr.strip().splitlines() or ['failed'])[-1]}")
            setup.ray_python = built.stdout.strip()
        try:
            with _workdir(args.keep) as tmp, redis_database() as redis_url, \
                    _database(setup, tmp) as db_url:
                result = measure(setup, redis_url, db_url, tmp, args.json_out)
        except BenchError as exc:
            sys.exit(f"bench.inference: {exc}")
    lines = table(result)
    print("\n".join(lines))
    if not args.no_write:
        gpu = bool(result["meta"].get("gpu"))
        write_section(DOC, GPU_BEGIN if gpu else BEGIN, GPU_END if gpu else END, lines)
        print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
