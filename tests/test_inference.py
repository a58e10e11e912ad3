"""Batch inference jobs (fedq/inference/): shard plans, the spec, every check on what a
worker sends back, and jobs on real workers: the embedded default, and Redis +
PostgreSQL with a worker SIGKILLed mid-job, cancel and resume."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
import torch
import torch.nn.functional as F
import yaml
from sqlalchemy import select

from fedq.blobs import BlobRef, open_store
from fedq.data import load_dataset
from fedq.data import text as text_data
from fedq.db import WatchdogAction, session_scope
from fedq.errors import SpecError
from fedq.inference import jobs
from fedq.inference.run import complete, encode_rows, run_items
from fedq.inference.spec import load_inference
from fedq.models import build_model, seeded_model
from fedq.protocol.envelope import MESSAGE_FORMAT, FormatError, read_claim
from fedq.protocol.inference import check_output, output_key, parse_task
from fedq.testing.cluster import Cluster, base_env, record_outcome
from fedq.testing.wait import wait_until
from fedq.weights import dumps, state_of

SMALL_TEXT = {"block_size": 32, "max_works": 3, "eval_windows": 64}
TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 32}
PROMPTS = [f"{w} my lord, the {n} of" for n in ("king", "queen", "night", "sea", "crown")
           for w in ("Good", "Now", "Alas", "Hark")] + ["", "x"]


def test_shards_cover_every_item_once_and_the_tail_is_short() -> None:
    for items, size, tail in [(1000, 64, 4), (10, 64, 4), (1, 1, 1), (257, 16, 2), (0, 8, 2)]:
        cuts = jobs.plan_shards(items, size, tail)
        assert [i for lo, hi in cuts for i in range(lo, hi)] == list(range(items))
        assert all(hi > lo for lo, hi in cuts) and all(hi - lo <= size for lo, hi in cuts)
    cuts = jobs.plan_shards(1000, 64, 4)
    sizes = [hi - lo for lo, hi in cuts]
    assert sizes[0] == 64 and sizes[-1] < 16, sizes  # the last shards are short
    assert sizes == sorted(sizes, reverse=True)
    assert len(cuts) <= 1000 // 64 + 4 * 7, len(cuts)  # a few short shards, not one per item


def _spec(tmp_path: Path, **fields: Any) -> Path:
    path = tmp_path / "infer.yaml"
    path.write_text(yaml.safe_dump({"kind": "inference", **fields}, sort_keys=False))
    return path


def test_a_spec_mistake_is_one_line_with_its_place(tmp_path: Path) -> None:
    path = _spec(tmp_path, model={"job": "abc"}, inputs={"prompts": "p.txt"}, op="classify",
                 shard_sise=3)
    with pytest.raises(SpecError) as exc:
        load_inference(path)
    lines = str(exc.value).splitlines()
    assert any(line.startswith(f"{path}:7:1: shard_sise: unknown field") for line in lines), lines
    path = _spec(tmp_path, model={"job": "abc", "weights": "w.safetensors"},
                 inputs={"dataset": "digits"}, op="classify")
    with pytest.raises(SpecError, match="give exactly one of model.job"):
        load_inference(path)
    path = _spec(tmp_path, model={"job": "abc"}, inputs={"prompts": "p.txt"}, op="classify")
    with pytest.raises(SpecError, match="classify reads images"):
        load_inference(path)


def test_parquet_takes_each_ops_columns_and_refuses_a_line_that_does_not_fit(
        tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from fedq.errors import FedqError
    from fedq.inference.jobs import _write_parquet

    shards = [encode_rows([{"i": 0, "text": "to be"}, {"i": 1, "text": ""}]),
              encode_rows([{"i": 2, "text": "é"}])]
    assert _write_parquet(tmp_path / "g.parquet", "generate", iter(shards)) == 3
    assert pq.read_table(tmp_path / "g.parquet").to_pylist() == [
        {"i": 0, "text": "to be"}, {"i": 1, "text": ""}, {"i": 2, "text": "é"}]
    with pytest.raises(FedqError, match="does not fit op score"):
        _write_parquet(tmp_path / "s.parquet", "score",
                       iter([encode_rows([{"i": 0, "logprob": -1.0, "tokens": 3, "x": 1}])]))
    with pytest.raises(FedqError, match="no columns known for op 'paint'"):
        _write_parquet(tmp_path / "p.parquet", "paint", iter([]))


def test_every_output_line_is_checked() -> None:
    good = encode_rows([{"i": 5, "label": 1, "probs": [0.25, 0.75]},
                        {"i": 6, "label": 0, "probs": [1.0, 0.0]}])
    check_output(good, "classify", 5, 7, 2)
    bad = {
        "a line short": good.split(b"\n")[0] + b"\n",
        "out of order": encode_rows([{"i": 6, "label": 0, "probs": [1.0, 0.0]},
                                     {"i": 5, "label": 1, "probs": [0.25, 0.75]}]),
        "label out of range": good.replace(b'"label":1', b'"label":7'),
        "a probability above 1": good.replace(b"0.75", b"1.75"),
        "NaN": good.replace(b"0.75", b"NaN"),
        "an extra field": good.replace(b'{"i":5,', b'{"i":5,"x":1,'),
        "not JSON": b"{\n" + good.split(b"\n")[1] + b"\n",
    }
    for what, data in bad.items():
        with pytest.raises(FormatError):
            check_output(data, "classify", 5, 7, 2)
            pytest.fail(f"{what}: accepted")
    with pytest.raises(FormatError, match="not {i, logprob <= 0, tokens}"):
        check_output(b'{"i":0,"logprob":3.5,"tokens":2}\n', "score", 0, 1, 256)
    with pytest.raises(FormatError, match="bytes"):
        check_output(json.dumps({"i": 0, "text": "x" * 5000}).encode() + b"\n", "generate",
                     0, 1, 256)
    # a generated text is no longer than what was asked: one character a token at most
    texts = encode_rows([{"i": 0, "text": "abcd"}, {"i": 1, "text": "x" * 4000}])
    check_output(texts, "generate", 0, 2, 256, 4000)
    check_output(texts, "generate", 0, 2, 256, [4, 4000])
    for limit in (4, [4, 3999], [3, 4000]):
        with pytest.raises(FormatError, match="more than its max_tokens"):
            check_output(texts, "generate", 0, 2, 256, limit)
    unit = encode_rows([{"i": 0, "embedding": [0.6, 0.8, 0.0]}])
    check_output(unit, "embed", 0, 1, 3)  # ``classes``: the embedding width
    for what, data, width in (("another width", unit, 4),
                              ("not unit length", unit.replace(b"0.8", b"0.9"), 3),
                              ("a string", unit.replace(b"0.0", b'"0"'), 3),
                              ("Infinity", unit.replace(b"0.0", b"Infinity"), 3)):
        with pytest.raises(FormatError, match="numbers of unit length"):
            check_output(data, "embed", 0, 1, width)
            pytest.fail(f"{what}: accepted")


def test_an_embed_job_knows_its_width_and_needs_a_model_with_embeddings() -> None:
    assert jobs.embedding_width({"name": "gpt", "args": {}}) == 128  # gpt's default
    assert jobs.embedding_width({"name": "gpt", "args": {"n_embd": 32}}) == 32
    with pytest.raises(SpecError, match="op: embed needs a model with embeddings"):
        jobs.embedding_width({"name": "small_cnn", "args": {}})
    with pytest.raises(SpecError, match="n_embd: 'x' is not a width"):
        jobs.embedding_width({"name": "gpt", "args": {"n_embd": "x"}})


def test_a_worker_refuses_a_task_not_in_fedq_shape() -> None:
    task = {"format": MESSAGE_FORMAT, "job": "abc123", "shard": 0, "attempt": 1, "queue": "cpu",
            "op": "classify", "start": 0, "stop": 4, "batch_size": 2, "split": "test",
            "model": {"key": "jobs/abc123/r00001/global.safetensors", "sha256": "0" * 64,
                      "size": 10},
            "arch": {"name": "small_cnn", "dataset": "digits"}}
    parse_task(task)
    for bad in ({"job": "../etc"}, {"stop": 0}, {"model": {**task["model"], "key": "/etc/x"}},
                {"op": "shell"}, {"format": 2}, {"extra": 1}, {"split": None}):
        with pytest.raises(FormatError):
            parse_task({**task, **bad})


def _batch_sizes(model: torch.nn.Module) -> list[int]:
    """The list of batch sizes model.generate_batch is called with from now on."""
    sizes: list[int] = []
    batch = model.generate_batch

    def counted(rows: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(rows))
        return batch(rows, *args, **kwargs)

    model.generate_batch = counted  # type: ignore[method-assign]
    return sizes


def test_generate_runs_a_shards_prompts_in_batches_and_keeps_each_prompts_text() -> None:
    """op generate: up to batch_size prompts a forward pass (similar lengths together),
    and each prompt's text is the one it gets alone with its seed (seed + i)."""
    torch.manual_seed(0)
    model = build_model("gpt", (32,), 256, **TINY_GPT).eval()
    sizes = _batch_sizes(model)
    sampling = {"max_tokens": 40, "temperature": 0.9, "top_k": 20, "seed": 11}
    got = run_items(model, "generate", PROMPTS, 3, 8, torch.device("cpu"), sampling)
    assert sizes == [8, 8, 6]
    assert [r["i"] for r in got] == [3 + n for n in range(len(PROMPTS))]
    for n, row in enumerate(got):
        ids = text_data.prompt_ids(PROMPTS[n])
        want = model.generate(ids[None, :], 40, temperature=0.9, top_k=20,
                              generator=torch.Generator().manual_seed(11 + 3 + n))
        assert row["text"] == text_data.decode(want[0, len(ids):]), n


def test_a_served_batch_generates_every_request_together_and_streams_every_text() -> None:
    """fedq serve's worker (complete): requests of different max_tokens, temperatures
    and top-k cuts in one forward pass per token, each with its own seed and settings
    (the text it gets alone); the streamed texts so far are prefixes of the final ones,
    for every item of the batch."""
    torch.manual_seed(0)
    model = build_model("gpt", (32,), 256, **TINY_GPT).eval()
    sizes = _batch_sizes(model)
    alike = {"max_tokens": 60, "temperature": 0.9, "top_k": 20}
    items = [{"prompt": "Good my lord", **alike, "seed": 1},
             {"prompt": "Hark", "max_tokens": 8, "temperature": 0.9, "top_k": 20, "seed": 2},
             {"prompt": "", **alike, "temperature": 1.3, "top_k": 0, "seed": 3},
             {"prompt": PROMPTS[5] * 3, **alike, "top_k": 3, "seed": 4}]
    seen: list[list[str]] = []
    with mock.patch("fedq.inference.run.STREAM_EVERY_S", 0.0):
        got = complete(model, items, torch.device("cpu"), seen.append)
    assert sizes == [4]
    assert [r["i"] for r in got] == [0, 1, 2, 3]
    for item, row in zip(items, got):
        ids = text_data.prompt_ids(item["prompt"])
        want = model.generate(ids[None, :], item["max_tokens"],
                              temperature=item["temperature"], top_k=item["top_k"] or None,
                              generator=torch.Generator().manual_seed(item["seed"]))
        assert row["text"] == text_data.decode(want[0, len(ids):]), item
    assert len(seen) == 60 and all(len(texts) == 4 for texts in seen)
    assert all(got[n]["text"].startswith(texts[n]) for texts in seen for n in range(4))
    assert all(texts[1] == got[1]["text"] for texts in seen[8:])  # Hark's 8: done early


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_a_shard_runs_in_its_devices_mixed_precision(tmp_path: Path, amp: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard runs under the AMP mode of the worker's GPU class (bf16 from sm_80, fp16
    on sm_7x, off on Pascal, MPS and the CPU: fedq.worker.hardware.amp_mode, as
    training). This machine has no GPU, so the class's answer is faked; the CPU's
    autocast runs it for real: the outputs stay within bf16's error of the float32
    model's, they differ from it only when AMP is on, and the result says which."""
    import fedq.inference.run as run

    # the mode chosen (the class's AMP or float32: measured in the test after this one)
    monkeypatch.setattr(run, "chosen_amp", lambda sha, op, model, items, size, device, tok: amp)
    store = open_store(str(tmp_path / "blobs"))
    weights = _classifier_file(tmp_path)
    ref = store.put("jobs/abc123/infer/model.safetensors", weights.read_bytes())
    task = {"format": MESSAGE_FORMAT, "job": "abc123", "shard": 0, "attempt": 1, "queue": "cpu",
            "op": "classify", "start": 0, "stop": 64, "batch_size": 32, "split": "test",
            "model": {"key": ref.key, "sha256": ref.sha256, "size": ref.size},
            "arch": {"name": "small_cnn", "dataset": "digits"}}
    result = run.run_shard(task, store, "w1")
    assert result["status"] == "ok", result
    assert result["device"] == ("cpu" if amp == "off" else "cpu+bf16")
    out = BlobRef(result["key"], result["sha256"], result["size"])
    rows = [json.loads(line) for line in store.get(out).decode().splitlines()]
    want = _reference_classify(weights)[:64]
    worst = max(abs(a - b) for row, w in zip(rows, want) for a, b in zip(row["probs"], w))
    assert (worst == 0.0) if amp == "off" else (0.0 < worst <= 0.05), worst


class _SlowUnder(torch.nn.Module):
    """A real model that takes 400 ms longer a forward pass in one precision: under the
    CPU's autocast (``amp=True``) or without it. (The CPU's bf16 runs the small CNN in
    1-45 ms a batch here while other tests run: 20 ms was not enough, and 150 ms once
    failed in a CI run under full load.)"""

    def __init__(self, inner: torch.nn.Module, amp: bool) -> None:
        super().__init__()
        self.inner, self.amp, self.calls = inner, amp, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if torch.is_autocast_enabled("cpu") == self.amp:
            # 0.4 s: at 0.15 s a CI run under full load once timed float32 (the fast
            # mode) slower in all five runs of the served batch's probe
            time.sleep(0.4)
        return self.inner(x)


@pytest.mark.parametrize("slow_under", ["bf16", "float32"])
def test_a_worker_keeps_amp_only_where_it_measured_the_model_faster(
        tmp_path: Path, slow_under: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GPU's class has mixed precision, a worker times the model's first batch
    under it and in float32, once per weights and operation, and runs the shard (and a
    served batch) in the faster: small models lose under AMP (docs/inference.md). The
    class's answer is faked (no GPU here); the CPU's autocast and the timing are real,
    with a model 400 ms slower in one of the two."""
    import fedq.inference.run as run
    import fedq.worker.loop as loop
    from fedq.weights import loads

    monkeypatch.setattr(run, "device_amp", lambda device: "bf16")
    monkeypatch.setattr(loop, "_AMP", {})
    built: list[str] = []  # the probes built: once, where measured
    probe = run.amp_probe
    monkeypatch.setattr(run, "amp_probe", lambda model, op, *rest: (built.append(op),
                                                                   probe(model, op, *rest))[1])
    store = open_store(str(tmp_path / "blobs"))
    weights = _classifier_file(tmp_path)
    ref = store.put("jobs/abc123/infer/model.safetensors", weights.read_bytes())
    arch = {"name": "small_cnn", "dataset": "digits"}
    model = _SlowUnder(run.load_model(arch, loads(weights.read_bytes()), torch.device("cpu")),
                       amp=slow_under == "bf16")
    monkeypatch.setitem(run._BUILT, ref.sha256, model)
    task = {"format": MESSAGE_FORMAT, "job": "abc123", "shard": 0, "attempt": 1, "queue": "cpu",
            "op": "classify", "start": 0, "stop": 64, "batch_size": 32, "split": "test",
            "model": {"key": ref.key, "sha256": ref.sha256, "size": ref.size}, "arch": arch}
    first = run.run_shard(task, store, "w1")
    assert first["status"] == "ok", first
    assert first["device"] == ("cpu" if slow_under == "bf16" else "cpu+bf16")
    probes = 2 * (1 + loop.AMP_PROBE_RUNS)
    assert model.calls == probes + 2  # the two batches of 32
    again = run.run_shard({**task, "shard": 1, "start": 64, "stop": 96}, store, "w1")
    assert again["device"] == first["device"] and model.calls == probes + 3  # measured once
    assert built == ["classify"]

    loop._AMP.clear()
    ds = load_dataset("digits")
    batch = {"format": MESSAGE_FORMAT, "op": "classify", "items": ds.x_test[:4].flatten(1).tolist(),
             "model": {"key": ref.key, "sha256": ref.sha256, "size": ref.size}, "arch": arch}
    served = run.serve_batch(batch, store, "w1")
    assert served["status"] == "ok", served
    assert loop._AMP == {("infer", ref.sha256, "classify"):
                         "off" if slow_under == "bf16" else "bf16"}


def test_the_amp_probe_is_a_first_batch_of_each_gpt_operation(tmp_path: Path) -> None:
    """What chosen_amp times for a GPT: the first batch's prompts (or served
    completions), padded into one forward pass, cut to the model's context."""
    import fedq.inference.run as run
    from fedq.weights import loads

    arch = {"name": "gpt", "dataset": "shakespeare", "args": TINY_GPT,
            "dataset_args": SMALL_TEXT}
    model = run.load_model(arch, loads(_gpt_file(tmp_path).read_bytes()), torch.device("cpu"))
    cpu, long = torch.device("cpu"), "word " * 40  # longer than the context of 32
    assert run.amp_probe(model, "score", [long] + PROMPTS, 3, cpu)().shape == (3, 32, 256)
    widest = max(len(text_data.prompt_ids(p)) for p in PROMPTS[:2])
    assert run.amp_probe(model, "embed", PROMPTS, 2, cpu)().shape[:2] == (2, widest)
    served = [{"prompt": "", "max_tokens": 4}, {"prompt": "abc", "max_tokens": 4}]
    assert run.amp_probe(model, "generate", served, 2, cpu)().shape[:2] == (2, 3)


def test_a_served_batch_of_completions_runs_as_one_generation(tmp_path: Path) -> None:
    """serve_batch, the worker's side of fedq serve: a batch of alike completions is
    generated together (one generate_batch call for all of them), and each answer is
    the text its prompt and seed get alone. Its texts so far are written only for a
    batch that has a streamed request (``stream``)."""
    import fedq.inference.run as run
    from fedq.models.gpt import GPT

    store = open_store(str(tmp_path / "blobs"))
    weights = _gpt_file(tmp_path)
    ref = store.put("jobs/abc123/serve/model.safetensors", weights.read_bytes())
    items = [{"prompt": p, "max_tokens": 6, "temperature": 1.0, "top_k": 0, "seed": n}
             for n, p in enumerate(PROMPTS[:5])]
    batch = {"format": MESSAGE_FORMAT, "op": "generate", "items": items,
             "model": {"key": ref.key, "sha256": ref.sha256, "size": ref.size},
             "arch": {"name": "gpt", "dataset": "shakespeare", "args": TINY_GPT,
                      "dataset_args": SMALL_TEXT}}
    sizes: list[int] = []
    alone = GPT.generate_batch

    def counted(self: GPT, rows: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(rows))
        return alone(self, rows, *args, **kwargs)

    written: list[list[str]] = []
    with mock.patch.object(GPT, "generate_batch", counted):
        result = run.serve_batch(batch, store, "w1", written.append)
        assert written == []  # nobody streams: only the answer is written
        streamed = run.serve_batch({**batch, "stream": True}, store, "w1", written.append)
    assert result["status"] == "ok", result
    assert sizes == [5, 5] and streamed["outputs"] == result["outputs"]
    assert written and len(written[0]) == 5, written
    model = _gpt(weights)
    for item, row in zip(items, result["outputs"], strict=True):
        ids = text_data.prompt_ids(item["prompt"])
        want = model.generate(ids[None, :], 6, generator=torch.Generator().manual_seed(
            item["seed"]))
        assert row["text"] == text_data.decode(want[0, len(ids):]), item


def _classifier_file(tmp_path: Path) -> Path:
    ds = load_dataset("digits")
    path = tmp_path / "cnn.safetensors"
    path.write_bytes(dumps(state_of(seeded_model("small_cnn", ds.input_shape, ds.num_classes,
                                                 3))))
    return path


def _classify_spec(tmp_path: Path, limit: int, **fields: Any) -> Any:
    """A spec classifying the first ``limit`` digits test images with the seeded small
    CNN (its weights written to ``tmp_path``)."""
    weights = _classifier_file(tmp_path)
    return load_inference(_spec(tmp_path, model={"weights": str(weights), "name": "small_cnn",
                                                 "dataset": "digits"},
                                inputs={"dataset": "digits", "limit": limit}, op="classify",
                                **fields))


def _answer(store: Any, job: str, shard: int, attempt: int, items: range,
            **over: Any) -> dict[str, Any]:
    """What an honest worker answers for a classify shard of ``items``, its output
    written to ``store``; ``over`` replaces fields."""
    lines = [{"i": i, "label": 0, "probs": [0.1] * 10} for i in items]
    ref = store.put(output_key(job, shard, attempt), encode_rows(lines))
    return {"status": "ok", "job": job, "shard": shard, "attempt": attempt, "worker": "w@test",
            "queue": "cpu", "key": ref.key, "sha256": ref.sha256, "size": ref.size,
            "items": len(lines), "seconds": 0.1, **over}


def _reference_classify(weights: Path) -> list[list[float]]:
    from fedq.weights import loads

    ds = load_dataset("digits")
    model = build_model("small_cnn", ds.input_shape, ds.num_classes)
    model.load_state_dict(loads(weights.read_bytes()))
    with torch.no_grad():
        return F.softmax(model.eval()(ds.x_test), dim=-1).tolist()


def _read_out(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp_path = tmp_path_factory.mktemp("inference")
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(w1=["cpu"], w2=["cpu"], control=["control"])
    yield cluster
    cluster.stop()


def test_forged_and_duplicate_answers_are_refused_and_a_shard_counts_once(
        tmp_path: Path) -> None:
    """The coordinator's side alone, on the embedded default (no worker runs: the test
    answers as one would, honestly and not)."""
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    spec = _classify_spec(tmp_path, 12, shard_size=4, in_flight=1, max_redispatch=1)
    job = jobs.submit(settings, spec, tmp_path)
    store = open_store(settings.blob_url)
    view = jobs.find(settings, job)
    assert view is not None and [r["status"] for r in view.shard_rows] == [
        "running", "queued", "queued"]  # 4 items each
    rows = [{"i": i, "label": 0, "probs": [0.1] * 10} for i in range(4)]

    def answer(shard: int, attempt: int, body: bytes, **over: Any) -> dict[str, Any]:
        ref = store.put(output_key(job, shard, attempt), body)
        result = {"status": "ok", "job": job, "shard": shard, "attempt": attempt,
                  "worker": "w@test", "queue": "cpu", "key": ref.key, "sha256": ref.sha256,
                  "size": ref.size, "items": 4, "seconds": 0.1, **over}
        return jobs.absorb(settings, result, job, shard, attempt)

    short = answer(0, 1, encode_rows(rows[:3]))
    assert short["status"] == "rejected" and "3 line(s)" in short["error"]
    # re-sent at once as attempt 2; an answer for an attempt never sent is dropped
    assert jobs.absorb(settings, {}, job, 0, 3)["status"] == "dropped"
    # nor is one that checks out for an attempt not sent yet (its output under that key)
    assert answer(0, 3, encode_rows(rows))["status"] == "dropped"
    other = answer(0, 2, encode_rows(rows), key=output_key(job, 1, 2))
    assert other["status"] == "rejected" and "is not" in other["error"]
    view = jobs.find(settings, job)
    assert view is not None and view.status == "failed" and "shard 0" in (view.error or "")
    assert jobs.resume(settings, job) == 3
    view = jobs.find(settings, job)
    assert view is not None and view.shard_rows[0]["attempt"] == 3
    assert answer(0, 3, encode_rows(rows))["status"] == "done"
    again = answer(0, 3, encode_rows(rows))
    assert again["status"] == "dropped"  # written once
    forged = {"status": "ok", "job": job, "shard": 0, "attempt": 3, "worker": "w@test",
              "queue": "cpu", "key": output_key(job, 0, 3), "sha256": "f" * 64, "size": 10,
              "items": 4}
    assert jobs.absorb(settings, forged, job, 0, 3)["status"] == "dropped"
    view = jobs.find(settings, job)
    assert view is not None and view.done_items == 4 and view.shard_rows[1]["status"] == "running"
    bad_hash = answer(1, 1, encode_rows([{**r, "i": r["i"] + 4} for r in rows]),
                      sha256="0" * 64)
    assert bad_hash["status"] == "rejected" and "digest mismatch" in bad_hash["error"]


def test_status_shows_each_shard_out_with_its_worker_and_heartbeat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fedq status JOB` of an inference job: under its table, each shard out with the
    worker that claimed it and its heartbeat's age (the watchdog's record,
    fedq/coordinator/liveness.py), then what the watchdog did."""
    from click.testing import CliRunner

    from fedq.cli import main
    from fedq.coordinator import liveness
    from fedq.db.models import utcnow
    from fedq.settings import get_settings

    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    spec = _classify_spec(tmp_path, 8, shard_size=4, in_flight=2)
    job = jobs.submit(settings, spec, tmp_path)
    claims = {jobs.task_id(job, 0, 1): {"status": "STARTED",
                                        "result": {"hostname": "w1@a", "beat": 3}},
              jobs.task_id(job, 1, 1): {"status": "STARTED",
                                        "result": {"hostname": "w2@a", "beat": 0}}}
    running, = [tasks for j, tasks, _ in jobs.running_tasks(settings) if j == job]
    assert sorted(running) == sorted(claims)
    # first seen 20 s ago, by the coordinator's clock (its heartbeat never moved since)
    liveness.observe(settings, job, running, utcnow() - timedelta(seconds=20),
                     meta=claims.__getitem__)
    liveness.mark_resent(settings, [jobs.task_id(job, 1, 1)])
    with session_scope(settings.database_url) as s:
        s.add(WatchdogAction(job_id=job, action="resend (lost w2@a)", result="queued"))
    for key, value in cluster.env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        shown = CliRunner().invoke(main, ["status", job])
    finally:
        get_settings.cache_clear()
    assert shown.exit_code == 0, shown.output
    assert "shard 0 on w1@a: heartbeat lost 20 s ago, re-dispatch due" in shown.output, \
        shown.output
    assert "shard 1 on w2@a: heartbeat lost 20 s ago, re-dispatched" in shown.output
    assert re.search(r"\d\d:\d\d:\d\d: resend \(lost w2@a\) \(queued\)", shown.output), \
        shown.output
    # `fedq watch JOB` (and `fedq infer`) print each lost worker's shard once, however
    # many times they look
    from io import StringIO

    from rich.console import Console

    from fedq.cli.infer import follow

    buf = StringIO()
    follow(settings, job, interval=0.05, timeout=0.5, console=Console(file=buf, width=200))
    lines = buf.getvalue().splitlines()
    for said in (r"shard 0 on w1@a: heartbeat lost 2\d s ago, re-dispatch due",
                 r"shard 1 on w2@a: heartbeat lost 2\d s ago, re-dispatched"):
        assert len([x for x in lines if re.fullmatch(said, x.strip())]) == 1, (said, lines)


def test_the_last_shard_out_gets_a_backup_copy_and_the_first_answer_counts(
        tmp_path: Path) -> None:
    """The coordinator's side on the embedded default, answering as workers would: once
    no shard waits, a freed slot sends a second copy of the shard out longest; the copy's
    answer completes the job, the first copy is revoked and its late answer dropped; a
    copy that fails is one failure, not two."""
    from fedq.engine.app import app

    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    store = open_store(settings.blob_url)

    def answer(job: str, row: dict[str, Any], attempt: int, **over: Any) -> dict[str, Any]:
        result = _answer(store, job, row["shard"], attempt, range(row["start"], row["stop"]),
                         **over)
        return jobs.absorb(settings, result, job, row["shard"], attempt)

    def rows(job: str) -> list[dict[str, Any]]:
        view = jobs.find(settings, job)
        assert view is not None
        return view.shard_rows

    def submit(**fields: Any) -> str:
        spec = _classify_spec(tmp_path, 8, shard_size=2, in_flight=2, **fields)
        job = jobs.submit(settings, spec, tmp_path)
        # every shard but the first answered as it is sent: shard 0 is the slow machine's
        while True:
            out = [r for r in rows(job)[1:] if r["status"] == "running"]
            if not out:
                return job
            for r in out:
                assert answer(job, r, r["attempt"])["status"] == "done"

    job = submit(max_redispatch=0)
    first = rows(job)[0]
    assert (first["status"], first["attempt"], first["backups"]) == ("running", 2, 1)
    assert answer(job, first, 2)["status"] == "done"  # the copy answers first
    view = jobs.find(settings, job)
    assert view is not None and view.status == "completed" and view.done_items == 8
    assert (view.to_json()["backups"], view.resent) == (1, 0)  # a copy is not a re-send
    assert app.backend.get_task_meta(jobs.task_id(job, 0, 1))["status"] == "REVOKED"
    assert app.backend.get_task_meta(jobs.task_id(job, 0, 2))["status"] != "REVOKED"
    assert answer(job, first, 1)["status"] == "dropped"  # the first copy, late

    # a copy that fails is one failure: with max_redispatch 1 the shard goes out again
    job = submit(max_redispatch=1)
    failed = answer(job, rows(job)[0], 2, status="error", error="RuntimeError: boom")
    assert failed["status"] == "error"
    first = rows(job)[0]
    assert (first["status"], first["attempt"]) == ("running", 3)  # not failed: 1 of 1
    assert answer(job, first, 1)["status"] == "done"  # the first copy was still out
    view = jobs.find(settings, job)
    assert view is not None and view.status == "completed"

    # resume forgets a cancelled job's copies for max_redispatch: its fresh copy is the
    # first again, and with max_redispatch 0 that copy failing fails the job (had the
    # old copy been kept in the count, the failure would have been taken for a copy's
    # and re-sent); what a person reads still counts both copies (attempts 2 and 4)
    # and one re-send (attempt 3, the resume's), not three re-sends
    job = submit(max_redispatch=0)
    jobs.cancel(settings, job)
    jobs.resume(settings, job)
    first = rows(job)[0]
    assert (first["status"], first["attempt"], first["backups"]) == ("running", 4, 2)
    assert answer(job, first, 4, status="error", error="RuntimeError: boom")["status"] == "error"
    view = jobs.find(settings, job)
    assert view is not None and view.status == "failed" and "failed 1 time(s)" in view.error, view
    assert (view.to_json()["backups"], view.resent) == (2, 1)

    # backups: false sends no copy
    job = submit(backups=False)
    first = rows(job)[0]
    assert (first["status"], first["attempt"], first["backups"]) == ("running", 1, 0)


def test_unset_in_flight_keeps_two_shards_out_per_worker_and_copies_only_to_a_free_slot(
        tmp_path: Path) -> None:
    """``in_flight`` unset (jobs.queue_limits): each worker registered on the queue that
    has not stepped aside counts for two shards out (its next one waits in the broker);
    one not seen lately does not count; one registered with ``-c N`` counts ``N`` times
    (believed up to 64: fedq.engine.broker.registered_slots); a backup copy still waits
    for a free slot, not for a shard fewer than that."""
    from fedq.db.models import Worker
    from fedq.db.session import ensure_schema

    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    ensure_schema(settings.database_url)
    with session_scope(settings.database_url) as s:
        s.add_all([Worker(hostname="a@test", queues=["cpu"], hardware={}),
                   Worker(hostname="b@test", queues=["cpu", "gpu_new"], hardware={},
                          available=True),
                   Worker(hostname="c@test", queues=["cpu"], hardware={}, available=False,
                          away_reason="owner active"),
                   Worker(hostname="g@test", queues=["gpu_new"], hardware={}),
                   Worker(hostname="g3@test", queues=["gpu_new"],
                          hardware={"concurrency": 3}),
                   # a hostile or garbled count is one
                   Worker(hostname="gx@test", queues=["gpu_new"],
                          hardware={"concurrency": 10**9}),
                   Worker(hostname="gt@test", queues=["gpu_new"],
                          hardware={"concurrency": True}),
                   # killed an hour ago without its shutdown: not seen since
                   Worker(hostname="d@test", queues=["cpu"], hardware={},
                          last_seen=datetime.now(timezone.utc) - timedelta(hours=1))])
    store = open_store(settings.blob_url)
    spec = _classify_spec(tmp_path, 10, shard_size=1)
    with session_scope(settings.database_url) as s:
        assert jobs.queue_limits(s, spec.to_json()) == {"cpu": (4, 2)}
        assert jobs.queue_limits(s, {**spec.to_json(), "queues": ["gpu_new", "tpu"]}) == {
            "gpu_new": (14, 7), "tpu": (2, 1)}
        assert jobs.queue_limits(s, {**spec.to_json(), "in_flight": 3}) == {"cpu": (3, 3)}
    job = jobs.submit(settings, spec, tmp_path)

    def out() -> list[dict[str, Any]]:
        view = jobs.find(settings, job)
        assert view is not None
        return [r for r in view.shard_rows if r["status"] == "running"]

    assert [r["shard"] for r in out()] == [0, 1, 2, 3]  # a and b, two each (c is away)
    # shards 2.. answered as a worker would, one at a time: 0 and 1 stay out
    while [r for r in out() if r["shard"] > 1]:
        row = next(r for r in out() if r["shard"] > 1)
        result = _answer(store, job, row["shard"], row["attempt"],
                         range(row["start"], row["stop"]), worker="a@test")
        assert jobs.absorb(settings, result, job, row["shard"], row["attempt"])[
            "status"] == "done"
    # nothing waits, two shards out on two workers: no slot is free, so no copy
    assert [(r["shard"], r["backups"]) for r in out()] == [(0, 0), (1, 0)]
    jobs.cancel(settings, job)


def test_an_answer_reads_the_shards_it_may_send_not_the_jobs_every_shard(
        tmp_path: Path) -> None:
    """Absorbing a shard's answer reads the shards out as a count per queue and only as
    many waiting rows as the queue has room for (jobs._fill), so an answer costs the
    same early in a job of many shards as late in it; the last answer still completes
    the job."""
    from sqlalchemy import event

    from fedq.db.models import InferenceShard

    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    store = open_store(settings.blob_url)
    job = jobs.submit(settings, _classify_spec(tmp_path, 360, shard_size=1, in_flight=2),
                      tmp_path)
    loaded: list[int] = []

    def on_load(row: InferenceShard, _: Any) -> None:
        loaded.append(row.shard)

    event.listen(InferenceShard, "load", on_load)
    try:
        for n in range(360):
            with session_scope(settings.database_url) as s:
                shard, attempt, start, stop = s.execute(select(
                    InferenceShard.shard, InferenceShard.attempt, InferenceShard.start,
                    InferenceShard.stop).where(InferenceShard.job_id == job,
                                               InferenceShard.status == "running")
                    .order_by(InferenceShard.shard).limit(1)).one()
            loaded.clear()
            result = _answer(store, job, shard, attempt, range(start, stop))
            assert jobs.absorb(settings, result, job, shard, attempt)["status"] == "done"
            # the answered shard (read to check it, then under the job's lock), the one
            # sent next and one more (others wait); near the end the other shard out,
            # which a free slot may copy
            assert len(loaded) <= 5, (n, loaded)
    finally:
        event.remove(InferenceShard, "load", on_load)
    view = jobs.find(settings, job)
    assert view is not None and view.status == "completed"


def test_repair_absorbs_a_lost_callbacks_answer_and_never_reads_a_huge_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog's pass over an inference job whose shards are past their timeout:
    an answer stored in the result backend whose callback never came is absorbed; one
    longer than the backend's bound (fedq.engine.backend.STATE_BYTES) is not read, and
    its shard is sent again."""
    import fedq.engine.backend as fb
    from fedq.engine.app import app

    monkeypatch.setattr(fb, "STATE_BYTES", 4096)
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    store = open_store(settings.blob_url)
    spec = _classify_spec(tmp_path, 4, shard_size=2, in_flight=2, shard_timeout_s=0.001)
    job = jobs.submit(settings, spec, tmp_path)
    for shard, pad in ((0, {}), (1, {"error": "x" * 10_000})):
        app.backend.store_result(jobs.task_id(job, shard, 1), _answer(
            store, job, shard, 1, range(2 * shard, 2 * shard + 2), **pad), "SUCCESS")
    time.sleep(0.01)
    actions = {a["shard"]: (a["action"], a["result"]) for a in jobs.repair(settings)
               if "shard" in a}
    assert actions[0] == ("absorb (lost callback)", "done")
    assert actions[1][0] == "resend (timeout)"  # the 10 kB answer was not read
    view = jobs.find(settings, job)
    assert view is not None
    rows = {r["shard"]: r for r in view.shard_rows}
    assert rows[0]["status"] == "done" and (rows[1]["status"], rows[1]["attempt"]) == (
        "running", 2)
    jobs.cancel(settings, job)


def test_a_slow_class_does_not_copy_a_shard_a_fast_class_is_about_to_finish(
        tmp_path: Path) -> None:
    """Backup copies by measured speed (jobs.backup_choice), on the embedded default
    answering as workers would, two classes: gpu_new at 4 items/s, cpu at 0.01 item/s
    (from the seconds the answers report). A free gpu_new slot copies a cpu shard (the
    copy is expected in 0.5 s, the shard in 200); a free cpu slot does not copy a
    gpu_new shard sent a moment ago (200 s against 0.5), and a gpu_new shard gone quiet
    past twice its time plus a second is copied after all."""
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    settings = cluster.settings
    store = open_store(settings.blob_url)
    per_item = {"gpu_new": 0.25, "cpu": 100.0}

    def answer(job: str, row: dict[str, Any], attempt: int) -> dict[str, Any]:
        items = range(row["start"], row["stop"])
        result = _answer(store, job, row["shard"], attempt, items,
                         worker=f"{row['queue']}@test", queue=row["queue"],
                         seconds=per_item[row["queue"]] * len(items))
        return jobs.absorb(settings, result, job, row["shard"], attempt)

    def shards(job: str) -> list[dict[str, Any]]:
        view = jobs.find(settings, job)
        assert view is not None
        return view.shard_rows

    spec = _classify_spec(tmp_path, 8, shard_size=2, in_flight=1, queues=["gpu_new", "cpu"])
    job = jobs.submit(settings, spec, tmp_path)
    s0, s1 = shards(job)[:2]
    assert (s0["queue"], s1["queue"]) == ("gpu_new", "cpu")
    assert answer(job, s1, 1)["status"] == "done"  # cpu: 0.01 item/s; s2 goes to cpu
    assert answer(job, s0, 1)["status"] == "done"  # gpu_new: 4 items/s; s3 to gpu_new
    s2, s3 = shards(job)[2:]
    assert (s2["queue"], s3["queue"], s2["status"], s3["status"]) == (
        "cpu", "gpu_new", "running", "running")
    assert answer(job, s2, 1)["status"] == "done"  # cpu is free; s3 ends in ~0.5 s
    s3 = shards(job)[3]
    assert (s3["queue"], s3["attempt"], s3["backups"]) == ("gpu_new", 1, 0), s3
    time.sleep(2.5)  # s3 is now out past 2 x 0.5 s + 1 s: overdue, worth a copy
    jobs.fill(settings, job)
    s3 = shards(job)[3]
    assert (s3["queue"], s3["attempt"], s3["backups"]) == ("cpu", 2, 1), s3
    assert answer(job, {**s3, "queue": "gpu_new"}, 1)["status"] == "done"

    # the other way round: gpu_new's free slot copies cpu's last shard at once
    job = jobs.submit(settings, spec, tmp_path)
    s0, s1 = shards(job)[:2]
    assert answer(job, s1, 1)["status"] == "done"  # s2 to cpu
    assert answer(job, s0, 1)["status"] == "done"  # s3 to gpu_new
    s2, s3 = shards(job)[2:]
    assert answer(job, s3, 1)["status"] == "done"  # gpu_new is free; s2 ends in ~200 s
    s2 = shards(job)[2]
    assert (s2["queue"], s2["attempt"], s2["backups"]) == ("gpu_new", 2, 1), s2


@pytest.mark.slow
def test_a_fast_worker_finishes_a_slow_workers_last_shard_as_its_backup(
        tmp_path: Path) -> None:
    """Real workers on the embedded default: the slow one (100,000x) takes a shard
    and holds it; the fast one, started after, takes the rest and then the
    slow one's shard as a backup copy, and the job completes with the model's outputs.
    Without copies the job would wait for the slow one's shard (hours)."""
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    try:
        cluster.start(control=["control"])
        slow = cluster.add("slow", ["cpu"], FEDQ_TEST_SLOWDOWN="100000")
        weights = _classifier_file(tmp_path)
        spec = _spec(tmp_path, model={"weights": weights.name, "name": "small_cnn",
                                      "dataset": "digits"},
                     inputs={"dataset": "digits", "split": "test"}, op="classify",
                     shard_size=60, batch_size=60, in_flight=2, shard_timeout_s=3600)
        job = cluster.fedq("infer", str(spec), "--no-wait").stdout.strip()
        wait_until(lambda: "Task fedq.infer_shard[" in slow.log_path.read_text(
            errors="replace"), 60, what="the slow worker to take a shard")
        cluster.add("fast", ["cpu"])
        out = tmp_path / "out.jsonl"
        watched = cluster.fedq("watch", job, timeout=120).stdout
        # a copy is counted apart from re-sends (a re-send is a failure, a copy is not)
        assert "6/6 shards, 1 backup copy" in watched and "re-sent" not in watched, watched
        cluster.fedq("results", job, "--out", str(out))
        view = jobs.find(cluster.settings, job)
        assert view is not None and view.status == "completed", view
        copied = [r for r in view.shard_rows if r["backups"]]
        # the shard the slow worker took (not always shard 0: it may start after both
        # first shards are out) is the one copied; its id names it
        held = re.search(rf"Task fedq\.infer_shard\[fedq-{job}-i(\d+)-a1",
                         slow.log_path.read_text(errors="replace"))
        assert held is not None
        assert [r["shard"] for r in copied] == [int(held.group(1))], view.shard_rows
        assert copied[0]["worker"] == "fast@test", view.shard_rows
        assert {r["worker"] for r in view.shard_rows} == {"fast@test"}
        got, want = _read_out(out), _reference_classify(weights)
        assert [r["i"] for r in got] == list(range(len(want)))  # none missing or doubled
        assert max(abs(a - b) for r, w in zip(got, want) for a, b in zip(r["probs"], w)) <= 1e-5
        record_outcome(
            "inference job (classify 360 digits, 6 shards), one worker 100,000x slow holds "
            "a shard; a fast worker joins (embedded default)",
            "nothing killed: a worker that does not answer in the job's time",
            "completed: the held shard's backup copy ran on the fast worker, its answer "
            "counted, the slow copy revoked; outputs equal the model's in input order",
            view.done_shards, len(want) - len({r["i"] for r in got}))
    finally:
        cluster.by_name("slow").kill()
        cluster.stop()


@pytest.mark.slow
def test_classify_on_the_embedded_default_matches_the_model_in_one_process(
        embedded: Cluster, tmp_path: Path) -> None:
    weights = _classifier_file(tmp_path)
    spec = _spec(tmp_path, name="digits-test", model={"weights": weights.name, "name": "small_cnn",
                                                      "dataset": "digits"},
                 inputs={"dataset": "digits", "split": "test"}, op="classify", shard_size=40,
                 batch_size=16)
    out = tmp_path / "out.jsonl"
    proc = embedded.fedq("infer", str(spec), "--out", str(out), timeout=240)
    job = proc.stdout.strip()
    assert "no live worker" not in proc.stderr  # the embedded workers answer inspect too
    got = _read_out(out)
    want = _reference_classify(weights)
    assert [r["i"] for r in got] == list(range(len(want)))
    worst = max(abs(a - b) for r, w in zip(got, want) for a, b in zip(r["probs"], w))
    assert worst <= 1e-5, worst
    assert all(r["label"] == max(range(10), key=w.__getitem__) for r, w in zip(got, want)
               if sorted(w)[-1] - sorted(w)[-2] > 1e-4)
    # the same outputs as Parquet: the op's columns, a row group per shard, input order
    import pyarrow.parquet as pq

    table = embedded.fedq("results", job, "--out", str(tmp_path / "out.parquet")).stdout
    assert f"{len(want)} outputs" in table
    parquet = pq.ParquetFile(tmp_path / "out.parquet")
    assert parquet.schema_arrow.names == ["i", "label", "probs"]
    probs = parquet.schema_arrow.field("probs").type
    assert str(probs).startswith("list<") and str(probs.value_type) == "double"
    assert parquet.read().to_pylist() == got
    data = json.loads(embedded.fedq("results", job, "--json").stdout)
    assert data["status"] == "completed" and data["done_items"] == len(want)
    assert parquet.metadata.num_row_groups == data["shards"]
    assert {w["worker"].split("@")[0] for w in data["workers"]} == {"w1", "w2"}
    table = embedded.fedq("results", job).stdout
    assert "items/s" in table and "w1@test" in table
    listed = embedded.fedq("status").stdout
    assert job in listed and f"{len(want)}/{len(want)}" in listed
    one = json.loads(embedded.fedq("status", job, "--json").stdout)
    assert one[0]["kind"] == "inference" and one[0]["done_items"] == len(want)
    # a page and figures a person can look at
    page = tmp_path / "report.html"
    embedded.fedq("report", job, "--out", str(page))
    text = page.read_text()
    assert f"{len(want)} of {len(want)} items" in text and "w1@test" in text
    assert '<table id="classes"><tr><th>class</th>' in text and '"text">cpu</td>' in text
    assert text.count('src="data:image/png;base64,') == 2
    plots = embedded.fedq("plot", job, "--out", str(tmp_path / "plots"), "--format", "png")
    assert sorted(Path(p).name for p in plots.stdout.split()) == [
        f"{job}-throughput.png", f"{job}-timeline.png"]
    # bad input: one line, non-zero, nothing written
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec.read_text().replace("op: classify", "op: score"))
    proc = embedded.fedq("infer", str(bad), check=False)
    assert proc.returncode == 2 and "inputs.prompts, not inputs.dataset" in proc.stderr
    assert "Traceback" not in proc.stderr
    missing = embedded.fedq("results", "abcdef012345", "--out", str(tmp_path / "x"), check=False)
    assert missing.returncode == 4 and not (tmp_path / "x").exists()


def _gpt_file(tmp_path: Path) -> Path:
    ds = load_dataset("shakespeare", None, SMALL_TEXT)
    path = tmp_path / "gpt.safetensors"
    path.write_bytes(dumps(state_of(seeded_model("gpt", ds.input_shape, ds.num_classes, 5,
                                                 **TINY_GPT))))
    return path


def _gpt(weights: Path) -> torch.nn.Module:
    from fedq.weights import loads

    ds = load_dataset("shakespeare", None, SMALL_TEXT)
    model = build_model("gpt", ds.input_shape, ds.num_classes, **TINY_GPT)
    model.load_state_dict(loads(weights.read_bytes()))
    return model.eval()


@pytest.mark.slow
def test_generate_on_redis_survives_a_worker_sigkill(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """The killed worker's shard goes out again once its heartbeat has stopped for
    FEDQ_WORKER_LOST_S (4 s here), not at its 600 s timeout, and with no backup copy
    (``backups: false``) to cover for it."""
    cluster = redis_cluster
    # w1 alone until it is killed, then w2 finishes the job; w1 slowed 20x (a shard of
    # this tiny GPT takes ~0.07 s on 2 cores: the whole job once ended before the test
    # saw w1 hold a shard); its heartbeat beats on while it is slow
    cluster.env.update(FEDQ_HEARTBEAT_S="1", FEDQ_WORKER_LOST_S="4")
    cluster.start(control=["control"])
    cluster.add("w1", ["cpu"], FEDQ_TEST_SLOWDOWN="20")
    cluster.start_beat()
    weights = _gpt_file(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    many = PROMPTS * 4
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in many))
    spec = _spec(tmp_path, model={"weights": weights.name, "name": "gpt", "dataset": "shakespeare",
                                  "args": TINY_GPT, "dataset_args": SMALL_TEXT},
                 inputs={"prompts": prompts.name}, op="generate",
                 generate={"max_tokens": 60, "temperature": 0.9, "top_k": 20, "seed": 11},
                 shard_size=4, batch_size=4, shard_timeout_s=600, max_redispatch=3,
                 backups=False)
    job = cluster.fedq("infer", str(spec), "--no-wait").stdout.strip()

    def done_by(worker: str) -> bool:
        view = jobs.find(cluster.settings, job)
        return view is not None and any(w.worker == worker for w in view.workers)

    wait_until(lambda: done_by("w1@test"), 120, what="w1 to finish a shard")
    w1 = cluster.by_name("w1")

    def holds_a_shard() -> bool:  # its log: a shard received and not yet answered,
        # and its claim stored (else the kill leaves nothing to see: only the timeout)
        log = w1.log_path.read_text(errors="replace")
        received = re.findall(r"Task fedq\.infer_shard\[([^\]]+)\] received", log)
        answered = set(re.findall(r"Task fedq\.infer_shard\[([^\]]+)\] succeeded", log))
        conn = redis.Redis.from_url(cluster.env["FEDQ_RESULT_BACKEND"])
        try:
            metas = [conn.get(f"celery-task-meta-{t}") for t in received if t not in answered]
        finally:
            conn.close()
        return any(raw and read_claim(json.loads(raw)) is not None for raw in metas)

    wait_until(holds_a_shard, 120, interval=0.01, what="w1 to hold a shard")
    w1.kill()  # SIGKILL while it holds a shard: the watchdog must send it again
    cluster.add("w2", ["cpu"])

    def resent_and_done() -> bool:
        view = jobs.find(cluster.settings, job)
        return view is not None and any(r["attempt"] >= 2 and r["status"] == "done"
                                        for r in view.shard_rows)

    wait_until(resent_and_done, 120, what="the killed worker's shard to be re-sent and done")
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        resent = list(s.scalars(select(WatchdogAction.action).where(
            WatchdogAction.job_id == job, WatchdogAction.action.startswith("resend"))))
    assert resent == ["resend (lost w1@test)"], resent
    watched = cluster.fedq("watch", job, timeout=240)
    assert "completed" in watched.stdout, watched.stdout + watched.stderr
    out = tmp_path / "out.jsonl"
    cluster.fedq("results", job, "--out", str(out))
    got = _read_out(out)
    assert [r["i"] for r in got] == list(range(len(many)))  # in order, none missing or doubled
    model = _gpt(weights)
    for i, row in enumerate(got):
        ids = text_data.prompt_ids(many[i])
        gen = torch.Generator().manual_seed(11 + i)
        want = model.generate(ids[None, :], 60, temperature=0.9, top_k=20, generator=gen)
        assert row["text"] == text_data.decode(want[0, len(ids):]), i
    view = jobs.find(cluster.settings, job)
    assert view is not None
    record_outcome(
        f"inference job (GPT generate, {len(many)} prompts, {view.shards} shards), a worker "
        "SIGKILLed while it holds a shard, another started (Redis)",
        "the worker's process group",
        "completed: the held shard sent again and counted once; outputs equal the "
        "model's in input order", view.done_shards,
        len(many) - len({r["i"] for r in got}))


@pytest.mark.slow
def test_score_on_redis_cancelled_and_resumed_matches_one_prompt_at_a_time(redis_cluster: Cluster,
                                                     tmp_path: Path) -> None:
    """Cancelled before any worker took a shard, then resumed: the job completes once,
    and the worker started between the two never runs the cancelled shards."""
    cluster = redis_cluster
    cluster.start(control=["control"])
    weights = _gpt_file(tmp_path)
    long = "It is a wise father that knows his own child. " * 3  # beyond one context
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join([*PROMPTS[:-2], long]) + "\n")
    spec = _spec(tmp_path, model={"weights": weights.name, "name": "gpt", "dataset": "shakespeare",
                                  "args": TINY_GPT, "dataset_args": SMALL_TEXT},
                 inputs={"prompts": prompts.name}, op="score", shard_size=7, batch_size=5)
    sent = cluster.fedq("infer", str(spec), "--no-wait")
    job = sent.stdout.strip()
    # no worker consumes cpu yet: said once, the control queue is live
    assert sent.stderr.count("no live worker consumes queue") == 1, sent.stderr
    assert "no live worker consumes queue 'cpu'" in sent.stderr
    assert "2 task(s) revoked" in cluster.fedq("cancel", job).stdout  # in_flight: 2
    out = tmp_path / "out.jsonl"
    refused = cluster.fedq("results", job, "--out", str(out), check=False)
    assert refused.returncode == 1 and "not completed" in refused.stderr
    assert not out.exists()
    w1 = cluster.add("w1", ["cpu"])
    assert "resumed: 3 shard(s) to go" in cluster.fedq("resume", job).stdout
    watched = cluster.fedq("watch", job, timeout=240)
    assert "completed" in watched.stdout, watched.stdout + watched.stderr
    # w1 started after the cancel: it never heard the broadcast, and refused the two
    # revoked shards from the result backend's mark (fedq/engine/revoke.py), unrun (the
    # last shard's backup copy may be refused the same way, "its shard is done")
    log = w1.log_path.read_text()
    cancelled = [line for line in log.splitlines() if "not run: task" in line
                 and "(its job was cancelled)" in line]
    assert len(cancelled) == 2, log
    cluster.fedq("results", job, "--out", str(out))
    got = _read_out(out)
    import pyarrow.parquet as pq

    cluster.fedq("results", job, "--out", str(tmp_path / "out.parquet"))
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == got  # logprob, tokens
    model = _gpt(weights)
    texts = [*PROMPTS[:-2], long]
    assert [r["i"] for r in got] == list(range(len(texts)))
    for row, text in zip(got, texts):
        ids = text_data.encode(text)
        total = 0.0
        with torch.no_grad():
            for lo in range(0, len(ids) - 1, 32):  # the model's context: 32 predictions
                piece = ids[lo:lo + 33]
                logp = F.log_softmax(model(piece[None, :-1])[0], dim=-1)
                total += float(logp.gather(-1, piece[1:, None]).sum())
        assert row["tokens"] == len(ids) - 1
        assert row["logprob"] == pytest.approx(total, abs=1e-3), text
    view = jobs.find(cluster.settings, job)
    assert view is not None
    record_outcome(
        "inference job (GPT score), cancelled before a worker took a shard, resumed "
        "with a worker started between (Redis)",
        "nothing killed: `fedq cancel`, then `fedq resume`",
        "completed once; the new worker refused the two cancelled shards unrun",
        view.done_shards, len(texts) - len({r["i"] for r in got}))

    # op: embed on the same worker: each prompt's unit vector, as one prompt at a time
    # gives it (the long one read in pieces of the model's 32-byte context)
    spec = _spec(tmp_path, model={"weights": weights.name, "name": "gpt", "dataset": "shakespeare",
                                  "args": TINY_GPT, "dataset_args": SMALL_TEXT},
                 inputs={"prompts": prompts.name}, op="embed", shard_size=7, batch_size=5,
                 name="embed")
    out = tmp_path / "embed.jsonl"
    sent = cluster.fedq("infer", str(spec), "--out", str(out), timeout=240)
    assert "no live worker" not in sent.stderr  # w1 consumes cpu now
    got = _read_out(out)
    assert [r["i"] for r in got] == list(range(len(texts)))
    for row, text in zip(got, texts):
        ids = text_data.prompt_ids(text)
        with torch.no_grad():
            total = sum(model.features(ids[lo:lo + 32][None])[0].double().sum(0)
                        for lo in range(0, len(ids), 32))
        want = F.normalize(total, dim=-1)
        assert len(row["embedding"]) == TINY_GPT["n_embd"]
        assert torch.allclose(torch.tensor(row["embedding"], dtype=torch.float64), want,
                              atol=1e-5), text


def test_inference_figures_draw_each_shard_and_each_worker() -> None:
    # Prepare: three shards answered by two workers of two classes, one shard failed.
    from types import SimpleNamespace

    from fedq.observe.plots import close, inference_figures
    from fedq.observe.report import render_inference

    rows = [{"shard": 0, "start": 0, "stop": 10, "status": "done", "attempt": 1,
             "queue": "cpu", "worker": "a@h", "device": "cpu", "seconds": 1.0, "error": None,
             "started": 101.0, "done": 102.0},
            {"shard": 1, "start": 10, "stop": 20, "status": "done", "attempt": 2,
             "queue": "gpu_new", "worker": "b@h", "device": "cuda", "seconds": 0.5,
             "error": None, "started": 101.5, "done": 102.0},
            {"shard": 2, "start": 20, "stop": 25, "status": "failed", "attempt": 3,
             "queue": "cpu", "worker": "a@h", "device": "cpu", "seconds": None,
             "error": "boom", "started": 103.0, "done": None}]
    workers = [SimpleNamespace(worker="a@h", device="cpu", shards=1, items=10, seconds=1.0,
                               items_per_s=10.0),
               SimpleNamespace(worker="b@h", device="cuda", shards=1, items=10, seconds=0.5,
                               items_per_s=20.0)]
    view = SimpleNamespace(id="j1", name="n", op="classify", status="failed", items=25,
                           done_items=20, shards=3, done_shards=2, resent=3, backups=1,
                           elapsed_s=4.0,
                           error="shard 2 failed", shard_rows=rows, workers=workers,
                           spec={"kind": "inference"}, created=100.0)
    # Execute
    figs = inference_figures(view)
    page = render_inference(view, {})
    # Assert: a bar per answered shard, starting at its second since submission; a cross
    # for the failed one; a bar per worker; the class table sums per queue.
    timeline = figs["timeline"].axes[0]
    bars = [p for p in timeline.patches if p.get_width() > 0]
    assert sorted((round(b.get_x(), 2), round(b.get_width(), 2)) for b in bars) == [
        (1.0, 1.0), (1.5, 0.5)]
    assert [len(line.get_xdata()) for line in timeline.lines] == [1]
    assert [round(p.get_width(), 1) for p in figs["throughput"].axes[0].patches] == [10.0, 20.0]
    close(figs)
    assert '<table id="failures">' in page and "boom" in page
    assert '<td class="text">gpu_new</td><td>1</td><td>1</td><td>10</td>' in page
    assert "20 of 25 items" in page and "3 re-sent, 1 backup copy" in page


def test_latest_model_is_the_newest_completed_job_that_fits_the_inputs(tmp_path: Path) -> None:
    # Prepare: a database with an older completed digits job, a newer failed digits
    # job, and a newest completed language-model job.
    from datetime import datetime, timedelta, timezone

    from fedq.db import Job, session_scope
    from fedq.db.session import ensure_schema
    from fedq.errors import JobNotFound
    from fedq.inference.spec import Inputs, ModelSource
    from fedq.settings import Settings

    url = f"sqlite:///{tmp_path / 'fedq.db'}"
    ensure_schema(url)
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = [("old", "completed", "digits", "small_cnn", 0), ("failed", "failed", "digits",
                                                               "small_cnn", 1),
            ("lm", "completed", "shakespeare", "gpt", 2)]
    with session_scope(url) as s:
        for name, status, dataset, model, hours in rows:
            s.add(Job(id=f"job{name}", name=name, spec={"dataset": dataset, "model": model},
                      status=status, total_rounds=1, committed_round=1,
                      global_key=f"jobs/job{name}/global", global_sha256="0" * 64,
                      global_size=10, created_at=start + timedelta(hours=hours)))
    settings = Settings.model_construct(database_url=url)
    latest = ModelSource(job="latest")
    # Execute
    digits, ref, _ = jobs.model_source(settings, latest, tmp_path, Inputs(dataset="digits"))
    text, text_ref, _ = jobs.model_source(settings, latest, tmp_path,
                                          Inputs(prompts="p.txt"))
    # Assert: the failed job is passed over; prompts take the language model; a data
    # set no job trained on is one clear error.
    assert ref is not None and ref.key == "jobs/jobold/global" and digits["name"] == "small_cnn"
    assert text_ref is not None and text_ref.key == "jobs/joblm/global" and text["name"] == "gpt"
    with pytest.raises(JobNotFound, match="latest: no completed training job on synthetic"):
        jobs.model_source(settings, latest, tmp_path, Inputs(dataset="synthetic"))
