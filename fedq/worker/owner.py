"""The owner comes first: when a worker may train, read by small probes, and a watch
that says at once when it must step aside.

A worker's run policy (its ``FEDQ_RUN_*`` settings, fedq/settings.py) is a set of
conditions; fedq trains only while all of them hold:

- ``when``: ``always``; ``idle`` (no user input for ``FEDQ_IDLE_AFTER_MIN`` minutes);
  ``schedule`` (inside ``FEDQ_RUN_WINDOW``, e.g. ``22:00-07:00``, on ``FEDQ_RUN_DAYS``);
- ``FEDQ_AC_ONLY``: on mains power only (a laptop on battery steps aside);
- ``FEDQ_MAX_OTHER_CPU``: other processes use at most this % of the machine's CPU
  (averaged over the last second; fedq's own worker processes do not count);
- ``FEDQ_MAX_OTHER_GPU``: at most this many compute processes that are not fedq's
  on the GPUs (0: step aside as soon as anyone else computes there; NVML).

Each condition is read by a probe with a stated fallback when the machine cannot tell
(:func:`probes` lists them for ``fedq doctor``): a probe that cannot tell never stops
the worker, and doctor says so. A failing condition stops fedq at once; it resumes only
after every condition has held for ``FEDQ_RESUME_AFTER_S`` (so an owner who pauses for
a few seconds does not get the fans back mid-sentence).

:class:`Watch` evaluates the policy every :data:`TICK_S` seconds in a small helper
process beside each worker process (:class:`Watcher`), which tells the worker when the
verdict changes. The worker's main process then stops or resumes consuming
(fedq/worker/signals.py), and the training loop asks :func:`away` before each step
(fedq/worker/loop.py), so a running task ends within one step and one tick.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from fedq.errors import ConfigError
from fedq.settings import Settings

log = logging.getLogger(__name__)

#: Seconds between two readings of the probes.
TICK_S = 0.2
#: The CPU load is averaged over this many seconds.
CPU_WINDOW_S = 1.0
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_CLOCK = re.compile(r"([01]?\d|2[0-3]):([0-5]\d)(?::([0-5]\d))?")

When = Literal["always", "idle", "schedule"]


def parse_window(text: str) -> tuple[int, int]:
    """``"22:00-07:00"`` (or with seconds, ``"22:00:00-07:00:30"``) as (start, end)
    seconds of the day; a window whose end is before its start runs over midnight."""
    parts = text.replace(" ", "").split("-")
    clocks = [_CLOCK.fullmatch(p) for p in parts]
    if len(parts) != 2 or not all(clocks):
        raise ConfigError(f"FEDQ_RUN_WINDOW: {text!r} is not a window such as 22:00-07:00")
    start, end = (int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3] or 0)
                  for m in clocks if m is not None)
    if start == end:
        raise ConfigError(f"FEDQ_RUN_WINDOW: {text!r} starts where it ends")
    return start, end


def parse_days(text: str) -> frozenset[int]:
    """``"mon-fri"``, ``"sat,sun"``, ``"mon-wed,fri"`` as weekday numbers (Monday 0)."""
    days: set[int] = set()
    for part in text.lower().replace(" ", "").split(","):
        ends = part.split("-")
        if not 1 <= len(ends) <= 2 or any(e not in DAYS for e in ends):
            raise ConfigError(f"FEDQ_RUN_DAYS: {part!r} is not a day or a range of days "
                              f"({', '.join(DAYS)}; e.g. mon-fri)")
        a, b = DAYS.index(ends[0]), DAYS.index(ends[-1])
        days.update(range(a, b + 1) if a <= b else [*range(a, 7), *range(0, b + 1)])
    return frozenset(days)


def in_window(now: datetime, window: tuple[int, int] | None, days: frozenset[int]) -> bool:
    """Whether local time ``now`` is inside ``window`` on one of ``days``. A window over
    midnight belongs to the day it starts on."""
    if window is None:
        return now.weekday() in days
    start, end = window
    t = now.hour * 3600 + now.minute * 60 + now.second
    if start < end:
        return start <= t < end and now.weekday() in days
    if t >= start:
        return now.weekday() in days
    return t < end and (now.weekday() - 1) % 7 in days


@dataclass(frozen=True)
class Policy:
    when: When = "always"
    idle_after_s: float = 300.0
    window: tuple[int, int] | None = None
    days: frozenset[int] = frozenset(range(7))
    ac_only: bool = False
    max_other_cpu: float | None = None  # percent of the whole machine
    max_other_gpu: int | None = None  # compute processes that are not fedq's
    resume_after_s: float = 10.0
    input_dir: Path = Path("/dev/input")
    power_dir: Path = Path("/sys/class/power_supply")

    @property
    def active(self) -> bool:
        """Whether anything can stop this worker (else no watch runs)."""
        return self.when != "always" or self.ac_only or self.max_other_cpu is not None \
            or self.max_other_gpu is not None

    @classmethod
    def from_settings(cls, s: Settings) -> Policy:
        """The policy the ``FEDQ_RUN_*`` settings describe (ConfigError on a bad one)."""
        window = parse_window(s.run_window) if s.run_window else None
        if s.run_when == "schedule" and window is None and not s.run_days:
            raise ConfigError("FEDQ_RUN_WHEN=schedule needs FEDQ_RUN_WINDOW or FEDQ_RUN_DAYS")
        return cls(when=s.run_when, idle_after_s=60 * s.idle_after_min, window=window,
                   days=parse_days(s.run_days) if s.run_days else frozenset(range(7)),
                   ac_only=s.ac_only, max_other_cpu=s.max_other_cpu,
                   max_other_gpu=s.max_other_gpu, resume_after_s=s.resume_after_s,
                   input_dir=s.input_dir, power_dir=s.power_dir)


# -- probes: each returns a reading, or None when this machine cannot tell -----------

def input_idle_s(input_dir: Path, now: float | None = None) -> float | None:
    """Seconds since a user last touched the machine: from the evdev devices under
    ``input_dir`` where there are any (:func:`evdev_idle_s`), else from the platform's
    own record (:func:`platform_idle_s`: logind, macOS's HIDIdleTime, Windows'
    GetLastInputInfo). None where nothing can tell."""
    idle = evdev_idle_s(input_dir, now)
    return idle if idle is not None else platform_idle_s()[0]


def evdev_idle_s(input_dir: Path, now: float | None = None) -> float | None:
    """The newest access or change time of the evdev devices under ``input_dir``
    (Linux; the kernel stamps a device as it delivers events), as seconds ago. None
    where there are none to read (a server, a container without /dev/input)."""
    try:
        stamps = [max(st.st_atime, st.st_mtime) for p in input_dir.iterdir()
                  if p.name.startswith("event") for st in [p.stat()]]
    except OSError:
        return None
    if not stamps:
        return None
    return max(0.0, (now or time.time()) - max(stamps))


#: The platform's idle record is read by a subprocess (logind, ioreg): at most this
#: often, which bounds the owner's wait where it is the only source.
PLATFORM_IDLE_EVERY_S = 1.0
_PLATFORM: tuple[float, float | None, str] | None = None


def platform_idle_s() -> tuple[float | None, str]:
    """(seconds since the last user input, where it was read) from the platform: on
    Linux logind's IdleHint/IdleSinceHint over the user sessions (`loginctl`; no user
    session at all counts as idle for ever), on macOS IOKit's HIDIdleTime (`ioreg`), on
    Windows GetLastInputInfo. (None, why) where none answers. Read at most every
    :data:`PLATFORM_IDLE_EVERY_S` seconds (cached between)."""
    global _PLATFORM
    now = time.monotonic()
    if _PLATFORM is not None and now - _PLATFORM[0] < PLATFORM_IDLE_EVERY_S:
        return _PLATFORM[1], _PLATFORM[2]
    if sys.platform == "darwin":
        found = _hid_idle_s()
    elif sys.platform == "win32":
        found = _last_input_idle_s()
    else:
        found = _logind_idle_s()
    _PLATFORM = (now, *found)
    return found


def _run(*cmd: str) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _logind_idle_s() -> tuple[float | None, str]:
    listed = _run("loginctl", "list-sessions", "--no-legend")
    if listed is None:
        return None, "no logind (loginctl) answers here"
    sessions = [line.split()[0] for line in listed.splitlines() if line.strip()]
    if not sessions:
        return float("inf"), "logind: no one is logged in"
    shown = _run("loginctl", "show-session", *sessions, "-p", "Class", "-p", "IdleHint",
                 "-p", "IdleSinceHint")
    if shown is None:
        return None, "logind: loginctl show-session failed"
    idle: list[float] = []
    for block in shown.split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Class", "user") != "user":
            continue  # greeters, background sessions
        if props.get("IdleHint") != "yes":
            idle.append(0.0)  # someone is at it now
        elif props.get("IdleSinceHint", "0").isdigit():
            idle.append(max(0.0, time.time() - int(props["IdleSinceHint"]) / 1e6))
    if not idle:
        return float("inf"), "logind: no user session"
    return min(idle), f"logind IdleHint over {len(idle)} user session(s)"


def _hid_idle_s() -> tuple[float | None, str]:
    shown = _run("ioreg", "-c", "IOHIDSystem", "-d", "4")
    found = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', shown or "")
    if found is None:
        return None, "macOS: ioreg gave no HIDIdleTime"
    return int(found[1]) / 1e9, "macOS IOHIDSystem HIDIdleTime"


def _last_input_idle_s() -> tuple[float | None, str]:  # pragma: no cover - Windows only
    import ctypes

    class LastInput(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LastInput(ctypes.sizeof(LastInput), 0)
    user32, kernel32 = ctypes.windll.user32, ctypes.windll.kernel32  # type: ignore[attr-defined]
    if not user32.GetLastInputInfo(ctypes.byref(info)):
        return None, "Windows: GetLastInputInfo failed"
    return ((kernel32.GetTickCount() - info.dwTime) & 0xFFFFFFFF) / 1000, \
        "Windows GetLastInputInfo"


def on_mains(power_dir: Path) -> bool | None:
    """True on mains power, False on battery, None without power-supply information
    (a desktop or a container: treated as mains). Linux's sysfs: a supply of type
    ``Mains`` or ``USB`` that is ``online``, else a ``Battery`` present means battery."""
    try:
        supplies = list(power_dir.iterdir())
    except OSError:
        return None
    kinds: dict[str, list[bool]] = {}
    for supply in supplies:
        try:
            kind = (supply / "type").read_text().strip()
            online = (supply / "online").read_text().strip() == "1" \
                if (supply / "online").exists() else True
        except OSError:
            continue
        kinds.setdefault(kind, []).append(online)
    if any(any(v) for k, v in kinds.items() if k in ("Mains", "USB")):
        return True
    if "Battery" in kinds:
        return False
    return None


def _is_ours(pid: int, cache: dict[int, bool]) -> bool:
    """Whether process ``pid`` is one of fedq's Celery workers (any on this machine:
    another fedq worker is not the owner)."""
    if pid not in cache:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        cache[pid] = (b"worker" in argv and any(a in (b"fedq", b"-Afedq") for a in argv)) \
            or b"fedq.worker.owner" in argv  # a worker's watch (:class:`Watcher`)
    return cache[pid]


def _proc_busy() -> tuple[int, int, dict[int, int]] | None:
    """(total jiffies, busy jiffies of the machine, pid -> busy jiffies of each of
    fedq's worker processes) from Linux's /proc; None without it."""
    try:
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    values = [int(v) for v in cpu]
    total = sum(values[:8])
    busy = total - values[3] - values[4]  # less idle and iowait
    ours: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or not _is_ours(int(entry.name), _OURS):
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        ours[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    return total, busy, ours


_OURS: dict[int, bool] = {}


class CpuLoad:
    """Other processes' share of the machine's CPU (percent), over the last second.

    fedq's workers' CPU is summed per process between two readings: a worker that
    starts between them adds what it used since it started (it is that new), one that
    exits takes its last interval with it (counted as other, briefly)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int, int]] = deque()
        self._last: dict[int, int] | None = None
        self._ours = 0  # fedq's workers' jiffies since the first reading

    def read(self) -> float | None:
        sample = _proc_busy()
        if sample is None:
            return None
        total, busy, ours = sample
        if self._last is not None:
            self._ours += sum(j - self._last.get(pid, 0) for pid, j in ours.items())
        self._last = ours
        now = time.monotonic()
        self.samples.append((now, total, busy, self._ours))
        while len(self.samples) > 2 and now - self.samples[1][0] >= CPU_WINDOW_S:
            self.samples.popleft()
        (_, t0, b0, o0), (_, t1, b1, o1) = self.samples[0], self.samples[-1]
        if t1 <= t0:
            return None
        return max(0.0, 100.0 * ((b1 - b0) - (o1 - o0)) / (t1 - t0))


def other_gpu_processes() -> int | None:
    """Compute processes on this machine's GPUs that are not fedq's (NVML through
    ``pynvml``, which torch's CUDA builds use for ``torch.cuda.utilization``); None
    without NVML (no NVIDIA GPU, or nvidia-ml-py not installed)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML here: cannot tell
        return None
    try:
        others = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if not _is_ours(int(proc.pid), _OURS):
                    others += 1
        return others
    except Exception:  # noqa: BLE001
        return None


@dataclass
class Probe:
    name: str
    reads: str  # what it reads on this machine
    works: bool  # whether it could read anything here


def probes(policy: Policy) -> list[Probe]:
    """What each condition's probe reads on this machine, for ``fedq doctor``."""
    evdev = evdev_idle_s(policy.input_dir)
    platform, source = (None, "") if evdev is not None else platform_idle_s()
    mains = on_mains(policy.power_dir)
    cpu = _proc_busy()
    gpu = other_gpu_processes()
    return [
        Probe("input idle", _idle_reads(policy.input_dir, evdev, platform, source),
              evdev is not None or platform is not None),
        Probe("power", f"{policy.power_dir}: {'mains' if mains else 'battery'}"
              if mains is not None else f"no power supply under {policy.power_dir}: "
              "treated as mains", mains is not None),
        Probe("other CPU", "/proc/stat and /proc/PID/stat (fedq's own workers excluded)"
              if cpu is not None else "no /proc here: FEDQ_MAX_OTHER_CPU cannot tell",
              cpu is not None),
        Probe("other GPU", f"NVML: {gpu} compute process(es) that are not fedq's"
              if gpu is not None else "no NVML (no NVIDIA GPU or no nvidia-ml-py): "
              "FEDQ_MAX_OTHER_GPU cannot tell", gpu is not None),
    ]


def _idle_reads(input_dir: Path, evdev: float | None, platform: float | None,
                source: str) -> str:
    if evdev is not None:
        return f"{input_dir}/event*: idle {evdev:.0f} s"
    if platform == float("inf"):
        return source
    if platform is not None:
        return f"{source}: idle {platform:.0f} s"
    return (f"no input devices under {input_dir} and {source}: FEDQ_RUN_WHEN=idle cannot "
            "tell and never stops this worker")


# -- the watch ------------------------------------------------------------------------

@dataclass
class Watch:
    """The policy's verdict, read at each :meth:`tick`: ``reason`` is None while fedq
    may train, else why it may not ("owner active", "on battery")."""

    policy: Policy
    clock: Callable[[], datetime] = datetime.now
    reason: str | None = None
    listeners: list[Callable[[str | None], None]] = field(default_factory=list)
    _held_since: float | None = None
    _cpu: CpuLoad = field(default_factory=CpuLoad)

    def check(self) -> str | None:
        """Why fedq may not train now (None: every condition holds)."""
        p = self.policy
        if p.when == "idle":
            idle = input_idle_s(p.input_dir)
            if idle is not None and idle < p.idle_after_s:
                return f"owner active (input {idle:.0f} s ago)"
        if (p.when == "schedule" or p.days != frozenset(range(7))) and \
                not in_window(self.clock(), p.window, p.days):
            return f"outside {_describe_window(p)}"
        if p.ac_only and on_mains(p.power_dir) is False:
            return "on battery"
        if p.max_other_cpu is not None:
            load = self._cpu.read()
            if load is not None and load > p.max_other_cpu:
                return f"other programs use {load:.0f}% CPU (> {p.max_other_cpu:g}%)"
        if p.max_other_gpu is not None:
            others = other_gpu_processes()
            if others is not None and others > p.max_other_gpu:
                return f"{others} other process(es) on the GPU"
        return None

    def tick(self) -> None:
        """One reading: away at once, back only after ``resume_after_s`` of holding."""
        why = self.check()
        now = time.monotonic()
        was = self.reason
        if why is not None:
            self._held_since = None
            self.reason = why
        elif self.reason is not None:
            self._held_since = self._held_since or now
            if now - self._held_since >= self.policy.resume_after_s:
                self.reason = None
        if (was is None) != (self.reason is None):
            for listener in list(self.listeners):
                listener(self.reason)


class Watcher:
    """A worker process's view of its watch, which runs in a helper process of its own
    (``python -m fedq.worker.owner``, started with the worker's environment) and
    writes a line each time the verdict changes. In a thread of the worker, each
    probe file read would take the GIL back from the training thread, itself waiting
    for a core when the machine is busy; the helper never waits for the GIL, and the
    worker's reader thread wakes only on a change (docs/owners.md says what was and
    was not measured). The helper exits when the worker does (its stdin closes)."""

    def __init__(self, policy: Policy) -> None:
        first = Watch(policy)
        first.tick()
        self.reason: str | None = first.reason
        self._proc = subprocess.Popen([sys.executable, "-m", "fedq.worker.owner"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        threading.Thread(target=self._read, name="fedq-owner", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            text = line.decode("utf-8", "replace").rstrip("\n")
            reason = text[len("away "):] or "away" if text.startswith("away") else None
            if (reason is None) != (self.reason is None):
                log.warning("fedq: %s", f"stepping aside: {reason}" if reason
                            else "the owner's conditions hold again: training resumes")
            self.reason = reason
        if self._proc.wait() > 0:  # (killed with its worker: nothing to say)
            log.warning("fedq: the owner watch exited with %s; training goes on",
                        self._proc.returncode)
            self.reason = None


def _serve() -> None:
    """The helper: tick, and print ``free`` / ``away REASON`` at start and on each
    change, until stdin closes (its worker exited)."""
    from fedq.settings import get_settings

    policy = Policy.from_settings(get_settings())
    watch = Watch(policy, listeners=[_say])
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    watch.tick()
    _say(watch.reason)
    while True:
        time.sleep(TICK_S)
        try:
            watch.tick()
        except Exception as exc:  # noqa: BLE001 - a probe's failure never stops a worker
            print(f"fedq: owner probe failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def _say(reason: str | None) -> None:
    print("free" if reason is None else f"away {reason}", flush=True)


def describe(p: Policy) -> str:
    """The policy in a line: "when idle for 5 min, on mains only, other CPU <= 30%"."""
    parts = {"always": "always", "idle": f"when idle for {p.idle_after_s / 60:g} min",
             "schedule": f"inside {_describe_window(p)}"}[p.when]
    extra = [f"inside {_describe_window(p)}" if p.when != "schedule" and
             p.days != frozenset(range(7)) else "",
             "on mains only" if p.ac_only else "",
             f"other CPU <= {p.max_other_cpu:g}%" if p.max_other_cpu is not None else "",
             f"other GPU processes <= {p.max_other_gpu}" if p.max_other_gpu is not None else "",
             f"resumes after {p.resume_after_s:g} s" if p.active else ""]
    return ", ".join([parts, *[e for e in extra if e]])


def _describe_window(p: Policy) -> str:
    days = "" if p.days == frozenset(range(7)) else \
        " on " + ",".join(DAYS[d] for d in sorted(p.days))
    if p.window is None:
        return f"the run days{days}"
    a, b = p.window
    return f"{_clock(a)}-{_clock(b)}{days}"


def _clock(t: int) -> str:
    return f"{t // 3600:02d}:{t % 3600 // 60:02d}" + (f":{t % 60:02d}" if t % 60 else "")


_WATCH: tuple[int, Watcher | None] | None = None
_LOCK = threading.Lock()


def watch() -> Watcher | None:
    """This process's watch (started on first use, again after a fork), or None when
    the worker's policy is ``always`` with no condition."""
    global _WATCH
    with _LOCK:
        if _WATCH is None or _WATCH[0] != os.getpid():
            from fedq.settings import get_settings

            policy = Policy.from_settings(get_settings())
            _WATCH = (os.getpid(), Watcher(policy) if policy.active else None)
        return _WATCH[1]


#: Set by the worker's main process (fedq/worker/signals.py): stops consuming now when
#: the owner's conditions fail. A task that yields in that process (``--pool solo``,
#: where tasks run on the consumer's own thread) calls it before it returns, so that
#: no queued task is taken between the yield and the consumer's next timer tick.
step_aside: Callable[[], None] | None = None
_STEP_ASIDE_PID = 0


def set_step_aside(fn: Callable[[], None]) -> None:
    global step_aside, _STEP_ASIDE_PID
    step_aside, _STEP_ASIDE_PID = fn, os.getpid()


def stepped_aside() -> None:
    """After a task yielded: stop consuming at once where this process is the consumer."""
    if step_aside is not None and _STEP_ASIDE_PID == os.getpid():
        step_aside()


def away() -> str | None:
    """Why this worker must not train now (None: it may)."""
    w = watch()
    return None if w is None else w.reason



if __name__ == "__main__":
    _serve()
