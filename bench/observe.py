"""What seeing a job costs: round time of the tiny zero-compute job with structured
logs and a Prometheus scraper on, against both off, on the same deployment recipe.

    .venv/bin/python -m bench.observe            # about 3 minutes on 2 cores

Redis (broker, result backend, blobs) + PostgreSQL, a control worker and 4 training
workers, 4 clients per round, ``zero_compute: true``. "on": every worker runs with
``FEDQ_LOG_FORMAT=json`` and a ``fedq metrics`` process is scraped once a second
(Prometheus' default is every 15 s: this is 15 times harsher). The phase timings and
worker diagnostics are recorded in both (they are always on). Runs alternate off / on
``REPEATS`` times, each a fresh deployment, so drift of a shared machine hits both.
Writes the table into docs/observability.md between its bench.observe markers.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import ROOT, pg_database, redis_database
from bench.fedq_run import run_job, zero_compute_spec
from fedq.testing.cluster import Cluster, base_env
from fedq.testing.procs import start_workers

CLIENTS, ROUNDS, REPEATS = 4, 31, 3
DOC = ROOT / "docs" / "observability.md"
BEGIN, END = "<!-- bench.observe -->", "<!-- /bench.observe -->"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(home: Path, on: bool) -> tuple[list[float], int]:
    """Seconds between round commits, and the scrapes made while the job ran."""
    with pg_database() as db, redis_database() as redis_url:
        env = base_env(home, FEDQ_BROKER_URL=redis_url, FEDQ_RESULT_BACKEND=redis_url,
                       FEDQ_BLOB_URL=redis_url, FEDQ_DATABASE_URL=db)
        if on:
            env["FEDQ_LOG_FORMAT"] = "json"
        cluster = Cluster(home, env)
        scraper: subprocess.Popen[bytes] | None = None
        stop, scrapes = threading.Event(), [0]
        try:
            cluster.fedq("db", "upgrade")
            procs = [cluster.worker("control", ["control"])]
            procs += [cluster.worker(f"w{i}", ["cpu"]) for i in range(CLIENTS)]
            cluster.workers += procs
            start_workers(procs)
            if on:
                port = _free_port()
                scraper = subprocess.Popen(
                    [sys.executable, "-m", "fedq.cli", "metrics", "--host", "127.0.0.1",
                     "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)

                def scrape() -> None:
                    while not stop.wait(1.0):
                        try:
                            with urllib.request.urlopen(
                                    f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                                r.read()
                            scrapes[0] += 1
                        except OSError:
                            pass

                threading.Thread(target=scrape, daemon=True).start()
            result = run_job(cluster, zero_compute_spec("tiny", ROUNDS, CLIENTS))
            return result.intervals(), scrapes[0]
        finally:
            stop.set()
            if scraper is not None:
                scraper.terminate()
                scraper.wait(10)
            cluster.stop()


def main() -> int:
    runs: dict[bool, list[float]] = {False: [], True: []}
    scraped = 0
    with tempfile.TemporaryDirectory(prefix="fedq-observe-") as tmp:
        for i in range(REPEATS):
            for on in (False, True):
                intervals, n = one_run(Path(tmp) / f"{i}-{int(on)}", on)
                runs[on] += intervals
                scraped += n
                print(f"bench.observe: repeat {i + 1}, {'on' if on else 'off'}: median "
                      f"{statistics.median(intervals) * 1000:.1f} ms/round", file=sys.stderr)
    cost = statistics.median(runs[True]) / statistics.median(runs[False]) - 1
    rows = [("off (text logs, no scraper)", runs[False]),
            ("on (JSON logs, scraped every second)", runs[True])]
    lines = [f"Measured {time.strftime('%Y-%m-%d')} with `.venv/bin/python -m bench.observe` "
             f"on this 2-core machine: {REPEATS} fresh deployments each, alternating; "
             f"{ROUNDS - 1} timed rounds per run; {scraped} scrapes answered.", "",
             "| observability | median ms/round | p90 ms/round | rounds timed |",
             "|---|---|---|---|"]
    lines += [f"| {name} | {statistics.median(v) * 1000:.1f} | "
              f"{statistics.quantiles(v, n=10)[-1] * 1000:.1f} | {len(v)} |" for name, v in rows]
    verdict = "met" if cost < 0.02 else "not met"
    lines += ["", f"Cost of turning it on: {cost * 100:+.1f}% of round time "
                  f"(target under 2%: {verdict})."]
    _write(lines)
    print("\n".join(lines))
    return 0


def _write(lines: list[str]) -> None:
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOC.write_text(f"{head}{BEGIN}\n" + "\n".join(lines) + f"\n{END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
