"""What every benchmark shares: services, worker processes, statistics, the report.

A benchmark is a function ``run(ctx) -> Section``; ``python -m bench`` runs them in
order and writes docs/benchmarks.md. Figures are medians over repeats with min-max;
comparisons are ratios of figures measured in the same run.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedq.testing.services import fresh_pg_database

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("FEDQ_BENCH_PG_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("FEDQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")


class BenchError(Exception):
    """A benchmark could not run (a service is missing, a run failed): one line."""


@dataclass(frozen=True)
class Stat:
    """Median of repeated measurements, with their range."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> "Stat":
        if not values:
            raise BenchError("no measurements")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, spec: str = ".3f", unit: str = "") -> str:
        return (f"{self.median:{spec}}{unit} ({self.low:{spec}}–{self.high:{spec}})"
                if self.n > 1 else f"{self.median:{spec}}{unit}")


@dataclass
class Section:
    """One benchmark's part of docs/benchmarks.md."""

    title: str
    intro: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[tuple[str, bool | None, str]] = field(default_factory=list)

    def target(self, what: str, met: bool | None, measured: str) -> None:
        """A target from the issue, whether this run met it (None: not measured)."""
        self.targets.append((what, met, measured))

    def markdown(self, smoke: bool = False) -> str:
        out = [f"## {self.title}", "", self.intro, "",
               "| " + " | ".join(self.header) + " |",
               "|" + "---|" * len(self.header)]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.targets:
            out += ["", "| target | met | measured |", "|---|---|---|"]
            out += [f"| {w} | {_verdict(m, smoke)} | {v} |" for w, m, v in self.targets]
        if self.notes:
            out += [""] + self.notes
        return "\n".join(out) + "\n"


def _verdict(met: bool | None, smoke: bool) -> str:
    if smoke:
        return "not judged (smoke sizes)"
    return "yes" if met else "no" if met is False else "not measured"


@dataclass
class Context:
    smoke: bool
    work: Path
    flower_python: Path | None
    log: list[str] = field(default_factory=list)
    #: smoke runs share one fedq deployment (started on first use, closed at the end)
    shared: Any = None
    stack: ExitStack = field(default_factory=ExitStack)

    def say(self, msg: str) -> None:
        """Progress on stderr (long benchmarks must show they are alive)."""
        line = f"[bench {time.strftime('%H:%M:%S')}] {msg}"
        print(line, file=sys.stderr, flush=True)
        self.log.append(line)


@contextmanager
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards."""
    def unavailable(exc: Exception) -> None:
        raise BenchError(f"PostgreSQL at {PG_ADMIN_URL} not available: "
                         f"{str(exc).splitlines()[0]}") from None

    with fresh_pg_database(PG_ADMIN_URL, "fedq_bench", unavailable) as url:
        yield url


_CHECKED: set[str] = set()


@contextmanager
def redis_database(url: str = REDIS_URL) -> Iterator[str]:
    """The bench's Redis database, flushed before and after."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        db = int(client.connection_pool.connection_kwargs.get("db") or 0)
        # Consumers (a Celery worker blocks in BRPOP and subscribes to its broadcast
        # channels): workers left over from an interrupted run would steal tasks.
        # (Checked once per run: a smoke run's own deployment stays up throughout.)
        others = [c for c in client.client_list() if int(c.get("db", -1)) == db
                  and (c.get("cmd") in ("brpop", "blpop") or int(c.get("psub", 0)) > 0)]
        first_use = url not in _CHECKED
        _CHECKED.add(url)
        if others and first_use:
            raise BenchError(f"Redis database {db} at {url} has {len(others)} consumer "
                             f"connection(s) (Celery workers left from an interrupted run?); "
                             f"stop them or set FEDQ_BENCH_REDIS_URL")
        client.flushdb()
    except redis.RedisError as exc:
        raise BenchError(f"Redis at {url} not available: {exc}") from None
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


def status_mb(pid: int, field: str) -> float:
    """A memory field of /proc/PID/status in MB: ``VmRSS`` (resident now) or ``VmHWM``
    (the resident high-water mark)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def versions(flower_python: Path | None) -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for pkg in ("celery", "kombu", "redis", "torch", "numpy", "safetensors", "SQLAlchemy"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = "not installed"
    try:
        import hiredis  # noqa: F401

        out["hiredis"] = version("hiredis")
    except ImportError:
        out["hiredis"] = "not installed"
    if flower_python is not None:
        proc = subprocess.run([str(flower_python), "-c",
                               "import flwr, ray; print(flwr.__version__, ray.__version__)"],
                              capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            flwr_v, ray_v = proc.stdout.split()
            out["flwr"], out["ray"] = flwr_v, ray_v
    try:
        out["redis-server"] = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True,
            check=False).stdout.split()[2].removeprefix("v=")
    except (OSError, IndexError):
        pass
    return out


def commit() -> str:
    """The checked-out commit, marked when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes" if dirty else "")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0.0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({cpu}), "
            f"{mem:.0f} GiB memory, no GPU used")


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}×" if x < 10 else f"{x:.0f}×"


def as_json(obj: Any) -> Any:
    if isinstance(obj, Stat):
        return {"median": obj.median, "min": obj.low, "max": obj.high, "n": obj.n}
    return obj


def write_section(doc: Path, begin: str, end: str, lines: Sequence[str]) -> None:
    """Replace what stands between the markers ``begin`` and ``end`` of ``doc`` (a
    generated table inside hand-written prose) with ``lines``."""
    head, _, rest = doc.read_text().partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{begin}\n" + "\n".join(lines) + f"\n{end}{tail}")
