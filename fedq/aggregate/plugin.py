"""How a reducer or server optimizer declares its hyperparameters: a pydantic model
named ``Params`` inside the class, with each field's default, bounds and description.
The job spec takes its ``reducer:`` and ``server:`` sections' other keys from there
(checked at submit, one line per mistake, by :func:`problems`), and
docs/strategies.md lists them. A new rule with
a new hyperparameter is one file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class Params(BaseModel):
    """No hyperparameters; a plug-in's own ``Params`` adds its fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


P = TypeVar("P", bound=Params)


def problems(field: str, owner: str, declared: type[Params],
             given: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """(field, message) for each of ``given`` that ``declared`` refuses."""
    try:
        declared.model_validate(dict(given))
    except ValidationError as exc:
        known = list(declared.model_fields)
        for err in exc.errors():
            name = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                yield (f"{field}.{name}", f"not a parameter of {owner}"
                       + (f" (did you mean {close[0]!r}?)" if close else "")
                       + f" (its parameters: {', '.join(known) or 'none'})")
            else:
                yield (f"{field}.{name}", str(err["msg"]).removeprefix("Value error, "))


def build(declared: type[P], given: Mapping[str, Any]) -> P:
    """The parameters of a spec checked at submit, read back: names ``declared`` does
    not have (a spec stored before plug-ins declared their own carried every plug-in's)
    and unset (None) values are left to the defaults."""
    return declared.model_validate({k: v for k, v in given.items()
                                    if k in declared.model_fields and v is not None})

