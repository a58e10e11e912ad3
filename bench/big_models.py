"""Large models end to end: zero-compute rounds of byte-level GPTs from 50 MB to 1.6 GB
(float32) on the deployment a coordinator runs (Redis as broker, result backend and
blob store, PostgreSQL, a control worker, two training workers).

Usage: ``.venv/bin/python -m bench.big_models`` writes the table into
docs/benchmarks.md ("Large models"); ``--no-write`` only prints it; ``--sizes`` picks
the models by name (``50MB,200MB,800MB``).

Each size runs one job (2 clients, 2 rounds, FedAvg; zero compute,
``FEDQ_TEST_ZERO_COMPUTE``: each client sends a small change of the whole model, so what
is measured is moving, checking and averaging the bytes) on a fresh deployment, so each
process's peak resident memory (``VmHWM``) is that job's. Redis's memory is sampled
every 0.2 s; the table shows its peak above what it held before the job. A blob over
FEDQ_BLOB_CHUNK_MB (64 MiB) is kept as chunks (fedq/blobs/chunks.py): before chunks,
Redis refused the 800 MB model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Sequence
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
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.procs import start_workers

DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- big models table -->", "<!-- end of big models table -->"
#: name -> the GPT's (n_layer, n_embd): about 12 * n_layer * n_embd^2 parameters.
#: (A 1.6 GB model, (8, 2048), needs more than this machine's 24 GiB: see the table's
#: memory column, about 5x the model for each of three processes and Redis.)
SIZES = {"50MB": (4, 512), "200MB": (4, 1024), "800MB": (4, 2048)}


#: The server optimizers a row may use, and the control worker's memory target for
#: each (issue 79): the model once (FedAvg) or twice (DiLoCo: its momentum), plus 1 GiB.
SERVERS = {"fedavg": 1, "diloco": 2}


@dataclass
class Row:
    name: str
    server: str
    params: int
    model_mb: float
    round_s: list[float]
    control_mb: float
    worker_mb: float
    redis_mb: float


def _spec(name: str, n_layer: int, n_embd: int, server: str) -> dict[str, object]:
    return {"name": f"zero-compute-big-{name}-{server}", "model": "gpt", "server": {"name": server},
            "model_args": {"n_layer": n_layer, "n_head": 16, "n_embd": n_embd},
            "dataset": "shakespeare", "dataset_args": {"block_size": 32},
            "num_clients": 2, "clients_per_round": 2, "rounds": 2,
            "eval_every": 0, "keep_updates": 0, "round_timeout_s": 1800,
            "queues": {"cpu": -1}, "seed": 0}


def _redis_peak(url: str, stop: threading.Event, out: list[int]) -> None:
    import redis

    client = redis.Redis.from_url(url)
    while not stop.wait(0.2):
        out.append(int(client.info("memory")["used_memory"]))


def run_one(name: str, server: str, work: Path, chunk_mb: int) -> Row:
    import redis

    n_layer, n_embd = SIZES[name]
    home = work / f"{name}-{server}"
    with pg_database() as db, redis_database() as url:
        env = base_env(home, FEDQ_BROKER_URL=url, FEDQ_RESULT_BACKEND=url,
                       FEDQ_BLOB_URL=url, FEDQ_DATABASE_URL=db,
                       FEDQ_BLOB_CHUNK_MB=str(chunk_mb))
        cluster = Cluster(home, env)
        try:
            cluster.fedq("db", "upgrade")
            procs = [cluster.worker("control", ["control"])]
            procs += [cluster.worker(f"w{i}", ["cpu"]) for i in range(2)]
            cluster.workers += procs
            start_workers(procs)
            before = int(redis.Redis.from_url(url).info("memory")["used_memory"])
            samples: list[int] = []
            stop = threading.Event()
            sampler = threading.Thread(target=_redis_peak, args=(url, stop, samples),
                                       daemon=True)
            sampler.start()
            try:
                run = run_job(cluster, _spec(name, n_layer, n_embd, server), timeout=3600)
            finally:
                stop.set()
                sampler.join()
            worker_mb = max(status_mb(p.proc.pid, "VmHWM") for p in procs[1:]
                            if p.proc is not None)
            with session_scope(db) as s:
                job = s.get(Job, run.job)
                size = int(job.global_size or 0) if job is not None else 0
        finally:
            cluster.stop()
    params = 12 * n_layer * n_embd ** 2
    return Row(name, server, params, size / 1e6, [float(r["seconds"] or 0) for r in run.rounds],
               run.control_peak_mb, worker_mb, (max(samples, default=before) - before) / 1e6)


def render(rows: Sequence[Row], chunk_mb: int) -> list[str]:
    return [
        f"Generated by `.venv/bin/python -m bench.big_models` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC at fedq commit {commit()} "
        f"({machine()}; Redis and PostgreSQL on the same machine). One zero-compute job "
        "a row: a byte-level GPT (float32), 2 clients, 2 rounds, the row's server "
        "optimizer (DiLoCo: Nesterov momentum), Redis as broker, results and blob store "
        f"(blobs over {chunk_mb} MiB as chunks, FEDQ_BLOB_CHUNK_MB). Peak resident "
        "memory (VmHWM) of the control worker and of the larger training worker, each "
        "against its target (issue 79: the model plus 1 GiB, twice the model plus 1 GiB "
        "for DiLoCo's control worker); "
        "Redis: its peak above what it held before the job.",
        "",
        "| model | server | parameters (approx.) | model MB | seconds a round (median) "
        "| control peak MB (target) | worker peak MB (target) | Redis peak MB |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {r.name} | {r.server} | {r.params / 1e6:,.0f}M | {r.model_mb:,.0f} "
          f"| {statistics.median(r.round_s):.1f} "
          f"| {r.control_mb:,.0f} ({_target(r.control_mb, r.model_mb, SERVERS[r.server])}) "
          f"| {r.worker_mb:,.0f} ({_target(r.worker_mb, r.model_mb, 1)}) "
          f"| {r.redis_mb:,.0f} |" for r in rows],
    ]


def _target(peak_mb: float, model_mb: float, copies: int) -> str:
    """``copies`` models plus 1 GiB, in the table's MB (peaks are MiB, VmHWM's kB / 1024:
    bench.common.status_mb), and whether ``peak_mb`` is within it."""
    target = copies * model_mb * 1e6 / 2**20 + 1024
    return f"{'met' if peak_mb <= target else 'over'}: {target:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs")
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help=f"comma-separated subset of {', '.join(SIZES)}")
    parser.add_argument("--chunk-mb", type=int, default=64,
                        help="FEDQ_BLOB_CHUNK_MB of the deployment (default 64, fedq's)")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated subset of {', '.join(SERVERS)}")
    args = parser.parse_args()
    servers = [n.strip() for n in args.servers.split(",") if n.strip()]
    if not servers or any(n not in SERVERS for n in servers):
        parser.error(f"--servers: pick from {', '.join(SERVERS)}")
    names = [n.strip() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        parser.error(f"--sizes: unknown size {unknown[0] if unknown else '(none)'!r} "
                     f"(known: {', '.join(SIZES)})")
    rows = []
    try:
        with TemporaryDirectory(prefix="fedq-big-") as work:
            for name in names:
                for server in servers:
                    started = time.perf_counter()
                    rows.append(run_one(name, server, Path(work), args.chunk_mb))
                    print(f"[bench.big_models] {name} {server}: "
                          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    except BenchError as exc:
        print(f"bench.big_models: {exc}", file=sys.stderr)
        return 1
    lines = render(rows, args.chunk_mb)
    print("\n".join(lines))
    if not args.no_write:
        write_section(DOC, BEGIN, END, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
