"""One way to wait for something in tests and test clusters: poll until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float, *, interval: float = 0.05,
               what: str | Callable[[], str] = "the condition") -> T:
    """Call ``check`` every ``interval`` seconds until it returns something truthy, and
    return that; after ``timeout`` seconds an AssertionError says what was awaited
    (``what``: text, or a function giving it then, e.g. a log's tail)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for "
                                 f"{what() if callable(what) else what}")
        time.sleep(interval)
