"""Worker images and the coordinator compose file: linted, validated and pinned from
the one pins file; with a Docker engine (marker ``docker``, scripts/test-deploy.sh),
each built image is asked what torch it carries."""

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
DOCKERFILES = sorted((ROOT / "worker-images").glob("Dockerfile.*")) + sorted(
    (ROOT / "docker").glob("Dockerfile.*"))


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
    files = {cls: ROOT / "worker-images" / f"Dockerfile.{cls}" for cls in table}
    files["coordinator"] = ROOT / "docker" / "Dockerfile.coordinator"  # the cpu build
    for name, path in files.items():
        cls = "cpu" if name == "coordinator" else name
        pin, text = table[cls], path.read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
        assert args["BASE"] == pin["base"], name
        assert args["TORCH"] == pin["torch"] and args["TORCHVISION"] == pin["torchvision"]
        assert args["TORCH_INDEX"] == pin["index"] and args["PYTHON"] == pin["python"]
        assert f"FEDQ_IMAGE_CLASS={cls}" in text  # doctor checks the image against its pin
        queue = "control" if name == "coordinator" else cls
        assert f'"-Q", "{queue}"' in text  # the image consumes its own class's queue


def test_image_check_against_the_pins() -> None:
    from fedq.worker.hardware import HardwareReport, image_problems

    table = pins()
    pin = table["gpu_sm61"]
    exact = HardwareReport(torch=f"{pin['torch']}+cu126", cuda="12.6", driver=None,
                           arch_list=[], gpus=[], build_arch=["sm_50", "sm_60", "sm_70"])
    assert image_problems(exact, "gpu_sm61") == []
    newer = HardwareReport(torch="2.14.1+cu130", cuda="13.0", driver=None, arch_list=[],
                           gpus=[], build_arch=["sm_75", "sm_80", "sm_90"])
    problems = image_problems(newer, "gpu_sm61")
    assert len(problems) == 3
    assert "torch 2.14.1+cu130 where pins.toml gives" in problems[0]
    assert "CUDA 13.0 build where pins.toml gives CUDA 12.6" in problems[1]
    assert "no kernels for sm_61" in problems[2]
    assert image_problems(newer, "gpu_new")[-1].startswith("a CUDA 13.0 build")  # sm_75 ok
    cpu = HardwareReport(torch=f"{table['cpu']['torch']}+cpu", cuda=None, driver=None,
                         arch_list=[], gpus=[])
    assert image_problems(cpu, "cpu") == []
    assert "is not a class" in image_problems(cpu, "tpu")[0]
    # an image built from the default package index is checked against that pin
    pypi = table["gpu_sm61"]["default_index"]
    from_pypi = HardwareReport(torch=f"{pypi['torch']}+cu126", cuda="12.6", driver=None,
                               arch_list=[], gpus=[], build_arch=["sm_50", "sm_60", "sm_70"])
    assert image_problems(from_pypi, "gpu_sm61", source="default_index") == []
    assert "torch 2.7.1+cu126 where pins.toml gives" in \
        image_problems(from_pypi, "gpu_sm61")[0]
    late = image_problems(newer, "gpu_sm61", source="default_index")
    assert "where pins.toml's default_index gives 2.7.1" in late[0] and \
        "no kernels for sm_61" in late[-1]
    assert image_problems(newer, "gpu_new", source="default_index") == []
    assert "no default_index build for cpu" in \
        image_problems(cpu, "cpu", source="default_index")[0]


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
    assert {"redis", "postgres", "s3", "s3-init", "migrate", "control", "beat",
            "flower"} <= set(services)
    assert services["migrate"]["command"] == ["fedq", "db", "upgrade"]
    assert services["control"]["depends_on"]["migrate"]["condition"] == \
        "service_completed_successfully"
    for name, svc in services.items():
        # every published port binds to FEDQ_BIND (loopback unless a private address is set)
        for port in svc.get("ports", []):
            assert port.startswith("${FEDQ_BIND:-127.0.0.1}:"), (name, port)
        # no password on a command line (ps shows those): they come from the env file
        command = " ".join(map(str, svc.get("command", [])))
        assert "PASSWORD}" not in command and "--requirepass" not in command, name
        assert svc["logging"]["options"]["max-size"], name  # rotated logs
    for name in ("redis", "postgres", "s3", "control", "beat", "flower"):
        assert "healthcheck" in services[name], name
    # secrets are files: no environment value holds one, each service names its own
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            assert "PASSWORD}" not in str(value), (name, key)
            if key.endswith("_FILE"):
                secret = str(value).rsplit("/", 1)[-1]
                assert secret in svc["secrets"], (name, key)
        for secret in svc.get("secrets", []):
            assert doc["secrets"][secret]["file"].startswith("${SECRETS_DIR:-./secrets}/")
    assert "database_url" not in services["worker-cpu"]["secrets"]
    flower = " ".join(services["flower"]["command"])  # its password from the secret file
    assert "pw=$$(cat /run/secrets/flower_password)" in flower
    assert "FLOWER_BASIC_AUTH=admin:$$pw exec celery" in flower
    override = yaml.safe_load((ROOT / "docker" / "compose.debian.yaml").read_text())
    assert list(validator.iter_errors(override)) == []
    assert set(override["services"]) <= set(services)


def test_compose_schema_rejects_a_broken_file() -> None:
    import jsonschema

    doc = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    doc["services"]["redis"]["restart_policy"] = "always"  # not a service key
    assert list(jsonschema.Draft7Validator(_compose_schema()).iter_errors(doc))


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    import os

    from tests.conftest import missing

    engine = subprocess.run(["bash", str(ROOT / "scripts" / "docker-engine.sh")],
                            capture_output=True, text=True, check=False)
    if engine.returncode != 0:
        missing("Docker engine", engine.stderr.strip()[-300:])
    env = {**os.environ, "DOCKER_HOST": engine.stdout.strip()}
    return subprocess.run(["docker", *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _lock_pin(name: str) -> str:
    text = (ROOT / "requirements" / "dev.lock").read_text()
    return re.search(rf"^{name}==(\S+)", text, re.M).group(1)  # type: ignore[union-attr]


@pytest.mark.docker
@pytest.mark.parametrize("image,cls", [("fedq-coordinator", "cpu"), ("fedq-worker:cpu", "cpu"),
                                       ("fedq-worker:gpu_new", "gpu_new"),
                                       ("fedq-worker:gpu_sm61", "gpu_sm61")])
def test_built_image_reports_its_torch(image: str, cls: str) -> None:
    """Each image imports torch, and `fedq doctor --json` inside it names the build it
    carries and checks it against pins.toml. Built here by scripts/images.sh, a GPU
    image carries the build PyPI serves for its class (its default_index pin: the
    gpu_sm61 image has sm_60 kernels, which Pascal sm_61 runs) and passes that check;
    the CPU images carry the lock's torch, a CUDA build (PyPI has no CPU-only Linux
    wheel), and the check must report the difference."""
    from tests.conftest import missing

    if _docker("image", "inspect", image).returncode != 0:
        missing(f"image {image}", "build it with `bash scripts/images.sh`")
    proc = _docker("run", "--rm", image, "fedq", "doctor", "--json")
    report = json.loads(proc.stdout)
    assert report["hardware_class"] == "cpu" and report["gpus"] == []  # no GPU here
    assert report["image"]["class"] == cls
    assert report["image"]["pins"] == pins()[cls]
    assert not any("failed a matmul/conv test" in p for p in report["problems"])
    image_problems = report["image"]["problems"]
    built = pins()[cls].get("default_index")
    if built is None:  # cpu: the lock's torch, checked against the release pin
        assert report["image"]["torch_from"] == "release"
        assert report["torch"].split("+")[0] == _lock_pin("torch")
        assert any(f"where pins.toml gives {pins()[cls]['torch']}" in p
                   for p in image_problems)
        assert proc.returncode == 1  # a difference from the pins is a problem doctor reports
        return
    assert report["image"]["torch_from"] == "default_index"
    assert report["torch"].split("+")[0] == built["torch"]
    assert report["cuda"] == built["cuda"]
    assert image_problems == [], image_problems
    floor = {"gpu_sm61": "sm_60", "gpu_new": "sm_75"}[cls]  # the class's oldest GPU runs it
    assert floor in report["build_arch"], report["build_arch"]
    if cls == "gpu_sm61":
        assert "sm_50" in report["build_arch"]  # the cu126 build: Maxwell and Pascal


#: fedq's worker side, run inside each worker image on that image's torch: safetensors
#: I/O, the embedded broker's transport, the downlink rebuild, hardware detection and
#: the start-up checks, replicas (streaming DiLoCo), data shards, the training loop's
#: options and divergence. Redis and PostgreSQL are this machine's (host network).
WORKER_TESTS = ["tests/test_weights.py", "tests/test_transport.py", "tests/test_downlink.py",
                "tests/test_hardware.py", "tests/test_streaming.py", "tests/test_partition.py",
                "tests/test_divergence.py", "tests/test_strategy_effects.py"]


@pytest.mark.docker
@pytest.mark.parametrize("image,cls", [("fedq-worker:cpu", "cpu"),
                                       ("fedq-worker:gpu_new", "gpu_new"),
                                       ("fedq-worker:gpu_sm61", "gpu_sm61")])
def test_the_worker_tests_pass_inside_each_worker_image(image: str, cls: str) -> None:
    """The worker tests, mounted read-only into the image, run by pytest from the image
    build's wheelhouse against the fedq and torch installed in the image (for gpu_sm61
    the older torch of its default_index pin)."""
    import os

    from fedq.data.text import archive_path
    from tests.conftest import missing

    if _docker("image", "inspect", image).returncode != 0:
        missing(f"image {image}", "build it with `bash scripts/images.sh`")
    cache = Path(os.environ.get("FEDQ_IMAGE_CACHE") or
                 Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "fedq" / "images")
    import hashlib

    lock = (ROOT / "requirements" / "dev.lock").read_bytes()
    wheels = cache / f"wheels-{hashlib.sha256(lock).hexdigest()[:12]}"  # as images.sh names it
    if not wheels.is_dir():
        missing("the images' wheelhouse", f"no {wheels}: run scripts/images.sh")
    corpus = archive_path().parent  # the text tests' corpus, fetched here once
    script = ("pip install -q --no-index --find-links /wheels --target /tmp/pt pytest "
              "pytest-timeout && python -c 'import torch; print(\"torch\", torch.__version__)'"
              " && PYTHONPATH=/tmp/pt python -m pytest -q -p no:cacheprovider "
              "-m 'not slow and not docker' " + " ".join(WORKER_TESTS)
              # it starts a redis-server of its own: a worker image carries none
              + " --deselect tests/test_weights.py::"
                "test_bulk_reader_authenticates_and_selects_the_database")
    dbs = os.environ.get("FEDQ_TEST_REDIS_DBS", "1-15")  # beside another stage: its own
    proc = _docker("run", "--rm", "--network", "host", "-e", "CI=true",
                   "-e", f"FEDQ_TEST_REDIS_DBS={dbs}",
                   "-e", "XDG_CACHE_HOME=/xdg", "-v", f"{corpus}:/xdg/fedq/data:ro",
                   "-v", f"{ROOT / 'tests'}:/src/tests:ro",
                   "-v", f"{ROOT / 'pyproject.toml'}:/src/pyproject.toml:ro",
                   "-v", f"{wheels}:/wheels:ro", "-w", "/src", image, "sh", "-c", script)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    built = pins()[cls].get("default_index") or {"torch": _lock_pin("torch")}
    assert f"torch {built['torch']}" in out, out[-3000:]  # that image's own torch
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed[1]) >= 70 and " failed" not in out, out[-3000:]


@pytest.mark.docker
def test_beat_schedule_file_shows_a_sync_in_the_image() -> None:
    """compose's beat healthcheck reads the schedule file's time. In the coordinator image
    Python's shelve uses dbm.ndbm, whose sync leaves the file alone; fedq's BeatSchedule
    touches it at every sync. With Celery's PersistentScheduler this fails."""
    script = (
        "import glob, os, time\n"
        "from fedq.engine.app import app\n"
        "from celery.utils.imports import symbol_by_name\n"
        "cls = symbol_by_name(app.conf.beat_scheduler)\n"
        "s = cls(app=app, schedule_filename='/tmp/sched', lazy=False)\n"
        "s.sync()\n"
        "files = glob.glob('/tmp/sched*')\n"
        "before = {f: os.stat(f).st_mtime for f in files}\n"
        "time.sleep(1.2)\n"
        "s.sync()\n"
        "print(sorted(files), all(os.stat(f).st_mtime > t for f, t in before.items()))\n")
    proc = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python",
                           "fedq-coordinator", "-c", script],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("True"), proc.stdout + proc.stderr[-1000:]
