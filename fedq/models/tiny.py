"""A small Hugging Face checkpoint made here, for trying fedq's LoRA and full-parameter
jobs on a laptop before downloading a real one: a causal LM of a family transformers
ships (random weights), a byte-level BPE tokenizer trained on the shipped plays (the
``tokenizers`` library) with a chat template, and text to train on.

    .venv/bin/python -m fedq.models.tiny DIR [--family llama|qwen2|gpt2] [--vocab 512]

writes DIR as ``save_pretrained`` writes a checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) and DIR/text/ (four plays, one ``.txt`` file
each). DIR must be new or empty; nothing is fetched from the network. Needs the
``[llm]`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

#: Small configs of three families (about 0.4M parameters with a 512-token vocabulary).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512},
    "qwen2": {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512},
    "gpt2": {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4,
             "n_positions": 512},
}
#: ChatML, as Qwen's checkpoints write it.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                 "assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAYS = 4


def make(folder: Path, family: str = "llama", vocab: int = 512, seed: int = 0,
         sizes: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint, its tokenizer and ``text/`` into ``folder`` (new or empty);
    ``sizes`` replaces config fields of the family's small one (``hidden_size``, ...).
    ValueError for a folder with something in it, or an unknown family."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder}: not a new or empty folder")
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from fedq.data import text

    plays = [body.decode("utf-8") for _, body in text.works(("shakespeare",))[:PLAYS]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(plays, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    size = tok.get_vocab_size(with_added_tokens=True)
    args = {**FAMILIES[family], **(sizes or {})}
    kind = args.pop("model_type")
    ids = {name: tok.token_to_id(name) for name in SPECIAL}
    config = AutoConfig.for_model(kind, vocab_size=size, bos_token_id=ids["<|endoftext|>"],
                                  eos_token_id=ids["<|im_end|>"], **args)
    hf_logging.set_verbosity_error()  # its notices and progress bars are not fedq's output
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 512}, indent=2) + "\n")
    (folder / "text").mkdir()
    for k, body in enumerate(plays):
        (folder / "text" / f"play{k + 1}.txt").write_text(body, encoding="utf-8")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedq.models.tiny",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    parser.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    args = parser.parse_args(argv)
    if not 300 <= args.vocab <= 50_000:
        print("fedq: error: --vocab: between 300 and 50000", file=sys.stderr)
        return 2
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("fedq: error: needs the [llm] extra (pip install 'fedq[llm]')", file=sys.stderr)
        return 2
    try:
        folder = make(args.folder, args.family, args.vocab)
    except (ValueError, OSError) as exc:
        print(f"fedq: error: {exc}", file=sys.stderr)
        return 2
    params = _parameters(folder)
    print(f"wrote {folder}: a {args.family} checkpoint of {params / 1e6:.1f}M parameters, its "
          f"tokenizer (chat template: ChatML) and {PLAYS} plays in {folder / 'text'}")
    return 0


def _parameters(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for key in f.keys():
            n = 1
            for d in f.get_slice(key).get_shape():
                n *= int(d)
            total += n
    return total


if __name__ == "__main__":
    sys.exit(main())
