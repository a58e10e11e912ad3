"""The ``fedq`` command: it parses and prints; the work is in library functions."""

from fedq.cli import members, observe  # noqa: F401  (worker; plot, report, metrics)
from fedq.cli.commands import main

__all__ = ["main"]
