"""Running a model over items: what a worker does with one shard, and the same code a
person calls in one process (``fedq.inference.run.run_items``) to check the outputs.

The model is built once per worker process and job (kept under its weights' digest,
like a training worker keeps the global model): the shards after the first of a job
pay no download and no build."""

from __future__ import annotations

import codecs
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any, cast

import torch
import torch.nn.functional as F

from fedq.blobs import BlobRef, BlobStore
from fedq.data import load_dataset, shape_of
from fedq.data.tokens import ByteTokenizer, Tokenizer, load_tokenizer
from fedq.models import build_model
from fedq.models.device import pick_device
from fedq.process import PROCESS
from fedq.protocol.inference import (
    Arch,
    Blob,
    ShardTask,
    output_key,
    parse_batch,
    parse_task,
)
from fedq.redaction import redact_text
from fedq.settings import get_settings
from fedq.testing import faults
from fedq.weights import loads
from fedq.worker.loop import amp_autocast, device_amp, measured_amp

log = logging.getLogger(__name__)

_BUILT: dict[str, torch.nn.Module] = {}  # weights' digest -> the model, loaded (one kept)

BYTES = ByteTokenizer()


@lru_cache(maxsize=4)
def tokenizer_of(name: str) -> Tokenizer:
    """The tokenizer a model's text goes through: ``bytes``, or the folder its data set's
    ``dataset_args.tokenizer`` names (read once per process)."""
    return load_tokenizer(name)


def arch_tokenizer(dataset_args: dict[str, Any] | None) -> Tokenizer:
    """The tokenizer of a model trained on a data set with ``dataset_args``."""
    name = (dataset_args or {}).get("tokenizer", "bytes")
    return tokenizer_of(name if isinstance(name, str) else "bytes")


def prompt_ids(tok: Tokenizer, prompt: str) -> torch.Tensor:
    """A prompt's token ids (T,); an empty prompt (or one of no tokens) starts the text
    at a newline."""
    ids = tok.encode(prompt) or tok.encode("\n") or [0]
    return torch.tensor(ids, dtype=torch.int64)


def load_model(arch: dict[str, Any], weights: dict[str, torch.Tensor],
               device: torch.device) -> torch.nn.Module:
    ds = shape_of(arch["dataset"], arch.get("dataset_args") or {})
    model = build_model(arch["name"], ds.input_shape, ds.num_classes, **(arch.get("args") or {}))
    model.load_state_dict(weights)
    return model.to(device).eval()


def here(arch: Arch, store: BlobStore) -> dict[str, Any]:
    """``arch`` as a dict, with paths that hold the model's checkpoint and tokenizer on
    this machine: its own copies, or those its training job stores beside it, fetched
    once per machine into FEDQ_HOME (fedq/models/stored.py)."""
    return localize(arch.model_dump(), store)


def localize(arch: dict[str, Any], store: BlobStore) -> dict[str, Any]:
    """:func:`here` of an arch as a dict (``name``, ``args``, ``dataset_args``, ...)."""
    from fedq.models.stored import beside, localized

    if not beside(arch["args"], arch["dataset_args"]):
        return arch
    from fedq.blobs.checkpoint import fetcher

    args, dataset_args = localized(arch["args"], arch["dataset_args"],
                                   fetcher(store, get_settings().home))
    return {**arch, "args": args, "dataset_args": dataset_args}


def _model(blob: Blob, arch: Arch, store: BlobStore, device: torch.device
           ) -> tuple[torch.nn.Module, int]:
    """The model of ``blob``, built here once per weights; the bytes downloaded."""
    sha = blob.sha256
    if sha in _BUILT:
        return _BUILT[sha], 0
    weights = PROCESS.model(sha)
    downloaded = 0
    if weights is None:
        ref = BlobRef(blob.key, sha, blob.size)
        weights = loads(store.get(ref, limit=ref.size), what=f"blob {ref.key}")
        downloaded = ref.size
    _BUILT.clear()
    _BUILT[sha] = load_model(here(arch, store), weights, device)
    return _BUILT[sha], downloaded


def chosen_amp(sha: str, op: str, model: torch.nn.Module, items: Any, batch_size: int,
               device: torch.device, tok: Tokenizer = BYTES) -> str:
    """The faster, for this model and operation on ``device``, of its GPU class's mixed
    precision and float32 (``fedq.worker.loop.measured_amp``: timed once per worker
    process, weights and operation on ``amp_probe``, the first batch's forward pass,
    built only then). A small model can lose under AMP (docs/inference.md measured
    it)."""
    return measured_amp(device_amp(device), ("infer", sha, op),
                        lambda: amp_probe(model, op, items, batch_size, device, tok),
                        device)


def amp_probe(model: torch.nn.Module, op: str, items: Any, batch_size: int,
              device: torch.device, tok: Tokenizer = BYTES) -> Callable[[], object]:
    """The first batch's forward pass of ``op`` over ``items`` (images as a tensor, or
    prompts or served completions): what ``chosen_amp`` times."""
    if op == "classify":
        x = items[:batch_size].to(device)
        return torch.no_grad()(lambda: model(x))
    prompts = [p["prompt"] if isinstance(p, dict) else p for p in list(items)[:batch_size]]
    block = cast(int, model.block_size)
    ids = [prompt_ids(tok, p)[:block] for p in prompts] or [prompt_ids(tok, "")]
    x = torch.zeros(len(ids), max(1, max(len(t) for t in ids)), dtype=torch.long)
    for r, t in enumerate(ids):
        x[r, :len(t)] = t
    x = x.to(device)
    if op == "embed":
        return torch.no_grad()(lambda: model.features(x))  # type: ignore[operator]
    return torch.no_grad()(lambda: model(x))


def _batches(n: int, size: int) -> Iterator[slice]:
    for lo in range(0, n, size):
        yield slice(lo, min(n, lo + size))


@torch.no_grad()
def classify(model: torch.nn.Module, x: torch.Tensor, start: int, batch_size: int,
             device: torch.device) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for sl in _batches(len(x), batch_size):
        probs = F.softmax(model(x[sl].to(device)).float(), dim=-1).cpu()
        for k, (p, label) in enumerate(zip(probs.tolist(), probs.argmax(-1).tolist())):
            rows.append({"i": start + sl.start + k, "label": label, "probs": p})
    return rows


@torch.no_grad()
def score(model: torch.nn.Module, prompts: Sequence[str], start: int, batch_size: int,
          device: torch.device, tok: Tokenizer = BYTES) -> list[dict[str, Any]]:
    """Each prompt's log-likelihood in nats, token by token (its first token given, each
    next one predicted; ``tokens``: how many were). A prompt longer than the
    model's context is scored in pieces of ``block_size`` predictions (the context
    starts again at each piece); pieces of all prompts are batched together."""
    block = cast(int, model.block_size)
    pieces: list[tuple[int, torch.Tensor]] = []
    counts: list[int] = []
    for n, prompt in enumerate(prompts):
        ids = torch.tensor(tok.encode(prompt), dtype=torch.int64)
        counts.append(max(len(ids) - 1, 0))
        for lo in range(0, max(len(ids) - 1, 0), block):
            pieces.append((n, ids[lo:lo + block + 1]))
    logprob = [0.0] * len(prompts)
    for sl in _batches(len(pieces), batch_size):
        batch = pieces[sl]
        width = max(len(ids) for _, ids in batch)
        x = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for r, (_, ids) in enumerate(batch):
            x[r, :len(ids)] = ids
            mask[r, :len(ids) - 1] = True
        x = x.to(device)
        logp = F.log_softmax(model(x[:, :-1]).float(), dim=-1)
        got = logp.gather(-1, x[:, 1:, None])[..., 0].cpu().masked_fill(~mask, 0.0).sum(-1)
        for (n, _), value in zip(batch, got.tolist()):
            logprob[n] += value
    return [{"i": start + n, "logprob": min(lp, 0.0), "tokens": counts[n]}
            for n, lp in enumerate(logprob)]


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[str], start: int, device: torch.device,
             max_tokens: int, temperature: float, top_k: int, seed: int,
             batch_size: int = 1, tok: Tokenizer = BYTES) -> list[dict[str, Any]]:
    """Each prompt continued by ``max_tokens`` tokens (decoded by ``tok``); item ``i``
    samples with seed ``seed + i``, so the text does not depend on how the items were
    sharded or batched. Up to ``batch_size`` prompts are generated together (one forward
    pass per token for all, :meth:`GPT.generate_batch`), prompts of similar lengths in
    the same batch (less padding)."""
    ids = [prompt_ids(tok, p) for p in prompts]
    texts: dict[int, str] = {}
    by_length = sorted(range(len(ids)), key=lambda n: len(ids[n]))
    for sl in _batches(len(by_length), batch_size):
        chunk = by_length[sl]
        outs = model.generate_batch(  # type: ignore[operator]
            [ids[n].to(device) for n in chunk], max_tokens, temperature=temperature,
            top_k=top_k or None,
            generators=[torch.Generator(device=device).manual_seed(seed + start + n)
                        for n in chunk])
        texts.update((n, tok.decode(out.cpu().tolist())) for n, out in zip(chunk, outs))
    return [{"i": start + n, "text": texts[n]} for n in range(len(prompts))]


STREAM_EVERY_S = 0.05


def complete(model: torch.nn.Module, items: Sequence[dict[str, Any]], device: torch.device,
             on_texts: Callable[[list[str]], None] | None = None,
             tok: Tokenizer = BYTES) -> list[dict[str, Any]]:
    """A served batch's completions, generated together (one forward pass per token for
    the whole batch), each item with its own ``max_tokens``, ``temperature``, ``top_k``
    and ``seed`` (so each text is the one its request gets alone). ``on_texts(texts)``:
    every item's text so far, at most every :data:`STREAM_EVERY_S` (the first token at
    once), each cut before a character that is not complete yet (a UTF-8 sequence whose
    last bytes are still to come), so that the final text always continues it."""
    texts = [""] * len(items)
    last = [float("-inf")]

    def so_far(new: list[torch.Tensor]) -> None:
        now = time.perf_counter()
        if on_texts is None or now - last[0] < STREAM_EVERY_S:
            return
        last[0] = now
        for n, row in enumerate(new):
            texts[n] = so_far_text(tok, row.tolist())
        on_texts(list(texts))

    if items:
        outs = model.generate_batch(  # type: ignore[operator]
            [prompt_ids(tok, item["prompt"]).to(device) for item in items],
            [item["max_tokens"] for item in items],
            temperature=[item["temperature"] for item in items],
            top_k=[item["top_k"] or None for item in items],
            generators=[torch.Generator(device=device).manual_seed(item["seed"])
                        for item in items], on_token=so_far)
        texts = [tok.decode(out.cpu().tolist()) for out in outs]
    return [{"i": n, "text": text} for n, text in enumerate(texts)]


def so_far_text(tok: Tokenizer, ids: list[int]) -> str:
    """The text of the tokens sampled so far, without a last character still to be
    completed by the next tokens: bytes of an unfinished UTF-8 sequence (byte-level
    models), or the replacement character a tokenizer decodes them to."""
    if isinstance(tok, ByteTokenizer):
        return codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(ids), final=False)
    return tok.decode(ids).rstrip("\ufffd")


@torch.no_grad()
def embed(model: torch.nn.Module, prompts: Sequence[str], start: int, batch_size: int,
          device: torch.device, tok: Tokenizer = BYTES) -> list[dict[str, Any]]:
    """Each prompt's embedding: the mean of the last layer's normalised hidden states
    over its tokens, scaled to unit length (so a dot product is the cosine). A prompt
    longer than the model's context is read in pieces of ``block_size`` tokens (the
    context starts again at each piece); pieces of all prompts are batched together."""
    block = cast(int, model.block_size)
    pieces: list[tuple[int, torch.Tensor]] = []
    for n, prompt in enumerate(prompts):
        ids = prompt_ids(tok, prompt)
        pieces += [(n, ids[lo:lo + block]) for lo in range(0, len(ids), block)]
    total: torch.Tensor | None = None
    for sl in _batches(len(pieces), batch_size):
        batch = pieces[sl]
        x = torch.zeros(len(batch), max(len(ids) for _, ids in batch), dtype=torch.long)
        mask = torch.zeros(x.shape, dtype=torch.bool)
        for r, (_, ids) in enumerate(batch):
            x[r, :len(ids)], mask[r, :len(ids)] = ids, True
        feats = model.features(x.to(device)).double().cpu()  # type: ignore[operator]
        sums = (feats * mask[..., None]).sum(1)
        if total is None:
            total = torch.zeros(len(prompts), feats.shape[-1], dtype=torch.float64)
        for (n, _), row in zip(batch, sums):
            total[n] += row
    assert total is not None  # every prompt has a token
    vectors = torch.nn.functional.normalize(total, dim=-1)
    return [{"i": start + n, "embedding": [round(v, 6) for v in vector]}
            for n, vector in enumerate(vectors.tolist())]


def run_items(model: torch.nn.Module, op: str, items: Any, start: int, batch_size: int,
              device: torch.device, sampling: dict[str, Any] | None = None,
              tok: Tokenizer = BYTES) -> list[dict[str, Any]]:
    if op == "classify":
        return classify(model, items, start, batch_size, device)
    if op == "score":
        return score(model, items, start, batch_size, device, tok)
    if op == "embed":
        return embed(model, items, start, batch_size, device, tok)
    s = sampling or {}
    return generate(model, items, start, device, int(s.get("max_tokens", 32)),
                    float(s.get("temperature", 0.8)), int(s.get("top_k", 40)),
                    int(s.get("seed", 0)), batch_size=batch_size, tok=tok)


def encode_rows(rows: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode()


def _items(task: ShardTask, store: BlobStore) -> Any:
    if task.split is not None:
        ds = load_dataset(task.arch.dataset, None, task.arch.dataset_args)
        x = ds.x_test if task.split == "test" else ds.x_train
        if task.stop > len(x):
            raise ValueError(f"items {task.start}..{task.stop} beyond the {len(x)} of "
                             f"{task.arch.dataset}/{task.split}")
        return x[task.start:task.stop]
    assert task.inputs is not None
    ref = BlobRef(task.inputs.key, task.inputs.sha256, task.inputs.size)
    kept = _PROMPTS.get(ref.sha256)
    if kept is None:
        kept = json.loads(store.get(ref, limit=ref.size))
        if not isinstance(kept, list) or not all(isinstance(p, str) for p in kept):
            raise ValueError(f"{ref.key} is not a list of prompts")
        _PROMPTS.clear()
        _PROMPTS[ref.sha256] = kept
    if task.stop > len(kept):
        raise ValueError(f"items {task.start}..{task.stop} beyond the {len(kept)} prompts")
    return kept[task.start:task.stop]


_PROMPTS: dict[str, list[str]] = {}


def run_shard(data: Any, store: BlobStore, worker: str, queue: str | None = None,
              signer: str | None = None) -> dict[str, Any]:
    """One shard: its outputs written under its own key (in ``signer``'s folder for a
    joined worker); the result as JSON (never raises)."""
    start, wall = time.perf_counter(), time.time()
    head = data if isinstance(data, dict) else {}
    base = {"job": head.get("job") if isinstance(head.get("job"), str) else "unknown",
            "shard": head.get("shard", 0), "attempt": head.get("attempt", 1),
            "worker": worker, "queue": queue or str(head.get("queue", "cpu"))[:32],
            "started": wall}
    try:
        task = parse_task(data)
        device = pick_device()
        model, _ = _model(task.model, task.arch, store, device)
        items = _items(task, store)
        tok = arch_tokenizer(here(task.arch, store)["dataset_args"])
        began = time.perf_counter()
        # the GPU class's AMP mode or float32, whichever this model ran faster here
        amp = chosen_amp(task.model.sha256, task.op, model, items, task.batch_size, device,
                         tok)
        with amp_autocast(amp, device):
            rows = run_items(model, task.op, items, task.start, task.batch_size, device,
                             task.sampling, tok)
        faults.slow_down(began)  # tests and benchmarks only (fedq/testing/faults.py)
        ref = store.put(output_key(task.job, task.shard, task.attempt, signer),
                        encode_rows(rows))
        return {**base, "status": "ok", "key": ref.key, "sha256": ref.sha256, "size": ref.size,
                "items": len(rows), "seconds": time.perf_counter() - start,
                # the device and its mixed precision (``cuda+bf16``), shown per worker
                "device": device.type if amp == "off" else f"{device.type}+{amp}"}
    except Exception as exc:  # noqa: BLE001 - reported as data, the shard is re-sent
        log.warning("inference shard failed: %s", exc)
        return {**base, "status": "error", "error": redact_text(f"{type(exc).__name__}: {exc}"),
                "seconds": time.perf_counter() - start}


def serve_batch(data: Any, store: BlobStore, worker: str,
                progress: Callable[[list[str]], None] | None = None) -> dict[str, Any]:
    """One batch of ``fedq serve`` requests: classify images, embed or continue
    prompts; the outputs in order (never raises). The model stays loaded between
    batches. ``progress(texts)``, while completions are generated for a batch that
    asks for it (``stream``): the text of each item so far, for the gateway's streamed
    answers."""
    start = time.perf_counter()
    try:
        msg = parse_batch(data)
        device = pick_device()
        task = ShardTask.model_construct(model=msg.model, arch=msg.arch)
        model, _ = _model(task.model, task.arch, store, device)
        items = _serve_inputs(msg)
        began = time.perf_counter()
        tok = arch_tokenizer(here(msg.arch, store)["dataset_args"])
        amp = chosen_amp(msg.model.sha256, msg.op, model, items, len(msg.items), device, tok)
        with amp_autocast(amp, device):
            rows = _serve_items(model, msg, items, device, progress if msg.stream else None,
                                tok)
        faults.slow_down(began)  # tests and benchmarks only (fedq/testing/faults.py)
        return {"status": "ok", "outputs": rows, "worker": worker,
                "seconds": time.perf_counter() - start}
    except Exception as exc:  # noqa: BLE001 - reported as data; the gateway sends it again
        log.warning("serve batch failed: %s", exc)
        return {"status": "error", "error": redact_text(f"{type(exc).__name__}: {exc}"),
                "worker": worker, "seconds": time.perf_counter() - start}


def _serve_inputs(msg: Any) -> Any:
    """A served batch's items as its operation takes them: images as one tensor."""
    if msg.op != "classify":
        return msg.items
    ds = load_dataset(msg.arch.dataset, None, msg.arch.dataset_args)
    return torch.tensor(msg.items, dtype=torch.float32).reshape(-1, *ds.input_shape)


def _serve_items(model: torch.nn.Module, msg: Any, items: Any, device: torch.device,
                 progress: Callable[[list[str]], None] | None,
                 tok: Tokenizer = BYTES) -> list[dict[str, Any]]:
    """A batch's outputs, in order (``serve_batch`` runs it under its AMP mode)."""
    if msg.op == "classify":
        return classify(model, items, 0, len(msg.items), device)
    if msg.op == "embed":
        return embed(model, items, 0, len(msg.items), device, tok)
    return complete(model, items, device, progress, tok)
