"""Hardware classes, the arch-coverage rule, and workers refusing the wrong queue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedq.coordinator.planning import split_by_throughput
from fedq.worker.hardware import (
    Gpu,
    HardwareReport,
    amp_mode,
    arch_covers,
    classify,
    diagnose,
    queue_problems,
)

DATA = Path(__file__).parent / "data"
CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize(
    ("caps", "cls"),
    [([(8, 9)], "gpu_new"), ([(7, 5)], "gpu_new"), ([(6, 1)], "gpu_sm61"),
     ([(6, 0)], "gpu_sm61"), ([(7, 0)], "gpu_sm61"), ([], "cpu"), ([(3, 5)], "cpu"),
     ([(8, 6), (6, 1)], "gpu_sm61")],
)
def test_classify(caps: list[tuple[int, int]], cls: str) -> None:
    assert classify(caps) == cls


@pytest.mark.parametrize(
    ("cap", "arch", "covered"),
    [((6, 1), CU128, False),  # Pascal on a cu128 wheel: the silent failure
     ((6, 1), CU126, True),  # sm_60 runs on sm_61
     ((8, 9), CU128, True),  # sm_86 runs on sm_89 (same major, lower minor)
     ((8, 9), ["sm_90"], False),  # a higher minor/major never runs
     ((8, 9), ["compute_80"], True),  # PTX JIT-compiles for newer GPUs
     ((7, 5), ["compute_80"], False),
     ((12, 0), ["sm_90", "compute_90"], True),
     ((6, 1), [], False)],
)
def test_arch_covers(cap: tuple[int, int], arch: list[str], covered: bool) -> None:
    assert arch_covers(cap, arch) is covered


def test_pascal_on_cu128_gets_a_plain_fix() -> None:
    report = HardwareReport(torch="2.11.0+cu128", cuda="12.8", driver="580", arch_list=CU128,
                            gpus=[Gpu(0, "NVIDIA GeForce GTX 1080", (6, 1), 7.9)])
    [problem] = diagnose(report)
    assert "GTX 1080 is sm_61" in problem
    assert "download.pytorch.org/whl/cu126" in problem
    fixed = HardwareReport(torch="2.11.0+cu126", cuda="12.6", driver="580", arch_list=CU126,
                           gpus=report.gpus)
    assert diagnose(fixed) == []


def test_amp_by_capability() -> None:
    assert [amp_mode(c) for c in [(9, 0), (8, 0), (7, 5), (7, 0), (6, 1), None]] == [
        "bf16", "bf16", "fp16", "fp16", "off", "off"]


def test_a_workers_owner_can_turn_mixed_precision_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDQ_AMP=off: float32 on a GPU whose class would run bf16 (docs/inference.md
    measured bf16 slower for small models), for training and inference alike, and
    `fedq doctor`'s AMP column says so; a value it does not know is one clear error."""
    import torch

    from fedq.errors import ConfigError
    from fedq.settings import get_settings, load_settings
    from fedq.worker.loop import device_amp

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    cuda = torch.device("cuda", 0)
    for wanted, amp in (("auto", "bf16"), ("off", "off")):
        monkeypatch.setenv("FEDQ_AMP", wanted)
        get_settings.cache_clear()
        try:
            assert device_amp(cuda) == amp
        finally:
            get_settings.cache_clear()
    assert amp_mode((8, 9), "off") == "off" and amp_mode((7, 5), "auto") == "fp16"
    with pytest.raises(ConfigError, match="FEDQ_AMP"):
        load_settings({"FEDQ_AMP": "fast"})


def test_queue_problems() -> None:
    cpu = HardwareReport(torch="2.14", cuda=None, driver=None, arch_list=[], gpus=[])
    assert queue_problems(["cpu"], cpu) == []
    assert "no CUDA GPU" in queue_problems(["gpu_sm61"], cpu)[0]
    pascal = HardwareReport(torch="2.11.0+cu126", cuda="12.6", driver="580", arch_list=CU126,
                            gpus=[Gpu(0, "GTX 1080", (6, 1), 7.9)])
    assert queue_problems(["gpu_sm61"], pascal) == []
    assert "class gpu_sm61" in queue_problems(["gpu_new"], pascal)[0]


def test_split_by_throughput() -> None:
    assert split_by_throughput(10, {"gpu_new": 300.0, "cpu": 100.0}) == {"gpu_new": 8, "cpu": 2}
    assert split_by_throughput(3, {"gpu_new": 1.0, "gpu_sm61": 1.0, "cpu": 1.0}) == {
        "gpu_new": 1, "gpu_sm61": 1, "cpu": 1}
    assert split_by_throughput(4, {}) == {"cpu": 4}
    assert split_by_throughput(5, {"gpu_sm61": 2.0, "control": 9.0}) == {"gpu_sm61": 5}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    env.update(extra)
    return env


def _worker(queue: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "fedq", "worker", "-Q", queue, "--pool", "solo",
         "-n", f"refuse-{queue}@test", "--without-gossip", "--without-mingle"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)


def test_worker_with_a_build_that_cannot_drive_its_gpu_refuses(tmp_path: Path) -> None:
    env = _env(FEDQ_HOME=str(tmp_path), FEDQ_EMULATE_HARDWARE=str(DATA / "gtx1080_cu128.json"))
    proc = _worker("gpu_sm61", env, tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "refused to start: GPU0 NVIDIA GeForce GTX 1080 is sm_61" in proc.stderr
    assert "whl/cu126" in proc.stderr


def test_worker_with_a_torch_older_than_fedq_supports_refuses(tmp_path: Path) -> None:
    """A worker process whose torch says 2.6 (a sitecustomize rewrites its version: the
    check reads torch.__version__) exits at start with one line, before consuming."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.6.0+cu124'\n")
    env = _env(FEDQ_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [str(site), str(Path(__file__).resolve().parents[1])]))
    proc = _worker("cpu", env, tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "refused to start: torch 2.6.0+cu124 is older than 2.7" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_worker_on_the_wrong_queue_refuses(tmp_path: Path) -> None:
    # This machine has no GPU: a gpu_new worker must not start.
    proc = _worker("gpu_new", _env(FEDQ_HOME=str(tmp_path)), tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "refusing to consume gpu_new: it has no CUDA GPU (start it with -Q cpu" in proc.stderr
    # A Pascal card with the right build may not take gpu_new either.
    env = _env(FEDQ_HOME=str(tmp_path), FEDQ_EMULATE_HARDWARE=str(DATA / "gtx1080_cu126.json"))
    proc = _worker("gpu_new", env, tmp_path)
    assert proc.returncode == 3
    assert "its GPUs are class gpu_sm61" in proc.stderr


def test_doctor(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "fedq.cli", "doctor"]
    here = subprocess.run(run, env=_env(FEDQ_HOME=str(tmp_path)), capture_output=True,
                          text=True, timeout=120, check=False)
    assert here.returncode == 0, here.stderr
    assert "class     cpu" in here.stdout and "celery -A fedq worker -Q cpu" in here.stdout
    pascal = subprocess.run(run, env=_env(FEDQ_EMULATE_HARDWARE=str(DATA / "gtx1080_cu128.json")),
                            capture_output=True, text=True, timeout=120, check=False)
    assert pascal.returncode == 1
    assert "class     gpu_sm61" in pascal.stdout
    assert "problem: GPU0 NVIDIA GeForce GTX 1080 is sm_61" in pascal.stderr
    assert "Traceback" not in pascal.stderr
    # an Ada card: AMP bf16, unless the worker's owner turned it off (FEDQ_AMP=off)
    ada = json.loads((DATA / "gtx1080_cu128.json").read_text())
    ada["gpus"][0].update(name="NVIDIA GeForce RTX 4090", capability=[8, 9])
    (tmp_path / "ada.json").write_text(json.dumps(ada))
    amp = {}
    for wanted in ("auto", "off"):
        shown = subprocess.run(run, env=_env(FEDQ_EMULATE_HARDWARE=str(tmp_path / "ada.json"),
                                             FEDQ_AMP=wanted, COLUMNS="200"),
                               capture_output=True, text=True, timeout=120, check=False)
        assert shown.returncode == 0, shown.stderr
        row = next(x for x in shown.stdout.splitlines() if "RTX 4090" in x)
        amp[wanted] = row.strip("│ ").split("│")[-1].strip()
    assert amp == {"auto": "bf16", "off": "off"}
    # a report it cannot read: one line, exit 2
    missing = subprocess.run(run, env=_env(FEDQ_EMULATE_HARDWARE=str(tmp_path / "no.json")),
                             capture_output=True, text=True, timeout=120, check=False)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"FEDQ_EMULATE_HARDWARE={tmp_path / 'no.json'}: not a hardware report fedq can " \
        "read (No such file or directory)" in " ".join(missing.stderr.split()), missing.stderr


def test_the_oldest_torch_is_stated_once_and_refused_below() -> None:
    """MIN_TORCH (a worker refuses to start below it) is pyproject's lower bound, and
    the gpu_sm61 image's torch is at it (docs/hardware.md, "Supported torch")."""
    import tomllib
    from packaging.requirements import Requirement

    from fedq.worker.hardware import MIN_TORCH, pins, torch_problem

    root = Path(__file__).resolve().parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch_req] = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    assert str(torch_req.specifier) == f">={MIN_TORCH[0]}.{MIN_TORCH[1]}"
    sm61 = pins()["gpu_sm61"]["default_index"]["torch"]
    assert torch_problem(sm61) is None and sm61.startswith(f"{MIN_TORCH[0]}.{MIN_TORCH[1]}.")
    assert torch_problem("2.14.1+cu130") is None
    said = torch_problem("2.6.0+cu124")
    assert said is not None and said.startswith("torch 2.6.0+cu124 is older than 2.7")
    assert torch_problem("nightly") == "torch 'nightly' is not a version fedq can read"
