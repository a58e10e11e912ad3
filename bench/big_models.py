"""Large models end to end: zero-compute rounds of byte-level GPTs from 50 MB to 4 GB
(float32, 1B parameters) on the deployment a coordinator runs (Redis as broker and
result backend, PostgreSQL, a control worker, two training workers), with the blobs on
Redis, a local folder or S3 (SeaweedFS).

Usage: ``.venv/bin/python -m bench.big_models`` writes the table into
docs/benchmarks.md ("Large models"); ``--no-write`` only prints it; ``--sizes`` picks
the models by name (default ``50MB,200MB,800MB``; also ``2GB``, ``4GB``),
``--stores`` the blob stores (default ``redis``), ``--servers`` the server optimizers
(default ``fedavg,diloco``), ``--chunk-mb`` Redis's chunk size. docs/benchmarks.md
names the command that made its table.

Each row runs one job (2 clients, 3 rounds, 2 at 2 GB on Redis; zero compute,
``FEDQ_TEST_ZERO_COMPUTE``: each client sends a small change of the whole model, so
what is measured is moving, checking and averaging the bytes) on a fresh deployment,
so each process's peak
resident memory (``VmHWM``) is that job's, against issue 79's targets. The processes'
resident memory (``VmRSS``) is also sampled every 0.1 s, for each round's peak (is
memory flat across rounds?). Redis's memory is sampled every 0.2 s; the table shows its
peak above what it held before the job.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from tempfile import TemporaryDirectory

from bench.common import (
    ROOT,
    BenchError,
    commit,
    machine,
    pg_database,
    redis_database,
    status_mb,
    write_section,
)
from bench.fedq_run import run_job
from fedq.db import Job, session_scope
from fedq.errors import FedqError
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.procs import start_workers
from fedq.testing.s3 import CREDENTIALS, S3Unavailable, seaweedfs

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- big models table -->", "<!-- end of big models table -->"
#: name -> the GPT's (n_layer, n_embd): about 12 * n_layer * n_embd^2 parameters, 4 bytes
#: each. The default run is the first three; 2GB and 4GB (1B parameters) are asked for
#: by name (--sizes), as they take minutes a row and most of this machine's memory.
SIZES = {"50MB": (4, 512), "200MB": (4, 1024), "800MB": (4, 2048), "2GB": (10, 2048),
         "4GB": (20, 2048), "smoke": (2, 128)}  # smoke: tests/test_bench_smoke.py
DEFAULT_SIZES = ("50MB", "200MB", "800MB")
#: What a run without --sizes and --stores measures: the growth curve on every store
#: with both server optimizers, 2 GB blobs on Redis (which holds every round's blobs in
#: its memory: a DiLoCo row's state too would pass this machine's 24 GiB) and 1B
#: parameters (4 GB) on the local store with both and on S3 with FedAvg.
PLAN = [(size, store, server) for size in DEFAULT_SIZES for store in ("redis", "local", "s3")
        for server in ("fedavg", "diloco")] + [
    ("2GB", "redis", "fedavg"), ("4GB", "local", "fedavg"), ("4GB", "local", "diloco"),
    ("4GB", "s3", "fedavg")]


#: Rounds a job: the first has no server state to read; the later ones show whether
#: memory stays flat.
ROUNDS = 3
#: ... except where Redis keeps the blobs of a model this large (it holds every round's
#: model in memory: a third round would pass this machine's 24 GiB at 2 GB).
REDIS_ROUNDS = {"2GB": 2, "4GB": 2}

#: The server optimizers a row may use, and the control worker's memory target for
#: each (issue 79): the model once (FedAvg) or twice (DiLoCo: its momentum), plus 1 GiB.
SERVERS = {"fedavg": 1, "diloco": 2}


#: Where the blobs are: Redis (chunks), a local folder, or S3 (SeaweedFS, started here).
STORES = ("redis", "local", "s3")


@dataclass
class Row:
    name: str
    server: str
    store: str
    params: int
    model_mb: float
    round_s: list[float]
    control_mb: float
    worker_mb: float
    redis_mb: float
    bound_s: float  # a round's blob bytes at the store's bare write and read rates
    by_round: list[tuple[float, float]]  # (control, larger worker) RSS peak MiB a round


def _spec(name: str, n_layer: int, n_embd: int, server: str, rounds: int
          ) -> dict[str, object]:
    return {"name": f"zero-compute-big-{name}-{server}", "model": "gpt", "server": {"name": server},
            "model_args": {"n_layer": n_layer, "n_head": 16, "n_embd": n_embd},
            "dataset": "shakespeare", "dataset_args": {"block_size": 32},
            "num_clients": 2, "clients_per_round": 2, "rounds": rounds,
            "eval_every": 0, "keep_updates": 0, "round_timeout_s": 1800,
            "queues": {"cpu": -1}, "seed": 0}


def _redis_peak(url: str, stop: threading.Event, out: list[int]) -> None:
    import redis

    client = redis.Redis.from_url(url)
    while not stop.wait(0.2):
        out.append(int(client.info("memory")["used_memory"]))


def _rss(pids: list[int], stop: threading.Event,
         out: list[tuple[float, float, float]]) -> None:
    """(epoch seconds, the first process's VmRSS MiB, the largest other's) every 0.1 s."""
    while not stop.wait(0.1):
        try:
            rss = [status_mb(pid, "VmRSS") for pid in pids]
        except OSError:  # a process ended: the job is over
            return
        out.append((time.time(), rss[0], max(rss[1:], default=0.0)))


def by_round(rounds: Sequence[dict[str, object]], samples: Sequence[tuple[float, float, float]]
             ) -> list[tuple[float, float]]:
    """Each committed round's peak sampled RSS (control, worker) between its start and
    its commit, for the rounds long enough to be sampled."""
    out = []
    for r in rounds:
        lo, hi = r["started_at"], r["finished_at"]
        if r["status"] != "committed" or not isinstance(lo, float) or not isinstance(hi, float):
            continue
        inside = [(c, w) for t, c, w in samples if lo <= t <= hi]
        if inside:  # (a round shorter than the sampling gets none)
            out.append((max(c for c, _ in inside), max(w for _, w in inside)))
    return out


def run_one(name: str, server: str, store: str, work: Path, chunk_mb: float) -> Row:
    """One row; its blobs are deleted after it (a plan's rows together would pass this
    machine's disk: the 4 GB rows keep every round's model, DiLoCo its state too)."""
    with contextlib.ExitStack() as stack:
        blobs: dict[str, str] = {}
        if store == "local":
            folder = work / f"blobs-{name}-{server}"
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            blobs = {"FEDQ_BLOB_URL": str(folder)}
        elif store == "s3":
            folder = work / f"s3-{name}-{server}"
            folder.mkdir()
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            endpoint = stack.enter_context(seaweedfs(lambda: Path(tempfile.mkdtemp(dir=folder))))
            blobs = {"FEDQ_BLOB_URL": "s3://fedq/big", "FEDQ_S3_ENDPOINT_URL": endpoint,
                     **CREDENTIALS}
        return _run(name, server, store, work, chunk_mb, blobs)


def _run(name: str, server: str, store: str, work: Path, chunk_mb: float,
         blobs: dict[str, str]) -> Row:
    import redis

    n_layer, n_embd = SIZES[name]
    home = work / f"{name}-{server}-{store}"
    with pg_database() as db, redis_database() as url:
        env = base_env(home, FEDQ_BROKER_URL=url, FEDQ_RESULT_BACKEND=url,
                       FEDQ_BLOB_URL=url, FEDQ_DATABASE_URL=db,
                       FEDQ_BLOB_CHUNK_MB=f"{chunk_mb:g}")
        env.update(blobs)
        n_params = 12 * n_layer * n_embd ** 2
        # the store's bare rates first, on an empty store, at about the model's size
        write_rate, read_rate = bare_rates(env, 4 * n_params, chunk_mb)
        cluster = Cluster(home, env)
        try:
            cluster.fedq("db", "upgrade")
            procs = [cluster.worker("control", ["control"])]
            procs += [cluster.worker(f"w{i}", ["cpu"]) for i in range(2)]
            cluster.workers += procs
            start_workers(procs)
            before = int(redis.Redis.from_url(url).info("memory")["used_memory"])
            samples: list[int] = []
            rss: list[tuple[float, float, float]] = []
            stop = threading.Event()
            samplers = [threading.Thread(target=_redis_peak, args=(url, stop, samples),
                                         daemon=True),
                        threading.Thread(target=_rss, args=([p.proc.pid for p in procs
                                                             if p.proc is not None], stop, rss),
                                         daemon=True)]
            for t in samplers:
                t.start()
            try:
                rounds = REDIS_ROUNDS.get(name, ROUNDS) if store == "redis" else ROUNDS
                run = run_job(cluster, _spec(name, n_layer, n_embd, server, rounds),
                              timeout=3600)
            finally:
                stop.set()
                for t in samplers:
                    t.join()
            worker_mb = max(status_mb(p.proc.pid, "VmHWM") for p in procs[1:]
                            if p.proc is not None)
            with session_scope(db) as s:
                job = s.get(Job, run.job)
                size = int(job.global_size or 0) if job is not None else 0
        finally:
            cluster.stop()
    # A round's blob traffic: the control worker reads the global model (its step) and
    # two updates and writes the new model; each of two workers reads the global model
    # and writes its update; DiLoCo's state is read (from round 2) and written too.
    state = 1 if server == "diloco" else 0
    bound = size * ((3 + state) / write_rate + (5 + state) / read_rate)
    params = n_params
    seconds = [float(r["seconds"] or 0) for r in run.rounds]
    return Row(name, server, store, params, size / 1e6, seconds, run.control_peak_mb,
               worker_mb, (max(samples, default=before) - before) / 1e6, bound,
               by_round(run.rounds, rss))


def bare_rates(env: dict[str, str], size: int, chunk_mb: float) -> tuple[float, float]:
    """Bytes a second of a bare write and a bare read of ``size`` bytes through the
    store the deployment ``env`` names, with fedq's client as the job uses it
    (``put_stream``, ``stream``: hashed, chunked on Redis), from this process."""
    from fedq.blobs import open_store

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update({k: env[k] for k in CREDENTIALS if k in env})
    try:
        store = open_store(env["FEDQ_BLOB_URL"], env.get("FEDQ_S3_ENDPOINT_URL"),
                           chunk_bytes=int(chunk_mb * 2**20))
        block = memoryview(os.urandom(16 << 20))

        def parts() -> Iterator[memoryview]:
            for at in range(0, size, len(block)):
                yield block[:min(len(block), size - at)]

        started = time.perf_counter()
        ref = store.put_stream("bench/bare", size, parts())
        wrote = time.perf_counter() - started
        started = time.perf_counter()
        read = sum(len(piece) for piece in store.stream(ref))
        reading = time.perf_counter() - started
        store.delete_keys(["bench/bare"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if read != size:
        raise BenchError(f"bare read of {size} bytes gave {read}")
    return size / wrote, size / reading


def render(rows: Sequence[Row], chunk_mb: float) -> list[str]:
    return [
        f"Generated by `.venv/bin/python -m bench.big_models` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC at fedq commit {commit()} "
        f"({machine()}; Redis and PostgreSQL on the same machine). One zero-compute job "
        f"a row: a byte-level GPT (float32), 2 clients, {ROUNDS} rounds (2 for 2 GB on "
        "Redis, which keeps every round's model in its memory), the row's server "
        "optimizer (DiLoCo: Nesterov momentum), Redis as broker and results, the row's "
        f"blob store (Redis: blobs over {chunk_mb:g} MiB as chunks, FEDQ_BLOB_CHUNK_MB; "
        "local: a folder; s3: SeaweedFS on this machine). Peak resident "
        "memory (VmHWM) of the control worker and of the larger training worker, each "
        "against its target (issue 79: the model plus 1 GiB, twice the model plus 1 GiB "
        "for DiLoCo's control worker); by round: each round's peak of the resident "
        "memory (VmRSS) sampled every 0.1 s, control worker / larger worker, 'flat' "
        "where no round after the second is 5% above it (the first reads no server "
        "state); Redis: its peak above what it held before the job (the blobs' too where it "
        "keeps them). The bound: a round's blob bytes (the control worker reads the "
        "global model and two updates and writes one model, each worker reads the model "
        "and writes its update; DiLoCo's state besides) at the rates of a bare write and "
        "a bare read of about the model's size through the same store and client, "
        "measured before the job; issue 79's target is a round in at most 1.5 times that.",
        "",
        "| model | store | server | parameters (approx.) | model MB "
        "| seconds a round (median) | bare-store bound s (ratio, target 1.5) "
        "| control peak MB (target) | worker peak MB (target) "
        "| by round MB: control; worker | Redis peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {r.name} | {r.store} | {r.server} | {r.params / 1e6:,.0f}M | {r.model_mb:,.0f} "
          f"| {_s(statistics.median(r.round_s))} | {_s(r.bound_s)} "
          f"({statistics.median(r.round_s) / r.bound_s:.2f}: "
          f"{'met' if statistics.median(r.round_s) <= 1.5 * r.bound_s else 'over'}) "
          f"| {r.control_mb:,.0f} ({_target(r.control_mb, r.model_mb, SERVERS[r.server])}) "
          f"| {r.worker_mb:,.0f} ({_target(r.worker_mb, r.model_mb, 1)}) "
          f"| {_rounds(r.by_round)} "
          f"| {r.redis_mb:,.0f} |" for r in rows],
    ]


def _s(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds >= 1 else f"{seconds:.2f}"


def _rounds(peaks: Sequence[tuple[float, float]]) -> str:
    """Each round's peaks, 'control / ...; worker / ...', and whether both are flat."""
    def flat(values: list[float]) -> bool:
        return len(values) < 3 or max(values[2:]) <= 1.05 * values[1]

    control, worker = [c for c, _ in peaks], [w for _, w in peaks]
    return (f"{' / '.join(f'{v:,.0f}' for v in control)}; "
            f"{' / '.join(f'{v:,.0f}' for v in worker)} "
            f"({'flat' if flat(control) and flat(worker) else 'grows'})")


def _target(peak_mb: float, model_mb: float, copies: int) -> str:
    """``copies`` models plus 1 GiB, in the table's MB (peaks are MiB, VmHWM's kB / 1024:
    bench.common.status_mb), and whether ``peak_mb`` is within it."""
    target = copies * model_mb * 1e6 / 2**20 + 1024
    return f"{'met' if peak_mb <= target else 'over'}: {target:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs")
    parser.add_argument("--sizes", help=f"comma-separated subset of {', '.join(SIZES)} "
                        f"(default {','.join(DEFAULT_SIZES)}; without --sizes and --stores: "
                        "the PLAN in bench/big_models.py)")
    parser.add_argument("--chunk-mb", type=float, default=64,
                        help="FEDQ_BLOB_CHUNK_MB of the deployment (default 64, fedq's)")
    parser.add_argument("--stores",
                        help=f"comma-separated subset of {', '.join(STORES)} (default redis)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated subset of {', '.join(SERVERS)}")
    args = parser.parse_args()
    servers = [n.strip() for n in args.servers.split(",") if n.strip()]
    stores = [n.strip() for n in (args.stores or "redis").split(",") if n.strip()]
    if not stores or any(n not in STORES for n in stores):
        parser.error(f"--stores: pick from {', '.join(STORES)}")
    if not servers or any(n not in SERVERS for n in servers):
        parser.error(f"--servers: pick from {', '.join(SERVERS)}")
    names = [n.strip() for n in (args.sizes or ",".join(DEFAULT_SIZES)).split(",")
             if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        parser.error(f"--sizes: unknown size {unknown[0] if unknown else '(none)'!r} "
                     f"(known: {', '.join(SIZES)})")
    plan = [row for row in PLAN if row[2] in servers] \
        if args.sizes is None and args.stores is None \
        else list(itertools.product(names, stores, servers))
    rows: list[Row] = []
    failed: list[str] = []
    try:
        with TemporaryDirectory(prefix="fedq-big-") as work:
            for name, store, server in plan:
                started = time.perf_counter()
                try:
                    rows.append(run_one(name, server, store, Path(work), args.chunk_mb))
                except (BenchError, S3Unavailable, FedqError) as exc:  # the rest still run
                    failed.append(f"{name} on {store} with {server}: "
                                  f"{str(exc).splitlines()[0][:300]}")
                print(f"[bench.big_models] {name} {store} {server}: "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    except (BenchError, S3Unavailable) as exc:
        print(f"bench.big_models: {exc}", file=sys.stderr)
        return 1
    if not rows:
        print(f"bench.big_models: no row completed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    lines = render(rows, args.chunk_mb) + ([""] + [f"Failed: {f}." for f in failed]
                                           if failed else [])
    print("\n".join(lines))
    if not args.no_write:
        write_section(DOC, BEGIN, END, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
