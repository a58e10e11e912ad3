"""Hugging Face causal LMs (fedq/models/hf.py): tiny Llama and Qwen2 configurations and
a tiny checkpoint saved here with ``save_pretrained``, never the hub; LoRA adapters as
the federated update, on real workers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedq.blobs import BlobRef, store_for
from fedq.coordinator.evaluation import evaluate_weights, initial_weights
from fedq.db import ClientUpdate, Job, session_scope
from fedq.models import build_model, pinned_args
from fedq.spec import JobSpec
from fedq.status import UpdateStatus
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.testing.procs import run_module
from fedq.weights import dumps, loads, state_of

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA = {"model_type": "llama", **TINY}
QWEN = {"model_type": "qwen2", **TINY}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
BYTES = (16,), 256  # the byte-level corpora's input shape and vocabulary
ROOT = Path(__file__).resolve().parents[1]

SPEC: dict[str, Any] = {
    "name": "hf", "model": "hf_causal_lm", "dataset": "shakespeare",
    "dataset_args": {"block_size": 16, "eval_windows": 64}, "num_clients": 2,
    "clients_per_round": 2, "rounds": 2, "local_steps": 8, "batch_size": 8,
    "optimizer": {"name": "adamw", "lr": 0.01}, "queues": {"cpu": -1}, "seed": 0}


def _checkpoint(folder: Path, config: dict[str, Any] = LLAMA) -> Path:
    """A tiny causal LM saved as ``save_pretrained`` writes it (random weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    args = dict(config)
    kind = args.pop("model_type")
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=256,
                                                                  **args))
    model.save_pretrained(folder)
    return folder


def test_a_lora_model_federates_its_adapters_and_every_process_builds_the_same_base(
) -> None:
    """With ``lora`` the state a job moves is the adapters alone (every name a LoRA
    tensor, a small share of the model); the frozen base is the same whatever torch's
    global seed was (each worker seeds torch per client before it builds the model)."""
    torch.manual_seed(11)
    one = build_model("hf_causal_lm", *BYTES, config=LLAMA, lora=LORA)
    torch.manual_seed(12)
    two = build_model("hf_causal_lm", *BYTES, config=LLAMA, lora=LORA)
    base_one, base_two = (m.lm.get_base_model().state_dict() for m in (one, two))
    assert all(torch.equal(base_one[k], base_two[k]) for k in base_one)
    adapters = one.state_dict()
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert set(adapters) == {n for n, p in one.named_parameters() if p.requires_grad}
    everything = sum(p.numel() for p in one.parameters())
    assert sum(v.numel() for v in adapters.values()) < 0.1 * everything
    two.load_state_dict(state_of(one))  # what a worker does with a round's global model
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(one(x), two(x)) and one(x).shape == (2, 16, 256)
    with pytest.raises(RuntimeError, match="adapter weights do not match the model"):
        two.load_state_dict({k: v for k, v in adapters.items() if ".lora_A." in k})
    full = build_model("hf_causal_lm", *BYTES, config=QWEN)  # a second family, no LoRA
    assert type(full.lm).__name__ == "Qwen2ForCausalLM"
    assert len(full.state_dict()) == len(dict(full.lm.state_dict()))


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path: Path) -> None:
    """``gradient_checkpointing: true`` recomputes the decoder's activations in the
    backward pass: the same loss and the same adapter gradients as without it, and the
    model says it checkpoints."""
    x = torch.randint(0, 256, (2, 16))
    grads = []
    for on in (False, True):
        model = build_model("hf_causal_lm", *BYTES, config=LLAMA, lora=LORA,
                            gradient_checkpointing=on)
        model.train()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
        loss.backward()
        grads.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                    if p.requires_grad}))
        checkpointing = any(getattr(m, "gradient_checkpointing", False) is True
                            for m in model.modules())
        assert checkpointing == on
    (plain_loss, plain), (ckpt_loss, ckpt) = grads
    assert ckpt_loss == pytest.approx(plain_loss, abs=1e-6) and plain.keys() == ckpt.keys()
    assert all(torch.allclose(plain[n], ckpt[n], atol=1e-6) for n in plain)


@pytest.mark.parametrize("source", ["config", "path"])
def test_a_lora_base_held_in_half_precision_trains_float32_adapters(
        tmp_path: Path, source: str) -> None:
    """``base_dtype: bfloat16`` holds the frozen base in bfloat16 (half the weights'
    memory, as the fit check counts it) and the adapters in float32: the same adapter
    tensors as a float32 base's, a training step moves the adapters alone and the base
    is the float32 one rounded. Without lora, and for an unknown type, one line each."""
    from fedq.models.hf import auto_type
    from fedq.spec import OptimizerSpec
    from fedq.worker import fit

    where = {"config": LLAMA} if source == "config" else \
        {"path": str(_checkpoint(tmp_path / "ckpt"))}
    full = build_model("hf_causal_lm", *BYTES, lora=LORA, **where)
    half = build_model("hf_causal_lm", *BYTES, lora=LORA, base_dtype="bfloat16", **where)
    bases = [dict(m.lm.get_base_model().named_parameters()) for m in (full, half)]
    frozen = [n for n, p in half.named_parameters() if not p.requires_grad]
    assert frozen and all(bases[1][n.removeprefix("lm.base_model.model.")].dtype ==
                          torch.bfloat16 for n in frozen if ".lora_" not in n)
    assert all(torch.equal(bases[1][n], bases[0][n].to(torch.bfloat16))
               for n in bases[0] if ".lora_" not in n)
    adapters = half.state_dict()
    assert all(v.dtype == torch.float32 for v in adapters.values())
    assert all(torch.equal(adapters[k], v) for k, v in full.state_dict().items())
    adamw = OptimizerSpec(name="adamw", lr=0.01)
    assert fit.need(half, adamw).weights < 0.6 * fit.need(full, adamw).weights
    x = torch.randint(0, 256, (2, 16))
    opt = torch.optim.AdamW([p for p in half.parameters() if p.requires_grad], lr=0.01)
    before = {n: p.detach().clone() for n, p in half.named_parameters()}
    loss = torch.nn.functional.cross_entropy(half(x).float().reshape(-1, 256), x.reshape(-1))
    loss.backward()
    opt.step()
    after = dict(half.named_parameters())
    assert math.isfinite(loss.item())
    assert any(not torch.equal(before[n], after[n]) for n in adapters if ".lora_B." in n)
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    # and through a worker's training loop (its optimizer, AMP choice, loss)
    from fedq.worker.loop import local_train

    tokens = torch.randint(0, 256, (16, 16))
    stats = local_train(half, tokens, tokens, optimizer=adamw, batch_size=4, epochs=None,
                        steps=3, seed=0, device=torch.device("cpu"))
    assert stats.steps == 3 and stats.loss is not None and math.isfinite(stats.loss)
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    with pytest.raises(ValueError, match=r"^hf_causal_lm: base_dtype: float16 needs lora"):
        build_model("hf_causal_lm", *BYTES, base_dtype="float16", **where)
    with pytest.raises(ValueError, match=r"base_dtype: 'int4' is not one of auto, float32"):
        build_model("hf_causal_lm", *BYTES, lora=LORA, base_dtype="int4", **where)
    # auto: what the GPU computes fastest (bfloat16 from Ampere on, float16 on Pascal)
    assert [auto_type(False, False), auto_type(True, False), auto_type(True, True)] == \
        [torch.float32, torch.float16, torch.bfloat16]


def test_a_worker_with_another_checkpoint_at_the_path_refuses_in_one_line(
        tmp_path: Path) -> None:
    """``fedq submit`` pins the checkpoint's digest into the job's model_args; a worker
    whose checkpoint at that path has one tensor changed builds nothing."""
    folder = _checkpoint(tmp_path / "ckpt")
    args = pinned_args("hf_causal_lm", {"path": str(folder), "lora": LORA})
    assert args["digest"].startswith("b3-")
    build_model("hf_causal_lm", *BYTES, **args)  # the same checkpoint: built
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^hf_causal_lm: path .*ckpt: its weights \(digest "
                                         r".*\) are not the job's .*same checkpoint$"):
        build_model("hf_causal_lm", *BYTES, **args)


@pytest.mark.parametrize(("model_args", "message"), [
    ({"config": LLAMA, "lora": {**LORA, "target_modules": ["q_proj", "qkv"]}},
     "lora.target_modules: 'qkv' is no linear module of this model (its linear modules: "
     "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)"),
    ({"config": {**LLAMA, "model_type": "llamma"}},
     "config: Unrecognized model identifier: llamma"),
    ({"path": "/nonexistent/ckpt"}, "path /nonexistent/ckpt: no *.safetensors file there"),
    ({"config": LLAMA, "path": "/x"}, "give exactly one of model_args.config"),
    ({"config": LLAMA, "lora": {**LORA, "rank": 4}}, "lora.rank: unknown (known: r, alpha"),
])
def test_a_model_that_cannot_be_built_is_one_line_and_no_job(
        tmp_path: Path, model_args: dict[str, Any], message: str) -> None:
    env = base_env(tmp_path / "home")
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "model_args": model_args}))
    proc = run_module("fedq.cli", ["submit", str(spec)], env, 120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr
    status = run_module("fedq.cli", ["status"], env, 120)
    assert "hf" not in status.stdout.replace("fedq", "")  # no job was made


def test_only_a_transformers_job_exports_and_an_unknown_job_is_named(tmp_path: Path) -> None:
    env = base_env(tmp_path / "home")
    spec = tmp_path / "digits.yaml"
    spec.write_text(yaml.safe_dump({**DIGITS, "name": "cnn"}))
    job = run_module("fedq.cli", ["submit", str(spec)], env, 120).stdout.split()[0]
    for args, code, line in (
            ([job, str(tmp_path / "out")], 2, f"fedq: error: job {job} trains small_cnn: "
             "only hf_causal_lm jobs export as a Hugging Face checkpoint"),
            (["f00dfeed0000", str(tmp_path / "out")], 4, "f00dfeed0000")):
        proc = run_module("fedq.cli", ["export", *args], env, 120)
        assert proc.returncode == code and line in proc.stderr.strip(), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def _tokenizer(folder: Path, corpus: list[str]) -> Path:
    """A byte-level BPE tokenizer of 400 tokens trained here on ``corpus`` and saved as
    ``tokenizer.json`` (what ``save_pretrained`` writes beside a checkpoint)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _own_text(folder: Path) -> list[str]:
    """Two plays as a .txt file and a .jsonl file of scenes (real English text)."""

    from fedq.data import text

    plays = [body.decode() for _, body in text.works(("shakespeare",))[:2]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "one.txt").write_text(plays[0][:30_000])
    scenes = [plays[1][k:k + 3_000] for k in range(0, 30_000, 3_000)]
    (folder / "two.jsonl").write_text(
        "\n".join(json.dumps({"text": s, "id": k}) for k, s in enumerate(scenes)) + "\n")
    return [plays[0][:30_000], "\n\n".join(scenes)]


def test_own_text_files_are_read_through_a_local_tokenizer(tmp_path: Path) -> None:
    """``dataset: text_files``: .txt and .jsonl files under the data folder, tokenized by
    a tokenizer.json in a local folder: the vocabulary is the tokenizer's, each file a
    group, windows decode back to the files' text; every mistake is one line naming
    the file (and line)."""
    from fedq.data import load_dataset
    from fedq.errors import DataUnavailable

    bodies = _own_text(tmp_path / "data")
    tok_dir = _tokenizer(tmp_path / "tok", bodies)
    args = {"files": ["one.txt", "*.jsonl"], "tokenizer": str(tok_dir), "block_size": 32,
            "eval_windows": 0}
    ds = load_dataset("text_files", tmp_path / "data", args)
    assert ds.num_classes == ds.tokenizer.vocab_size == 400 and ds.is_text
    assert ds.input_shape == (32,) and set(ds.groups.tolist()) == {0, 1}
    assert int(ds.x_train.max()) < 400 and torch.equal(ds.x_train[:, 1:], ds.y_train[:, :-1])
    first = ds.tokenizer.decode(torch.cat([ds.x_train[0], ds.y_train[0, -1:]]).tolist())
    assert bodies[0].startswith(first)  # the first window is the file's first tokens
    assert ds.tokenizer.decode(ds.tokenizer.encode(bodies[1])) == bodies[1]
    # fewer bytes a token than the byte-level set: BPE merges the commonest pairs
    raw = load_dataset("text_files", tmp_path / "data", {**args, "tokenizer": "bytes"})
    assert raw.num_classes == 256 and len(raw.x_train) > 1.5 * len(ds.x_train)

    (tmp_path / "data" / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "data" / "worse.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp_path / "data" / "short.txt").write_text("too short")
    (tmp_path / "empty").mkdir()
    for files, tokenizer, line in (
            (["nothing.txt"], "bytes", f"text_files: {tmp_path}/data/nothing.txt: no such file"),
            (["*.csv"], "bytes", f"text_files: no file matches {tmp_path}/data/*.csv"),
            (["bad.jsonl"], "bytes", f"text_files: {tmp_path}/data/bad.jsonl:2: no string "
                                     "field 'text'"),
            (["worse.jsonl"], "bytes", f"{tmp_path}/data/worse.jsonl:2: not JSON (Expecting"),
            (["short.txt"], "bytes", "text_files: too little text for one training and one "
                                     "held-out window of 33 tokens"),
            (["one.txt"], str(tmp_path / "empty"), f"tokenizer {tmp_path}/empty: no "
                                                   "tokenizer.json there"),
            ([], "bytes", "text_files: files: give one or more paths or glob patterns")):
        with pytest.raises(DataUnavailable) as refused:
            load_dataset("text_files", tmp_path / "data",
                         {**args, "files": files, "tokenizer": tokenizer})
        assert line in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_conversations_are_rendered_by_the_tokenizers_chat_template(tmp_path: Path) -> None:
    """``chat: true``: each .jsonl line's ``messages`` becomes text through the chat
    template in the tokenizer folder's tokenizer_config.json (transformers, local files
    only); a folder without a template, bytes, and a line that is no conversation are
    one line each."""

    from fedq.coordinator.evaluation import evaluate
    from fedq.data import load_dataset
    from fedq.data.datasets import IGNORE
    from fedq.errors import DataUnavailable

    bodies = _own_text(tmp_path / "data")
    tok_dir = _tokenizer(tmp_path / "tok", bodies)
    lines = [bodies[0][k:k + 400] for k in range(0, 24_000, 400)]
    chats = [{"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
             for a, b in zip(lines[::2], lines[1::2], strict=True)]
    (tmp_path / "data" / "chat.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    args = {"files": ["chat.jsonl"], "tokenizer": str(tok_dir), "chat": True,
            "block_size": 32, "eval_windows": 0}
    with pytest.raises(DataUnavailable, match=r"tokenizer_config.json has no chat_template"):
        load_dataset("text_files", tmp_path / "data", args)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}"}))
    every = load_dataset("text_files", tmp_path / "data", {**args, "loss_on": "all"})
    seen = every.tokenizer.decode(every.x_train.reshape(-1).tolist())
    assert seen.startswith(f"<|user|>{lines[0]}\n<|assistant|>{lines[1]}\n"), seen[:200]
    assert not (every.y_train == IGNORE).any()

    # loss_on: assistant (the default): the loss is taken on the assistant turns alone
    ds = load_dataset("text_files", tmp_path / "data", args)
    targets = ds.y_train[ds.y_train != IGNORE]
    said = ds.tokenizer.decode(targets.tolist())
    assert lines[1][:60] in said and lines[3][:60] in said  # the assistant's words...
    assert lines[0][:60] not in said and lines[2][:60] not in said  # ...never the user's
    assert "<|user|>" not in said and "<|assistant|>" in said
    assert 0.3 < len(targets) / every.y_train.numel() < 0.7  # half of each conversation
    # a window whose targets are all the user's is left out; the inputs are whole
    assert len(ds.x_train) < len(every.x_train) and (ds.x_train != IGNORE).all()
    assert ((ds.y_train != IGNORE).any(dim=1)).all() and (ds.y_test != IGNORE).any()
    # the held-out loss counts the assistant's tokens alone
    model = torch.nn.Sequential(torch.nn.Embedding(ds.num_classes, ds.num_classes))
    _, loss = evaluate(model, ds.x_test, ds.y_test, device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(ds.x_test).flatten(0, 1)
    kept = ds.y_test.flatten() != IGNORE
    want = torch.nn.functional.cross_entropy(logits[kept], ds.y_test.flatten()[kept])
    assert loss == pytest.approx(float(want), rel=1e-5)

    with pytest.raises(DataUnavailable, match=r"loss_on: 'users': all or assistant$"):
        load_dataset("text_files", tmp_path / "data", {**args, "loss_on": "users"})
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({  # the turn count first
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{{ messages|length }}{% for m in messages %}<|{{ m['role'] }}|>"
                         "{{ m['content'] }}\n{% endfor %}"}))
    with pytest.raises(DataUnavailable, match=r"chat.jsonl:1: message 2: the chat template "
                                              r"does not render each turn as a prefix"):
        load_dataset("text_files", tmp_path / "data", args)
    assert load_dataset("text_files", tmp_path / "data", {**args, "loss_on": "all"})
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}"}))
    with pytest.raises(DataUnavailable, match="chat: needs a tokenizer folder"):
        load_dataset("text_files", tmp_path / "data", {**args, "tokenizer": "bytes"})
    (tmp_path / "data" / "chat.jsonl").write_text(
        json.dumps(chats[0]) + "\n" + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataUnavailable, match=r"chat.jsonl:2: messages: not a list of "
                                              r"\{role, content\} strings$"):
        load_dataset("text_files", tmp_path / "data", args)


def test_inference_reads_and_writes_text_through_the_models_own_tokenizer(
        tmp_path: Path) -> None:
    """Batch inference and fedq serve of a model trained through a tokenizer folder: its
    shape comes from the folder and ``block_size`` (no training file read), prompts are
    encoded and texts decoded by it, score counts its tokens, and a generated text may
    be as long as ``max_tokens`` of its longest tokens (the bound a worker's answer is
    checked against), never longer; a streamed text holds back a character whose bytes
    are not all sampled yet."""
    from fedq.data import shape_of
    from fedq.data.tokens import ByteTokenizer, load_tokenizer
    from fedq.inference.jobs import token_chars
    from fedq.inference.run import complete, load_model, run_items, so_far_text
    from fedq.protocol.envelope import FormatError
    from fedq.protocol.inference import check_output, line_bytes

    tok_dir = _tokenizer(tmp_path / "tok", _own_text(tmp_path / "data"))
    args = {"files": ["nowhere/*.txt"], "tokenizer": str(tok_dir), "block_size": 16}
    shape = shape_of("text_files", args)
    tok = load_tokenizer(str(tok_dir))
    assert (shape.input_shape, shape.num_classes, shape.is_text) == ((16,), tok.vocab_size,
                                                                      True)
    arch = {"name": "hf_causal_lm", "dataset": "text_files", "dataset_args": args,
            "args": {"config": QWEN}}
    model = build_model("hf_causal_lm", (16,), tok.vocab_size, config=QWEN)
    model = load_model(arch, state_of(model), torch.device("cpu"))
    prompts = ["ROMEO. What light through yonder", "Who art thou?"]
    cpu = torch.device("cpu")
    scored = run_items(model, "score", prompts, 0, 4, cpu, tok=tok)
    assert [r["tokens"] for r in scored] == [len(tok.encode(p)) - 1 for p in prompts]
    assert [r["tokens"] for r in run_items(model, "score", prompts, 0, 4, cpu)] == \
        [len(p.encode()) - 1 for p in prompts]  # bytes, where no tokenizer is given
    # the longest prompt is scored in pieces of the model's 16 positions, the same sum
    long = " ".join(prompts * 6)
    ids = torch.tensor(tok.encode(long))
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None, :16]), -1)[0, :-1].gather(
            -1, ids[1:16, None])[:, 0].sum().item()
    assert len(ids) > 17 and run_items(model, "score", [long], 0, 4, cpu,
                                       tok=tok)[0]["logprob"] < logp
    made = run_items(model, "generate", prompts, 0, 2, cpu, {"max_tokens": 6, "seed": 3},
                     tok)
    again = complete(model, [{"prompt": p, "max_tokens": 6, "temperature": 0.8, "top_k": 40,
                              "seed": 3 + n} for n, p in enumerate(prompts)], cpu, None, tok)
    assert [r["text"] for r in made] == [r["text"] for r in again]
    assert any(len(r["text"]) > 6 for r in made), made  # more characters than tokens
    embedded = run_items(model, "embed", prompts, 0, 4, cpu, tok=tok)
    assert {len(r["embedding"]) for r in embedded} == {TINY["hidden_size"]}
    chars = token_chars(arch)
    assert chars == tok.token_chars() > 1 and token_chars({"dataset_args": {}}) == 1
    longest = "x" * (6 * chars)
    check_output(json.dumps({"i": 0, "text": longest}).encode(), "generate", 0, 1, 0, 6,
                 chars)
    with pytest.raises(FormatError, match="more than its max_tokens 6 can decode to"):
        check_output(json.dumps({"i": 0, "text": longest + "x"}).encode(), "generate", 0, 1,
                     0, 6, chars)
    assert line_bytes("generate", 4096, chars) > 12 * 4096 * chars
    assert so_far_text(ByteTokenizer(), list("é".encode())[:1]) == ""
    assert so_far_text(ByteTokenizer(), list("aé".encode())) == "aé"


def test_a_chat_request_is_rendered_by_the_template_and_checked_field_by_field(
        tmp_path: Path) -> None:
    """/v1/chat/completions' request: the messages rendered by the tokenizer folder's
    chat template into one completion prompt, its end-of-turn text a stop after the
    request's own; max_completion_tokens read as max_tokens; what fedq does not do
    (tools, content parts, an unknown role) refused by name."""
    from fedq.data.tokens import chat_asker
    from fedq.serve.openai import parse_chat
    from fedq.serve.served import Served

    ckpt = tmp_path / "ckpt"
    made = run_module("fedq.models.tiny", [str(ckpt)], base_env(tmp_path / "home"), 120)
    assert made.returncode == 0, made.stderr
    ask, end = chat_asker(str(ckpt))
    served = Served(name="m", op="generate", model={}, arch={}, classes=512,
                    input_shape=(32,), queues=["cpu"], chat=ask, chat_end=end)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Who art thou?"}]
    items, prompt, stops = parse_chat({"messages": messages, "max_completion_tokens": 9,
                                       "n": 2, "seed": 4, "stop": ["\n\n"]}, served)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho art "
                      "thou?<|im_end|>\n<|im_start|>assistant\n")
    assert stops == ["\n\n", "<|im_end|>"]
    assert [(i["prompt"], i["max_tokens"], i["seed"]) for i in items] == \
        [(prompt, 9, 4), (prompt, 9, 5)]
    for body, said in [
            ({"messages": messages, "tools": []}, "tools: not supported by fedq serve"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
             "messages[0].content: a string"),
            ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role: one of"),
            ({"messages": []}, "messages: a list of 1 to"),
            ({"messages": messages, "max_tokens": 2, "max_completion_tokens": 2},
             "give one"),
            ({"prompt": "hi"}, 'expected an object with "messages"')]:
        with pytest.raises(ValueError, match=re.escape(said)):
            parse_chat(body, served)


@pytest.mark.slow
def test_a_lora_job_on_a_local_checkpoint_trains_adapters_on_two_workers(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """A tiny Llama checkpoint (save_pretrained), LoRA on q and v: 2 workers on Redis +
    PostgreSQL train 3 rounds; every upload is the adapters' size, not the model's, and
    the global model's held-out loss ends below round 0's. Then full-parameter DiLoCo
    of a new Qwen2 model: the same code, another family."""
    cluster = redis_cluster
    folder = _checkpoint(tmp_path / "ckpt")
    cluster.start(a=["cpu"], b=["cpu"], control=["control"])
    lora = {**SPEC, "name": "hf-lora", "rounds": 3,
            "model_args": {"path": str(folder), "lora": LORA}}
    job = cluster.submit(lora)
    done = cluster.wait(job, timeout=300)
    assert done.status == "completed", done.error
    spec = JobSpec.model_validate({**lora, "model_args": pinned_args("hf_causal_lm",
                                                                      lora["model_args"])})
    from fedq.models.hf import checkpoint_digest

    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        stored = s.get(Job, job)
        assert stored is not None  # fedq submit pinned the checkpoint it saw
        assert stored.spec["model_args"]["digest"] == checkpoint_digest(folder)
    adapters = initial_weights(spec)
    size = len(dumps(adapters, {"job": job}))
    model_bytes = (folder / "model.safetensors").stat().st_size
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        ok = [u for u in s.query(ClientUpdate).filter_by(job_id=job)
              if u.status == UpdateStatus.OK]
        assert len(ok) == 6 and {u.worker for u in ok} == {"a@test", "b@test"}
        assert all(abs(u.bytes_up - size) < 512 for u in ok), (size, [u.bytes_up for u in ok])
    assert size < model_bytes / 10
    _, start_loss = evaluate_weights(spec, adapters)
    final = cluster.rounds(job)[-1]
    assert final.eval_loss is not None and final.eval_loss < start_loss, \
        (start_loss, [r.eval_loss for r in cluster.rounds(job)])
    _check_the_result(cluster, job, spec, folder, tmp_path)
    # full-parameter DiLoCo of a new Qwen2 model on text files of our own, tokenized by a
    # local BPE tokenizer: the vocabulary is the tokenizer's, generate decodes with it,
    # and the export carries the tokenizer that plain transformers loads beside it
    bodies = _own_text(tmp_path / "data")
    tok_dir = _tokenizer(tmp_path / "tok", bodies)
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({  # a chat template, for --chat
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"}))
    full = cluster.submit({**SPEC, "name": "hf-diloco", "model_args": {"config": QWEN},
                           "server": {"name": "diloco"}, "dataset": "text_files",
                           "data_dir": str(tmp_path / "data"),
                           "dataset_args": {"files": ["one.txt", "two.jsonl"],
                                            "tokenizer": str(tok_dir), "block_size": 16,
                                            "eval_windows": 64}})
    assert cluster.wait(full, timeout=300).status == "completed"
    said = cluster.fedq("generate", full, "--prompt", "ROMEO.", "--tokens", "8").stdout
    assert said.startswith("ROMEO.") and len(said) > len("ROMEO."), said
    reply = cluster.fedq("generate", full, "--chat", "Who art thou?", "--tokens", "8").stdout
    assert reply.strip() and "Who art thou" not in reply and "<|" not in reply[:2], reply
    refused = cluster.fedq("generate", job, "--chat", "hi", check=False)
    assert refused.returncode == 2 and "--chat needs a model trained through a tokenizer " \
        "folder" in refused.stderr and refused.stderr.count("\n") == 1, refused.stderr
    exported = tmp_path / "qwen"
    cluster.fedq("export", full, str(exported))
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(exported, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert lm.config.vocab_size == 400 and tok.decode(tok.encode(bodies[0][:200])) == \
        bodies[0][:200]
    _infer_and_serve(cluster, full, tok_dir, tmp_path, exported)


def _refused(cluster: Cluster, tmp_path: Path, spec: dict[str, Any], said: str) -> None:
    """`fedq submit` of ``spec``: one line saying ``said``, exit 2."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = cluster.fedq("submit", str(path), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and said in proc.stderr, \
        proc.stderr


@pytest.mark.slow
def test_a_shipped_base_reaches_workers_that_lack_the_checkpoint(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """``ship_base: true``: fedq submit puts the checkpoint's config and weights in the
    blob store with the job. The checkpoint then leaves the path the job names, so no
    process has it there: two workers (training) and the control worker (evaluating
    each round) fetch that copy once into FEDQ_HOME/bases, the job's digest checks it,
    and LoRA trains on it. Without the fetch the workers refuse the task (no
    config.json at the path) and the job fails. A spec that writes base_files itself,
    or ship_base without a path, is one line, exit 2, no job."""
    from fedq.models.hf import checkpoint_digest

    cluster = redis_cluster
    folder = _checkpoint(tmp_path / "ckpt")
    digest = checkpoint_digest(folder)
    cluster.start(control=["control"])
    job = cluster.submit({**SPEC, "name": "hf-shipped", "model_args": {
        "path": str(folder), "lora": LORA, "ship_base": True}})
    folder.rename(tmp_path / "away")  # before any worker starts
    cluster.start(a=["cpu"], b=["cpu"])
    done = cluster.wait(job, timeout=300)
    assert done.status == "completed", done.error
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        stored = s.get(Job, job)
        assert stored is not None
        files = stored.spec["model_args"]["base_files"]
        ok = [u for u in s.query(ClientUpdate).filter_by(job_id=job)
              if u.status == UpdateStatus.OK]
    assert sorted(files) == ["config.json", "generation_config.json", "model.safetensors"]
    assert all(ref["key"].startswith(f"jobs/{job}/base/") for ref in files.values())
    (fetched,) = (Path(cluster.env["FEDQ_HOME"]) / "bases").iterdir()
    assert sorted(p.name for p in fetched.iterdir()) == sorted(files)
    assert checkpoint_digest(fetched) == digest
    assert len(ok) == 4 and {u.worker for u in ok} == {"a@test", "b@test"}
    assert all(r.eval_loss is not None for r in cluster.rounds(job))
    for args, said in [({"path": str(tmp_path / "away"), "base_files": {}},
                        "model_args.base_files: fedq submit writes it"),
                       ({"config": LLAMA, "ship_base": True},
                        "ship_base sends the checkpoint at model_args.path")]:
        _refused(cluster, tmp_path, {**SPEC, "name": "bad", "model_args": args}, said)


@pytest.mark.slow
def test_a_bpe_trained_at_submit_is_stored_with_the_job_and_fetched_by_workers(
        redis_cluster: Cluster, tmp_path: Path) -> None:
    """``tokenizer: bpe:300`` on text_files: fedq submit trains a byte-level BPE of 300
    tokens on the job's files, writes it to FEDQ_HOME/tokenizers and stores it with the
    job. The submitter's folder then goes away, so the control worker (evaluating,
    bounding each client's steps) and two workers (training a new Qwen2 model) fetch
    the stored copy into folders of their own, and the job completes; `fedq generate`
    decodes with it too. Without the fetch the workers cannot read the tokenizer and the
    job fails. A vocabulary out of range, chat with a trained BPE, or a spec that
    writes tokenizer_files itself is one line, exit 2, no job."""
    from fedq.data.tokens import FolderTokenizer

    cluster = redis_cluster
    bodies = _own_text(tmp_path / "data")
    args = {"files": ["one.txt", "two.jsonl"], "tokenizer": "bpe:300", "block_size": 16,
            "eval_windows": 64}
    spec = {**SPEC, "name": "hf-bpe", "model_args": {"config": QWEN}, "dataset": "text_files",
            "data_dir": str(tmp_path / "data"), "dataset_args": args}
    job = cluster.submit(spec)
    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        stored = s.get(Job, job)
        assert stored is not None
        written = Path(stored.spec["dataset_args"]["tokenizer"])
        ref = stored.spec["dataset_args"]["tokenizer_files"]["tokenizer.json"]
    home = Path(cluster.env["FEDQ_HOME"])
    assert written.parent == home / "tokenizers" and ref["key"] == \
        f"jobs/{job}/tokenizer/tokenizer.json"
    trained = FolderTokenizer(written)
    assert trained.vocab_size == 300 and trained.decode(trained.encode(bodies[0][:300])) == \
        bodies[0][:300]
    data = (written / "tokenizer.json").read_bytes()
    written.rename(tmp_path / "away")  # before any worker or the control worker starts
    cluster.start(control=["control"], a=["cpu"], b=["cpu"])
    done = cluster.wait(job, timeout=300)
    assert done.status == "completed", done.error
    fetched = [p for p in (home / "tokenizers").iterdir() if p != written]
    assert len(fetched) == 1 and (fetched[0] / "tokenizer.json").read_bytes() == data
    assert all(r.eval_loss is not None for r in cluster.rounds(job))
    said = cluster.fedq("generate", job, "--prompt", "ROMEO.", "--tokens", "8").stdout
    assert said.startswith("ROMEO.") and len(said) > len("ROMEO."), said
    for bad, said in [({**args, "tokenizer": "bpe:10"}, "a vocabulary of 260 to"),
                      ({**args, "chat": True}, "is trained without one"),
                      ({**args, "tokenizer_files": {}},
                       "dataset_args.tokenizer_files: fedq submit writes it")]:
        _refused(cluster, tmp_path, {**spec, "name": "bad", "dataset_args": bad}, said)


def _infer_and_serve(cluster: Cluster, job: str, tok_dir: Path, tmp_path: Path,
                     exported: Path) -> None:
    """A model trained through its own BPE tokenizer, used on real workers: `fedq infer`
    generates, scores and embeds through that tokenizer (the texts the model's in one
    process, the token counts the tokenizer's), and `fedq serve JOB` answers OpenAI's
    own Python client: chat completions rendered by the tokenizer's chat template, cut
    at a stop, whole or streamed, and completions, with usage in the tokenizer's
    tokens. `fedq serve --hf` of the folder `fedq export` wrote answers the same chat,
    through the tokenizer and template exported with it."""
    import openai

    from fedq.data.tokens import chat_asker, load_tokenizer
    from fedq.inference.run import complete, run_items
    from tests.test_serve import Gateway

    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        row = s.get(Job, job)
        assert row is not None
        spec, ref = JobSpec.model_validate(row.spec), BlobRef(row.global_key,
                                                              row.global_sha256,
                                                              row.global_size)
    tok = load_tokenizer(str(tok_dir))
    model = build_model("hf_causal_lm", (16,), tok.vocab_size, **spec.model_args)
    model.load_state_dict(loads(store_for(cluster.settings).get(ref)))
    model.eval()
    cpu = torch.device("cpu")
    prompts = ["ROMEO. What light", "Who art thou?", "JULIET."]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    sampling = {"max_tokens": 6, "temperature": 0.8, "top_k": 20, "seed": 5}
    got = {}
    for op in ("generate", "score", "embed"):
        path = tmp_path / f"infer-{op}.yaml"
        path.write_text(yaml.safe_dump({
            "kind": "inference", "name": f"hf-{op}", "queues": ["cpu"], "op": op,
            "model": {"job": job}, "inputs": {"prompts": str(tmp_path / "prompts.txt")},
            "shard_size": 2, "generate": sampling}))
        out = tmp_path / f"infer-{op}.jsonl"
        cluster.fedq("infer", str(path), "--out", str(out), timeout=240)
        got[op] = [json.loads(line) for line in out.read_text().splitlines()]
    want = run_items(model, "generate", prompts, 0, 1, cpu, sampling, tok)
    assert got["generate"] == want and all(r["text"] for r in want), (got["generate"], want)
    scored = run_items(model, "score", prompts, 0, 4, cpu, tok=tok)
    assert [r["tokens"] for r in got["score"]] == [len(tok.encode(p)) - 1 for p in prompts]
    assert all(math.isclose(a["logprob"], b["logprob"], abs_tol=1e-3)
               for a, b in zip(got["score"], scored, strict=True))
    vectors = run_items(model, "embed", prompts, 0, 4, cpu, tok=tok)
    assert all(max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"],
                                              strict=True)) < 1e-4
               for a, b in zip(got["embed"], vectors, strict=True))

    gateway = Gateway(cluster, [job])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1",
                               api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Who art thou?"}]
        ask, _ = chat_asker(str(tok_dir))
        prompt = ask(messages)
        reply = complete(model, [{"prompt": prompt, "max_tokens": 8, "temperature": 1.0,
                                  "top_k": 0, "seed": 7}], cpu, None, tok)[0]["text"]
        stop = reply[3:5]  # a stop the reply holds: it ends before it
        chat = client.chat.completions.create(model=job, messages=messages,  # type: ignore
                                              max_tokens=8, seed=7, stop=[stop])
        text = reply[:reply.find(stop)]
        assert chat.object == "chat.completion" and chat.choices[0].message.role == \
            "assistant"
        assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == \
            (text, "stop"), (chat, reply)
        assert chat.usage is not None and (chat.usage.prompt_tokens,
                                           chat.usage.completion_tokens) == \
            (len(tok.encode(prompt)), len(tok.encode(text)))
        pieces = list(client.chat.completions.create(
            model=job, messages=messages, max_tokens=8, seed=7, stop=[stop],  # type: ignore
            stream=True, stream_options={"include_usage": True}))
        said = [c for c in pieces if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in said) == text
        assert said[0].choices[0].delta.role == "assistant"
        assert said[-1].choices[0].finish_reason == "stop" and pieces[-1].usage is not None
        whole = client.chat.completions.create(model=job, messages=messages,  # type: ignore
                                               max_tokens=8, seed=7)
        assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == \
            (reply, "length")
        done = client.completions.create(model=job, prompt="ROMEO.", max_tokens=6, seed=2)
        alone = complete(model, [{"prompt": "ROMEO.", "max_tokens": 6, "temperature": 1.0,
                                  "top_k": 0, "seed": 2}], cpu, None, tok)[0]["text"]
        assert done.choices[0].text == alone and done.usage is not None and \
            done.usage.prompt_tokens == len(tok.encode("ROMEO."))
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=job, messages=messages,  # type: ignore
                                           logprobs=True)
        assert "logprobs: not supported by fedq serve" in refused.value.message
    finally:
        gateway.stop()
    gateway = Gateway(cluster, ["--hf", str(exported)])
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1",
                               api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [str(exported)]
        again = client.chat.completions.create(model=str(exported),  # type: ignore
                                               messages=messages, max_tokens=8, seed=7)
        assert again.choices[0].message.content == reply, (again, reply)
        pieces = list(client.chat.completions.create(
            model=str(exported), messages=messages, max_tokens=8, seed=7,  # type: ignore
            stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in pieces) == reply
    finally:
        gateway.stop()
    missing = cluster.fedq("serve", "--hf", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and \
        "model.hf: hf_causal_lm: path" in missing.stderr, missing.stderr


def _check_the_result(cluster: Cluster, job: str, spec: JobSpec, checkpoint: Path,
                      tmp_path: Path) -> None:
    """`fedq export` writes what plain transformers (merged) and PEFT (--adapter) load
    with fedq's logits for the trained global model; `fedq generate` samples from it;
    a second export into the same folder is one line, exit 2, the folder untouched."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with session_scope(cluster.env["FEDQ_DATABASE_URL"]) as s:
        row = s.get(Job, job)
        assert row is not None
        ref = BlobRef(row.global_key, row.global_sha256, row.global_size)
    model = build_model("hf_causal_lm", *BYTES, **spec.model_args)
    model.load_state_dict(loads(store_for(cluster.settings).get(ref)))
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    said = cluster.fedq("export", job, str(merged)).stdout
    assert f"job {job} round 3: written to {merged}" in said
    cluster.fedq("export", job, str(adapter), "--adapter")
    x = torch.randint(0, 256, (2, 16))
    plain = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).eval()
    base = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    peft = PeftModel.from_pretrained(base, adapter, local_files_only=True).eval()
    model.eval()
    with torch.no_grad():
        ours = model(x)
        assert torch.allclose(plain(input_ids=x).logits, ours, atol=1e-5)
        assert torch.allclose(peft(input_ids=x).logits, ours, atol=1e-5)
    before = sorted(p.name for p in merged.iterdir())
    again = cluster.fedq("export", job, str(merged), check=False)
    assert again.returncode == 2 and again.stderr.strip() == (
        f"fedq: error: {merged} exists and is not an empty folder: name a new one")
    assert sorted(p.name for p in merged.iterdir()) == before
    text = cluster.fedq("generate", job, "--prompt", "ROMEO.", "--tokens", "20")
    assert text.stdout.startswith("ROMEO.") and len(text.stdout.encode()) > len("ROMEO.")
    assert "Warning" not in text.stderr, text.stderr


def test_the_readmes_lora_example_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    """The README's LoRA block: `python -m fedq.models.tiny DIR` writes a checkpoint with
    its tokenizer and text, `fedq submit examples/lora_checkpoint.yaml --set ...` points
    the example at it, and a worker's task trains and sends the adapters alone. The
    tiny checkpoint's ChatML template finds the assistant's turns for the loss mask. A
    malformed --set is one line, exit 2, no job."""

    from fedq.blobs import global_key, open_store
    from fedq.data import load_dataset
    from fedq.data.datasets import IGNORE
    from fedq.data.tokens import chat_prompt
    from fedq.protocol.training import TrainRef, UpdateRef
    from fedq.spec import load_spec
    from fedq.worker.update import run_training

    ckpt = tmp_path / "ckpt"
    env = base_env(tmp_path / "home")
    made = run_module("fedq.models.tiny", [str(ckpt)], env, 120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"wrote {ckpt}: a llama checkpoint of 0.4M parameters")
    again = run_module("fedq.models.tiny", [str(ckpt)], env, 120)
    assert again.returncode == 2 and again.stderr.strip() == \
        f"fedq: error: {ckpt}: not a new or empty folder"

    sets = [f"model_args.path={ckpt}", f"dataset_args.tokenizer={ckpt}",
            f"data_dir={ckpt / 'text'}", "local_steps=2", "dataset_args.block_size=32"]
    spec = load_spec(ROOT / "examples" / "lora_checkpoint.yaml", sets)
    spec = JobSpec.model_validate({**spec.to_json(), "model_args": pinned_args(
        "hf_causal_lm", spec.model_args)})
    store = open_store(str(tmp_path / "blobs"))
    adapters = initial_weights(spec)
    assert adapters and all("lora_" in k for k in adapters)
    blob = store.put(global_key("j", 0), dumps(adapters))
    out = UpdateRef.from_json(run_training(TrainRef("j", 1, 0, "cpu", spec.to_json(),
                                                    blob).to_json(), store, "w"))
    assert out.status == "ok" and out.steps == 2, out.error
    assert out.bytes_up < (ckpt / "model.safetensors").stat().st_size / 10

    chats = [{"messages": [{"role": "user", "content": f"question {k} " * 20},
                           {"role": "assistant", "content": f"answer {k} " * 20}]}
             for k in range(40)]
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "c.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    ds = load_dataset("text_files", tmp_path / "chat", {
        "files": ["c.jsonl"], "tokenizer": str(ckpt), "chat": True, "block_size": 32})
    said = ds.tokenizer.decode(ds.y_train[ds.y_train != IGNORE].tolist())
    assert "answer 3 answer" in said and "question" not in said and "<|im_end|>" in said
    # what `fedq generate --chat` asks the model with, and where its reply ends
    assert chat_prompt(str(ckpt), None, "hi") == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>")

    bad = run_module("fedq.cli", ["submit", str(ROOT / "examples" / "lora_checkpoint.yaml"),
                                  "--set", "model_args.path"], env, 120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert "--set 'model_args.path': want KEY=VALUE" in bad.stderr
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").glob("*.db"))
