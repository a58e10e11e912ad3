"""Reading a job spec: a YAML or JSON file (or a mapping) validated against
fedq/spec/schema.py, every mistake reported on one line with the file, line and
column, the field and, for a misspelt name, a suggestion, e.g.::

    job.yaml:4:3: model_args.widht: unknown argument of small_cnn (did you mean 'width'?)
    job.yaml:9:1: partition.alpha: Input should be greater than 0
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from fedq.errors import SpecError
from fedq.spec.schema import JobSpec, _did_you_mean, _kwargs_problems, _registries


def _fields_at(path: tuple[str | int, ...]) -> list[str]:
    """The field names the schema allows at ``path`` (for suggestions)."""
    model: Any = JobSpec
    for part in path:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return []
        model = _model_of(fields[part].annotation)
    return list(getattr(model, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    """The BaseModel inside ``Optional[M]``; for a union of several, the first."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _error_lines(source: str, exc: ValidationError,
                 positions: dict[tuple[str | int, ...], tuple[int, int]]) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if p not in ("iid", "dirichlet", "by_group"))
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field{_did_you_mean(str(loc[-1]), _fields_at(loc[:-1]))}"
        if not loc:
            for part in msg.splitlines():  # the cross-field rules: "field: message" each
                field, _, text = part.partition(": ")
                key = tuple(field.split("."))
                lines.append(f"{_where(source, positions, key)}: {field}: {text}")
            continue
        field = ".".join(str(p) for p in loc)
        lines.append(f"{_where(source, positions, loc)}: {field}: {msg}" if field
                     else f"{_where(source, positions, ())}: {msg}")
    return lines


def _where(source: str, positions: dict[tuple[str | int, ...], tuple[int, int]],
           loc: tuple[str | int, ...]) -> str:
    """``source:line:col`` of the deepest part of ``loc`` the file has, else ``source``."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in positions:
            line, col = positions[loc[:end]]
            return f"{source}:{line}:{col}"
    return source


def parse_spec(data: Any, source: str = "spec",
               positions: dict[tuple[str | int, ...], tuple[int, int]] | None = None) -> JobSpec:
    """Validate a mapping as a :class:`JobSpec`; raise :class:`SpecError` with one line
    per mistake. ``positions``: (line, column) of each key path, from :func:`load_spec`."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        lines = _error_lines(source, exc, positions or {})
    # The fields failed, so the cross-field rules did not run; the constructor arguments
    # need only their own fields: report those mistakes too.
    models, datasets, _, _ = _registries()
    for field, owner, table, skip in (("model_args", "model", models, 2),
                                      ("dataset_args", "dataset", datasets, 1)):
        name, args = data.get(owner), data.get(field)
        if isinstance(name, str) and name in table and isinstance(args, dict):
            for key, msg in _kwargs_problems(field, table[name], args, skip=skip, owner=name):
                line = f"{_where(source, positions or {}, tuple(key.split('.')))}: {key}: {msg}"
                if line not in lines:
                    lines.append(line)
    raise SpecError("\n".join(lines))


def read_spec_file(path: str | Path
                   ) -> tuple[Any, dict[tuple[str | int, ...], tuple[int, int]]]:
    """A YAML or JSON spec file's data and the (line, column) of each key; a file that
    cannot be read or parsed is one :class:`SpecError` line with its place."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            return json.loads(text), {}
        return yaml.safe_load(text), _yaml_positions(yaml.compose(text, Loader=yaml.SafeLoader))
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{where}: not valid YAML: {problem}") from None


def load_spec(path: str | Path, sets: Sequence[str] = ()) -> JobSpec:
    """Read and validate a YAML or JSON job spec file, with ``sets`` applied first
    (:func:`apply_sets`)."""
    data, positions = read_spec_file(path)
    if sets:
        data = apply_sets(data, sets, str(path))
        keys = [tuple(item.partition("=")[0].split(".")) for item in sets]
        positions = {k: v for k, v in positions.items()  # the file no longer says these
                     if not any(k[:len(key)] == key for key in keys)}
    return parse_spec(data, str(path), positions)


def apply_sets(data: Any, sets: Sequence[str], source: str = "spec") -> dict[str, Any]:
    """A copy of spec ``data`` with each ``KEY=VALUE`` of ``sets`` applied in order (as
    ``fedq submit --set`` gives them): KEY is a dotted path of fields (``rounds``,
    ``model_args.lora.r``), its mappings made where the spec has none; VALUE is read as
    YAML (``3``, ``true``, ``[a.txt, b.txt]``, ``{r: 8}``; a plain word is a string).
    A malformed item is one :class:`SpecError` line."""
    import copy

    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    out = copy.deepcopy(data)
    for item in sets:
        key, eq, raw = item.partition("=")
        path = key.split(".")
        if not eq or not all(p.strip() == p and p for p in path):
            raise SpecError(f"--set {item[:80]!r}: want KEY=VALUE, KEY a field's dotted "
                            f"path (model_args.path=/models/qwen)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise SpecError(f"--set {key}: its value is not YAML ({problem})") from None
        here = out
        for depth, part in enumerate(path[:-1]):
            nxt = here.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise SpecError(f"--set {key}: {'.'.join(path[:depth + 1])} is not a "
                                f"mapping in {source}")
            here = nxt
        here[path[-1]] = value
    return out


def _yaml_positions(node: Any, path: tuple[str | int, ...] = ()
                    ) -> dict[tuple[str | int, ...], tuple[int, int]]:
    """(line, column), 1-based, of every mapping key in a composed YAML document."""
    out: dict[tuple[str | int, ...], tuple[int, int]] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = (*path, key.value)
            out[here] = (key.start_mark.line + 1, key.start_mark.column + 1)
            out.update(_yaml_positions(value, here))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out[(*path, i)] = (item.start_mark.line + 1, item.start_mark.column + 1)
            out.update(_yaml_positions(item, (*path, i)))
    return out
