"""A training worker's mixed precision: its GPU class's mode or float32, whichever
trains the model faster on that machine, measured on the first batch
(fedq.worker.loop.measured_amp; inference's use of it: tests/test_inference.py)."""

from __future__ import annotations

import time

import pytest
import torch

import fedq.worker.loop as loop
from fedq.spec import OptimizerSpec


class _Net(torch.nn.Module):
    """Batch norm and dropout, which a careless measurement would disturb, and 150 ms
    more a forward pass in one precision: under the CPU's autocast or without it (the
    CPU's bf16 is slow and noisy here while other tests run)."""

    def __init__(self, slow_under_amp: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                       torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 3))
        self.slow_under_amp, self.calls = slow_under_amp, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if torch.is_autocast_enabled("cpu") == self.slow_under_amp:
            time.sleep(0.15)
        return self.net(x)


def _train(model: torch.nn.Module) -> loop.LocalStats:
    x, y = torch.randn(48, 8, generator=torch.Generator().manual_seed(1)), torch.arange(48) % 3
    return loop.local_train(model, x, y, optimizer=OptimizerSpec(name="sgd", lr=0.1),
                            batch_size=16, epochs=1, steps=None, seed=2,
                            device=torch.device("cpu"))


@pytest.mark.parametrize("slow_under", ["bf16", "float32"])
def test_training_runs_in_the_mode_measured_faster_and_the_measuring_leaves_no_trace(
        slow_under: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU class's answer is faked (no GPU here); the CPU's bf16 autocast and the
    timing are real. The loop trains in the faster mode, measures once per model and
    batch shape, and, when float32 wins, ends with the very weights (batch-norm
    statistics included) of a loop that never measured."""
    monkeypatch.setattr(loop, "_AMP", {})
    monkeypatch.setattr(loop, "device_amp", lambda device: "bf16")
    model = _Net(slow_under_amp=slow_under == "bf16")
    stats = _train(model)
    assert stats.amp == ("off" if slow_under == "bf16" else "bf16")
    probes = 2 * (1 + loop.AMP_PROBE_RUNS)
    assert model.calls == probes + 3  # then the three steps of 16
    assert _train(model).amp == stats.amp and model.calls == probes + 6  # measured once
    if slow_under == "bf16":
        loop._AMP.clear()
        measured = _Net(slow_under_amp=True)
        _train(measured)
        assert measured.calls == probes + 3
        monkeypatch.setattr(loop, "device_amp", lambda device: "off")
        plain = _Net(slow_under_amp=True)
        assert _train(plain).amp == "off"
        for (name, a), b in zip(measured.state_dict().items(), plain.state_dict().values()):
            assert torch.equal(a, b), name


def test_nothing_is_measured_where_the_class_has_no_amp() -> None:
    model = _Net(slow_under_amp=False)
    assert _train(model).amp == "off" and model.calls == 3
