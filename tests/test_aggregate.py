"""FedAvg and update checks on small hand-computed tensors (Prepare / Execute / Assert)."""

from __future__ import annotations

import pytest
import torch

from fedq.aggregate import (
    Accumulator,
    apply_delta,
    check_update,
    fedavg,
    fednova_mean,
    weighted_mean,
)
from fedq.errors import UpdateRejected


def test_weighted_mean_hand_computed() -> None:
    # Prepare: two clients, 1 and 3 samples.
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([5.0, -2.0]), "b": torch.tensor([4.0])}
    # Execute
    mean = weighted_mean([(1.0, a), (3.0, b)])
    # Assert: (1*1 + 3*5)/4 = 4, (1*2 + 3*-2)/4 = -1, (0 + 12)/4 = 3
    assert torch.equal(mean["w"], torch.tensor([4.0, -1.0]))
    assert torch.equal(mean["b"], torch.tensor([3.0]))


def test_fedavg_adds_mean_delta_to_global() -> None:
    weights = {"w": torch.tensor([10.0, 10.0]), "n": torch.tensor(7, dtype=torch.int64)}
    d1 = {"w": torch.tensor([1.0, 0.0]), "n": torch.tensor(2.0)}
    d2 = {"w": torch.tensor([-1.0, 2.0]), "n": torch.tensor(3.0)}
    new = fedavg(weights, [(2.0, d1), (2.0, d2)])
    assert torch.equal(new["w"], torch.tensor([10.0, 11.0]))
    # integer buffer: 7 + 2.5 rounds to 10 (round half to even gives 9.5 -> 10)
    assert new["n"].dtype == torch.int64 and int(new["n"]) == 10


def test_streaming_mean_equals_plain_weighted_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    updates = [{"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
               for _ in range(7)]
    weights = [float(w) for w in torch.randint(1, 100, (7,), generator=gen)]
    consumed = []

    def stream():  # one update at a time, as the coordinator reads them
        for w, u in zip(weights, updates):
            consumed.append(w)
            yield w, u

    streamed = weighted_mean(stream())
    total = sum(weights)
    for name in ("a", "b"):
        plain = sum(w * u[name] for w, u in zip(weights, updates)) / total
        torch.testing.assert_close(streamed[name], plain, rtol=1e-6, atol=1e-6)
    assert consumed == weights


def test_weighted_mean_refuses_empty_and_zero_weights() -> None:
    with pytest.raises(ValueError, match="no updates"):
        weighted_mean([])
    with pytest.raises(ValueError, match="sum to zero"):
        weighted_mean([(0.0, {"w": torch.ones(1)})])


def test_accumulator_reuses_its_memory_while_the_shapes_fit() -> None:
    # Prepare: round 1 and round 2 of the same model; then a model of another shape.
    acc = Accumulator()
    r1 = [(1.0, {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}),
          (3.0, {"w": torch.tensor([5.0, -2.0]), "n": torch.tensor(7)})]
    r2 = [(2.0, {"w": torch.tensor([2.0, 2.0]), "n": torch.tensor(1)}),
          (2.0, {"w": torch.tensor([0.0, 4.0]), "n": torch.tensor(3)})]
    # Execute
    first = acc.mean(r1)
    first_w, first_ptr = first["w"].clone(), first["w"].data_ptr()
    second = acc.mean(r2)
    # Assert: hand-computed means; the second wrote into the first's memory.
    assert torch.equal(first_w, torch.tensor([4.0, -1.0]))
    assert torch.equal(second["w"], torch.tensor([1.0, 3.0]))
    assert second["n"].dtype == torch.float32 and float(second["n"]) == 2.0
    assert second["w"].data_ptr() == first_ptr
    other = acc.mean([(1.0, {"w": torch.ones(3)})])  # another shape: new memory
    assert torch.equal(other["w"], torch.ones(3)) and other["w"].data_ptr() != first_ptr
    with pytest.raises(ValueError, match="sum to zero"):  # a failed mean keeps nothing
        acc.mean([(0.0, {"w": torch.ones(3)})])
    assert acc.weights is None


def test_mean_adds_blob_updates_in_one_call_per_update() -> None:
    # Prepare: updates as finalize reads them (parsed from safetensors blobs, both the
    # bytearray the Redis store reads into and bytes), several tensors each.
    from fedq.aggregate.fedavg import _breaks
    from fedq.weights import dumps, loads

    gen = torch.Generator().manual_seed(0)
    raw = [{"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen),
            "c": torch.randn(2, 2, 2, generator=gen)} for _ in range(3)]
    parsed = [loads(bytearray(dumps(u))) for u in raw[:2]] + [loads(dumps(raw[2]))]
    # Execute
    acc = Accumulator()
    mean = acc.mean(zip([1.0, 2.0, 3.0], parsed))
    # Assert: each update lies back to back in one buffer, so it is added with one call
    # (no break between its tensors); the accumulator is one buffer too; the result is
    # the per-tensor mean.
    assert all(_breaks(list(u.values())) == set() for u in parsed)
    assert _breaks(list(mean.values())) == set()
    for name in raw[0]:
        expected = sum(w * u[name] for w, u in zip([1.0, 2.0, 3.0], raw)) / 6.0
        assert torch.allclose(mean[name], expected, atol=1e-6)


def test_mean_of_updates_laid_out_any_way_equals_per_tensor_mean() -> None:
    # Prepare: tensors back to back in one buffer but in separate storages (their
    # memory is adjacent: a span over both would be out of bounds), a transposed
    # (non-contiguous) tensor, float64 and integer tensors, and a mix across updates.
    buf = bytearray(torch.arange(8, dtype=torch.float32).numpy().tobytes())
    first = torch.frombuffer(buf, dtype=torch.float32, count=4, offset=0)
    second = torch.frombuffer(buf, dtype=torch.float32, count=4, offset=16)
    assert second.data_ptr() == first.data_ptr() + 16
    updates = [
        {"a": first, "b": second, "t": torch.ones(2, 3).t(),
         "d": torch.ones(2, dtype=torch.float64), "n": torch.tensor(3)},
        {"a": torch.ones(4), "b": torch.full((4,), 2.0), "t": torch.arange(6.0).view(3, 2),
         "d": torch.full((2,), 4.0, dtype=torch.float64), "n": torch.tensor(5)},
    ]
    # Execute
    mean = weighted_mean([(1.0, u) for u in updates])
    again = weighted_mean([(1.0, u) for u in reversed(updates)], out=mean)
    # Assert: the per-tensor mean, in both orders, in the accumulator's dtypes.
    for result in (mean, again):
        for name in updates[0]:
            expected = (updates[0][name].double() + updates[1][name].double()) / 2
            assert torch.allclose(result[name].double(), expected), name
        assert result["d"].dtype == torch.float64 and result["n"].dtype == torch.float32


def test_mean_with_the_expected_total_skips_the_division_pass_only_when_it_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: three updates, weights 1, 2, 3; count division calls.
    gen = torch.Generator().manual_seed(1)
    updates = [{"a": torch.randn(4, generator=gen), "b": torch.randn(3, generator=gen)}
               for _ in range(3)]
    pairs = list(zip([1.0, 2.0, 3.0], updates))
    want = weighted_mean(pairs)
    want = {k: v.clone() for k, v in want.items()}
    divisions = []
    real = torch.Tensor.div_
    monkeypatch.setattr(torch.Tensor, "div_",
                        lambda self, *a, **kw: divisions.append(1) or real(self, *a, **kw))
    # Execute: the total as expected; then one update refused on the way (sum 4, not 6).
    acc = Accumulator()
    acc.expect(6.0)
    held = {k: v.clone() for k, v in acc.mean(pairs).items()}
    skipped = len(divisions)
    acc.expect(6.0)
    short = acc.mean(pairs[:1] + pairs[2:])
    # Assert: the same mean either way; no division pass when the total held, one pass
    # (one call over the one buffer) when it did not.
    assert skipped == 0 and len(divisions) == 1
    for name in want:
        assert torch.allclose(held[name], want[name], atol=1e-6)
        expected = (updates[0][name] + 3 * updates[2][name]) / 4
        assert torch.allclose(short[name], expected, atol=1e-6)
    assert acc.expected is None  # used once


def test_apply_delta_keeps_dtype() -> None:
    new = apply_delta({"h": torch.ones(2, dtype=torch.float16)}, {"h": torch.full((2,), 0.5)})
    assert new["h"].dtype == torch.float16
    assert torch.equal(new["h"], torch.full((2,), 1.5, dtype=torch.float16))


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        ({"w": torch.tensor([float("nan"), 0.0])}, "non-finite"),
        ({"w": torch.tensor([float("inf"), 0.0])}, "non-finite"),
        ({"w": torch.zeros(3)}, "shape"),
        ({"w": torch.zeros(2, dtype=torch.float64)}, "dtype"),
        ({}, "missing tensor 'w'"),
        ({"w": torch.zeros(2), "x": torch.zeros(1)}, "unexpected tensor 'x'"),
        ({"w": torch.tensor([3.0, 4.0])}, "norm 5 exceeds"),
    ],
)
def test_check_update_rejects(update: dict, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason):
        check_update(update, {"w": torch.zeros(2)}, max_norm=4.0)


def test_check_update_returns_norm() -> None:
    assert check_update({"w": torch.tensor([3.0, 4.0])}, {"w": torch.zeros(2)}) == 5.0


def test_fednova_hand_computed() -> None:
    # Prepare: equal weights; client a took 1 step (delta 2), client b took 4 steps (delta 4).
    a = {"w": torch.tensor([2.0])}
    b = {"w": torch.tensor([4.0])}
    # Execute
    out = fednova_mean([(1.0, 1, a), (1.0, 4, b)])
    # Assert: per-step 2 and 1, mean 1.5; tau_eff = (1 + 4) / 2 = 2.5 -> 3.75
    assert torch.allclose(out["w"], torch.tensor([3.75]))
    # FedAvg would give 3.0: the one-step client drags the average back.
    assert torch.equal(weighted_mean([(1.0, a), (1.0, b)])["w"], torch.tensor([3.0]))


def test_fednova_equals_fedavg_for_equal_steps() -> None:
    gen = torch.Generator().manual_seed(2)
    ups = [(float(i + 1), 5, {"w": torch.randn(4, generator=gen)}) for i in range(3)]
    torch.testing.assert_close(fednova_mean(ups)["w"],
                               weighted_mean((w, u) for w, _, u in ups)["w"])
