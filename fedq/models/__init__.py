"""The model zoo: ``build_model(name, input_shape, num_classes, **kwargs)``."""

from fedq.models.registry import MODELS, build_model, check_model, register

__all__ = ["MODELS", "build_model", "check_model", "register"]
