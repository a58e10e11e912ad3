"""Run Flower's engines on the same zero-compute work as fedq, with Flower's own tools.

- Deployment Engine: ``flower-superlink`` and N ``flower-supernode`` processes on
  loopback; ``flwr run`` submits bench/flower_app (a ClientApp that returns the
  arrays it got plus a small change; the ServerApp runs Flower's FedAvg).
- Simulation Engine: ``flower-superlink --simulation`` (one process, Ray actors, no
  network between server and clients); the same ``flwr run``.

Flower lives in its own environment (scripts/bench.sh builds it; never a dependency of
fedq); this module only starts its commands. The ServerApp appends a timestamp to a
file after each round's aggregation; the per-round time is the gap between stamps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import ROOT, BenchError
from fedq.testing.wan import Host, Relays

APP = ROOT / "bench" / "flower_app"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for(path: Path, marker: str, proc: subprocess.Popen[bytes], timeout: float,
              name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and marker in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise BenchError(f"{name} exited {proc.returncode}; see {path}")
        time.sleep(0.2)
    raise BenchError(f"no {marker!r} in {path} after {timeout:.0f}s")


def flower_rounds(flower_bin: Path, work: Path, engine: str, shapes: list[list[int]],
                  rounds: int, clients: int, timeout: float = 900,
                  hosts: Sequence[Host] = (), relays: Relays | None = None) -> list[float]:
    """Seconds between consecutive rounds (the first not counted) of a zero-compute
    FedAvg run on Flower's ``deployment`` or ``simulation`` engine. ``hosts``
    (deployment): SuperNode i runs in ``hosts[i]``'s network namespace and reaches the
    SuperLink through a relay on its emulated link (bench/wan.py)."""
    if engine not in ("deployment", "simulation"):
        raise ValueError(engine)
    home = work / f"flower-{engine}-{time.monotonic_ns()}"
    home.mkdir(parents=True)
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    shapes_file, times_file = home / "shapes.json", home / "times.txt"
    shapes_file.write_text(json.dumps(shapes))
    env = {**os.environ, "FLWR_HOME": str(home),
           "PATH": f"{flower_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str, prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        log = open(home / f"{name}.log", "wb")
        proc = subprocess.Popen([*prefix, str(flower_bin / args[0]), *args[1:]], env=env,
                                cwd=home,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        procs.append(proc)
        return proc

    try:
        link = start("superlink", "flower-superlink", "--insecure", "--port", str(port),
                     "--disable-runtime-dependency-installation",
                     *(["--simulation"] if engine == "simulation" else []))
        _wait_for(home / "superlink.log", "Starting Flower SuperExec", link, 120,
                  "flower-superlink")
        if engine == "deployment":
            nodes = []
            for i in range(clients):
                address, prefix = f"127.0.0.1:{port}", []
                if hosts:
                    assert relays is not None
                    host = hosts[i % len(hosts)]
                    relay = host.forward(relays, port, port=0)
                    address, prefix = f"{host.root_ip}:{relay.port}", host.exec_prefix()
                nodes.append(start(f"supernode{i}", "flower-supernode", "--insecure",
                                   "--superlink", address, "--port", str(_free_port()),
                                   prefix=prefix))
            for i, node in enumerate(nodes):
                _wait_for(home / f"supernode{i}.log", "SuperNode ID", node, 120,
                          "flower-supernode")
        run = [str(flower_bin / "flwr"), "run", str(APP), "local",
               "--run-config", f'num-rounds={rounds} clients={clients} '
                               f'shapes-file="{shapes_file}" times-file="{times_file}"']
        if engine == "simulation":
            run += ["--federation-config", f"num-supernodes={clients}"]
        out = subprocess.run(run, env=env, cwd=home, capture_output=True, text=True,
                             timeout=120, check=False)
        if out.returncode != 0 or "Successfully started run" not in out.stdout:
            raise BenchError(f"flwr run failed ({out.returncode}): "
                             f"{(out.stdout + out.stderr).strip()[-500:]}")
        deadline = time.monotonic() + timeout
        while True:
            stamps = times_file.read_text().split() if times_file.exists() else []
            failed = [s for s in stamps if s.startswith("error:")]
            if failed:
                raise BenchError(f"Flower {engine}: a ClientApp failed "
                                 f"({failed[0].replace('_', ' ')[:300]}); see {home}")
            if len(stamps) >= rounds:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"Flower {engine}: {len(stamps)} of {rounds} rounds after "
                                 f"{timeout:.0f}s; see {home}")
            if link.poll() is not None:
                raise BenchError(f"flower-superlink exited {link.returncode}; see {home}")
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        # superexec and app processes start their own sessions: find them by FLWR_HOME
        _kill_strays(home)
    times = [float(t) for t in stamps]
    return [b - a for a, b in zip(times, times[1:])]


def _kill_strays(home: Path) -> None:
    marker = f"FLWR_HOME={home}".encode()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            if marker in (pid_dir / "environ").read_bytes():
                os.kill(int(pid_dir.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
