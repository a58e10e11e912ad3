"""Does a training task fit the worker's device (fedq/worker/fit.py): what is counted,
where the budget comes from, and the one-line refusal of a task over it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fedq.blobs import global_key, open_store
from fedq.coordinator.evaluation import initial_weights
from fedq.models import build_model
from fedq.process import PROCESS
from fedq.protocol.training import TrainRef, UpdateRef
from fedq.settings import get_settings
from fedq.spec import OptimizerSpec, parse_spec
from fedq.weights import dumps
from fedq.worker import fit
from fedq.worker.update import run_training

CPU = torch.device("cpu")


@pytest.mark.parametrize(("optimizer", "states"), [
    ({"name": "sgd"}, 0), ({"name": "sgd", "momentum": 0.9}, 1),
    ({"name": "adam"}, 2), ({"name": "adamw"}, 2)])
def test_need_counts_weights_gradients_and_the_optimizers_state(optimizer: dict[str, object],
                                                                states: int) -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 2))
    model[2].weight.requires_grad_(False)  # frozen: a weight without gradient or state
    got = fit.need(model, OptimizerSpec.model_validate(optimizer))
    # 110 + 20 + 22 parameters and BatchNorm's 2 x 10 running stats and its step count
    assert got.weights == 4 * (110 + 20 + 22 + 20) + 8
    trainable = 4 * (110 + 20 + 2)
    assert (got.gradients, got.optimizer) == (trainable, states * trainable)


def test_lora_counts_the_adapters_alone() -> None:
    pytest.importorskip("peft")
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    lora = build_model("hf_causal_lm", (16,), 256, config=config,
                       lora={"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]})
    got = fit.need(lora, OptimizerSpec(name="adamw"))
    adapters = sum(p.numel() * 4 for n, p in lora.named_parameters() if "lora_" in n)
    assert adapters > 0 and got.gradients == adapters and got.optimizer == 2 * adapters
    assert got.weights > 20 * adapters


def test_the_budget_is_the_least_of_the_setting_and_the_device() -> None:
    most, line = fit.budget(CPU, None, None, resident=0)
    assert most is not None and most > 0 and "this machine has" in line
    limited, line = fit.budget(CPU, 0.5, None, resident=0)
    assert limited == 2**19 and line == "this worker allows {} MB (FEDQ_TRAIN_MEMORY_MB)"
    assert fit.budget(torch.device("meta"), None, None, 0) == (None, "")


def test_a_task_over_the_workers_memory_is_refused_before_its_first_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    PROCESS.clear()
    store = open_store(str(tmp_path / "blobs"))
    spec = parse_spec({"name": "t", "model": "small_cnn", "dataset": "digits",
                       "num_clients": 2, "clients_per_round": 1, "rounds": 1,
                       "local_steps": 2, "batch_size": 16,
                       "optimizer": {"name": "adamw", "lr": 0.001}})
    blob = store.put(global_key("j", 0), dumps(initial_weights(spec)))
    ref = TrainRef("j", 1, 0, "cpu", spec.to_json(), blob)
    monkeypatch.setenv("FEDQ_TRAIN_MEMORY_MB", "0.01")
    get_settings.cache_clear()
    out = UpdateRef.from_json(run_training(ref.to_json(), store, "w"))
    assert out.status == "error" and out.steps == 0
    assert out.error is not None and "\n" not in out.error
    assert out.error.startswith("TrainingDoesNotFit: training needs 0.")
    assert "adamw state" in out.error and "this worker allows 0.01 MB (FEDQ_TRAIN_MEMORY_MB)" \
        in out.error
    monkeypatch.setenv("FEDQ_TRAIN_MEMORY_MB", "100")
    get_settings.cache_clear()
    try:
        assert UpdateRef.from_json(run_training(ref.to_json(), store, "w")).status == "ok"
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
