"""The package as users get it: a wheel that carries its migrations, installed into a
fresh environment outside the checkout, migrating PostgreSQL and SQLite and running a
job on the embedded default; the lock file agreeing with pyproject.toml; extras named
when missing; the Celery and kombu internals fedq patches still where it expects them."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

import fedq
from tests.conftest import pg_database

ROOT = Path(__file__).resolve().parents[1]


def _lock() -> dict[str, str]:
    """Package name -> pinned version, for the lines of dev.lock that apply here."""
    pins: dict[str, str] = {}
    env = default_environment()
    for line in (ROOT / "requirements" / "dev.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            (spec,) = req.specifier
            pins[_norm(req.name)] = spec.version
    return pins


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_lock_satisfies_pyproject() -> None:
    """Every requirement of the locked groups is met by the lock's pin (re-run
    scripts/lock.sh after editing pyproject.toml's dependencies)."""
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    lock = _lock()
    env = default_environment()
    wanted = project["dependencies"] + extras["test"] + extras["coordinator"]
    for group in ("postgres", "s3", "dp", "zstd", "dashboard", "worker"):
        wanted += extras[group]
    problems = []
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        pinned = lock.get(_norm(req.name))
        if pinned is None:
            problems.append(f"{req.name}: not in the lock")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req.name}: lock pins {pinned}, pyproject wants {req.specifier}")
    assert problems == []


def test_environment_is_the_lock() -> None:
    """The environment the tests run in has exactly the lock's versions."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for name, pinned in _lock().items():
        try:
            have = version(name)
        except PackageNotFoundError:
            wrong.append(f"{name}: missing (lock {pinned})")
            continue
        if have.split("+")[0] != pinned.split("+")[0]:
            wrong.append(f"{name}: {have} installed, lock {pinned}")
    assert wrong == []


def test_version_is_written_once() -> None:
    from importlib.metadata import version

    assert "version" in _pyproject()["project"]["dynamic"]
    assert version("fedq") == fedq.__version__


def test_license_matches_pyproject() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert _pyproject()["project"]["license"]["text"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_patched_internals_are_where_fedq_expects_them() -> None:
    """fedq subclasses kombu's filesystem Channel (_put, _queue_bind, get_table,
    _delete) and Celery's RedisBackend._add_pending_result; an upgrade that renames
    them breaks fedq silently, so the versions are pinned in pyproject.toml and the
    shapes checked here."""
    from celery._state import task_join_will_block
    from celery.backends.redis import RedisBackend
    from kombu.transport import filesystem

    from fedq.engine.backend import RedisBackend as FedqBackend
    from fedq.engine.transport import Channel

    assert list(inspect.signature(filesystem.Channel._put).parameters)[:3] == \
        ["self", "queue", "payload"]
    assert "data_folder_out" in inspect.getsource(filesystem.Channel)
    assert list(inspect.signature(filesystem.Channel._queue_bind).parameters) == \
        ["self", "exchange", "routing_key", "pattern", "queue"]
    assert list(inspect.signature(filesystem.Channel.get_table).parameters) == ["self", "exchange"]
    assert callable(filesystem.Channel._exchange_file) and filesystem.exchange_queue_t._fields == \
        ("routing_key", "pattern", "queue")
    assert list(inspect.signature(RedisBackend._add_pending_result).parameters) == \
        ["self", "task_id", "result", "weak"]
    assert callable(task_join_will_block)
    assert Channel._put is not filesystem.Channel._put
    assert FedqBackend._add_pending_result is not RedisBackend._add_pending_result


def test_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """With boto3 or psycopg absent, the CLI says which extra to install, in one line."""
    import importlib.util

    from click.testing import CliRunner

    from fedq.cli import main
    from fedq.db.session import connect
    from fedq.settings import get_settings

    real = importlib.util.find_spec
    hidden = {"boto3", "psycopg", "matplotlib", "prometheus_client"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in hidden else real(name, *a))
    monkeypatch.setenv("FEDQ_DATABASE_URL", "postgresql+psycopg://u@127.0.0.1:1/none")
    get_settings.cache_clear()
    connect.cache_clear()
    try:
        result = CliRunner().invoke(main, ["status"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "pip install 'fedq[postgres]'" in lines[0], result.output

    from fedq.blobs.s3 import S3BlobStore
    from fedq.errors import MissingExtra

    with pytest.raises(MissingExtra, match=r"pip install 'fedq\[s3\]'"):
        S3BlobStore("s3://bucket/prefix")
    for args, extra in ((["plot", "somejob"], "plot"), (["report", "somejob"], "plot"),
                        (["metrics", "--once"], "metrics")):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and f"pip install 'fedq[{extra}]'" in lines[0], result.output


@pytest.mark.slow
def test_wheel_installs_migrates_and_runs_a_job(tmp_path: Path) -> None:
    """Build the wheel, install it into a new venv outside the checkout, then
    `fedq db upgrade` on SQLite and PostgreSQL and `fedq demo` on the embedded default."""
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                    "--outdir", str(dist), str(src)], check=True, capture_output=True)
    (wheel,) = dist.glob("fedq-*.whl")
    assert wheel.name.startswith(f"fedq-{fedq.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"fedq/_migrations/env.py", "fedq/_migrations/script.py.mako",
            "fedq/pins.toml"} <= names
    shipped = {n for n in names if n.startswith("fedq/_migrations/versions/0")}
    assert len(shipped) == len(list((ROOT / "migrations" / "versions").glob("0*.py")))
    assert not any(n.startswith("migrations/") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    subprocess.run([str(vpy), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True)
    # The dependencies come from the test environment, appended after the new venv's own
    # site-packages (so fedq itself is the wheel's; the editable install's hook is a .pth
    # that Python does not run from a folder added this way).
    site = subprocess.run(
        [str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env.update(FEDQ_HOME=str(work / "home"), PYTHONPATH="")
    fedq_bin = str(venv / "bin" / "fedq")

    def run(*args: str, **extra: str) -> str:
        proc = subprocess.run([fedq_bin, *args], cwd=work, env={**env, **extra},
                              capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    where = subprocess.run([str(vpy), "-c", "import fedq, fedq.db.session as s; "
                            "print(fedq.__file__); print(s.migrations_dir())"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    module, migrations = where.stdout.split()
    assert module.startswith(str(venv)) and migrations.startswith(str(venv)), where.stdout

    head = sorted(p.stem for p in (ROOT / "migrations" / "versions").glob("0*.py"))[-1]
    head_rev = head.split("_", 1)[0]
    out = run("db", "upgrade", FEDQ_DATABASE_URL=f"sqlite:///{work}/fedq.db")
    assert f"revision {head_rev}" in out
    with pg_database() as url:
        out = run("db", "upgrade", FEDQ_DATABASE_URL=url)
        assert f"revision {head_rev}" in out
    out = run("demo", "--rounds", "1", "--workers", "1", "--home", str(work / "demo"))
    assert "completed" in out.lower(), out
