"""The figures docs/observability.md shows, made from real jobs.

    .venv/bin/python -m bench.figures            # about 2 minutes on 2 cores

Digits on the embedded default, three training workers of which one is 3 times
slower (``FEDQ_TEST_SLOWDOWN=3``: the straggler the timeline should make obvious), then
the same workers on a buffered job (K=2, C=4) for the staleness figure. Writes
docs/img/observe-*.png.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import ROOT
from fedq.coordinator.jobs import client_results, job_record, round_results
from fedq.observe.plots import figures, write_figures
from fedq.testing.cluster import DIGITS, Cluster, base_env

SYNC: dict[str, Any] = {**DIGITS, "name": "digits-straggler", "num_clients": 9,
                        "clients_per_round": 6, "rounds": 6}
BUFFERED: dict[str, Any] = {**SYNC, "name": "digits-buffered", "clients_per_round": 4,
                            "rounds": 8, "aggregation": {"mode": "buffered", "buffer": 2}}


def main() -> int:
    out = ROOT / "docs" / "img"
    with tempfile.TemporaryDirectory(prefix="fedq-figures-") as tmp:
        cluster = Cluster(Path(tmp), base_env(Path(tmp) / "home"))
        cluster.start(fast1=["cpu"], fast2=["cpu"], control=["control"])
        cluster.add("slow", ["cpu"], FEDQ_TEST_SLOWDOWN="3")
        try:
            for spec, wanted in ((SYNC, ("progress", "timeline", "bytes", "utilisation")),
                                 (BUFFERED, ("staleness",))):
                job = cluster.submit(spec)
                view = cluster.wait(job, timeout=600)
                if view.status != "completed":
                    print(f"bench.figures: {spec['name']}: {view.status}: {view.error}",
                          file=sys.stderr)
                    return 1
                s = cluster.settings
                figs = figures(job_record(s, job), round_results(s, job), client_results(s, job))
                keep = {k: v for k, v in figs.items() if k in wanted}
                for path in write_figures(keep, out, "observe", ("png",)):
                    print(path)
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
