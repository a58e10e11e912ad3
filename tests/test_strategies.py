"""Server optimizers, DP and compression on small hand-computed numbers
(Prepare / Execute / Assert)."""

from __future__ import annotations

import math

import pytest
import torch

from fedq.aggregate.compression import (
    decode,
    dequantize_int8,
    encode,
    maybe_decompress,
    quantize_int8,
    zstd_compress,
)
from fedq.aggregate.dp import add_gaussian_noise, epsilon
from fedq.aggregate.server import make_server
from fedq.weights import dumps, loads_with_meta, raw_size

W = {"w": torch.tensor([1.0]), "n": torch.tensor(4, dtype=torch.int64)}
D = {"w": torch.tensor([0.5]), "n": torch.tensor(1.0)}


def _two_steps(name: str, **opts: float) -> tuple[float, float]:
    o = make_server(name, opts)
    w1, s1 = o.step(W, D, {})
    w2, _ = o.step(w1, D, s1)
    assert int(w1["n"]) == 5 and w1["n"].dtype == torch.int64  # integer buffers: plain delta
    return float(w1["w"]), float(w2["w"])


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam", "diloco"])
def test_a_step_tensor_by_tensor_is_the_whole_step_and_pure(name: str) -> None:
    # Prepare: a model of float32 tensors and an integer buffer, a state from a first step
    from fedq.aggregate.fedavg import apply_delta

    g = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g),
               "n": torch.tensor(7, dtype=torch.int64)}
    delta = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g),
             "n": torch.tensor(1.0)}
    server = make_server(name, {})
    _, state = server.step(weights, delta, {})
    kept = {k: v.clone() for k, v in {**weights, **delta, **state}.items()}
    # Execute
    new, new_state = server.step(weights, delta, state)
    # Assert: the steps of every tensor added at once (apply_delta), bit for bit; the
    # inputs untouched
    steps, after = {"n": delta["n"]}, {}
    for k in ("a", "b"):
        mine = {s: state[f"{s}.{k}"] for s in ("m", "v") if f"{s}.{k}" in state}
        steps[k], got = server.update(delta[k], mine)
        after.update({f"{s}.{k}": v for s, v in got.items()})
    reference = apply_delta(weights, steps)
    assert list(new) == list(reference)
    assert all(torch.equal(new[k], reference[k]) and new[k].dtype == reference[k].dtype
               for k in reference)
    assert new_state.keys() == after.keys()
    assert all(torch.equal(new_state[k], after[k]) for k in after)
    assert all(torch.equal(v, kept[k]) for k, v in {**weights, **delta, **state}.items())


def test_fedavg() -> None:
    assert _two_steps("fedavg") == (1.5, 2.0)


def test_fedavgm() -> None:
    # v1 = 0.5 -> 1.5; v2 = 0.9 * 0.5 + 0.5 = 0.95 -> 2.45
    first, second = _two_steps("fedavgm")
    assert first == 1.5 and second == pytest.approx(2.45)


def test_fedadam() -> None:
    # m1 = 0.1 * 0.5 = 0.05; v1 = 0.01 * 0.25 = 0.0025; step = 0.1 * 0.05 / 0.05 = 0.1
    # m2 = 0.9 * 0.05 + 0.05 = 0.095; v2 = 0.99 * 0.0025 + 0.0025 = 0.004975
    first, second = _two_steps("fedadam")
    assert first == pytest.approx(1.1, abs=1e-6)
    assert second == pytest.approx(1.1 + 0.1 * 0.095 / math.sqrt(0.004975), abs=1e-6)


def test_fedadagrad() -> None:
    # no momentum: m = d; v1 = 0.25 -> step 0.1; v2 = 0.5 -> step 0.1 * 0.5 / sqrt(0.5)
    first, second = _two_steps("fedadagrad")
    assert first == pytest.approx(1.1, abs=1e-6)
    assert second == pytest.approx(1.1 + 0.1 * 0.5 / math.sqrt(0.5), abs=1e-6)


def test_fedyogi() -> None:
    # v1 = 0 - 0.01 * 0.25 * sign(0 - 0.25) = 0.0025 (as Adam); v2 = 0.0025 - 0.0025 *
    # sign(0.0025 - 0.25) = 0.005
    first, second = _two_steps("fedyogi")
    assert first == pytest.approx(1.1, abs=1e-6)
    assert second == pytest.approx(1.1 + 0.1 * 0.095 / math.sqrt(0.005), abs=1e-6)


def test_diloco_outer_nesterov() -> None:
    # g = -0.5; b1 = -0.5; w1 = 1 - 0.7 * (-0.5 + 0.9 * -0.5) = 1.665
    # b2 = 0.9 * -0.5 - 0.5 = -0.95; w2 = 1.665 - 0.7 * (-0.5 + 0.9 * -0.95) = 2.6135
    first, second = _two_steps("diloco")
    assert first == pytest.approx(1.665) and second == pytest.approx(2.6135)


def test_server_step_is_pure() -> None:
    state = {"m.w": torch.tensor([0.2])}
    make_server("fedavgm").step(W, D, state)
    assert torch.equal(state["m.w"], torch.tensor([0.2])) and float(W["w"]) == 1.0


def test_gaussian_noise_scale() -> None:
    mean = {"w": torch.zeros(200_000), "n": torch.tensor(3)}
    noisy = add_gaussian_noise(mean, clip_norm=2.0, noise_multiplier=1.5, clients_per_round=10,
                               generator=torch.Generator().manual_seed(0))
    assert float(noisy["w"].std()) == pytest.approx(1.5 * 2.0 / 10, rel=0.02)
    assert int(noisy["n"]) == 3


def test_epsilon_matches_stepping_the_accountant() -> None:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(10):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)
    assert epsilon(10, noise_multiplier=1.0, sample_rate=0.1, delta=1e-5) == pytest.approx(
        acc.get_epsilon(delta=1e-5))
    more = epsilon(20, noise_multiplier=1.0, sample_rate=0.1, delta=1e-5)
    noisier = epsilon(10, noise_multiplier=2.0, sample_rate=0.1, delta=1e-5)
    assert more > acc.get_epsilon(delta=1e-5) > noisier


def test_int8_round_trip_error_is_half_a_step() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    q, scales = quantize_int8(x, chunk=64)
    assert q.dtype == torch.int8 and scales.shape == (16,)
    back = dequantize_int8(q, scales, (1000,), 64)
    per = torch.repeat_interleave(scales, 64)[:1000]
    assert bool(((back - x).abs() <= per / 2 + 1e-7).all())
    # hand-computed: chunk [1, -2, 0.5] -> scale 2/127, codes [64, -127, 32]
    q, s = quantize_int8(torch.tensor([1.0, -2.0, 0.5]), chunk=8)
    assert q.tolist() == [64, -127, 32] and float(s[0]) == pytest.approx(2 / 127)


def test_codecs_round_trip_through_blob_bytes() -> None:
    gen = torch.Generator().manual_seed(3)
    update = {"a": torch.randn(300, 7, generator=gen), "n": torch.tensor(2.0)}
    shapes = {k: tuple(v.shape) for k, v in update.items()}
    sizes = {}
    for codec, tol in (("none", 0.0), ("fp16", 2e-3), ("int8", 2e-2)):
        stored, meta = encode(update, codec, chunk=256)
        data = dumps(stored, meta)
        sizes[codec] = len(data)
        for blob in (data, zstd_compress(data)):
            tensors, got_meta = loads_with_meta(maybe_decompress(blob, 1 << 20))
            back = decode(tensors, got_meta, shapes)
            assert set(back) == {"a", "n"} and back["a"].dtype == torch.float32
            assert float((back["a"] - update["a"]).abs().max()) <= tol * 3 + 1e-9
    assert raw_size(update) == 300 * 7 * 4 + 4
    assert sizes["fp16"] < 0.55 * sizes["none"] and sizes["int8"] < 0.30 * sizes["none"]


def test_zstd_passes_plain_bytes_through() -> None:
    assert maybe_decompress(b"plain", 10) == b"plain"
    assert maybe_decompress(zstd_compress(b"x" * 1000), 1000) == b"x" * 1000


def test_docs_name_every_declared_option() -> None:
    """docs/strategies.md's tables list each optimizer's and reducer's own options
    (their declarations, fedq/aggregate/plugin.py), and no other."""
    from pathlib import Path

    from fedq.aggregate.reducers import REDUCERS
    from fedq.aggregate.server import SERVER_OPTIMIZERS

    text = (Path(__file__).resolve().parents[1] / "docs" / "strategies.md").read_text()
    for table in (SERVER_OPTIMIZERS, REDUCERS):
        for name, cls in table.items():
            row = next(line for line in text.splitlines()
                       if line.startswith("|") and f"`{name}`" in line.split("|")[1])
            options = row.split("|")[3]
            declared = set(cls.Params.model_fields)
            named = {o for o in ("lr", "momentum", "beta2", "tau", "beta", "f", "m")
                     if f"`{o}`" in options}
            assert named == declared, (name, named, declared)
