"""Where a finalize's time goes: named phases timed on the thread that runs it.

``recording()`` starts a record for the current thread; ``phase(name)`` adds the time
its block takes to that record (nothing when no record is open, so library code can
mark its phases at no cost elsewhere). Phases may nest: an outer phase's time
includes its inner ones (``summary`` reports the outer one's own time as
``NAME (rest)``). finalize logs the record of each round it commits; the
phases benchmark (bench/phases.py) reads those lines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()

#: Inner phases of each outer one: the outer one's own time is the rest.
NESTED = {"updates": ("read wait", "decode", "verify"),
          "next dispatch": ("next: round row", "next: send tasks")}


@contextmanager
def recording() -> Iterator[dict[str, float]]:
    """A fresh record (name -> seconds) for this thread while the block runs."""
    previous = getattr(_local, "times", None)
    times: dict[str, float] = {}
    _local.times = times
    try:
        yield times
    finally:
        _local.times = previous


def current_times() -> dict[str, float]:
    """This thread's open record (empty when none is open)."""
    return dict(getattr(_local, "times", None) or {})


@contextmanager
def phase(name: str) -> Iterator[None]:
    times: dict[str, float] | None = getattr(_local, "times", None)
    if times is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - start


def summary(times: dict[str, float]) -> str:
    """``open round 1.2 ms, collect results 3.0 ms, ...``: each phase's own time, in the
    order the phases ended (an outer phase, which ends after its inner ones, is shown as
    ``NAME (rest)``: its time less theirs)."""
    own = {}
    for name, seconds in times.items():
        if name in NESTED:
            own[f"{name} (rest)"] = max(0.0, seconds - sum(times.get(i, 0.0)
                                                           for i in NESTED[name]))
        else:
            own[name] = seconds
    return ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in own.items())
