"""Hardware classes, and whether the installed torch can drive this machine's GPUs.

Facts behind the rules (docs/hardware.md has the sources):
- A CUDA wheel runs on a GPU of capability (M, m) if its arch list has ``sm_M<k>`` with
  k <= m (same major: binary compatible), or a ``compute_XY`` PTX entry with
  (X, Y) <= (M, m) (the driver JIT-compiles it).
- A wrong build only *warns* at CUDA init; ``torch.cuda.is_available()`` stays True
  and the first kernel fails with "no kernel image is available". So we check the
  arch list and then run a tiny matmul and conv forward/backward on each device.
- Classes: ``gpu_new`` is compute capability >= 7.5 (Turing and newer, cu128 builds);
  ``gpu_sm61`` is the legacy class for 5.0 <= cc < 7.5 (Maxwell, Pascal, Volta), served
  by cu126 builds that still carry sm_50/sm_60/sm_70 kernels; everything else ``cpu``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedq.engine.names import GPU_QUEUES
from fedq.errors import ConfigError

NEW_MIN_CC = (7, 5)
LEGACY_MIN_CC = (5, 0)
#: The oldest torch fedq's worker code runs on: the gpu_sm61 image's 2.7.1+cu126 (the
#: newest CUDA 12.6 build on PyPI), which the deploy stage trains with beside the lock's
#: torch (docs/hardware.md, "Supported torch"). pyproject.toml says the same.
MIN_TORCH = (2, 7)
PINS_FILE = Path(__file__).resolve().parents[1] / "pins.toml"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    capability: tuple[int, int]
    memory_gb: float


@dataclass
class HardwareReport:
    torch: str
    cuda: str | None  # the CUDA version torch was built with
    driver: str | None
    arch_list: list[str]
    gpus: list[Gpu]
    mps: bool = False
    jetson: bool = False
    hostname: str = field(default_factory=platform.node)
    problems: list[str] = field(default_factory=list)
    # The kernels compiled into this torch build: known without a GPU (arch_list is
    # empty when CUDA cannot start), so an image can be checked on a CPU host.
    build_arch: list[str] = field(default_factory=list)
    # The rest of the environment, for `fedq workers` and `fedq report`.
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    memory_gb: float | None = field(default_factory=lambda: _memory_gb())
    python: str = field(default_factory=platform.python_version)
    system: str = field(default_factory=platform.platform)

    @property
    def hardware_class(self) -> str:
        return classify([g.capability for g in self.gpus])

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["hardware_class"] = self.hardware_class
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HardwareReport":
        gpus = [Gpu(g["index"], g["name"], tuple(g["capability"]), g["memory_gb"])  # type: ignore[arg-type]
                for g in data.get("gpus", [])]
        return cls(torch=data["torch"], cuda=data.get("cuda"), driver=data.get("driver"),
                   arch_list=list(data.get("arch_list", [])), gpus=gpus,
                   mps=bool(data.get("mps")), jetson=bool(data.get("jetson")),
                   hostname=data.get("hostname", platform.node()),
                   problems=list(data.get("problems", [])),
                   build_arch=list(data.get("build_arch", [])),
                   cpus=int(data.get("cpus") or 1), memory_gb=data.get("memory_gb"),
                   python=str(data.get("python", "?")), system=str(data.get("system", "?")))


def _memory_gb() -> float | None:
    """Physical memory in GB (None where sysconf does not say, e.g. Windows)."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (AttributeError, ValueError, OSError):
        return None


def torch_problem(version: str) -> str | None:
    """Why a worker with torch ``version`` must not start (older than MIN_TORCH), or
    None."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return f"torch {version!r} is not a version fedq can read"
    if (int(found[1]), int(found[2])) < MIN_TORCH:
        return (f"torch {version} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, the oldest "
                "fedq's worker code is tested on; install the torch its class pins "
                "(fedq/pins.toml, docs/hardware.md)")
    return None


def classify(capabilities: list[tuple[int, int]]) -> str:
    """The queue class for a machine with GPUs of these capabilities (the weakest decides)."""
    usable = [cc for cc in capabilities if cc >= LEGACY_MIN_CC]
    if not usable:
        return "cpu"
    return "gpu_new" if min(usable) >= NEW_MIN_CC else "gpu_sm61"


def _parse_arch(entry: str) -> tuple[str, tuple[int, int]] | None:
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", entry)
    if not m:
        return None
    return m.group(1), (int(m.group(2)), int(m.group(3)))


def arch_covers(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build with ``arch_list`` has kernels for ``capability``."""
    for entry in arch_list:
        parsed = _parse_arch(entry)
        if parsed is None:
            continue
        kind, (major, minor) = parsed
        if kind == "sm" and major == capability[0] and minor <= capability[1]:
            return True
        if kind == "compute" and (major, minor) <= capability:
            return True
    return False


def amp_mode(capability: tuple[int, int] | None, wanted: str = "auto") -> str:
    """Mixed precision by capability: bf16 at >= 8.0, fp16 (+GradScaler) at 7.x, else off;
    always off where the worker's owner turned it off (``wanted``: FEDQ_AMP).

    Gate on capability, not ``torch.cuda.is_bf16_supported()``, which counts emulation.
    Pascal's fp16 runs at 1/64 of fp32 and has no tensor cores, so AMP is off there.
    """
    if capability is None or wanted == "off":
        return "off"
    if capability >= (8, 0):
        return "bf16"
    if capability >= (7, 0):
        return "fp16"
    return "off"


def fix_for(gpu: Gpu, report: HardwareReport) -> str:
    cls = classify([gpu.capability])
    cc = f"{gpu.capability[0]}.{gpu.capability[1]}"
    if cls == "gpu_sm61":
        return (f"{gpu.name} (compute capability {cc}) needs a torch build with sm_50/sm_60 "
                f"kernels: pip install torch=={pins()['gpu_sm61']['torch']} --index-url "
                f"{pins()['gpu_sm61']['index']} (or use the fedq-worker:gpu_sm61 image)")
    if cls == "gpu_new":
        return (f"install a torch build for CUDA 12.8: pip install torch --index-url "
                f"{pins()['gpu_new']['index']} (or use the fedq-worker:gpu_new image)")
    return f"{gpu.name} (compute capability {cc}) is too old for any current torch build"


def diagnose(report: HardwareReport) -> list[str]:
    """Problems with this machine's torch build, one plain sentence each (with the fix)."""
    problems = list(report.problems)
    for gpu in report.gpus:
        if gpu.capability < LEGACY_MIN_CC:
            continue
        if not arch_covers(gpu.capability, report.arch_list):
            problems.append(
                f"GPU{gpu.index} {gpu.name} is sm_{gpu.capability[0]}{gpu.capability[1]}, but "
                f"this torch {report.torch} (CUDA {report.cuda}) has kernels only for "
                f"{', '.join(report.arch_list) or 'no GPU'}: {fix_for(gpu, report)}")
    return problems


def queue_problems(queues: list[str], report: HardwareReport) -> list[str]:
    """Why this machine must not consume ``queues`` (empty when it may)."""
    cls = report.hardware_class
    problems = []
    for queue in queues:
        if queue not in GPU_QUEUES or queue == cls:
            continue
        have = (f"its GPUs are class {cls}" if report.gpus else "it has no CUDA GPU")
        problems.append(f"refusing to consume {queue}: {have} "
                        f"(start it with -Q {cls} instead)")
    if any(q in GPU_QUEUES for q in queues):
        problems.extend(diagnose(report))
    return problems


def smoke_test(device: str) -> str | None:
    """A tiny matmul and conv forward/backward on ``device``; the error, or None."""
    import torch

    try:
        dev = torch.device(device)
        a = torch.randn(64, 64, device=dev, requires_grad=True)
        conv = torch.nn.Conv2d(3, 4, 3).to(dev)
        x = torch.randn(2, 3, 8, 8, device=dev)
        loss = (a @ a).sum() + conv(x).sum()
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def probe(run_smoke: bool = True) -> HardwareReport:
    """Inspect this machine (or read the emulated report named by FEDQ_EMULATE_HARDWARE)."""
    from fedq.settings import get_settings

    emulated = get_settings().emulate_hardware
    if emulated:
        try:
            return HardwareReport.from_json(json.loads(emulated.read_text()))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
                f"missing {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise ConfigError(f"FEDQ_EMULATE_HARDWARE={emulated}: not a hardware report "
                              f"fedq can read ({why})") from None
    import warnings

    import torch

    gpus: list[Gpu] = []
    arch: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "too old" warning: we report it ourselves
        if torch.cuda.is_available():
            arch = list(torch.cuda.get_arch_list())
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                gpus.append(Gpu(i, props.name, (props.major, props.minor),
                                round(props.total_memory / 2**30, 1)))
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)()
    report = HardwareReport(torch=torch.__version__, cuda=torch.version.cuda,
                            driver=_driver_version(), arch_list=arch, gpus=gpus, mps=mps,
                            jetson=Path("/etc/nv_tegra_release").exists(),
                            build_arch=str(flags).split() if flags else [])
    if run_smoke:
        for gpu in gpus:
            if arch_covers(gpu.capability, arch):
                error = smoke_test(f"cuda:{gpu.index}")
                if error:
                    report.problems.append(f"GPU{gpu.index} {gpu.name} failed a matmul/conv "
                                           f"test: {error}")
        if not gpus:
            error = smoke_test("mps" if mps else "cpu")
            if error:
                report.problems.append(f"{'mps' if mps else 'cpu'} failed a matmul/conv test: "
                                       f"{error}")
    return report


def pins() -> dict[str, dict[str, Any]]:
    """fedq/pins.toml: the torch build per class (strings; ``default_index``: a table)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    with open(PINS_FILE, "rb") as fh:
        return tomllib.load(fh)


#: The weakest GPU each class must drive: its image's torch needs kernels for it.
CLASS_FLOOR = {"gpu_new": NEW_MIN_CC, "gpu_sm61": (6, 1)}


def image_problems(report: HardwareReport, cls: str,
                   table: dict[str, Any] | None = None,
                   source: str = "release") -> list[str]:
    """How the torch in an image built for class ``cls`` differs from fedq/pins.toml
    (the image sets FEDQ_IMAGE_CLASS, and FEDQ_IMAGE_TORCH: ``source``, which of the
    class's pins it follows); empty when it is that build."""
    table = pins() if table is None else table
    if cls not in table:
        return [f"FEDQ_IMAGE_CLASS={cls!r} is not a class of pins.toml ({', '.join(table)})"]
    pin, where = table[cls], "pins.toml"
    if source == "default_index":
        if "default_index" not in pin:
            return [f"FEDQ_IMAGE_TORCH=default_index, but pins.toml has no default_index "
                    f"build for {cls}"]
        pin, where = pin["default_index"], "pins.toml's default_index"
        want_cuda = pin["cuda"] or None
    else:
        cu = re.search(r"/cu(\d+)(\d)$", pin["index"])
        want_cuda = f"{cu.group(1)}.{cu.group(2)}" if cu else None
    problems = []
    have = report.torch.split("+")[0]
    if have != pin["torch"]:
        problems.append(f"torch {report.torch} where {where} gives {pin['torch']} for {cls}")
    if (report.cuda or None) != want_cuda:
        problems.append(f"a {'CUDA ' + report.cuda if report.cuda else 'CPU-only'} build "
                        f"where {where} gives "
                        f"{'CUDA ' + want_cuda if want_cuda else 'CPU-only'} for {cls}")
    floor = CLASS_FLOOR.get(cls)
    if floor is not None and not arch_covers(floor, report.build_arch):
        problems.append(f"no kernels for sm_{floor[0]}{floor[1]}, the oldest GPU of {cls} "
                        f"(this build has {' '.join(report.build_arch) or 'none'})")
    return problems


def image_for(cls: str) -> str:
    return f"fedq-worker:{cls} (worker-images/Dockerfile.{cls})"
