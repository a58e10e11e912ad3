"""One registry style for every plug-in kind (models, data sets, reducers, server
optimizers): a name -> object mapping filled by a decorator where the object is
defined, so adding one is one file and its ``@X.register("name")`` line::

    @REDUCERS.register("trimmed_mean")
    class TrimmedMean(SourceReducer): ...

A registered class gets the name as its ``name`` attribute. The job spec's allowed
names come from these mappings.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    """Name -> plug-in, for one ``kind`` (its word in error messages)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if isinstance(item, type):
                setattr(item, "name", name)  # noqa: B010 - the class's own name attribute
            self[name] = item
            return item

        return add

    def unknown(self, name: str) -> str:
        """One line saying ``name`` is not registered, with a suggestion."""
        close = difflib.get_close_matches(name, list(self), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint} (known: {', '.join(self)})"
