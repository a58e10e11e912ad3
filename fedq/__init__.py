"""fedq: federated training across the machines you already own, on Celery.

``celery -A fedq worker -Q cpu`` finds the Celery app here as ``fedq.app``.
"""

from fedq.app import app

__version__ = "0.1.0"
__all__ = ["app", "__version__"]
