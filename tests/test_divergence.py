"""A client whose local training diverges says so, instead of sending an update the
coordinator can only call malformed (a NaN loss fails the result's strict parse)."""

from __future__ import annotations

from pathlib import Path

from fedq.blobs import global_key, open_store
from fedq.process import PROCESS
from fedq.testing.cluster import DIGITS
from fedq.weights import dumps


def test_a_diverged_client_reports_training_diverged(tmp_path: Path, worker_home: Path) -> None:
    from fedq.coordinator.evaluation import initial_weights
    from fedq.protocol.training import TrainRef, UpdateRef
    from fedq.spec import parse_spec
    from fedq.worker.update import run_training

    store = open_store(str(tmp_path / "blobs"))

    def train(lr: float) -> UpdateRef:
        spec = parse_spec({**DIGITS, "num_clients": 2, "clients_per_round": 2, "rounds": 1,
                           "local_steps": 20, "optimizer": {"name": "sgd", "lr": lr}})
        PROCESS.clear()
        blob = store.put(global_key("j1", 0), dumps(initial_weights(spec), {"job": "j1"}))
        return UpdateRef.from_json(run_training(
            TrainRef("j1", 1, 0, "cpu", spec.to_json(), blob).to_json(), store, "w"))

    diverged = train(1e12)
    assert diverged.status == "error" and diverged.key is None
    assert diverged.error is not None and "training diverged: mean loss nan" in \
        diverged.error.replace("inf", "nan"), diverged.error
    assert "lr 1000000000000.0" in diverged.error
    fine = train(0.05)
    assert fine.status == "ok" and fine.loss is not None, fine.error
