"""Tokenizers of the text data sets: bytes, or a Hugging Face tokenizer read from a
local folder (its ``tokenizer.json``, as ``save_pretrained`` writes it beside a
checkpoint), never fetched from the hub.

``tokenizer: bytes`` (the default) is one token a byte, a vocabulary of 256: every text
round-trips exactly. A folder's tokenizer (``tokenizer: /models/qwen``) is read with the
``tokenizers`` library of the ``[llm]`` extra; its vocabulary is the data set's, which
the model's must cover (fedq/models/hf.py checks it). A folder whose
``tokenizer_config.json`` has a ``chat_template`` also renders conversations
(:func:`chat_renderer`, with transformers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fedq.errors import DataUnavailable

BYTES = "bytes"


class Tokenizer(Protocol):
    """Text to token ids and back."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_chars(self) -> int:
        """The most characters one token adds to a decoded text (what bounds a
        generated text of ``n`` tokens: ``n`` times this)."""
        ...


class ByteTokenizer:
    """One token a UTF-8 byte; a decoded sequence that is not valid UTF-8 (sampling can
    make one) has its bad bytes replaced."""

    name = BYTES
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(v) for v in ids).decode("utf-8", errors="replace")

    def token_chars(self) -> int:
        return 1  # a byte decodes to at most one character (or one replacement)


class FolderTokenizer:
    """The tokenizer a folder's ``tokenizer.json`` describes (the ``tokenizers`` library:
    the fast tokenizer of transformers, without transformers)."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise DataUnavailable(f"tokenizer {folder}: no tokenizer.json there (a folder "
                                  "that save_pretrained wrote a tokenizer into)")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise DataUnavailable(f"tokenizer {folder}: the tokenizers library is missing "
                                  "(pip install 'fedq[llm]')") from None
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises its own Exception subclasses
            raise DataUnavailable(f"tokenizer {path}: cannot read it ({exc})") from None
        self.name = str(folder)
        self._chars: int | None = None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        """The token ids of ``text`` and where each token starts in it (a character
        offset)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [int(start) for start, _ in enc.offsets]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def token_chars(self) -> int:
        """The longest of each token's text (its vocabulary entry, and the token decoded
        alone), plus one: a decoder may add a space where a token starts a word."""
        if self._chars is None:
            most = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)),
                       default=1)
            alone = self._tok.decode_batch([[i] for i in range(self.vocab_size)],
                                           skip_special_tokens=False)
            most = max([most, *(len(t) for t in alone)])
            self._chars = most + 1
        return self._chars


#: A conversation rendered: its text, and the (start, end) character spans of its
#: assistant turns (each from the end of what comes before it, the assistant's header
#: included where the template puts one there, to the end of the turn, its end-of-turn
#: marker included).
Rendered = tuple[str, list[tuple[int, int]]]


def chat_renderer(name: str, data_dir: Path | None = None,
                  turns: bool = True) -> Callable[[Any], Rendered]:
    """The chat template of tokenizer folder ``name`` (its ``tokenizer_config.json``,
    read by transformers with local files only), as a function of one conversation
    (``[{role, content}, ...]``) to its text and its assistant turns' spans (none
    looked for unless ``turns``); DataUnavailable with one line when there is no
    template; ValueError when the conversation is not one, or the template does not
    render each turn as a prefix of the whole (the spans could not be found)."""
    tok = _chat_tokenizer(name, data_dir)

    def text(messages: list[Any], prompt: bool = False) -> str:
        if not messages:
            return ""
        try:
            return str(tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=prompt))
        except Exception as exc:  # the template's own error (jinja2, raise_exception)
            raise ValueError(f"the chat template refused it ({str(exc)[:200]})") from None

    def render(messages: Any) -> Rendered:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise ValueError("messages: not a list of {role, content} strings")
        whole = text(messages)
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages if turns else ()):
            if message["role"] != "assistant":
                continue
            before, upto = text(messages[:i], prompt=True), text(messages[:i + 1])
            if not (upto.startswith(before) and whole.startswith(upto)):
                raise ValueError(f"message {i + 1}: the chat template does not render each "
                                 "turn as a prefix of the conversation, so its assistant "
                                 "turns cannot be found (loss_on: all trains on every token)")
            spans.append((len(before), len(upto)))
        return whole, spans

    return render


def chat_asker(name: str, data_dir: Path | None = None
               ) -> tuple[Callable[[list[dict[str, str]]], str], str | None]:
    """Tokenizer folder ``name``'s chat template as a function of a conversation
    (``[{role, content}, ...]``) to the text that asks its model for the next reply
    (the generation prompt added; ValueError with one line when the template refuses
    the conversation), and the text that ends a reply (its ``eos_token``; None where it
    names none). DataUnavailable with one line when there is no template."""
    tok = _chat_tokenizer(name, data_dir)

    def ask(messages: list[dict[str, str]]) -> str:
        try:
            return str(tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True))
        except Exception as exc:  # the template's own error (jinja2, raise_exception)
            raise ValueError(f"the chat template refused it ({str(exc)[:200]})") from None

    eos = getattr(tok, "eos_token", None)
    return ask, eos if isinstance(eos, str) and eos else None


def chat_prompt(name: str, data_dir: Path | None, message: str) -> tuple[str, str | None]:
    """The text that asks tokenizer folder ``name``'s model for a reply to ``message`` (a
    user turn rendered by its chat template, with the generation prompt), and the text
    that ends the reply (:func:`chat_asker`). DataUnavailable with one line when there
    is no template, or it refuses the message."""
    ask, end = chat_asker(name, data_dir)
    try:
        return ask([{"role": "user", "content": message}]), end
    except ValueError as exc:
        raise DataUnavailable(f"tokenizer {name}: {exc}") from None


def _chat_tokenizer(name: str, data_dir: Path | None) -> Any:
    """Tokenizer folder ``name`` read by transformers (local files only), which has a
    chat template; DataUnavailable with one line otherwise."""
    if name == BYTES:
        raise DataUnavailable("text_files: chat: needs a tokenizer folder whose "
                              "tokenizer_config.json has a chat_template, not bytes")
    folder = _folder(name, data_dir)
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataUnavailable(f"tokenizer {folder}: chat templates need transformers "
                              "(pip install 'fedq[llm]')") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a folder it cannot read
        raise DataUnavailable(f"tokenizer {folder}: cannot read it "
                              f"({str(exc).splitlines()[0][:200]})") from None
    if not getattr(tok, "chat_template", None):
        raise DataUnavailable(f"tokenizer {folder}: its tokenizer_config.json has no "
                              "chat_template (chat: true renders conversations with it)")
    return tok


def _folder(name: str, data_dir: Path | None) -> Path:
    folder = Path(name).expanduser()
    return folder if folder.is_absolute() or data_dir is None else data_dir / folder


def load_tokenizer(name: str, data_dir: Path | None = None) -> Tokenizer:
    """``bytes``, or the tokenizer in folder ``name`` (relative to ``data_dir`` unless
    absolute); DataUnavailable with one line when there is none."""
    if name == BYTES:
        return ByteTokenizer()
    if TRAINED.match(name):
        raise DataUnavailable(f"tokenizer {name}: fedq submit trains it on the job's files "
                              "(a job's spec names the folder it wrote)")
    return FolderTokenizer(_folder(name, data_dir))


#: ``tokenizer: bpe:VOCAB``: a byte-level BPE of VOCAB tokens that ``fedq submit``
#: trains on the job's files (:func:`train_bpe`).
TRAINED = re.compile(r"^bpe:(\d{1,7})$")
#: The vocabularies :func:`train_bpe` makes: the 256 bytes and an end of text, at least.
BPE_VOCAB = (260, 1_000_000)
#: The special token a trained tokenizer ends a document with.
END_OF_TEXT = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int) -> bytes:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``texts`` with the
    ``tokenizers`` library (every byte a token of its own, so any text encodes; the
    merges GPT-2's kind), as the ``tokenizer.json`` ``save_pretrained`` writes.
    DataUnavailable with one line for a vocabulary out of :data:`BPE_VOCAB` or without
    the library."""
    lo, hi = BPE_VOCAB
    if not lo <= vocab_size <= hi:
        raise DataUnavailable(f"tokenizer: bpe:{vocab_size}: a vocabulary of {lo:,} to "
                              f"{hi:,} tokens")
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataUnavailable("tokenizer: bpe: the tokenizers library is missing (pip "
                              "install 'fedq[llm]')") from None
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok.to_str().encode()


def local_tokenizer(dataset_args: dict[str, Any],
                    fetch: Callable[[dict[str, Any], str], Path]) -> dict[str, Any]:
    """``dataset_args`` whose ``tokenizer`` folder holds, on this machine, the tokenizer
    its job stores with it (``tokenizer_files``: a tokenizer fedq submit trained): as
    given where that folder's ``tokenizer.json`` is the stored one (its digest), else
    the folder ``fetch(tokenizer_files, name)`` wrote the blob store's copy into."""
    import hashlib

    import fedq.digest as digests

    files, name = dataset_args.get("tokenizer_files"), dataset_args.get("tokenizer")
    if not isinstance(files, dict) or not isinstance(name, str):
        return dataset_args
    ref = files.get("tokenizer.json")
    if not isinstance(ref, dict) or not isinstance(ref.get("sha256"), str):
        return dataset_args
    try:
        data = (Path(name).expanduser() / "tokenizer.json").read_bytes()
        if digests.of(data, ref["sha256"]) == ref["sha256"]:
            return dataset_args
    except (OSError, ValueError):
        pass
    folder = fetch(files, hashlib.sha256(ref["sha256"].encode()).hexdigest()[:32])
    return {**dataset_args, "tokenizer": str(folder)}
