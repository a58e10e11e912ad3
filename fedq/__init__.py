"""fedq: federated training across the machines you already own, on Celery.

``celery -A fedq worker -Q cpu`` finds the Celery app here as ``fedq.app``. It is
loaded on first access (PEP 562), so ``import fedq.aggregate`` or ``import fedq.spec``
does not import Celery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the one place: pyproject.toml reads it
__all__ = ["app", "__version__"]

if TYPE_CHECKING:
    from celery import Celery

    app: Celery


def __getattr__(name: str) -> Any:
    if name == "app":
        from fedq.engine.app import app

        return app
    raise AttributeError(f"module 'fedq' has no attribute {name!r}")
