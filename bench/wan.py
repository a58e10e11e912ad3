"""Rounds over emulated wide-area links; writes docs/wan.md.

    .venv/bin/python -m bench.wan              # ~20 minutes on 2 cores; needs root
    .venv/bin/python -m bench.wan --smoke --presets lan   # a few minutes (CI)

Every training worker runs in a network namespace of its own (fedq/testing/wan/):
the link's rate is capped by tbf, its latency made by a relay in user space. The
control worker, Redis and PostgreSQL stay on this host, as on a coordinator. Tables:

1. the emulator itself: per preset, the round trip and throughput a probe measures
   inside a host, and the relay's CPU per GB;
2. seconds per round per preset for a ResNet-18-size (44.7 MB) zero-compute job with
   fp32 and int8 updates and for the digits job, against the bound the link allows
   (model bytes / downlink + update bytes / uplink + ``ROUND_TRIPS`` round trips) and
   the same job over loopback (this machine's own floor);
3. the per-machine blob cache: four workers on one host, bytes on its link per round
   with and without ``FEDQ_BLOB_CACHE``;
4. buffered asynchronous against synchronous rounds (bench/jobs.py's benchmark) with
   each worker a host on one preset (``--buffered-preset``, default home);
5. sha256 against BLAKE3 (fedq's blob digest, fedq/digest.py) on a 45 MB model.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import blake3

from bench.common import (
    ROOT,
    BenchError,
    Context,
    Section,
    commit,
    machine,
    pg_database,
    redis_database,
)
from bench.fedq_run import run_job, zero_compute_spec
from bench.jobs import buffered_modes, lognormal_slowdowns
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.procs import WorkerProcess, start_workers
from fedq.testing.wan import (
    PRESETS,
    Host,
    Profile,
    Relays,
    have_netns,
    probe,
    serve_probe_target,
)

DOC = ROOT / "docs" / "wan.md"
MARKER = "<!-- end of generated part -->"
#: Round trips a round needs beyond its bytes: the task reaches the worker, the model
#: GET, the update SET, the result reaches the chord (each one request/answer).
ROUND_TRIPS = 4
HOSTS = 2
DIGITS = {"name": "wan-digits", "model": "small_cnn", "dataset": "digits", "num_clients": 2,
          "clients_per_round": 2, "local_epochs": 1, "batch_size": 32, "eval_every": 0,
          "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "seed": 1,
          "round_timeout_s": 900}


@dataclass
class Row:
    preset: str
    job: str
    seconds: float
    bound: float  # the link's: bytes / rates + round trips
    floor: float  # the same job over loopback on this machine
    bytes_down: int
    bytes_up: int

    @property
    def expected(self) -> float:
        """The link's bound plus this machine's own floor: a client's download, its
        work, its upload and the aggregation follow one another."""
        return self.bound + self.floor


def say(msg: str) -> None:
    print(f"[wan {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emulator(relays: Relays, presets: list[Profile]) -> list[dict[str, Any]]:
    server, _ = serve_probe_target()
    rows = []
    try:
        for p in presets:
            host = Host("probe", p).create()
            try:
                relay = host.forward(relays, server.getsockname()[1])
                cpu = relays.cpu_seconds()
                up, down = int(p.up_mbit * 1e6 / 8 * 2), int(p.down_mbit * 1e6 / 8 * 2)
                got = probe(host, relay.port, up, down)
                cpu = relays.cpu_seconds() - cpu
                rows.append({"preset": p, **got, "cpu_per_gb": cpu / ((up + down) / 1e9)})
                say(f"emulator {p.name}: {got}")
            finally:
                host.destroy()
    finally:
        server.close()
    return rows


@contextmanager
def wan_cluster(work: Path, relays: Relays, hosts: list[Host], workers_per_host: int,
                cache: bool, slow: list[float] | None = None,
                direct: int = 0) -> Iterator[Cluster]:
    """Redis + PostgreSQL here, a control worker here, ``workers_per_host`` training
    workers ``w{n}@{host}`` in each host reaching Redis through its relay; worker n
    runs ``slow[n]`` times slower. ``direct``: that many workers on this host instead,
    over loopback (the machine's own floor)."""
    with pg_database() as db, redis_database() as redis_url:
        home = work / f"wan-{time.monotonic_ns()}"
        env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                       FEDQ_BLOB_URL=redis_url, FEDQ_DATABASE_URL=db)
        cluster = Cluster(home, env)
        cluster.fedq("db", "upgrade")
        port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        procs = [cluster.worker("control", ["control"])]
        for h, host in enumerate(hosts):
            url = host.url(redis_url, host.forward(relays, port))
            extra = {"FEDQ_BLOB_CACHE": str(home / f"cache-{host.name}")} if cache else {}
            for n in range(h * workers_per_host, (h + 1) * workers_per_host):
                speed = {"FEDQ_TEST_SLOWDOWN": f"{slow[n]:g}"} if slow and slow[n] > 1 else {}
                procs.append(WorkerProcess(
                    f"w{n}@{host.name}", ["cpu"], home / "logs" / f"w{n}.log",
                    env={**env, "FEDQ_BROKER_URL": url, "FEDQ_RESULT_BACKEND": url,
                         "FEDQ_BLOB_URL": url, **extra, **speed},
                    prefix=host.exec_prefix()))
        procs += [cluster.worker(f"w{n}", ["cpu"]) for n in range(direct)]
        cluster.workers += procs
        try:
            start_workers(procs)
            yield cluster
        finally:
            cluster.stop()
            for host in hosts:
                for relay in host.relays:
                    relay.close()
                host.relays.clear()


def _round_seconds(cluster: Cluster, spec: dict[str, Any]) -> tuple[float, int, int]:
    """Mean seconds per round after the first (dispatch to commit), and the bytes one
    client moved down and up in the last round."""
    run = run_job(cluster, spec, timeout=1800)
    rows = run.rounds[1:] if len(run.rounds) > 1 else run.rounds
    updates = [u for u in cluster.updates(run.job)
               if u.round_number == run.rounds[-1]["round"]]
    down = max(u.bytes_down for u in updates)
    up = max(u.bytes_up for u in updates)
    return statistics.mean(float(r["seconds"]) for r in rows), down, up


def bound(p: Profile, down: int, up: int) -> float:
    return down * 8 / (p.down_mbit * 1e6) + up * 8 / (p.up_mbit * 1e6) + \
        ROUND_TRIPS * p.rtt_ms / 1000


def _jobs(n: int) -> list[tuple[str, dict[str, Any]]]:
    return [("ResNet-18 zero-compute, fp32", zero_compute_spec("resnet18", n, HOSTS)),
            ("ResNet-18 zero-compute, int8",
             zero_compute_spec("resnet18", n, HOSTS, compression={"codec": "int8"})),
            (INT8_BOTH, zero_compute_spec("resnet18", n, HOSTS,
                                          compression={"codec": "int8", "downlink": "int8"})),
            ("digits small CNN, fp32", {**DIGITS, "rounds": n})]


INT8_BOTH = "ResNet-18 zero-compute, int8 up and down"
FLOWER_JOB = "Flower Deployment Engine, ResNet-18 zero-compute, fp32"


def _flower(flower_python: Path, work: Path, n: int, hosts: list[Host],
            relays: Relays) -> float:
    """Mean seconds per round (after the first) of Flower's Deployment Engine on the
    zero-compute ResNet-18 job, one SuperNode per host (none: on loopback)."""
    from bench.flower_run import flower_rounds
    from bench.overhead import model_shapes

    shapes, _ = model_shapes("resnet18")
    return statistics.mean(flower_rounds(flower_python.parent, work, "deployment", shapes,
                                         n + 1, HOSTS, hosts=hosts, relays=relays))


def rounds_table(work: Path, relays: Relays, presets: list[Profile], smoke: bool,
                 flower_python: Path | None, flower_presets: list[str]) -> list[Row]:
    n = 2 if smoke else 3
    floor: dict[str, float] = {}
    with wan_cluster(work, relays, [], 1, cache=False, direct=HOSTS) as cluster:
        for name, spec in _jobs(n):
            floor[name] = _round_seconds(cluster, spec)[0]
            say(f"loopback {name}: {floor[name]:.2f} s/round")
    model_bytes = 0
    if flower_python is not None and flower_presets:
        floor[FLOWER_JOB] = _flower(flower_python, work, n, [], relays)
        say(f"loopback {FLOWER_JOB}: {floor[FLOWER_JOB]:.2f} s/round")
    hosts = [Host(f"h{i}", presets[0]).create() for i in range(HOSTS)]
    out: list[Row] = []
    try:
        with wan_cluster(work, relays, hosts, 1, cache=False) as cluster:
            for p in presets:
                for host in hosts:
                    host.shape(p)
                # a slow preset: two rounds (the second is timed)
                slow = bound(p, 45_000_000, 45_000_000) > 30
                for name, spec in _jobs(2 if slow else n):
                    secs, down, up = _round_seconds(cluster, spec)
                    row = Row(p.name, name, secs, bound(p, down, up), floor[name], down, up)
                    out.append(row)
                    if name.endswith("fp32") and name.startswith("ResNet"):
                        model_bytes = down
                    say(f"{p.name} {name}: {secs:.2f} s/round, link bound {row.bound:.2f} s,"
                        f" expected {row.expected:.2f} s")
                if FLOWER_JOB in floor and p.name in flower_presets:
                    secs = _flower(flower_python, work, n, hosts, relays)  # type: ignore[arg-type]
                    row = Row(p.name, FLOWER_JOB, secs, bound(p, model_bytes, model_bytes),
                              floor[FLOWER_JOB], model_bytes, model_bytes)
                    out.append(row)
                    say(f"{p.name} Flower: {secs:.2f} s/round, link bound {row.bound:.2f} s")
    finally:
        for host in hosts:
            host.destroy()
    return out


def cache_table(work: Path, relays: Relays, smoke: bool) -> list[tuple[str, float, float]]:
    """Four workers on one host (a 4-GPU box): link bytes per round, cache off and on."""
    rows = []
    for cache in (False, True):
        host = Host("box", PRESETS["metro"]).create()
        try:
            with wan_cluster(work, relays, [host], 4, cache=cache) as cluster:
                n = 2 if smoke else 3
                before = host.bytes()
                run = run_job(cluster, zero_compute_spec("resnet18", n, 4), timeout=900)
                down, up = (b - a for a, b in zip(before, host.bytes(), strict=True))
                model = max(u.bytes_down for u in cluster.updates(run.job))
                rows.append(("on" if cache else "off", down / n / model, up / n / model))
                say(f"cache {'on' if cache else 'off'}: {down / n / 1e6:.1f} MB down/round")
        finally:
            host.destroy()
    return rows


def buffered_section(work: Path, relays: Relays, preset: Profile, smoke: bool) -> Section:
    """bench/jobs.py's buffered-vs-synchronous benchmark, each worker a host on
    ``preset``'s link."""
    workers = 2 if smoke else 6
    slow = [4 * x for x in lognormal_slowdowns(workers)]
    ctx = Context(smoke=smoke, work=work, flower_python=None)
    hosts = [Host(f"s{i}", preset).create() for i in range(workers)]
    try:
        with wan_cluster(work, relays, hosts, 1, cache=False, slow=slow) as cluster:
            return buffered_modes(ctx, cluster, slow,
                                  "Buffered asynchronous vs synchronous over a WAN",
                                  f"each on a host of its own on the {preset.name} preset "
                                  f"({preset.describe()}), Redis + PostgreSQL here,")
    finally:
        for host in hosts:
            host.destroy()


def hash_speed() -> list[tuple[str, float]]:
    data = os.urandom(45_000_000)
    out = []
    for name, fn in [("sha256 (hashlib, OpenSSL)", lambda: hashlib.sha256(data).digest())]:
        t = time.perf_counter()
        for _ in range(5):
            fn()
        out.append((name, (time.perf_counter() - t) / 5))
    for threads, label in ((1, "BLAKE3, 1 thread (fedq's blob digest)"),
                           (blake3.blake3.AUTO, "BLAKE3, all cores")):
        t = time.perf_counter()
        for _ in range(5):
            blake3.blake3(data, max_threads=threads).digest()
        out.append((label, (time.perf_counter() - t) / 5))
    return out


def write(path: Path, emu: list[dict[str, Any]], rows: list[Row],
          cache: list[tuple[str, float, float]], buffered: Section | None,
          hashes: list[tuple[str, float]], elapsed: float, smoke: bool) -> None:
    flower = any(r.job == FLOWER_JOB for r in rows)
    command = ".venv/bin/python -m bench.wan" + (" --smoke" if smoke else "") + (
        ' --flower-python "$(bash scripts/flower-env.sh)"' if flower else "")
    lines = [
        "# fedq over wide-area links",
        "",
        f"Generated by `{command}` on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} at commit {commit()} ({machine()}, "
        f"{platform.python_version()}); {elapsed / 60:.1f} minutes. Each training worker "
        "is a host of its own: a network namespace whose only way to Redis is a veth "
        "link, rate-capped by tbf, latency from a user-space relay "
        "(fedq/testing/wan/).",
        "",
        "## The presets and the emulator",
        "",
        "A probe inside a host measures the link: median of 20 one-byte round trips, "
        "and 2 s of bulk transfer each way (a stall is an extra retransmission timeout, "
        "so the constrained preset's throughput falls below its cap by design). Relay "
        "CPU: seconds of one core per GB relayed.",
        "",
        "| preset | link | source | RTT measured | up measured | down measured | "
        "relay CPU s/GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in emu:
        p: Profile = e["preset"]
        lines.append(
            f"| {p.name} | {p.describe()} | {p.source} | {e['rtt_ms']:.1f} ms "
            f"({e['rtt_ms'] / p.rtt_ms - 1:+.0%}) | {e['up_mbit']:.0f} Mbit/s "
            f"({e['up_mbit'] / p.up_mbit - 1:+.0%}) | {e['down_mbit']:.0f} Mbit/s "
            f"({e['down_mbit'] / p.down_mbit - 1:+.0%}) | {e['cpu_per_gb']:.2f} |")
    lines += [
        "",
        "## Seconds per round against the link's bound",
        "",
        f"{HOSTS} hosts, one worker each, both on the preset's link; the mean of the "
        "rounds after the first (dispatch to commit). Link bound = model bytes / "
        f"downlink + update bytes / uplink + {ROUND_TRIPS} round trips. Loopback = the "
        f"same job with the {HOSTS} workers on this machine, no link: its own floor "
        "(serialising, hashing, Redis, aggregating, training for digits, on 2 cores). A "
        "client's download, its work, its upload and the aggregation follow one another, "
        "so the last column compares with their sum. Target: within 1.25x of the link "
        "bound for the 45 MB model with fp32 updates.",
        "",
        "| preset | job | MB down / up per client | s/round | link bound s | "
        "loopback s | x link bound | x (link bound + loopback) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.preset} | {r.job} | {r.bytes_down / 1e6:.1f} / "
                     f"{r.bytes_up / 1e6:.1f} | {r.seconds:.2f} | {r.bound:.2f} | "
                     f"{r.floor:.2f} | {r.seconds / r.bound:.2f} | "
                     f"{r.seconds / r.expected:.2f} |")
    if not flower:
        lines += ["", "Flower's Deployment Engine: not run this time (`--flower-python`)."]
    else:
        lines += ["", "Flower's Deployment Engine: the same zero-compute FedAvg "
                      "(bench/flower_app), one SuperNode per host reaching the SuperLink "
                      "through the host's link; its loopback floor is Flower's own on "
                      "this machine."]
    fp32 = {r.preset: r.seconds for r in rows if r.job.endswith("fp32")
            and r.job.startswith("ResNet")}
    int8 = {r.preset: r.seconds for r in rows if r.job.endswith("int8")}
    both = {r.preset: r.seconds for r in rows if r.job == INT8_BOTH}
    if "home" in fp32 and "home" in int8:
        lines += ["", f"int8 against fp32 updates on the home uplink: "
                      f"{fp32['home'] / int8['home']:.2f}x faster per round with int8 "
                      "updates"
                      + (f", {fp32['home'] / both['home']:.2f}x with the model also sent "
                         "down as int8 steps (`compression: {downlink: int8}`)"
                         if "home" in both else "") + " (target 3x)."]
    lines += [
        "",
        "## Four workers on one machine: the per-host blob cache",
        "",
        "One host (metro link) runs four workers, as a 4-GPU box would; bytes that "
        "crossed its link per round, in units of the global model.",
        "",
        "| FEDQ_BLOB_CACHE | models down per round | models up per round |",
        "|---|---|---|",
    ]
    lines += [f"| {c} | {d:.2f} | {u:.2f} |" for c, d, u in cache]
    if buffered is not None:
        lines += ["", buffered.markdown(smoke).strip()]
    lines += [
        "",
        "## Hashing a 45 MB model",
        "",
        "| hash | seconds | GB/s |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {s:.4f} | {45e6 / s / 1e9:.2f} |" if s == s else f"| {n} | - | - |"
              for n, s in hashes]
    prose = path.read_text().split(MARKER, 1)[1] if path.exists() and \
        MARKER in path.read_text() else "\n"
    path.write_text("\n".join(lines) + "\n\n" + MARKER + prose)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wan")
    parser.add_argument("--smoke", action="store_true", help="two presets, short jobs")
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help=f"comma-separated subset of {', '.join(PRESETS)}")
    parser.add_argument("--out", type=Path, default=DOC)
    parser.add_argument("--flower-python", type=Path,
                        default=os.environ.get("FEDQ_BENCH_FLOWER_PYTHON") or None,
                        help="python of the Flower environment (bash scripts/flower-env.sh "
                             "prints it); without it Flower's rows are left out")
    parser.add_argument("--flower-presets", default="lan,home",
                        help="presets on which Flower's Deployment Engine also runs")
    parser.add_argument("--buffered-preset", default="home",
                        help="the preset of the buffered-vs-synchronous table ('none': "
                             "skip it)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown preset {unknown[0]!r} (known: {', '.join(PRESETS)})")
    flower_presets = [n.strip() for n in args.flower_presets.split(",") if n.strip()]
    if args.flower_python is not None and not Path(args.flower_python).exists():
        parser.error(f"--flower-python: {args.flower_python} does not exist")
    if args.buffered_preset not in (*PRESETS, "none"):
        parser.error(f"--buffered-preset: unknown preset {args.buffered_preset!r}")
    if args.smoke:
        names = names[:2]
    why = have_netns()
    if why:
        print(f"bench.wan: cannot make hosts here: {why}", file=sys.stderr)
        return 1
    presets = [PRESETS[n] for n in names]
    # SIGTERM unwinds like Ctrl-C: the finally blocks stop the workers, remove the hosts.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    relays = Relays()
    try:
        with tempfile.TemporaryDirectory(prefix="fedq-wan-") as tmp:
            emu = emulator(relays, presets)
            rows = rounds_table(Path(tmp), relays, presets, args.smoke, args.flower_python,
                                flower_presets)
            cache = cache_table(Path(tmp), relays, args.smoke)
            buffered = buffered_section(Path(tmp), relays, PRESETS[args.buffered_preset],
                                        args.smoke) if args.buffered_preset != "none" \
                else None
    except BenchError as exc:
        print(f"bench.wan: {exc}", file=sys.stderr)
        return 1
    finally:
        relays.close()
    write(args.out, emu, rows, cache, buffered, hash_speed(), time.monotonic() - started,
          args.smoke)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
