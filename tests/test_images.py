"""Worker images and the coordinator compose file: linted and validated (no Docker engine
runs here), and pinned from the one pins file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedq.worker.hardware import pins

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "worker-images").glob("Dockerfile.*")) + [
    ROOT / "docker" / "Dockerfile.coordinator"]


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed (scripts/bootstrap.sh installs it)"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile: Path) -> None:
    proc = subprocess.run([_tool("hadolint"), "--no-color", str(dockerfile)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_worker_images_follow_the_pins() -> None:
    table = pins()
    assert set(table) == {"gpu_new", "gpu_sm61", "cpu"}
    for cls, pin in table.items():
        text = (ROOT / "worker-images" / f"Dockerfile.{cls}").read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
        assert args["BASE"] == pin["base"], cls
        assert args["TORCH"] == pin["torch"] and args["TORCHVISION"] == pin["torchvision"]
        assert args["TORCH_INDEX"] == pin["index"] and args["PYTHON"] == pin["python"]
        assert f'"-Q", "{cls}"' in text  # the image consumes its own class's queue


def _compose_schema() -> dict:
    import compose  # docker-compose 1.29.2, installed --no-deps for its schema file

    path = Path(compose.__file__).parent / "config" / "compose_spec.json"
    return json.loads(path.read_text())


def test_compose_file_is_valid_and_complete() -> None:
    import jsonschema

    doc = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    validator = jsonschema.Draft7Validator(_compose_schema())
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert errors == []
    services = doc["services"]
    assert {"redis", "postgres", "minio", "migrate", "control", "beat", "flower"} <= set(services)
    assert "--requirepass" in services["redis"]["command"]
    assert any(str(a).startswith("--basic-auth=") for a in services["flower"]["command"])
    assert services["migrate"]["command"] == ["fedq", "db", "upgrade"]
    assert services["control"]["depends_on"]["migrate"]["condition"] == \
        "service_completed_successfully"
    # every published port binds to FEDQ_BIND (loopback unless a private address is set)
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("${FEDQ_BIND:-127.0.0.1}:"), (name, port)


def test_compose_schema_rejects_a_broken_file() -> None:
    import jsonschema

    doc = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    doc["services"]["redis"]["restart_policy"] = "always"  # not a service key
    assert list(jsonschema.Draft7Validator(_compose_schema()).iter_errors(doc))
