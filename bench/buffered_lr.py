"""Why a buffered job's FedAvg step defaults to K/C: accuracy per version with server
lr 1 and K/C, against synchronous FedAvg after the same number of updates.

    .venv/bin/python -m bench.buffered_lr          # about 2 minutes on 2 cores

Digits, small_cnn, 12 clients, 3 training workers and a control worker on the
embedded default; synchronous: 6 clients per round, 12 rounds; buffered: C = 6 tasks
in flight, K = 3, 24 versions (the same 72 updates). Prints a markdown table
(docs/strategies.md quotes it).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from fedq.testing.cluster import Cluster, base_env

SPEC: dict[str, Any] = {"name": "lr", "model": "small_cnn", "dataset": "digits",
                        "batch_size": 16, "seed": 3, "num_clients": 12, "local_epochs": 1,
                        "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
                        "clients_per_round": 6}
BUFFERED = {"mode": "buffered", "buffer": 3}
RUNS: list[tuple[str, dict[str, Any]]] = [("synchronous FedAvg, 12 rounds", {"rounds": 12}),
        ("buffered K=3, server lr 1", {"rounds": 24, "aggregation": BUFFERED,
                                       "server": {"name": "fedavg", "lr": 1.0}}),
        ("buffered K=3, server lr K/C = 0.5 (default)", {"rounds": 24,
                                                        "aggregation": BUFFERED})]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fedq-lr-") as tmp:
        cluster = Cluster(Path(tmp), base_env(Path(tmp) / "home"))
        cluster.start(w1=["cpu"], w2=["cpu"], w3=["cpu"], control=["control"])
        lines = ["| run | accuracy after 1/4, 1/2, 3/4, all of the updates | best | final |",
                 "|---|---|---|---|"]
        try:
            for name, extra in RUNS:
                job = cluster.submit({**SPEC, **extra})
                view = cluster.wait(job, timeout=600)
                if view.status != "completed":
                    print(f"bench.buffered_lr: {name}: {view.status}: {view.error}",
                          file=sys.stderr)
                    return 1
                acc = [r.accuracy or 0.0 for r in cluster.rounds(job)]
                n = len(acc)
                marks = [acc[n * q // 4 - 1] for q in (1, 2, 3, 4)]
                lines.append(f"| {name} | {', '.join(f'{a:.3f}' for a in marks)} | "
                             f"{max(acc):.3f} | {acc[-1]:.3f} |")
        finally:
            cluster.stop()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
