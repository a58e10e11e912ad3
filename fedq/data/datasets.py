"""In-memory datasets: images as float tensors (N, C, H, W), labels as int64 (N,).

- ``digits``: scikit-learn's 1,797 real 8x8 digit images (ships with the package,
  works offline); a fixed stratified 80/20 train/test split.
- ``cifar10``: torchvision's CIFAR-10 read from ``data_dir`` (downloaded there when
  the machine is online and the folder lacks it).
- ``synthetic``: Gaussian class clusters of any image shape, for benchmarks.
- ``shakespeare``: real English text for language models (fedq/data/text.py): inputs
  (N, T) byte ids, targets the same shifted by one, each window's work as its group.
- ``text_files``: your own ``.txt`` and ``.jsonl`` files, read from ``data_dir`` on each
  machine that loads them, tokenized by bytes or by a local Hugging Face tokenizer
  (fedq/data/tokens.py); windows as for ``shakespeare``, each file a group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedq.errors import DataUnavailable, UnknownDataset
from fedq.registry import Registry

# The test split never depends on a job's seed, so accuracies compare across jobs.
SPLIT_SEED = 20240601
#: A target no loss is taken on (torch's cross_entropy ``ignore_index``): the tokens of a
#: conversation that the assistant did not say, with ``loss_on: assistant``.
IGNORE = -100


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: torch.Tensor  # (N, C, H, W) float32
    y_train: torch.Tensor  # (N,) int64
    x_test: torch.Tensor  # (M, C, H, W) float32
    y_test: torch.Tensor  # (M,) int64
    num_classes: int  # classes, or the vocabulary size of a text data set
    groups: torch.Tensor | None = None  # (N,) int64: the source (work) of each example
    tokenizer: Any = None  # a text data set's (fedq.data.tokens.Tokenizer)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def is_text(self) -> bool:
        """Token windows (N, T) in, next tokens (N, T) out."""
        return self.y_train.ndim == 2

    def partition_labels(self) -> np.ndarray:
        """What partitions split by: each example's group if it has one, else its label."""
        return (self.groups if self.groups is not None else self.y_train).numpy()


def _standardize(train: np.ndarray, test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = float(train.mean()), float(train.std()) or 1.0
    return (torch.from_numpy(((train - mean) / std).astype(np.float32)),
            torch.from_numpy(((test - mean) / std).astype(np.float32)))


#: Name -> loader (data_dir, **dataset_args) -> Dataset; a job spec's ``dataset``.
DATASETS: Registry[Callable[..., Dataset]] = Registry("dataset")
#: The data sets whose loader reads the spec's ``data_dir`` (the others are built in).
READS_DATA_DIR = frozenset({"cifar10", "text_files"})


@DATASETS.register("digits")
def _digits(data_dir: Path | None) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8), values 0..16
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, bunch.target, test_size=0.2, random_state=SPLIT_SEED, stratify=bunch.target)
    xt, xe = _standardize(x_tr, x_te)
    return Dataset("digits", xt, torch.from_numpy(y_tr).long(), xe,
                   torch.from_numpy(y_te).long(), 10)


@DATASETS.register("cifar10")
def _cifar10(data_dir: Path | None) -> Dataset:
    from torchvision.datasets import CIFAR10

    if data_dir is None:
        raise DataUnavailable("cifar10: no data_dir (set it in the spec or FEDQ_DATA_DIR)")
    try:
        parts = [CIFAR10(str(data_dir), train=t, download=False) for t in (True, False)]
    except RuntimeError:
        try:
            parts = [CIFAR10(str(data_dir), train=t, download=True) for t in (True, False)]
        except Exception as exc:  # network errors come in many types
            raise DataUnavailable(
                f"cifar10: {data_dir} has no cifar-10-batches-py and the download failed "
                f"({type(exc).__name__}); put CIFAR-10 there or go online") from None
    arrays = [np.asarray(p.data, dtype=np.float32).transpose(0, 3, 1, 2) / 255.0 for p in parts]
    xt, xe = _standardize(arrays[0], arrays[1])
    return Dataset("cifar10", xt, torch.tensor(parts[0].targets).long(), xe,
                   torch.tensor(parts[1].targets).long(), 10)


@DATASETS.register("synthetic")
def _synthetic(data_dir: Path | None, n_train: int = 10_000, n_test: int = 2_000,
               shape: tuple[int, ...] | list[int] = (3, 32, 32), num_classes: int = 10,
               noise: float = 2.0) -> Dataset:
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    shape = tuple(shape)
    means = torch.randn((num_classes, *shape), generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, num_classes, (n,), generator=gen)
        return means[y] + noise * torch.randn((n, *shape), generator=gen), y

    (xt, yt), (xe, ye) = draw(n_train), draw(n_test)
    return Dataset("synthetic", xt, yt, xe, ye, num_classes)


@DATASETS.register("shakespeare")
def _shakespeare(data_dir: Path | None, block_size: int = 64,
                 authors: tuple[str, ...] | list[str] = ("shakespeare", "milton"),
                 val_fraction: float = 0.1, max_works: int = 0,
                 eval_windows: int = 1024) -> Dataset:
    """Byte-level windows of the works of ``authors``; the last ``val_fraction`` of every
    work is held out. ``max_works`` > 0 keeps the first that many works (tests);
    ``eval_windows`` > 0 evaluates on that many held-out windows, evenly spaced (0: all
    of them; about 10,000 at block_size 64, slow on a CPU every round)."""
    from fedq.data import text

    unknown = sorted(set(authors) - set(text.AUTHORS))
    if unknown or not authors:
        raise DataUnavailable(f"shakespeare: authors must be among {sorted(text.AUTHORS)}")
    from fedq.data.tokens import ByteTokenizer

    found = text.works(tuple(authors))[:max_works or None]
    sources = [np.frombuffer(data, dtype=np.uint8) for _, data in found]
    return _windowed("shakespeare", sources, ByteTokenizer(), block_size, val_fraction,
                     eval_windows)


@DATASETS.register("text_files")
def _text_files(data_dir: Path | None, files: tuple[str, ...] | list[str] = (),
                tokenizer: str = "bytes",
                block_size: int = 64, val_fraction: float = 0.1, eval_windows: int = 1024,
                field: str = "text", chat: bool = False,
                loss_on: str = "assistant",
                tokenizer_files: dict[str, Any] | None = None) -> Dataset:
    """The ``files`` (paths or glob patterns, relative to ``data_dir`` unless absolute):
    a ``.jsonl`` file's lines are JSON objects whose ``field`` is one document each, any
    other file is UTF-8 text; with ``chat`` a ``.jsonl`` line's ``messages`` (a
    conversation) is rendered by the tokenizer's chat template instead. Each file is
    tokenized by ``tokenizer`` (``bytes``, or a folder with a ``tokenizer.json``); the
    last ``val_fraction`` of every file's tokens is held out. ``eval_windows`` as for
    ``shakespeare``. ``loss_on``, for ``chat``: ``assistant`` (the default) takes the
    loss on the assistant turns' tokens alone (every other target is :data:`IGNORE`, and
    a window with none is left out), in training and in the held-out loss; ``all`` on
    every token. ``tokenizer_files``: where a tokenizer fedq submit trained is stored
    (fedq/data/tokens.py, ``local_tokenizer``), read by the caller, not here."""
    from fedq.data import text, tokens

    del tokenizer_files

    if loss_on not in ("all", "assistant"):
        raise DataUnavailable(f"text_files: loss_on: {loss_on!r}: all or assistant")
    tok = tokens.load_tokenizer(tokenizer, data_dir)
    render = tokens.chat_renderer(tokenizer, data_dir, turns=loss_on == "assistant") \
        if chat else None
    found = text.read_files(list(files), data_dir, field, render)
    sources, targets = [], []
    for _, body, spans in found:
        if spans is None or loss_on == "all":
            sources.append(np.asarray(tok.encode(body), dtype=np.int64))
            targets.append(sources[-1])
            continue
        assert isinstance(tok, tokens.FolderTokenizer)  # chat needs a folder's tokenizer
        ids, starts = tok.encode_with_starts(body)
        sources.append(np.asarray(ids, dtype=np.int64))
        targets.append(_assistant_only(sources[-1], np.asarray(starts, dtype=np.int64),
                                       spans))
    return _windowed("text_files", sources, tok, block_size, val_fraction, eval_windows,
                     targets)


def _assistant_only(ids: np.ndarray, starts: np.ndarray,
                    spans: list[tuple[int, int]]) -> np.ndarray:
    """``ids`` with every token that does not start inside one of ``spans`` (sorted,
    disjoint character ranges) replaced by :data:`IGNORE`."""
    out = np.full_like(ids, IGNORE)
    if spans:
        first = np.asarray([s for s, _ in spans], dtype=np.int64)
        last = np.asarray([e for _, e in spans], dtype=np.int64)
        k = np.searchsorted(first, starts, side="right") - 1
        inside = (k >= 0) & (starts < last[np.maximum(k, 0)])
        out[inside] = ids[inside]
    return out


def _windowed(name: str, sources: list[np.ndarray], tokenizer: Any, block_size: int,
              val_fraction: float, eval_windows: int,
              targets: list[np.ndarray] | None = None) -> Dataset:
    """Token windows of every source (the last ``val_fraction`` of each held out), the
    source's index as each training window's group. ``targets``: each source's ids as
    targets, :data:`IGNORE` where no loss is taken (default: the ids); a window with no
    target left is dropped."""
    train, test, groups = [], [], []
    for g, ids in enumerate(sources):
        cut = int(len(ids) * (1 - val_fraction))
        wanted = ids if targets is None else targets[g]
        parts = []
        for lo, hi in ((0, cut), (cut, len(ids))):
            x = text_windows(ids[lo:hi], block_size)
            y = text_windows(wanted[lo:hi], block_size)
            kept = (y[:, 1:] != IGNORE).any(axis=1)
            parts.append(np.concatenate([x[kept, :-1], y[kept, 1:]], axis=1))
        train.append(parts[0])
        test.append(parts[1])
        groups.append(np.full(len(parts[0]), g, dtype=np.int64))
    if not sum(len(w) for w in train) or not sum(len(w) for w in test):
        raise DataUnavailable(f"{name}: too little text for one training and one held-out "
                              f"window of {block_size + 1} tokens"
                              + (" with an assistant turn in it" if targets is not None
                                 and any(t is not s for t, s in zip(targets, sources,
                                                                    strict=True)) else ""))
    tr = torch.from_numpy(np.concatenate(train).astype(np.int64))  # (N, 2T): inputs, targets
    te = torch.from_numpy(np.concatenate(test).astype(np.int64))
    if 0 < eval_windows < len(te):
        te = te[np.linspace(0, len(te) - 1, eval_windows).round().astype(np.int64)]
    t = block_size
    return Dataset(name, tr[:, :t].contiguous(), tr[:, t:].contiguous(),
                   te[:, :t].contiguous(), te[:, t:].contiguous(), tokenizer.vocab_size,
                   torch.from_numpy(np.concatenate(groups)), tokenizer)


def text_windows(ids: np.ndarray, block_size: int) -> np.ndarray:
    """(N, block_size + 1) non-overlapping windows of the token ids ``ids``."""
    n = max(0, (len(ids) - 1) // block_size)
    idx = np.arange(n)[:, None] * block_size + np.arange(block_size + 1)[None, :]
    return ids[idx]


@dataclass(frozen=True)
class Shape:
    """What a model built for a data set needs of it: its inputs' shape, its classes
    (or vocabulary), whether it is text, and a text data set's tokenizer."""
    input_shape: tuple[int, ...]
    num_classes: int
    is_text: bool
    tokenizer: Any = None


def shape_of(name: str, args: dict[str, Any] | None = None) -> Shape:
    """The :class:`Shape` of data set ``name`` with ``args``; ``text_files`` from its
    ``block_size`` and tokenizer alone, without reading its files (a machine that only
    runs a trained model has none of them)."""
    if name == "text_files":
        import inspect

        from fedq.data import tokens

        given = args or {}
        default = inspect.signature(_text_files).parameters["block_size"].default
        block = given.get("block_size", default)
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise DataUnavailable(f"text_files: block_size: {block!r} is not a positive "
                                  "integer")
        tok = tokens.load_tokenizer(str(given.get("tokenizer", "bytes")))
        return Shape((block,), tok.vocab_size, True, tok)
    ds = load_dataset(name, None, args)
    return Shape(ds.input_shape, ds.num_classes, ds.is_text, ds.tokenizer)


@lru_cache(maxsize=4)
def _load(name: str, data_dir: str | None, args_json: str, stamp: str = "") -> Dataset:
    del stamp  # part of the cache's key only
    args = json.loads(args_json)
    if "authors" in args:
        args["authors"] = tuple(args["authors"])
    return DATASETS[name](Path(data_dir) if data_dir else None, **args)


def load_dataset(name: str, data_dir: str | Path | None = None,
                 args: dict[str, Any] | None = None) -> Dataset:
    """Load (once per process) the named dataset; raise UnknownDataset / DataUnavailable.
    ``text_files`` is read again when one of its files, or its tokenizer folder's JSON
    files, changes (size or modification time)."""
    if name not in DATASETS:
        raise UnknownDataset(f"dataset: unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    stamp = ""
    if name == "text_files":  # files of one's own change: read again when they do
        from fedq.data import text

        given = args or {}
        where = Path(data_dir) if data_dir else None
        stamp = text.files_stamp(list(given.get("files") or ()), where)
        tokenizer = given.get("tokenizer", "bytes")
        if isinstance(tokenizer, str) and tokenizer != "bytes":  # and its folder's files
            folder = Path(tokenizer).expanduser()
            folder = folder if folder.is_absolute() or where is None else where / folder
            stamp += "|" + text.files_stamp([str(folder / "*.json")], None)
    return _load(name, str(data_dir) if data_dir else None,
                 json.dumps(args or {}, sort_keys=True), stamp)
