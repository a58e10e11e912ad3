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


def test_private_files_are_the_owners_alone_whatever_the_umask_or_a_squatter(
        tmp_path: Path) -> None:
    """Join bundles and keys (fedq.files.write_whole): written under a name nobody can
    take first (O_EXCL, random), mode 600 under umask 000, whole. The embedded default's
    .fedq/ is 700 (fedq.files.private_folder). Before, a bundle went through the
    predictable ``.NAME.tmp``: a local user who made it first (mode 666) owned the
    bundle's token. Go back to that and this fails."""
    import os
    import stat

    from fedq.cli.members import _write_private
    from fedq.engine.app import celery_config
    from fedq.settings import load_settings

    folder = tmp_path / "bundles"
    folder.mkdir()
    os.chmod(folder, 0o777)
    squat = folder / ".w1.bundle.tmp"  # the old predictable name, another user's
    squat.touch()
    os.chmod(squat, 0o666)
    os.chown(squat, 65534, 65534)
    old = os.umask(0)
    try:
        _write_private(folder / "w1.bundle", '{"token": "secret"}\n')
        home = tmp_path / "fresh" / ".fedq"
        celery_config(load_settings({"FEDQ_HOME": str(home)}))
    finally:
        os.umask(old)
    bundle = (folder / "w1.bundle").stat()
    assert stat.S_IMODE(bundle.st_mode) == 0o600 and bundle.st_uid == os.getuid()
    assert squat.read_text() == "" and squat.stat().st_uid == 65534  # never written through
    assert sorted(p.name for p in folder.iterdir()) == [".w1.bundle.tmp", "w1.bundle"]
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    from fedq.testing.cluster import record

    record("security", scenario="files: a squatted temporary name",
           did="another local user pre-created the bundle's old temporary name (mode 666), "
               "umask 000",
           fedq="the bundle is written under a fresh O_EXCL name, mode 600; .fedq/ is 700",
           guard="fedq/files.py (write_whole, private_folder)",
           outcome="the squatter's file untouched, the token unreadable to others")
