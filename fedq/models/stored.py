"""What a job stores beside its spec for machines that lack it: the checkpoint it ships
(``model_args.base_files``, fedq/models/hf.py) and the tokenizer ``fedq submit``
trained (``dataset_args.tokenizer_files``, fedq/data/tokens.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``fetch(kind, files, name)``: the folder ``name`` under FEDQ_HOME/``kind`` holding
#: ``files`` (blob refs as JSON) fetched from the blob store (fedq/blobs/checkpoint.py).
Fetch = Callable[[str, dict[str, Any], str], Path]


def beside(model_args: dict[str, Any], dataset_args: dict[str, Any]) -> bool:
    """Whether the job stores a checkpoint or a tokenizer beside its spec."""
    return "base_files" in model_args or "tokenizer_files" in dataset_args


def localized(model_args: dict[str, Any], dataset_args: dict[str, Any], fetch: Fetch
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``model_args`` and ``dataset_args`` with paths that hold, on this machine, the
    job's checkpoint and tokenizer: as given where they hold the job's files (by
    digest), else the folders ``fetch`` wrote the stored copies into (``bases``,
    ``tokenizers``)."""
    from fedq.data.tokens import local_tokenizer
    from fedq.models.hf import local_args

    if "base_files" in model_args:
        model_args = local_args(model_args, lambda files, name: fetch("bases", files, name))
    if "tokenizer_files" in dataset_args:
        dataset_args = local_tokenizer(dataset_args,
                                       lambda files, name: fetch("tokenizers", files, name))
    return model_args, dataset_args
