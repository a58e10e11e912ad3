"""Every repository path the docs, the README, pyproject.toml and fedq's docstrings and
comments name exists: a newcomer who follows one finds the file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./-])((?:fedq|tests|docs|bench|scripts|examples|docker|worker-images|"
                  r"migrations|requirements)/[\w./-]*\w\.(?:py|md|sh|ya?ml|toml|lock|txt|png|"
                  r"svg|html|json|mako))(?![\w/])")
# Paths that name what a command writes elsewhere, not files of this repository.
ELSEWHERE = {"docs/img/progress.png"}


def _sources() -> list[Path]:
    return [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "fedq").rglob("*.py"))]


def test_every_named_path_exists() -> None:
    missing = []
    for source in _sources():
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for path in PATH.findall(line):
                if path in ELSEWHERE or any(c in path for c in "*{}"):
                    continue
                if not (ROOT / path).exists():
                    missing.append(f"{source.relative_to(ROOT)}:{number}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
