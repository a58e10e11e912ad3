"""Name -> model constructor (``@MODELS.register("name")``, fedq/registry.py). Each
constructor takes (input_shape, num_classes, **kwargs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fedq.errors import UnknownModel
from fedq.registry import Registry

ModelFactory = Callable[..., nn.Module]
MODELS: Registry[ModelFactory] = Registry("model")
#: Model name -> what turns a spec's ``model_args`` into the ones a job stores (a
#: checkpoint's digest added: fedq/models/hf.py); a model without one stores them as given.
PINS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def pinned_args(name: str, model_args: dict[str, Any]) -> dict[str, Any]:
    """``model_args`` of model ``name`` as a job stores them (:data:`PINS`)."""
    pin = PINS.get(name)
    return model_args if pin is None else pin(model_args)


def check_model(name: str, source: str = "spec") -> None:
    if name not in MODELS:
        raise UnknownModel(f"{source}: model: unknown model {name!r} "
                           f"(known: {', '.join(sorted(MODELS))})")


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any
) -> nn.Module:
    """A freshly initialised model; seed torch before calling for reproducible weights."""
    check_model(name)
    return MODELS[name](input_shape, num_classes, **kwargs)


def seeded_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int,
                 **kwargs: Any) -> nn.Module:
    """The model as a job's round 0 has it: built right after ``torch.manual_seed(seed)``.
    The coordinator makes round 0's global model with it, and a worker rebuilds the
    same bytes instead of downloading them (fedq/worker/update.py)."""
    torch.manual_seed(seed)
    return build_model(name, input_shape, num_classes, **kwargs)
