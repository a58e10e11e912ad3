"""Language models: the GPT (shapes, causal mask, tying), the byte tokenizer, the
Shakespeare/Milton data set and its splits, the inner lr schedule, DiLoCo's inner
state across rounds and a worker restart, and a whole job with `fedq generate`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from fedq.blobs import global_key, open_store
from fedq.coordinator.evaluation import initial_weights
from fedq.data import client_indices, load_dataset
from fedq.data import text as text_data
from fedq.models import build_model
from fedq.observe.plots import close, figures
from fedq.process import PROCESS
from fedq.protocol.training import TrainRef, UpdateRef
from fedq.spec import OptimizerSpec, parse_spec
from fedq.testing.cluster import Cluster, base_env
from fedq.weights import dumps, loads, loads_with_meta
from fedq.worker import inner
from fedq.worker.loop import lr_at
from fedq.worker.update import run_training

SMALL_TEXT = {"block_size": 32, "max_works": 3, "eval_windows": 64}
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32}


def test_gpt_shapes_size_and_tied_head() -> None:
    model = build_model("gpt", (64,), 256)
    logits = model(torch.randint(0, 256, (2, 64)))
    assert logits.shape == (2, 64, 256)  # (B, T, vocab)
    params = sum(p.numel() for p in model.parameters())  # the tied head counts once
    assert 0.7e6 < params < 1.0e6, params
    assert model.head.weight is model.tok.weight  # type: ignore[union-attr]
    big = build_model("gpt", (256,), 256, n_layer=6, n_head=6, n_embd=384)
    assert 10e6 < sum(p.numel() for p in big.parameters()) < 12e6


def test_a_future_token_does_not_change_an_earlier_logit() -> None:
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256, **TINY_GPT).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10] = (x[0, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[0, :10], b[0, :10])  # positions before the change: identical
    assert not torch.allclose(a[0, 10:], b[0, 10:])  # at and after it: changed


def test_a_batch_of_prompts_generates_what_each_prompt_alone_does() -> None:
    """GPT.generate_batch: prompts of different lengths, one longer than the context
    (each row's own window), top-k and temperature; each row's tokens are generate()'s
    for that prompt and seed, token for token."""
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256, **TINY_GPT).eval()
    rows = [torch.randint(0, 256, (n,)) for n in (1, 5, 16, 3, 21, 5)]
    got = model.generate_batch(rows, 24, temperature=0.9, top_k=20,
                               generators=[torch.Generator().manual_seed(7 + b)
                                           for b in range(len(rows))])
    for b, row in enumerate(rows):
        want = model.generate(row[None, :], 24, temperature=0.9, top_k=20,
                              generator=torch.Generator().manual_seed(7 + b))
        assert torch.equal(got[b], want[0, len(row):]), b


def test_a_batch_mixing_lengths_temperatures_and_cuts_generates_each_rows_own() -> None:
    """GPT.generate_batch with one setting per row: each row's tokens are generate()'s
    with that row's token count, temperature and top-k, and a row that has its tokens
    leaves the forward passes (the later ones see fewer rows)."""
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256, **TINY_GPT).eval()
    rows = [torch.randint(0, 256, (n,)) for n in (1, 5, 16, 3, 21)]
    tokens, temps, ks = [24, 3, 30, 1, 12], [0.9, 1.5, 0.5, 1.0, 2.0], [20, None, 1, 256, 5]
    widths = [0]  # the rows the output head saw in each step (cached and whole windows)
    hook = model.head.register_forward_hook(
        lambda _m, args, _out: widths.__setitem__(-1, widths[-1] + args[0].shape[0]))
    got = model.generate_batch(rows, tokens, temperature=temps, top_k=ks,
                               generators=[torch.Generator().manual_seed(7 + b)
                                           for b in range(len(rows))],
                               on_token=lambda _new: widths.append(0))
    hook.remove()
    assert widths[:-1] == [5] + [4] * 2 + [3] * 9 + [2] * 12 + [1] * 6
    for b, row in enumerate(rows):
        want = model.generate(row[None, :], tokens[b], temperature=temps[b], top_k=ks[b],
                              generator=torch.Generator().manual_seed(7 + b))
        assert torch.equal(got[b], want[0, len(row):]), b
    with pytest.raises(ValueError, match="2 settings for 5 rows"):
        model.generate_batch(rows, [1, 2], generators=[torch.Generator()] * 5)


def test_the_key_value_cache_reads_each_position_once_and_changes_no_token() -> None:
    """generate_batch with its cache: the prompts are read once and each later token at
    one position (the attention's input holds one token a row), until a row outgrows
    the context and is read whole again; the tokens are the ones without the cache
    (which re-reads every window), token for token on the CPU."""
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256, **TINY_GPT).eval()
    rows = [torch.randint(0, 256, (n,)) for n in (1, 5, 16, 3, 21, 9)]
    tokens = [30, 3, 8, 12, 4, 7]  # rows 0 and 5 outgrow the 16-byte context
    seen: list[tuple[int, int]] = []  # (rows, positions) the first attention took in
    hook = model.blocks[0].attn.register_forward_hook(
        lambda _m, args, _out: seen.append(tuple(args[0].shape[:2])))

    def run(cache: bool) -> list[torch.Tensor]:
        seen.clear()
        return model.generate_batch(rows, tokens, temperature=0.9, top_k=20, cache=cache,
                                    generators=[torch.Generator().manual_seed(3 + b)
                                                for b in range(len(rows))])

    without = run(False)
    work_without = sum(r * t for r, t in seen)
    with_cache = run(True)
    hook.remove()
    for b in range(len(rows)):
        assert torch.equal(with_cache[b], without[b]), b
    # step 1: the 5 prompts that fit read once, the 21 bytes whole; step 2: one new
    # position for each cached row, whole windows for the 16-byte one that outgrew it
    assert seen[:4] == [(5, 16), (1, 16), (4, 1), (2, 16)]
    assert sum(r * t for r, t in seen) < 0.6 * work_without  # 514 of 990 positions


def test_byte_tokenizer_round_trip() -> None:
    for text in ["To be, or not to be", "Thy ſweet — é\n\t", ""]:
        ids = text_data.encode(text)
        assert ids.dtype == torch.int64 and all(0 <= int(i) < 256 for i in ids)
        assert text_data.decode(ids) == text


def test_dataset_split_holds_out_the_end_of_every_work() -> None:
    ds = load_dataset("shakespeare", None, SMALL_TEXT)
    works = text_data.works(("shakespeare", "milton"))[:3]
    assert ds.is_text and ds.num_classes == 256 and ds.input_shape == (32,)
    assert torch.equal(ds.y_train[:, :-1], ds.x_train[:, 1:])  # targets: next bytes
    train_rows = {bytes(r.tolist()) for r in ds.x_train.to(torch.uint8)}
    held_out = {bytes(r.tolist()) for r in ds.x_test.to(torch.uint8)}
    assert not train_rows & held_out
    # the held-out text is the last 10% of each work
    total = sum(len(w) for _, w in works)
    assert 0.85 < ds.x_train.numel() / total < 0.92
    first_work_tail = works[0][1][int(len(works[0][1]) * 0.9):]
    assert bytes(ds.x_test[0].tolist()) == first_work_tail[:32] and len(ds.x_test) == 64
    assert ds.groups is not None and set(ds.groups.tolist()) == {0, 1, 2}


def test_by_group_partition_gives_each_client_whole_works() -> None:
    ds = load_dataset("shakespeare", None, SMALL_TEXT)
    spec = parse_spec({"model": "gpt", "dataset": "shakespeare", "dataset_args": SMALL_TEXT,
                       "num_clients": 3, "clients_per_round": 3, "rounds": 1,
                       "local_steps": 1, "partition": {"kind": "by_group"}})
    groups = ds.partition_labels()
    owned = [set(groups[client_indices(groups, spec.partition, 3, c, 0)].tolist())
             for c in range(3)]
    assert all(len(o) == 1 for o in owned) and set.union(*owned) == {0, 1, 2}
    iid = [client_indices(groups, parse_spec({**spec.to_json(), "partition": {"kind": "iid"}}
                                             ).partition, 3, c, 0) for c in range(3)]
    assert all(len(set(groups[i].tolist())) == 3 for i in iid)  # IID: every work everywhere


def test_inner_lr_schedule() -> None:
    opt = OptimizerSpec(name="adamw", lr=1e-3, warmup_steps=10, schedule="cosine",
                        final_lr_fraction=0.1)
    assert math.isclose(lr_at(0, opt, 110), 1e-4)  # warm-up: (0 + 1) / 10 of lr
    assert math.isclose(lr_at(9, opt, 110), 1e-3)
    assert math.isclose(lr_at(60, opt, 110), 1e-3 * (0.1 + 0.9 * 0.5))  # halfway
    assert math.isclose(lr_at(110, opt, 110), 1e-4)  # the end: final_lr_fraction
    assert lr_at(500, OptimizerSpec(lr=0.05), None) == 0.05


def _lm_spec(**fields: Any) -> dict[str, Any]:
    return {"model": "gpt", "model_args": TINY_GPT, "dataset": "shakespeare",
            "dataset_args": SMALL_TEXT, "num_clients": 2, "clients_per_round": 2,
            "rounds": 3, "local_steps": 4, "batch_size": 8,
            "optimizer": {"name": "adamw", "lr": 3e-3, "beta2": 0.95, "warmup_steps": 2,
                          "schedule": "cosine", "grad_clip": 1.0, "keep_state": True},
            "server": {"name": "diloco"}, "compression": {"codec": "int8"}, **fields}


def test_diloco_inner_state_survives_rounds_and_a_worker_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDQ_HOME", str(tmp_path / "home"))
    from fedq.settings import get_settings

    get_settings.cache_clear()
    PROCESS.clear()
    store = open_store(str(tmp_path / "blobs"))
    spec = parse_spec(_lm_spec())
    blob = store.put(global_key("j", 0), dumps(initial_weights(spec)))
    path = inner.state_path(tmp_path / "home", "j", 1)

    def train(round_number: int) -> UpdateRef:
        ref = TrainRef("j", round_number, 1, "cpu", spec.to_json(), blob)
        out = UpdateRef.from_json(run_training(ref.to_json(), store, "w"))
        assert out.status == "ok", out.error
        return out

    first = train(1)
    assert first.stats.tokens == 4 * 8 * 32  # steps x batch x context
    saved, meta = loads_with_meta(path.read_bytes())
    assert meta["step"] == "4" and any(k.endswith(".exp_avg_sq") for k in saved)
    train(2)
    assert loads_with_meta(path.read_bytes())[1]["step"] == "8"
    PROCESS.clear()  # a restarted worker process: nothing in memory, the file on disk
    get_settings.cache_clear()
    train(3)
    after, meta = loads_with_meta(path.read_bytes())
    assert meta["step"] == "12"
    # the moments went on from the kept ones (a fresh AdamW would restart them at 0)
    steps = [v for k, v in after.items() if k.endswith(".step")]
    assert steps and all(float(s) == 12 for s in steps)
    get_settings.cache_clear()


def test_time_budget_schedule_follows_the_job_clock(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``time_budget_s`` the cosine follows the job's rounds, not each client's step
    count: the last round decays to the floor whatever steps the client took (a slow
    worker is not left at a high lr while the fast ones decay)."""
    monkeypatch.setenv("FEDQ_HOME", str(tmp_path / "home"))
    from fedq.settings import get_settings

    get_settings.cache_clear()
    fields = {"rounds": 2, "compression": {"codec": "none"},
              "optimizer": {"name": "adamw", "lr": 3e-3, "schedule": "cosine",
                            "schedule_steps": 1000, "final_lr_fraction": 0.0}}
    timed = parse_spec(_lm_spec(**fields, time_budget_s=600))  # the steps end each round
    plain = parse_spec(_lm_spec(**fields))
    assert timed.schedule_window(1) == (0.0, 0.5) and timed.schedule_window(2) == (0.5, 1.0)
    assert plain.schedule_window(2) is None
    # a cosine needs no step horizon when the clock gives it
    assert parse_spec(_lm_spec(local_steps=None, local_epochs=1, time_budget_s=5))
    store = open_store(str(tmp_path / "blobs"))
    blob = store.put(global_key("j", 0), dumps(initial_weights(plain)))

    def update(spec: Any) -> float:
        ref = TrainRef("j", 2, 1, "cpu", spec.to_json(), blob)
        out = UpdateRef.from_json(run_training(ref.to_json(), store, "w"))
        assert out.status == "ok", out.error
        return float(torch.cat([v.flatten() for v in loads(store.get(out.blob)).values()])
                     .norm())

    # round 2 of 2 by the clock: the lr falls from half to zero over its steps; by the
    # step count (4 + 4 of 1000) it stays near the peak, and the update is larger
    assert update(timed) < 0.8 * update(plain)
    get_settings.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_gpt_job_end_to_end_and_generate(tmp_path: Path, backend: str,
                                         request: pytest.FixtureRequest) -> None:
    urls: dict[str, str] = {}
    if backend == "redis":
        redis_db = request.getfixturevalue("redis_db")
        urls = {"FEDQ_BROKER_URL": redis_db, "FEDQ_RESULT_BACKEND": redis_db,
                "FEDQ_DATABASE_URL": request.getfixturevalue("pg_url"),
                "FEDQ_BLOB_URL": str(tmp_path / "blobs")}
    cluster = Cluster(tmp_path, base_env(tmp_path / "home", **urls))
    if backend == "redis":
        cluster.fedq("db", "upgrade")
    cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
    try:
        example = yaml.safe_load(
            (Path(__file__).resolve().parents[1] / "examples" / "gpt_shakespeare.yaml")
            .read_text())
        spec = {**example, "model_args": TINY_GPT, "dataset_args": SMALL_TEXT, "rounds": 2,
                "local_steps": 5, "num_clients": 2, "clients_per_round": 2, "batch_size": 8}
        job, view = cluster.run(spec, timeout=300)
        assert view.status == "completed", view.error
        out = json.loads(cluster.fedq("results", job, "--json").stdout)
        for r in out["rounds"]:
            assert r["tokens"] == 2 * 5 * 8 * 32 and r["tokens_per_second"] > 0
            assert r["perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
        assert all(c["tokens"] == 5 * 8 * 32 for c in out["clients"])
        # the worker's peak memory, reported with each update (torch alone is > 100 MB)
        assert all(c["host_peak_mb"] > 100 for c in out["clients"]), out["clients"]
        sample = cluster.fedq("generate", job, "--prompt", "ROMEO.", "--tokens", "40").stdout
        assert sample.startswith("ROMEO.") and len(sample.encode()) >= 40
        watched = cluster.fedq("watch", job).stdout
        assert "tokens/s" in watched
        per_client = cluster.fedq("results", job, "--clients").stdout
        assert "w1@test" in per_client or "w2@test" in per_client  # the per-client table
        assert np.isfinite(out["rounds"][-1]["eval_loss"])
        # The progress figure of a language model: perplexity and validation loss.
        figs = figures(out["job"], out["rounds"], out["clients"])
        left, right = figs["progress"].axes
        assert left.get_ylabel() == "validation perplexity"
        assert list(left.lines[0].get_ydata()) == [r["perplexity"] for r in out["rounds"]]
        assert list(right.lines[1].get_ydata()) == [r["eval_loss"] for r in out["rounds"]]
        close(figs)
    finally:
        cluster.stop()
