"""Streaming DiLoCo: fragments, the server's step on one fragment, the model sent down
as a step of that fragment, each client's kept replica, and a real job whose rounds
each synchronise one fragment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

from fedq.aggregate.compression import Q_SUFFIX
from fedq.aggregate.downlink import apply_step, compress_step, content_digest
from fedq.aggregate.server import make_server
from fedq.aggregate.streaming import fragment_names, fragments, synced_between
from fedq.blobs import global_key, open_store
from fedq.cli.output import describe
from fedq.db import ClientUpdate, Round, session_scope
from fedq.errors import UpdateRejected
from fedq.models import build_model
from fedq.protocol.training import TrainRef, UpdateRef
from fedq.spec import SpecError, parse_spec
from fedq.testing.cluster import Cluster, base_env
from fedq.weights import dumps, loads, loads_with_meta, raw_size
from fedq.worker import replica
from fedq.worker.update import run_training

GPT = {"n_layer": 4, "n_head": 2, "n_embd": 32}


def _gpt_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in build_model("gpt", (16,), 256, **GPT).state_dict().items()}


def test_fragments_cover_the_model_once_keep_tied_weights_together_and_balance() -> None:
    weights = _gpt_weights()
    for count in (2, 3, 4):
        parts = fragments(weights, count)
        names = [n for part in parts for n in part]
        assert sorted(names) == sorted(weights) and len(names) == len(set(names))
        # the tied embedding and output head are one tensor in the model: one fragment
        assert any({"tok.weight", "head.weight"} <= set(p) for p in parts)
        # whole blocks: every tensor of block i in the same fragment
        for i in range(GPT["n_layer"]):
            assert sum(any(n.startswith(f"blocks.{i}.") for n in p) for p in parts) == 1
        sizes = [raw_size({n: weights[n] for n in p}) for p in parts]
        if count < 4:  # 5 groups (4 blocks, the rest) in 4 fragments cannot balance
            assert max(sizes) < 1.6 * min(sizes), sizes
        # the same fragments whatever order the tensors come in (safetensors sorts them)
        shuffled = dict(sorted(weights.items(), reverse=True))
        assert [set(p) for p in fragments(shuffled, count)] == [set(p) for p in parts]
    # fewer blocks than fragments: per tensor
    small = {"a.weight": torch.zeros(4), "b.weight": torch.zeros(8), "c.bias": torch.zeros(2)}
    assert sorted(map(len, fragments(small, 3))) == [1, 1, 1]
    with pytest.raises(ValueError, match="fewer than 4 fragments"):
        fragments(small, 4)
    assert synced_between(3, 5, 4) == {2, 3, 0} and synced_between(1, 9, 4) == {0, 1, 2, 3}
    assert synced_between(4, 3, 4) == set()


def test_the_outer_step_on_one_fragment_leaves_the_rest_and_its_momentum() -> None:
    weights = _gpt_weights()
    server = make_server("diloco")
    full = {k: torch.randn_like(v) * 0.01 for k, v in weights.items()}
    w1, state = server.step(weights, full, {})
    part = fragment_names(weights, 2, 2)
    delta = {k: full[k] for k in part}
    w2, state2 = server.step(w1, delta, state)
    for name in weights:
        if name in part:
            # as the full step computes it for these tensors
            w_full, s_full = server.step(w1, full, state)
            assert torch.equal(w2[name], w_full[name])
            assert torch.equal(state2[f"m.{name}"], s_full[f"m.{name}"])
        else:
            assert torch.equal(w2[name], w1[name])
            assert torch.equal(state2[f"m.{name}"], state[f"m.{name}"])
    assert set(state2) == set(state)


def test_the_model_goes_down_as_a_step_of_the_synchronised_fragment_alone() -> None:
    weights = _gpt_weights()
    server = make_server("diloco")
    part = fragment_names(weights, 1, 2)
    new, _ = server.step(weights, {k: torch.full_like(weights[k], 0.01) for k in part}, {})
    residual = {k: torch.full_like(v, 1e-4) for k, v in weights.items()}
    published, left, stored, meta = compress_step(weights, new, residual, 256)
    assert {k[:-len(Q_SUFFIX)] for k in stored if k.endswith(Q_SUFFIX)} == set(part)
    assert raw_size(stored) < 0.4 * raw_size(weights)
    for name in weights:  # the other fragment: unchanged, its residual kept for later
        if name not in part:
            assert published[name] is weights[name] and left[name] is residual[name]
    assert content_digest(apply_step(weights, stored, meta)) == content_digest(published)
    dropped = {k: v for k, v in stored.items() if not k.startswith(part[-1] + ".")}
    with pytest.raises(UpdateRejected, match="content hash"):
        apply_step(weights, dropped, meta)
    # without the int8 downlink: the fragment's new values whole, the model exactly
    published, left, stored, meta = compress_step(weights, new, {}, 256, quantize=False)
    assert set(stored) == set(part) and left == {} and meta["fedq.codec"] == "part"
    rebuilt = apply_step(weights, stored, meta)
    assert all(torch.equal(rebuilt[k], new[k]) for k in new)


def test_a_replica_takes_only_the_fragments_synchronised_since_it_was_saved(
        tmp_path: Path) -> None:
    weights = _gpt_weights()
    path = tmp_path / "r.safetensors"
    parts = fragments(weights, 3)
    start, kept = replica.start_from(weights, path, 2, 3)  # no file: the global model
    assert kept == 0 and all(torch.equal(start[k], weights[k]) for k in weights)
    local = {k: v + 1.0 for k, v in weights.items()}
    replica.save(local, path, 4)
    # saved after round 4 (fragment 0 synced then), now round 5: fragment 0 from global
    start, kept = replica.start_from(weights, path, 5, 3)
    assert kept == 2
    for i, part in enumerate(parts):
        for n in part:
            assert torch.equal(start[n], weights[n] if i == 0 else local[n]), (i, n)
    # round 6: rounds 4 and 5 synchronised fragments 0 and 1
    start, kept = replica.start_from(weights, path, 6, 3)
    assert kept == 1 and all(torch.equal(start[n], local[n]) for n in parts[2])
    assert all(torch.equal(start[n], weights[n]) for n in parts[0] + parts[1])
    # F rounds on: every fragment synchronised since, a fresh replica; a retried round
    # (saved in this round or later) does not train on from its own result
    for number in (7, 4, 3):
        assert replica.start_from(weights, path, number, 3)[1] == 0
    path.write_bytes(b"not safetensors")
    assert replica.start_from(weights, path, 5, 3)[1] == 0


def test_mixing_merges_a_synchronised_fragment_with_the_local_one(tmp_path: Path) -> None:
    weights = _gpt_weights()
    path = tmp_path / "r.safetensors"
    parts = fragments(weights, 3)
    local = {k: v + 1.0 if v.dtype.is_floating_point else v for k, v in weights.items()}
    replica.save(local, path, 4)
    start, kept = replica.start_from(weights, path, 5, 3, mixing=0.25)
    assert kept == 2
    for n in parts[0]:  # synchronised in round 4: 0.25 x local + 0.75 x global
        torch.testing.assert_close(start[n], weights[n] + 0.25, atol=1e-6, rtol=0)
    for n in parts[1] + parts[2]:  # not synchronised: the replica's own values
        assert torch.equal(start[n], local[n])
    # a fresh replica (no file, or F rounds old) is the global model, unmixed
    for number in (2, 7):
        start, kept = replica.start_from(weights, path if number == 7 else tmp_path / "x",
                                         number, 3, mixing=0.25)
        assert kept == 0 and all(torch.equal(start[k], weights[k]) for k in weights)


def _spec(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt", "model_args": GPT, "dataset": "shakespeare",
            "dataset_args": {"block_size": 16, "max_works": 3, "eval_windows": 64},
            "num_clients": 2, "clients_per_round": 2, "rounds": 4, "local_steps": 3,
            "batch_size": 8,
            "optimizer": {"name": "sgd", "lr": 0.5}, "server": {"name": "diloco"},
            "streaming": {"fragments": 2}, **fields}


def test_streaming_spec_rules_and_description() -> None:
    spec = parse_spec(_spec())
    assert "streaming: 1 of 2 fragments per round" in describe(spec)
    with pytest.raises(SpecError, match="streaming: needs synchronous rounds"):
        parse_spec(_spec(aggregation={"mode": "buffered", "buffer": 1}))
    with pytest.raises(SpecError, match="fragments"):
        parse_spec(_spec(streaming={"fragments": 1}))
    with pytest.raises(SpecError, match="mixing"):
        parse_spec(_spec(streaming={"fragments": 2, "mixing": 1.0}))
    assert "mixing 0.5" in describe(parse_spec(_spec(streaming={"fragments": 2,
                                                                "mixing": 0.5})))


def test_a_worker_trains_on_from_its_replica_and_sends_one_fragment(
        tmp_path: Path, worker_home: Path) -> None:
    store = open_store(str(tmp_path / "blobs"))
    spec = parse_spec(_spec())
    model0 = _gpt_weights()
    path = replica.replica_path(worker_home, "j", 1)

    def train(number: int, weights: dict[str, torch.Tensor], spec_json: dict[str, Any]
              ) -> dict[str, torch.Tensor]:
        blob = store.put(global_key("j", number - 1), dumps(weights))
        out = UpdateRef.from_json(run_training(
            TrainRef("j", number, 1, "cpu", spec_json, blob).to_json(), store, "w"))
        assert out.status == "ok", out.error
        assert out.key is not None
        return loads(store._read(out.key))

    # round 1 synchronises fragment 0: the update names it alone, at its size
    first = train(1, model0, spec.to_json())
    part0, part1 = fragment_names(model0, 1, 2), fragment_names(model0, 2, 2)
    assert set(first) == set(part0)
    kept1, meta = loads_with_meta(path.read_bytes())
    assert meta["round"] == "1" and set(kept1) == set(model0)
    assert not torch.equal(kept1[part1[0]], model0[part1[0]])  # trained, kept
    # the server moved fragment 0; round 2 (fragment 1) with a step size so small
    # that training changes nothing: its update is what round 1 trained fragment 1 by
    model1 = {k: v + 0.01 if k in part0 else v for k, v in model0.items()}
    still = {**spec.to_json(), "optimizer": {"name": "sgd", "lr": 1e-12}}
    second = train(2, model1, still)
    assert set(second) == set(part1)
    for n in part1:
        torch.testing.assert_close(second[n], kept1[n] - model0[n], atol=1e-6, rtol=0)
    # and its replica took fragment 0 from the new global model
    kept2, meta = loads_with_meta(path.read_bytes())
    assert meta["round"] == "2"
    for n in part0:
        torch.testing.assert_close(kept2[n], model1[n], atol=1e-6, rtol=0)
    # with mixing 0.5, round 3 starts fragment 1 (synchronised in round 2) halfway
    # between the replica's value and the global one
    mixed = {**spec.to_json(), "optimizer": {"name": "sgd", "lr": 1e-12},
             "streaming": {"fragments": 2, "mixing": 0.5}}
    model2 = {k: v + 0.02 if k in part1 else v for k, v in model1.items()}
    train(3, model2, mixed)
    kept3, meta = loads_with_meta(path.read_bytes())
    assert meta["round"] == "3"
    for n in part1:
        torch.testing.assert_close(kept3[n], 0.5 * kept2[n] + 0.5 * model2[n], atol=1e-6,
                                   rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("downlink", ["none", "int8"])
def test_a_streaming_job_synchronises_one_fragment_per_round(tmp_path: Path,
                                                              downlink: str) -> None:
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(a=["cpu"], b=["cpu"], control=["control"])
    job, view = cluster.run(_spec(rounds=4, queues={"cpu": 2},
                                  compression={"downlink": downlink}))
    assert view.status == "completed", view.error
    store = open_store(cluster.settings.blob_url)
    models = {n: loads(store._read(global_key(job, n))) for n in range(5)}
    full = raw_size(models[0])
    with session_scope(cluster.settings.database_url) as s:
        rows = s.scalars(select(ClientUpdate).where(ClientUpdate.job_id == job)).all()
        rounds = {r.number: r for r in s.scalars(select(Round).where(Round.job_id == job))}
    assert len(rows) == 8 and all(r.status == "ok" for r in rows)
    for n in range(1, 5):
        part = set(fragment_names(models[0], n, 2))
        changed = {k for k in models[0] if not torch.equal(models[n][k], models[n - 1][k])}
        assert changed and changed <= part, (n, sorted(changed - part))
        # each update carries one fragment: about half the model
        ups = [r.bytes_up for r in rows if r.round_number == n]
        assert all(u < 0.65 * full for u in ups), (ups, full)
        assert rounds[n].bytes_up == sum(ups)
    # a worker holding the previous model downloads one fragment: whole (fp32, about
    # half the model) or as an int8 step (about an eighth)
    downs = [r.bytes_down for r in rows if r.round_number > 1]
    assert sum(1 for b in downs if 0 < b < (0.2 if downlink == "int8" else 0.65) * full) \
        >= 2, (downs, full)
    kept = list((tmp_path / "home").rglob("c*.model.safetensors"))
    assert len(kept) == 2 and all(loads_with_meta(p.read_bytes())[1]["round"] == "4"
                                  for p in kept)
