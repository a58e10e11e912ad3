"""scripts/env.sh, which writes the compose stack's docker/.env and secret files, and the
dashboard's refusal of a placeholder password: run here on copies, no Docker needed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path) -> Path:
    """A copy of what env.sh reads and writes: scripts/env.sh and docker/env.example."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "docker").mkdir()
    shutil.copy(ROOT / "scripts" / "env.sh", tmp_path / "scripts" / "env.sh")
    shutil.copy(ROOT / "docker" / "env.example", tmp_path / "docker" / "env.example")
    return tmp_path


def _env_sh(tree: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("FEDQ_BIND", "REDIS_PORT", "POSTGRES_PORT", "S3_PORT")}
    return subprocess.run(["bash", str(tree / "scripts" / "env.sh")], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, check=True)


def _values(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines()
                if line and not line.startswith("#"))


def test_a_port_set_again_reaches_an_existing_env_file_and_passwords_stay(
        tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    _env_sh(tree)
    env_file, secrets = tree / "docker" / ".env", tree / "docker" / "secrets"
    first = {p.name: p.read_text() for p in secrets.iterdir()}
    assert _values(env_file)["REDIS_PORT"] == "6379" and len(first["redis_password"]) == 32
    said = _env_sh(tree, REDIS_PORT="6380").stderr
    assert "set REDIS_PORT in it from the environment" in said, said
    assert _values(env_file)["REDIS_PORT"] == "6380"  # the host's own Redis keeps 6379
    assert _values(env_file)["POSTGRES_PORT"] == "5432"
    assert {p.name: p.read_text() for p in secrets.iterdir()} == first  # the stack's own
    assert "keeping it" in _env_sh(tree, REDIS_PORT="6380").stderr  # nothing to change


def test_a_placeholder_password_is_never_kept(tmp_path: Path) -> None:
    """An older docker/.env held the passwords, and its example had change-me ones: env.sh
    keeps a real one and replaces a placeholder (and the URLs made from it)."""
    tree = _tree(tmp_path)
    env_file = tree / "docker" / ".env"
    env_file.write_text((tree / "docker" / "env.example").read_text()
                        + "REDIS_PASSWORD=change-me-redis\nPOSTGRES_PASSWORD=kept0123\n")
    said = _env_sh(tree).stderr
    secrets = tree / "docker" / "secrets"
    assert "redis password is a placeholder; writing a random one" in said, said
    redis_pw = (secrets / "redis_password").read_text()
    assert not redis_pw.startswith("change-me") and len(redis_pw) == 32
    assert (secrets / "postgres_password").read_text() == "kept0123"
    assert f":{redis_pw}@redis:6379/0" in (secrets / "broker_url").read_text()
    # a secret file an older env.sh wrote with a placeholder is replaced too
    (secrets / "flower_password").write_text("change-me-flower")
    (secrets / "broker_url").write_text("redis://:change-me-redis@redis:6379/0")
    said = _env_sh(tree).stderr
    assert "flower_password held a placeholder password" in said, said
    assert "change-me" not in (secrets / "flower_password").read_text()
    assert f":{redis_pw}@" in (secrets / "broker_url").read_text()


@pytest.mark.parametrize("compose", ["compose.yaml", "compose.secure.yaml"])
def test_the_dashboard_refuses_a_placeholder_password(tmp_path: Path, compose: str) -> None:
    """The flower service's command, as the compose file gives it to sh (its celery
    replaced by echo): a placeholder is one line and exit 2; a real one starts it."""
    command = yaml.safe_load((ROOT / "docker" / compose).read_text())[
        "services"]["flower"]["command"]
    assert command[:2] == ["sh", "-c"]
    secret = tmp_path / "flower_password"
    script = command[2].replace("$$", "$").replace("/run/secrets/flower_password",
                                                   str(secret)).replace("exec celery",
                                                                        "exec echo celery")
    secret.write_text("change-me-flower")
    refused = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == ("fedq: flower_password is a placeholder (change-me...); "
                                      "bash scripts/env.sh writes a random one")
    secret.write_text("0123456789abcdef")
    started = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert started.returncode == 0 and started.stdout.startswith("celery -A fedq flower")
