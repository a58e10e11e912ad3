"""Bad environments at submit: one line, a non-zero exit, nothing half-written.
And `fedq cancel` on a live job."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from fedq.errors import ConfigError
from fedq.testing.cluster import DIGITS, Cluster, base_env
from fedq.testing.procs import run_module


def _fedq(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    full.update({"FEDQ_HOME": str(tmp_path / "home"), **env})
    return run_module("fedq.cli", args, full, 120)


def _submit(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(DIGITS))
    return _fedq(tmp_path, "submit", str(spec), **env)


def _one_line(proc: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def _no_job_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert not (home / "blobs" / "jobs").exists()
    if (home / "fedq.db").exists():
        import sqlite3

        with sqlite3.connect(home / "fedq.db") as conn:
            assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0


def test_unreachable_broker(tmp_path: Path) -> None:
    _one_line(_submit(tmp_path, FEDQ_BROKER_URL="redis://127.0.0.1:1/0"), 3,
              "broker redis://127.0.0.1:1/0 is not reachable")
    _no_job_written(tmp_path)


def test_unreachable_database(tmp_path: Path) -> None:
    _one_line(_submit(tmp_path, FEDQ_DATABASE_URL="postgresql+psycopg://x@127.0.0.1:1/x"), 3,
              "database postgresql+psycopg://x@127.0.0.1:1/x")
    assert not (tmp_path / "home" / "blobs" / "jobs").exists()


def test_unwritable_blob_store(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    _one_line(_submit(tmp_path, FEDQ_BLOB_URL=str(tmp_path / "a-file" / "blobs")), 3,
              "is not writable")
    _no_job_written(tmp_path)


def test_unreachable_s3_blob_store(tmp_path: Path) -> None:
    _one_line(_submit(tmp_path, FEDQ_BLOB_URL="s3://fedq/x",
                      FEDQ_S3_ENDPOINT_URL="http://127.0.0.1:1", AWS_ACCESS_KEY_ID="k",
                      AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1"), 3,
              "blob store s3://fedq/x is not writable")
    _no_job_written(tmp_path)


def test_workers_with_the_broker_down_is_one_line(tmp_path: Path) -> None:
    _one_line(_fedq(tmp_path, "workers", FEDQ_BROKER_URL="redis://127.0.0.1:1/0"), 3,
              "broker redis://127.0.0.1:1/0 is not reachable")


@pytest.mark.parametrize("command", [("watch", "nosuchjob"), ("results", "nosuchjob"),
                                     ("status", "nosuchjob"), ("cancel", "nosuchjob"),
                                     ("generate", "nosuchjob")])
def test_unknown_job_exits_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             command: tuple[str, ...]) -> None:
    # In process (the CLI's own entry point through click's runner): the same code as
    # `fedq ...`, without a Python start-up per case.
    from click.testing import CliRunner

    from fedq.cli import main
    from fedq.settings import get_settings

    for key in [k for k in os.environ if k.startswith("FEDQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("FEDQ_HOME", str(tmp_path / "home"))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(main, list(command))
    finally:
        get_settings.cache_clear()
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 4 and len(lines) == 1, result.output
    assert "no job 'nosuchjob'" in lines[0] and result.stdout == ""


def test_exit_codes_are_in_the_help() -> None:
    from click.testing import CliRunner

    from fedq.cli import main

    for args in (["--help"], ["watch", "--help"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and "4 no such job" in " ".join(result.stdout.split())


def test_unknown_setting_is_refused(tmp_path: Path) -> None:
    _one_line(_submit(tmp_path, FEDQ_BROKER="redis://oops"), 2, "unknown setting FEDQ_BROKER")


@pytest.mark.parametrize(("name", "value"), [
    ("FEDQ_BROKER_URL", "redis://:change-me-redis@127.0.0.1:1/0"),
    ("FEDQ_DATABASE_URL", "postgresql+psycopg://fedq:change-me-postgres@127.0.0.1:1/fedq"),
    ("AWS_SECRET_ACCESS_KEY", "change-me-s3-secret"),
])
@pytest.mark.parametrize("from_file", [False, True])
def test_placeholder_passwords_are_refused(tmp_path: Path, name: str, value: str,
                                           from_file: bool) -> None:
    """A placeholder password is public: a stack still using one does not start (the
    migrate and control services load these settings first), whether the value is in
    the environment or in the secret file a ``*_FILE`` variable names."""
    if from_file:
        (tmp_path / "secret").write_text(value + "\n")
        env = {f"{name}_FILE": str(tmp_path / "secret")}
    else:
        env = {name: value}
    _one_line(_submit(tmp_path, **env), 2, f"{name}")
    _no_job_written(tmp_path)


def test_secrets_are_read_from_the_files_their_file_variables_name(tmp_path: Path) -> None:
    """``FEDQ_X_FILE`` (Docker's secrets convention) gives FEDQ_X from a file, its
    trailing newline dropped; setting both, a missing file or an empty one is one line
    naming the variable, and nothing is written."""
    from fedq.errors import ConfigError
    from fedq.settings import load_settings

    url = tmp_path / "broker_url"
    url.write_text("redis://:s3cret-pass@127.0.0.1:6399/5\n")
    (tmp_path / "db").write_text(f"sqlite:///{tmp_path / 'x.db'}")
    got = load_settings({"FEDQ_BROKER_URL_FILE": str(url), "FEDQ_HOME": str(tmp_path),
                         "FEDQ_RESULT_BACKEND_FILE": str(url),
                         "FEDQ_DATABASE_URL_FILE": str(tmp_path / "db")})
    assert got.broker_url == got.result_backend == "redis://:s3cret-pass@127.0.0.1:6399/5"
    assert got.database_url == f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ConfigError, match="FEDQ_BROKER_URL and FEDQ_BROKER_URL_FILE are both"):
        load_settings({"FEDQ_BROKER_URL_FILE": str(url), "FEDQ_BROKER_URL": "redis://x/0"})
    (tmp_path / "empty").write_text("\n")
    for path, says in ((tmp_path / "nope", "cannot read"),
                       (tmp_path / "empty", "the file is empty")):
        _one_line(_submit(tmp_path, FEDQ_DATABASE_URL_FILE=str(path)), 2,
                  f"FEDQ_DATABASE_URL_FILE: {path}")
        assert says in _submit(tmp_path, FEDQ_DATABASE_URL_FILE=str(path)).stderr
        _no_job_written(tmp_path)


def test_s3_secret_key_from_a_file_reaches_the_store(s3_server: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 reads no ``*_FILE``: fedq passes the key it read from
    AWS_SECRET_ACCESS_KEY_FILE. A wrong key in the file is refused by the server."""
    from fedq.blobs import open_store
    from fedq.errors import BlobError

    key = tmp_path / "s3_password"
    key.write_text("fedq-secret\n")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fedq")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY_FILE", str(key))
    store = open_store("s3://fedq/secret-file", s3_server)
    ref = store.put("k", b"payload")
    assert store.get(ref) == b"payload"
    key.write_text("not-the-key")
    with pytest.raises(BlobError):
        open_store("s3://fedq/secret-file", s3_server).put("k2", b"x")


@pytest.mark.slow
def test_cancel_revokes_and_stops(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, base_env(tmp_path / "home"))
    cluster.start(control=["control"])  # no training worker: the round stays open
    try:
        job = cluster.submit({**DIGITS, "rounds": 2})
        cluster.wait_for_round(job, 1)
        out = cluster.fedq("cancel", job)
        assert f"job {job} cancelled; 4 task(s) revoked" in out.stdout
        view = cluster.wait(job, timeout=30)
        assert view.status == "cancelled"
        assert [r.status for r in cluster.rounds(job)] == ["failed"]
        again = cluster.fedq("cancel", job, check=False)
        assert again.returncode == 1 and "is cancelled, not running" in again.stderr
        watched = cluster.fedq("watch", job, check=False)
        assert watched.returncode == 6 and f"job {job} was cancelled" in watched.stderr
        resumed = cluster.fedq("resume", job)
        assert "resumed at round 1" in resumed.stdout
        timed = cluster.fedq("watch", job, "--timeout", "1", check=False)
        assert timed.returncode == 7 and "still running after 1s" in timed.stderr
    finally:
        cluster.stop()


@pytest.mark.slow
def test_doctor_smoke_trains_one_round_on_this_machine(tmp_path: Path) -> None:
    proc = _fedq(tmp_path, "doctor", "--smoke", "--json", "--steps", "2", "--batch-size", "16",
                 "--home", str(tmp_path / "smoke"))
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads(proc.stdout)
    smoke = report["smoke"]
    assert smoke["queue"] == report["hardware_class"] == "cpu"
    assert smoke["steps"] == 2 and smoke["samples"] == 32 and smoke["samples_per_second"] > 0
    assert smoke["device"] == "cpu" and smoke["amp"] == "off" and smoke["gpu_peak_mb"] is None
    assert smoke["bytes_up"] > 40e6  # a whole ResNet-18 delta came back


def test_every_variable_fedq_or_its_scripts_read_is_accepted() -> None:
    """A FEDQ_* variable that fedq's code or scripts/ read must not be refused as an
    unknown setting (FEDQ_DATA_CACHE, which fedq/data/text.py reads, once was)."""
    import fedq.settings as settings_module

    root = Path(__file__).resolve().parents[1]
    reads: set[str] = set()
    for path in (root / "fedq").rglob("*.py"):
        reads |= set(re.findall(r"""environ(?:\.get\(|\[)["'](FEDQ_[A-Z0-9_]+)["']""",
                                path.read_text()))
    for path in (root / "scripts").glob("*.sh"):
        reads |= set(re.findall(r"\$\{?(FEDQ_[A-Z0-9_]+)", path.read_text()))
    assert "FEDQ_DATA_CACHE" in reads and "FEDQ_DOCKER_HOME" in reads  # the search works
    accepted = {f"FEDQ_{k}" for k in settings_module._KNOWN} | settings_module._NOT_SETTINGS
    refused = {r for r in reads - accepted if not r.startswith(settings_module._TEST_PREFIXES)}
    assert not refused, refused


def test_every_documented_setting_is_read_and_the_compose_variables_pass() -> None:
    """docs/settings.md is what fedq/settings.py's declarations generate, and names
    every variable fedq accepts (a setting missing from either is a typo the user
    cannot see); docker/.env's FEDQ_BIND, loaded into the shell by docs/deploy.md, is
    not refused as unknown."""
    import fedq.settings as settings_module
    from fedq.settings import load_settings, settings_doc

    doc = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert doc == settings_doc(), "regenerate: .venv/bin/python -m fedq.settings " \
                                  "> docs/settings.md"
    documented = set(re.findall(r"^\| `(FEDQ_[A-Z0-9_]+)`", doc, re.M))
    assert documented == {f"FEDQ_{k}" for k in settings_module._KNOWN}
    assert "FEDQ_POWER_SUPPLY_DIR" in documented and "FEDQ_JOINED_AS" not in documented
    assert load_settings({"FEDQ_POWER_SUPPLY_DIR": "/p", "FEDQ_HOME": "/tmp/fedq-x"}
                         ).power_dir == Path("/p")
    with pytest.raises(ConfigError, match=r"^FEDQ_HEARTBEAT_S: Input should be greater"):
        load_settings({"FEDQ_HEARTBEAT_S": "-1", "FEDQ_HOME": "/tmp/fedq-x"})
    got = load_settings({"FEDQ_WORKER_LOST_S": "3", "FEDQ_HEARTBEAT_S": "1",
                         "FEDQ_BIND": "127.0.0.1", "FEDQ_HOME": "/tmp/fedq-x"})
    assert (got.worker_lost_s, got.heartbeat_s) == (3.0, 1.0)
