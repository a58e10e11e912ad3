"""The model zoo: ``build_model(name, input_shape, num_classes, **kwargs)``.

A model module registers its constructors on import; the built-in ones are imported here.
"""

from fedq.models import cnn, gpt, hf, resnet  # noqa: F401  (register the built-in models)
from fedq.models.registry import MODELS, build_model, check_model, pinned_args, seeded_model

__all__ = ["MODELS", "build_model", "check_model", "pinned_args", "seeded_model"]
