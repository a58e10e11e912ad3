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


def _compose_sh(tmp_path: Path, plugin: bool, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/compose.sh on a copy of the repository's layout, with `docker` and
    `docker-compose` on PATH as scripts that print what they were given (the plugin's
    `docker compose version` answers only when ``plugin``): which Compose the wrapper
    chooses and what it passes is the logic under test, not Docker's."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "scripts" / "compose.sh", tree / "scripts" / "compose.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(
        "#!/bin/sh\n"
        f'if [ "$1 $2" = "compose version" ]; then exit {0 if plugin else 1}; fi\n'
        'echo "docker $*"\n')
    (bin_dir / "docker-compose").write_text('#!/bin/sh\necho "docker-compose $*"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    return subprocess.run(["bash", str(tree / "scripts" / "compose.sh"), *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          check=False)


def test_the_compose_wrapper_runs_whichever_compose_the_host_has(tmp_path: Path) -> None:
    """docs/deploy.md's blocks run `bash scripts/compose.sh`: Compose v2's plugin where it
    answers, else v1's docker-compose, with the env file and the compose files its flags
    name, in the order the overrides need; without docker/.env, or without a command,
    one line and exit 2, and Compose is not run."""
    missing = _compose_sh(tmp_path, True, "up", "-d")
    assert missing.returncode == 2 and missing.stdout == "" and \
        "docker/.env is missing: run bash scripts/env.sh first" in missing.stderr
    (tmp_path / "tree" / "docker").mkdir()
    (tmp_path / "tree" / "docker" / ".env").write_text("FEDQ_BIND=127.0.0.1\n")
    files = "--env-file docker/.env -f docker/compose.yaml -f docker/compose.debian.yaml " \
        "-f docker/compose.secure.yaml"
    v2 = _compose_sh(tmp_path, True, "--secure", "--debian", "up", "-d", "--no-build")
    assert v2.returncode == 0 and v2.stdout.strip() == f"docker compose {files} up -d --no-build"
    v1 = _compose_sh(tmp_path, False, "--debian", "--secure", "down")
    assert v1.returncode == 0 and v1.stdout.strip() == f"docker-compose {files} down"
    plain = _compose_sh(tmp_path, False, "ps")
    assert plain.stdout.strip() == "docker-compose --env-file docker/.env -f " \
        "docker/compose.yaml ps"
    bare = _compose_sh(tmp_path, True)
    assert bare.returncode == 2 and bare.stdout == "" and "give a Compose command" in \
        bare.stderr
