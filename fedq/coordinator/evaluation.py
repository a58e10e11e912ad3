"""The coordinator's view of a model: its round-0 weights and its test accuracy."""

from __future__ import annotations

import torch
from torch import nn

from fedq.aggregate.types import Weights
from fedq.data import load_dataset
from fedq.data.datasets import IGNORE
from fedq.models import build_model, seeded_model
from fedq.models.device import pick_device
from fedq.process import PROCESS
from fedq.settings import get_settings
from fedq.spec import JobSpec
from fedq.weights import state_of


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
             device: torch.device, batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on (x, y): per example for a
    classifier, per token (nats per token) for a language model, over the targets that
    are not :data:`fedq.data.datasets.IGNORE`."""
    model.to(device).eval()
    correct, loss_sum = 0, 0.0
    counted = int((y != IGNORE).sum())
    for start in range(0, len(y), batch_size):
        xb, yb = x[start:start + batch_size].to(device), y[start:start + batch_size].to(device)
        logits = model(xb).flatten(0, -2)  # (B, classes) or (B * T, vocab)
        yb = yb.flatten()
        loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum",
                                                      ignore_index=IGNORE))
        correct += int((logits.argmax(dim=1) == yb).sum())  # never equal to IGNORE
    return correct / max(counted, 1), loss_sum / max(counted, 1)


def evaluate_weights(spec: JobSpec, weights: Weights) -> tuple[float, float]:
    """(accuracy, loss) of ``weights`` on the dataset's held-out test split."""
    spec = here(spec)
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    model = build_model(spec.model, ds.input_shape, ds.num_classes, **spec.model_args)
    model.load_state_dict(weights)
    return evaluate(model, ds.x_test, ds.y_test, device=pick_device())


def here(spec: JobSpec, base: bool = True) -> JobSpec:
    """``spec`` with paths that hold, on this machine, what its job stores beside it:
    the tokenizer fedq submit trained (``dataset_args.tokenizer_files``) and, with
    ``base``, the checkpoint it ships (``model_args.base_files``): the paths given
    where they hold the job's files (by digest), else the folders under FEDQ_HOME
    (``tokenizers/``, ``bases/``) the blob store's copies are fetched into once."""
    from fedq.models.stored import beside, localized

    if not beside(spec.model_args, spec.dataset_args):
        return spec
    from fedq.blobs.checkpoint import fetcher

    settings = get_settings()
    model_args, dataset_args = localized(spec.model_args if base else {}, spec.dataset_args,
                                         fetcher(PROCESS.blobs(settings), settings.home))
    return spec.model_copy(update={"model_args": model_args if base else spec.model_args,
                                   "dataset_args": dataset_args})


def initial_weights(spec: JobSpec) -> Weights:
    """The round-0 global model, a function of (model, dataset shape, seed)."""
    spec = here(spec)
    ds = load_dataset(spec.dataset, spec.data_dir, spec.dataset_args)
    return state_of(seeded_model(spec.model, ds.input_shape, ds.num_classes, spec.seed,
                                 **spec.model_args))
