"""Every strategy option has its effect, through the code that wires it: the spec field
reaches the worker's training (run_training) or the coordinator's pipeline (reduce,
apply_server). Each test fails if the option is dropped on its way. The blob store is a
local folder: these are about fedq's logic, not a service."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedq.aggregate import Accumulator
from fedq.aggregate.clip import update_norm
from fedq.blobs import BlobStore, global_key, open_store
from fedq.coordinator.evaluation import initial_weights
from fedq.coordinator.pipeline import Outcome, apply_server, reduce
from fedq.process import PROCESS
from fedq.protocol.training import TrainRef, UpdateRef
from fedq.spec import JobSpec, parse_spec
from fedq.testing import faults
from fedq.weights import dumps, loads
from fedq.worker.update import run_training

BASE: dict[str, Any] = {"model": "small_cnn", "dataset": "digits", "num_clients": 4,
                        "clients_per_round": 2, "rounds": 1, "local_steps": 5,
                        "batch_size": 16, "seed": 3}
REFERENCE = {"w": torch.zeros(4000), "b": torch.zeros(3)}


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    PROCESS.clear()
    return open_store(str(tmp_path / "blobs"))


def _update(store: BlobStore, client: int, delta: dict[str, torch.Tensor], *, samples: int = 10,
            steps: int = 1) -> UpdateRef:
    blob = store.put(f"u/{client}", dumps(delta))
    return UpdateRef(status="ok", job="j", round=1, client=client, queue="cpu", worker="w",
                     key=blob.key, sha256=blob.sha256, samples=samples, steps=steps,
                     bytes_up=blob.size)


def _reduce(spec: JobSpec, store: BlobStore, refs: list[UpdateRef],
            tmp_path: Path) -> dict[str, torch.Tensor]:
    delta = reduce(spec, store, refs, REFERENCE, Outcome(), tmp_path / "scratch", Accumulator())
    assert delta is not None
    return {k: v.clone() for k, v in delta.items()}


def _spec(**fields: Any) -> JobSpec:
    return parse_spec({**BASE, **fields})


def test_fednova_differs_from_the_mean_when_step_counts_differ(store: BlobStore,
                                                                tmp_path: Path) -> None:
    # client 0: 1 step, delta 1; client 1: 4 steps, delta 4; equal samples.
    refs = [_update(store, 0, {"w": torch.ones(4000), "b": torch.ones(3)}, steps=1),
            _update(store, 1, {"w": torch.full((4000,), 4.0), "b": torch.full((3,), 4.0)},
                    steps=4)]
    mean = _reduce(_spec(), store, refs, tmp_path)
    nova = _reduce(_spec(reducer={"name": "fednova"}), store, refs, tmp_path)
    assert torch.allclose(mean["w"], torch.full((4000,), 2.5))  # (1 + 4) / 2
    # FedNova: tau_eff = (1 + 4) / 2 = 2.5; per-step directions 1 and 1 -> 2.5 * 1
    assert torch.allclose(nova["w"], torch.full((4000,), 2.5))
    refs[1] = _update(store, 1, {"w": torch.full((4000,), 2.0), "b": torch.full((3,), 2.0)},
                      steps=4)
    mean = _reduce(_spec(), store, refs, tmp_path)
    nova = _reduce(_spec(reducer={"name": "fednova"}), store, refs, tmp_path)
    assert torch.allclose(mean["w"], torch.full((4000,), 1.5))
    # tau_eff 2.5 x (1/1 + 2/4) / 2 = 2.5 x 0.75 = 1.875
    assert torch.allclose(nova["w"], torch.full((4000,), 1.875))


def test_clip_norm_bounds_every_update(store: BlobStore, tmp_path: Path) -> None:
    refs = [_update(store, 0, {"w": torch.full((4000,), 3.0), "b": torch.zeros(3)}),
            _update(store, 1, {"w": torch.full((4000,), -1.0), "b": torch.zeros(3)})]
    plain = _reduce(_spec(), store, refs, tmp_path)
    clipped = _reduce(_spec(clip_norm=0.5), store, refs, tmp_path)
    assert math.isclose(float(plain["w"][0]), 1.0)
    # each update scaled to norm 0.5 first: +0.5/sqrt(4000) and -0.5/sqrt(4000) -> 0
    assert abs(float(clipped["w"][0])) < 1e-6
    assert update_norm(clipped) <= 0.5 + 1e-6


def test_dp_adds_noise_of_the_stated_scale(store: BlobStore, tmp_path: Path) -> None:
    zeros = {"w": torch.zeros(4000), "b": torch.zeros(3)}
    refs = [_update(store, c, zeros) for c in range(2)]
    assert update_norm(_reduce(_spec(), store, refs, tmp_path)) == 0.0
    noisy = _reduce(_spec(dp={"noise_multiplier": 2.0, "clip_norm": 1.0}), store, refs, tmp_path)
    std = float(noisy["w"].std())
    # DP-FedAvg: sigma = z * C / clients_per_round = 2 * 1 / 2 = 1
    assert 0.9 < std < 1.1, std


@pytest.mark.parametrize(("server", "first_step"), [
    ({"name": "fedavg", "lr": 0.5}, 0.5 * 0.2),
    ({"name": "fedavgm", "lr": 0.5, "momentum": 0.9}, 0.5 * 0.2),
    # Adam's first step: m = 0.1 d, v = 0.01 d^2 -> lr * sign(d)
    ({"name": "fedadam", "lr": 0.01}, 0.01),
    ({"name": "fedyogi", "lr": 0.01}, 0.01),
    # Adagrad: m = (1 - 0.9) d with beta_1 0.9 set, v = d^2 -> lr * 0.1
    ({"name": "fedadagrad", "lr": 0.01, "momentum": 0.9}, 0.001),
    # DiLoCo: g = -d, b = g; w - lr (g + mu b) = w + lr (1 + mu) d
    ({"name": "diloco", "lr": 0.7, "momentum": 0.9}, 0.7 * 1.9 * 0.2),
])
def test_server_optimizer_first_step_from_the_spec(server: dict[str, Any],
                                                   first_step: float) -> None:
    weights = {"w": torch.tensor([1.0, -1.0])}
    delta = {"w": torch.tensor([0.2, 0.2])}
    new, _ = apply_server(_spec(server=server), weights, delta, {})
    assert torch.allclose(new["w"], torch.tensor([1.0, -1.0]) + first_step, atol=1e-6)


def _train(store: BlobStore, **fields: Any) -> tuple[UpdateRef, dict[str, torch.Tensor]]:
    spec = _spec(**fields)
    blob = store.put(global_key("j", 0), dumps(initial_weights(spec)))
    ref = TrainRef("j", 1, 0, "cpu", spec.to_json(), blob)
    out = UpdateRef.from_json(run_training(ref.to_json(), store, "w"))
    assert out.status == "ok", out.error
    return out, loads(store.get(out.blob))


def test_fedprox_pulls_the_local_model_toward_the_global_one(store: BlobStore) -> None:
    _, plain = _train(store)
    _, prox = _train(store, prox_mu=5.0)
    assert update_norm(prox) < 0.9 * update_norm(plain)


def test_codecs_shrink_the_bytes_sent(store: BlobStore) -> None:
    none, _ = _train(store)
    fp16, _ = _train(store, compression={"codec": "fp16"})
    int8, _ = _train(store, compression={"codec": "int8"})
    assert 0.45 < fp16.bytes_up / none.bytes_up < 0.55
    assert 0.2 < int8.bytes_up / none.bytes_up < 0.33
    assert none.stats.raw_bytes == fp16.stats.raw_bytes == int8.stats.raw_bytes


def test_byzantine_clients_send_the_scaled_update(store: BlobStore,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The test fault (fedq/testing/faults.py): client 0 of a job named ``attack-*``
    sends its honest update times -10; the same job under another name is honest."""
    _, honest = _train(store, name="attack-b")
    monkeypatch.setenv(*faults.byzantine_env("^attack-", [0], -10.0).popitem())
    _, other = _train(store, name="t")
    _, flipped = _train(store, name="attack-b")
    name = "features.0.weight"
    assert torch.allclose(flipped[name], -10 * honest[name], atol=1e-5)
    assert torch.allclose(other[name], honest[name], atol=1e-6)


def test_a_zero_compute_job_trains_nothing(store: BlobStore,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The test fault the benchmarks run with (fedq/testing/faults.py): a job whose name
    matches sends a fixed small change of every weight and no training."""
    monkeypatch.setenv(faults.ZERO_COMPUTE, faults.ZERO_COMPUTE_JOBS)
    trained, _ = _train(store, name="t")
    assert trained.steps > 0
    ref, delta = _train(store, name="zero-compute-t")
    assert (ref.steps, ref.samples, ref.stats.seen) == (0, 1, 1)
    assert all(torch.all(v == 1e-4) for v in delta.values() if v.dtype.is_floating_point)


def test_a_malformed_fault_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.BYZANTINE, "0,1")
    with pytest.raises(ValueError, match="FEDQ_TEST_BYZANTINE='0,1': want REGEX:CLIENTS"):
        faults.byzantine_scale("attack-a", 0)
    monkeypatch.setenv(faults.SLOWDOWN, "0.5")
    with pytest.raises(ValueError, match="FEDQ_TEST_SLOWDOWN='0.5': want a number >= 1"):
        faults.slowdown()


def test_a_slowed_step_stops_sleeping_when_its_task_should_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slowed worker paused (SIGSTOP) inside a step counts the pause in the step's
    wall time: 100 s paused at 20x would be 1,900 s of sleep once resumed, before the
    loop looks at its revocation (tests/test_sites.py's paused worker). The sleep asks
    ``stop`` every 0.1 s and ends when it says something; without it the call below
    sleeps on (the thread is left behind and the join times out)."""
    import threading
    import time

    monkeypatch.setenv(faults.SLOWDOWN, "20")
    said: list[str | None] = [None]
    sleeper = threading.Thread(target=faults.slow_down, daemon=True,
                               args=(time.perf_counter() - 100, lambda: said[0]))
    sleeper.start()
    sleeper.join(0.5)
    assert sleeper.is_alive()  # nothing said: it sleeps its 1,900 s
    said[0] = "revoked"
    sleeper.join(5)
    assert not sleeper.is_alive()


def test_the_accumulator_is_kept_between_rounds_and_the_kept_model_survives_it(
        store: BlobStore, tmp_path: Path) -> None:
    """A commit that holds the whole model keeps the mean's memory from round to round
    (no round pays its page faults again), and the model it kept for the next round is
    not that memory: the next mean leaves it as it was."""
    from fedq.coordinator.commit import aggregate

    spec = _spec(eval_every=0, server={"name": "fedavg"})
    acc = Accumulator()
    current = {k: v.clone() for k, v in REFERENCE.items()}
    ones = {"w": torch.ones(4000), "b": torch.ones(3)}
    first = aggregate(spec, store, "j", 1, [_update(store, 0, ones)], current, "0" * 64,
                      None, Outcome(), tmp_path / "s1", acc)
    assert first is not None and acc.weights is not None
    memory = acc.weights["w"].data_ptr()
    kept = {k: v.clone() for k, v in first.weights.items()}
    assert torch.equal(kept["w"], torch.ones(4000))
    twos = {"w": torch.full((4000,), 2.0), "b": torch.full((3,), 2.0)}
    second = aggregate(spec, store, "j", 2, [_update(store, 1, twos)], first.weights,
                       first.blob.sha256, None, Outcome(), tmp_path / "s2", acc)
    assert second is not None and torch.equal(second.weights["w"], torch.full((4000,), 3.0))
    assert acc.weights is not None and acc.weights["w"].data_ptr() == memory
    for k in kept:  # the first round's model, still what round 2 stepped from
        assert torch.equal(first.weights[k], kept[k]), k
