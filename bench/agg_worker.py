"""One aggregation measurement in a fresh process (so its peak memory is its own).

    python bench/agg_worker.py IMPL K SHAPES_JSON REPEATS

IMPL: fedq (fedq.aggregate.Accumulator.mean, what finalize runs, over updates parsed
from safetensors blobs as finalize reads them: its memory is kept from one repeat to
the next as finalize keeps it from round to round), flower
(flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords, what Flower's FedAvg
runs), flower_legacy (flwr.server.strategy.aggregate.aggregate), axpy (the bound: one
contiguous K x N float32 buffer summed row by row into one accumulator, torch's
vectorized add; the accumulator is kept from repeat to repeat too). Updates are built
in memory first; the measurement is the aggregation alone. Prints one JSON line:
seconds per repeat, bytes of one model, resident memory before, and the peak above it
during the first repeat.

Runs with fedq's environment (fedq, axpy) or the Flower one (flower*): it imports
only what its IMPL needs.
"""

from __future__ import annotations

import json
import sys
import time


def _status(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS (Linux)
        fh.write("5")


def main() -> None:
    impl, k, shapes_file, repeats = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    shapes = [tuple(s) for s in json.load(open(shapes_file))]
    import numpy as np

    rng = np.random.default_rng(0)
    arrays = [[rng.standard_normal(s, dtype=np.float32) for s in shapes] for _ in range(k)]
    nbytes = sum(a.nbytes for a in arrays[0])

    if impl == "fedq":
        import torch

        from fedq.aggregate import Accumulator
        from fedq.weights import dumps, loads

        # as finalize reads them: each update parsed from its safetensors blob (views
        # of the one buffer the blob store read it into)
        updates = [loads(bytearray(dumps({f"t{i}": torch.from_numpy(a)
                                          for i, a in enumerate(u)})))
                   for u in arrays]
        del arrays[:]
        accumulator = Accumulator()

        def once() -> None:
            accumulator.expect(float(k))  # finalize knows the weights from the results
            accumulator.mean((1.0, u) for u in updates)
    elif impl == "axpy":
        import torch

        flat = torch.from_numpy(np.concatenate([np.concatenate([a.ravel() for a in u])
                                                for u in arrays]).reshape(k, -1))
        del arrays[:]
        acc = torch.empty(flat.shape[1])

        def once() -> None:
            torch.mul(flat[0], 1.0 / k, out=acc)
            for i in range(1, k):
                acc.add_(flat[i], alpha=1.0 / k)
    elif impl == "flower":
        from flwr.app import ArrayRecord, MetricRecord, RecordDict
        from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

        records = [RecordDict({"arrays": ArrayRecord(u),
                               "metrics": MetricRecord({"num-examples": 1})}) for u in arrays]
        del arrays[:]

        def once() -> None:
            aggregate_arrayrecords(records, "num-examples")
    elif impl == "flower_legacy":
        from flwr.server.strategy.aggregate import aggregate

        results = [(u, 1) for u in arrays]

        def once() -> None:
            aggregate(results)
    else:
        raise SystemExit(f"unknown IMPL {impl!r}")

    import gc

    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = _status("VmHWM") - base
        gc.collect()
    print(json.dumps({"impl": impl, "k": k, "seconds": times, "model_bytes": nbytes,
                      "base_mb": base, "extra_peak_mb": peak}))


if __name__ == "__main__":
    main()
