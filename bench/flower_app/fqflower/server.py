"""ServerApp: Flower's FedAvg over zero-compute clients, one timestamp per round."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


class TimedFedAvg(FedAvg):
    def __init__(self, times_file: str, **kwargs):
        super().__init__(**kwargs)
        self.times_file = times_file

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        errors = [str(m.error) for m in replies if m.has_error()]
        if errors:  # a failed ClientApp answers small and fast: never time such a round
            with open(self.times_file, "a") as fh:
                fh.write(f"error: round {server_round}: {errors[0]}\n".replace(" ", "_"))
            raise RuntimeError(f"round {server_round}: {len(errors)} client errors")
        result = super().aggregate_train(server_round, replies)
        with open(self.times_file, "a") as fh:
            fh.write(f"{time.time()!r}\n")
        return result


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["clients"])
    with open(str(cfg["shapes-file"])) as fh:
        shapes = json.load(fh)
    # Random, not zeros: Flower stores and sends message content as objects named by
    # their hash, so arrays of one repeated value would cross the network once and
    # flatter it (measured on an emulated link: 20 of 45 MB per round with zeros).
    rng = np.random.default_rng(0)
    arrays = ArrayRecord([rng.standard_normal(s).astype(np.float32) for s in shapes])
    strategy = TimedFedAvg(str(cfg["times-file"]), fraction_train=1.0, fraction_evaluate=0.0,
                           min_train_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=int(cfg["num-rounds"]))
