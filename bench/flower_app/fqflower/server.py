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
    arrays = ArrayRecord([np.zeros(s, np.float32) for s in shapes])
    strategy = TimedFedAvg(str(cfg["times-file"]), fraction_train=1.0, fraction_evaluate=0.0,
                           min_train_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=arrays, num_rounds=int(cfg["num-rounds"]))
