"""Causal language models of Hugging Face ``transformers`` (the ``[llm]`` extra), built
from local files only, and LoRA adapters (PEFT) as the only tensors a job trains and
federates.

In a spec: ``model: hf_causal_lm`` with ``model_args``:

- ``config: {model_type: llama, hidden_size: 64, ...}``: a new model of that
  architecture (any causal LM family transformers ships: llama, qwen2, qwen3, mistral,
  gpt2, ...; no per-family code here), its weights initialised from ``seed`` (0 unless
  set) whichever process builds it, so every worker holds the same base;
  ``vocab_size`` defaults to the dataset's vocabulary (256 for the byte-level corpora)
  and ``max_position_embeddings`` to at least the dataset's block size;
- or ``path: DIR``: a checkpoint as ``save_pretrained`` writes it, read with
  ``local_files_only`` (its vocabulary must cover the dataset's). ``fedq submit``
  adds ``digest``, a BLAKE3 digest of the folder's safetensors files (:func:`pin`), and
  a worker whose checkpoint at that path is not the same refuses the task in one line:
  every worker trains the same base;
- ``ship_base: true`` (with ``path``): ``fedq submit`` also puts the checkpoint's
  config and weights (:func:`shipped_files`) in the blob store with the job
  (``base_files``), and a worker whose ``path`` does not hold the job's checkpoint
  fetches that copy once into a folder of its machine (:func:`local_args`);
- ``gradient_checkpointing: true``: activations recomputed in the backward pass, not
  kept (less memory for a longer step);
- ``lora: {r: 8, alpha: 16, dropout: 0.05, target_modules: [q_proj, v_proj]}``: the
  base is frozen and only the adapters train. The model's ``state_dict`` is then the
  adapters alone: they are what a round's global model, each update, verification,
  codecs, DP and aggregation see, so an upload is the adapters' size, not the model's;
- ``base_dtype`` (with ``lora``): the frozen base held in ``float16`` or ``bfloat16``
  (half the memory of ``float32``, the default), or ``auto``: what the process's GPU
  computes fastest, bfloat16 where it has it (Ampere and newer), float16 where it
  does not (Pascal, a GTX 1080), float32 without a GPU. The model is read (or made)
  in float32 on the host, its adapters added, then the base rounded to that type, so
  the adapters are float32 and the same tensors in every process whatever its base's
  type; the device holds the half-precision base.

The hub is never asked: ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` are set before
transformers is imported. A bad argument (an unknown ``model_type``, a missing
checkpoint, a ``target_modules`` name the model lacks) is one ``ValueError`` line; the
last lists the model's module names.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fedq.digest as digests
from fedq.errors import require_extra
from fedq.models.registry import MODELS, PINS

#: What ``lora`` takes, and PEFT's name for each.
_LORA_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout",
              "target_modules": "target_modules"}


class HFCausalLM(nn.Module):
    """A transformers causal LM as fedq trains it: token ids (B, T) -> logits (B, T, V).
    With ``adapters_only`` its ``state_dict`` holds the trainable (LoRA) tensors only,
    and ``load_state_dict`` takes exactly those."""

    def __init__(self, lm: nn.Module, adapters_only: bool, block_size: int = 0) -> None:
        super().__init__()
        self.lm = lm
        self.adapters_only = adapters_only
        self._trained = frozenset(n for n, p in self.named_parameters() if p.requires_grad)
        config = getattr(lm, "config", None)
        #: the most positions the model reads (its config's), and the data set's window
        self.positions = int(getattr(config, "max_position_embeddings", 0)
                             or getattr(config, "n_positions", 0) or 1 << 30)
        self.block_size = min(block_size, self.positions) if block_size else self.positions

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx).logits  # type: ignore[no-any-return]

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states (B, T, hidden_size), after the model's final
        norm (what transformers returns last in ``hidden_states``)."""
        out = self.lm(input_ids=idx, output_hidden_states=True)
        return out.hidden_states[-1]  # type: ignore[no-any-return]

    @torch.no_grad()
    def generate_batch(self, rows: list[torch.Tensor], tokens: int | Sequence[int], *,
                       temperature: float | Sequence[float] = 1.0,
                       top_k: int | None | Sequence[int | None] = None,
                       generators: list[torch.Generator],
                       on_token: Callable[[list[torch.Tensor]], None] | None = None
                       ) -> list[torch.Tensor]:
        """``rows[b]`` (1-D token ids) continued by ``tokens`` tokens sampled with
        ``generators[b]`` (temperature, then top-k, as fedq's GPT samples:
        fedq/models/gpt.py), each row on its own with the model's key-value cache;
        the new tokens of each row. ``on_token`` as the GPT's."""
        from fedq.models.gpt import _per_row

        n = len(rows)
        want, temps, ks = _per_row(tokens, n), _per_row(temperature, n), _per_row(top_k, n)
        out: list[torch.Tensor] = [row.new_empty(0) for row in rows]
        with warnings.catch_warnings():  # the cache's argument is renamed across versions
            warnings.simplefilter("ignore", FutureWarning)
            self._sample(rows, want, temps, ks, generators, on_token, out)
        return out

    def _sample(self, rows: list[torch.Tensor], want: list[int], temps: list[float],
                ks: list[int | None], generators: list[torch.Generator],
                on_token: Callable[[list[torch.Tensor]], None] | None,
                out: list[torch.Tensor]) -> None:
        from fedq.models.gpt import _sampling

        for b, row in enumerate(rows):
            tokens = min(int(want[b]), self.positions - 1)
            # the prompt's last tokens, so that the text fits the model's positions
            step, past = row[max(0, len(row) - (self.positions - tokens)):][None], None
            for _ in range(tokens):
                res = self.lm(input_ids=step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                probs = _sampling(res.logits[:, -1], [temps[b]], [ks[b]])
                step = torch.multinomial(probs, 1, generator=generators[b])  # (1, 1)
                out[b] = torch.cat([out[b], step[0]])
                if on_token is not None:
                    on_token(out)

    def save_pretrained(self, folder: Path, adapter: bool = False) -> None:
        """Write the model as a Hugging Face checkpoint that plain ``transformers``
        loads: the LoRA adapters merged into the base, or with ``adapter`` the PEFT
        adapter alone (``adapter_config.json`` and its safetensors)."""
        lm: Any = self.lm
        if adapter:
            if not self.adapters_only:
                raise ValueError("the model has no LoRA adapters to write alone")
            lm.save_pretrained(str(folder))
            return
        if self.adapters_only:
            lm = copy.deepcopy(lm).merge_and_unload()
        lm.save_pretrained(str(folder))

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        full = super().state_dict(*args, destination=destination, prefix=prefix,
                                  keep_vars=keep_vars)
        if self.adapters_only:
            for key in [k for k in full if k[len(prefix):] not in self._trained]:
                del full[key]
        return full

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        if not self.adapters_only:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        given = set(state_dict)
        if strict and given != self._trained:
            missing, extra = sorted(self._trained - given), sorted(given - self._trained)
            raise RuntimeError(f"adapter weights do not match the model: missing "
                               f"{missing[:3]}, unexpected {extra[:3]}")
        return super().load_state_dict(state_dict, strict=False, assign=assign)


def checkpoint_digest(folder: Path) -> str:
    """A BLAKE3 digest of a checkpoint's weights: each ``*.safetensors`` file of
    ``folder`` (by name, in order), its name, size and bytes, read 16 MiB at a time."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"hf_causal_lm: path {folder}: no *.safetensors file there")
    hasher = digests.new()
    for file in files:
        hasher.update(f"{file.name}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as fh:
            while block := fh.read(16 << 20):
                hasher.update(block)
    return digests.text(hasher)


def shipped_files(folder: Path) -> list[Path]:
    """What ``ship_base`` sends of the checkpoint in ``folder``: its ``config.json``,
    ``generation_config.json`` where there is one, and its ``*.safetensors`` files (the
    tokenizer is the data set's, read from ``dataset_args.tokenizer``)."""
    names = ["config.json", "generation_config.json"]
    return [folder / n for n in names if (folder / n).is_file()] + \
        sorted(folder.glob("*.safetensors"))


def local_args(model_args: dict[str, Any], fetch: Callable[[dict[str, Any], str], Path]
               ) -> dict[str, Any]:
    """``model_args`` with a ``path`` that holds the job's checkpoint on this machine:
    as given where the folder at ``path`` has the job's digest; else, for a job that
    ships its base (``base_files``), the folder ``fetch(base_files, digest)`` wrote
    the blob store's copy into (a per-machine folder named by the digest)."""
    files, digest, path = model_args.get("base_files"), model_args.get("digest"), \
        model_args.get("path")
    if not isinstance(files, dict) or not isinstance(digest, str) or not isinstance(path, str):
        return model_args
    folder = Path(path).expanduser()
    try:
        if (folder / "config.json").is_file() and checkpoint_digest(folder) == digest:
            return model_args
    except (OSError, ValueError):
        pass
    import hashlib

    name = hashlib.sha256(digest.encode()).hexdigest()[:32]  # a folder name of the digest
    return {**model_args, "path": str(fetch(files, name))}


def pin(model_args: dict[str, Any]) -> dict[str, Any]:
    """``model_args`` as a job stores them: with ``path``, the checkpoint's digest added
    (unless given), so that every worker can check it trains the same base."""
    path = model_args.get("path")
    if not isinstance(path, str) or not path or model_args.get("digest") or \
            model_args.get("config") is not None:  # (both: the model says so, built)
        return model_args
    return {**model_args, "digest": checkpoint_digest(Path(path).expanduser())}


@MODELS.register("hf_causal_lm")
def hf_causal_lm(input_shape: tuple[int, ...], num_classes: int,
                 config: dict[str, Any] | None = None, path: str = "",
                 lora: dict[str, Any] | None = None, seed: int = 0,
                 digest: str = "", gradient_checkpointing: bool = False,
                 base_dtype: str = "float32", ship_base: bool = False,
                 base_files: dict[str, Any] | None = None) -> nn.Module:
    """input_shape: (block_size,); num_classes: the dataset's vocabulary size.
    ``gradient_checkpointing``: the decoder layers' activations are computed again in
    the backward pass instead of kept (transformers' own, non-reentrant), trading
    compute for memory; the same gradients."""
    require_extra("transformers", "llm", "model hf_causal_lm")
    if lora is not None:
        require_extra("peft", "llm", "model hf_causal_lm with lora")
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its notices and progress bars are not fedq's output
    hf_logging.disable_progress_bar()

    if (config is None) == (not path):
        raise ValueError("hf_causal_lm: give exactly one of model_args.config (a new "
                         "model) and model_args.path (a local checkpoint)")
    if ship_base and not path:
        raise ValueError("hf_causal_lm: ship_base sends the checkpoint at model_args.path "
                         "through the blob store: give a path")
    del base_files  # where workers fetch the shipped checkpoint from (:func:`local_args`)
    dtype = base_type(base_dtype, lora is not None)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # the same base in every process; and no deprecation notice of transformers'
        # own internals on fedq's stderr
        warnings.simplefilter("ignore", FutureWarning)
        torch.manual_seed(seed)
        if config is not None:
            lm = AutoModelForCausalLM.from_config(_config(AutoConfig, config, input_shape,
                                                          num_classes))
        else:
            folder = Path(path).expanduser()
            if digest and (mine := checkpoint_digest(folder)) != digest:
                raise ValueError(
                    f"hf_causal_lm: path {folder}: its weights (digest "
                    f"{digests.short(mine)}...) are not the job's ({digests.short(digest)}"
                    f"...): every worker must hold the same checkpoint")
            lm = _load(AutoModelForCausalLM, folder, num_classes)
        if gradient_checkpointing:
            if not getattr(lm, "supports_gradient_checkpointing", False):
                raise ValueError(f"hf_causal_lm: gradient_checkpointing: "
                                 f"{type(lm).__name__} does not support it")
            lm.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            lm.config.use_cache = False  # a cache is for generation, not training
        if lora is not None:
            lm = _with_lora(lm, lora)  # on the float32 base: the same adapters everywhere
            for p in lm.parameters():
                if not p.requires_grad and p.dtype.is_floating_point:
                    p.data = p.data.to(dtype)  # the frozen base, rounded
    return HFCausalLM(lm, adapters_only=lora is not None, block_size=input_shape[0])


def positions(model_args: dict[str, Any]) -> int:
    """The most positions the model ``model_args`` describe reads (its config's
    ``max_position_embeddings`` or ``n_positions``; 2**30 where it names none)."""
    config = _read_config(model_args)
    return int(getattr(config, "max_position_embeddings", 0)
               or getattr(config, "n_positions", 0) or 1 << 30)


def hidden_size(model_args: dict[str, Any]) -> int:
    """The width of the hidden states of the model ``model_args`` describe (a new
    model's ``config``, or the ``config.json`` of the checkpoint at ``path``), without
    building it; ValueError with one line when it cannot be read."""
    return int(_read_config(model_args).hidden_size)


def _read_config(model_args: dict[str, Any]) -> Any:
    """The transformers config ``model_args`` describe (a new model's ``config``, or the
    ``config.json`` at ``path``); ValueError with one line when it cannot be read."""
    require_extra("transformers", "llm", "model hf_causal_lm")
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoConfig

    config = model_args.get("config")
    try:
        if isinstance(config, dict):
            args = dict(config)
            return AutoConfig.for_model(str(args.pop("model_type", "")), **args)
        return AutoConfig.from_pretrained(str(Path(str(model_args.get("path"))).expanduser()),
                                          local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"hf_causal_lm: {str(exc).splitlines()[0][:200]}") from None


#: What ``base_dtype`` takes.
BASE_DTYPES = {"float32": torch.float32, "float16": torch.float16,
               "bfloat16": torch.bfloat16}


def base_type(name: object, lora: bool) -> torch.dtype:
    """The dtype ``base_dtype: name`` holds the base in, in this process; ValueError
    with one line for an unknown name, or a half-precision base without ``lora`` (full
    training keeps float32 weights; AMP by hardware class does the rest)."""
    if name == "auto":
        cuda = torch.cuda.is_available()
        return auto_type(cuda, cuda and torch.cuda.is_bf16_supported())
    if not isinstance(name, str) or name not in BASE_DTYPES:
        raise ValueError(f"hf_causal_lm: base_dtype: {name!r} is not one of auto, "
                         f"{', '.join(BASE_DTYPES)}")
    if name != "float32" and not lora:
        raise ValueError(f"hf_causal_lm: base_dtype: {name} needs lora (a frozen base); "
                         "full-parameter training keeps float32 weights")
    return BASE_DTYPES[name]


def auto_type(cuda: bool, bf16: bool) -> torch.dtype:
    """``base_dtype: auto`` on a process with (or without) a GPU that has bfloat16."""
    if not cuda:
        return torch.float32
    return torch.bfloat16 if bf16 else torch.float16


PINS["hf_causal_lm"] = pin


def _config(auto: Any, given: dict[str, Any], input_shape: tuple[int, ...],
            num_classes: int) -> Any:
    args = dict(given)
    kind = args.pop("model_type", None)
    if not isinstance(kind, str):
        raise ValueError("hf_causal_lm: model_args.config needs a model_type (llama, "
                         "qwen2, mistral, gpt2, ...)")
    args.setdefault("vocab_size", num_classes)
    if args["vocab_size"] < num_classes:
        raise ValueError(f"hf_causal_lm: config.vocab_size {args['vocab_size']} is less "
                         f"than the dataset's vocabulary of {num_classes}")
    key = "n_positions" if kind == "gpt2" else "max_position_embeddings"
    args[key] = max(int(args.get(key) or 0), input_shape[0])
    try:
        return auto.for_model(kind, **args)
    except ValueError as exc:
        first = str(exc).split(". ")[0]
        raise ValueError(f"hf_causal_lm: config: {first[:200]}") from None


def _load(auto: Any, folder: Path, num_classes: int) -> nn.Module:
    """The checkpoint in ``folder`` in float32, whatever type its files hold."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"hf_causal_lm: path {folder}: no config.json there (a folder "
                         f"as save_pretrained writes it)")
    try:
        lm = auto.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(f"hf_causal_lm: path {folder}: "
                         f"{str(exc).splitlines()[0][:200]}") from None
    vocab = int(getattr(lm.config, "vocab_size", 0) or 0)
    if vocab < num_classes:
        raise ValueError(f"hf_causal_lm: path {folder}: its vocabulary of {vocab} is less "
                         f"than the dataset's {num_classes}")
    return lm  # type: ignore[no-any-return]


def _with_lora(lm: nn.Module, lora: dict[str, Any]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    unknown = sorted(set(lora) - set(_LORA_KEYS))
    if unknown:
        raise ValueError(f"hf_causal_lm: lora.{unknown[0]}: unknown (known: "
                         f"{', '.join(_LORA_KEYS)})")
    names = sorted({n.rsplit(".", 1)[-1] for n, m in lm.named_modules()
                    if isinstance(m, nn.Linear)})
    targets = lora.get("target_modules", ["q_proj", "v_proj"])
    if not isinstance(targets, list) or not targets or \
            any(not isinstance(t, str) for t in targets):
        raise ValueError("hf_causal_lm: lora.target_modules: a list of module names")
    missing = [t for t in targets if t not in names]
    if missing:
        raise ValueError(f"hf_causal_lm: lora.target_modules: {missing[0]!r} is no linear "
                         f"module of this model (its linear modules: {', '.join(names)})")
    params = {_LORA_KEYS[k]: v for k, v in lora.items()}
    params["target_modules"] = targets
    return get_peft_model(lm, LoraConfig(**params))  # type: ignore[no-any-return]
