"""`fedq demo` as a newcomer runs it: no servers, real workers, >= 0.90 accuracy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_trains_digits_and_stops_its_workers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDQ_")}
    # URLs pointing at servers must not matter: the demo uses the embedded default.
    env["FEDQ_BROKER_URL"] = "redis://127.0.0.1:1/0"
    env["FEDQ_IDENTITY"] = "required"  # nor a coordinator's identity setting: no keys here
    home = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "fedq.cli", "demo", "--home", str(home)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identity off: the demo's workers are processes of this machine" in proc.stdout
    for n in range(1, 6):
        assert re.search(rf"round\s+{n}\s+committed", proc.stdout), proc.stdout
    match = re.search(r"final test accuracy (\d\.\d+)", proc.stdout)
    assert match and float(match.group(1)) >= 0.90, proc.stdout
    accuracy = float(match.group(1))
    assert (home / "fedq.db").exists()
    # then the trained model classifies the test images on the same workers
    match = re.search(r"classified (\d+) test images on \d worker\(s\) .*; (\d\.\d+) right",
                      proc.stdout.replace("\n", " "))
    assert match, proc.stdout
    lines = (home / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == int(match.group(1)) == 360
    # the predictions agree with the job's own evaluation of its final model
    assert abs(float(match.group(2)) - accuracy) < 1e-3, proc.stdout
    left = subprocess.run(["pgrep", "-f", "celery.*-n train1@demo.*"], capture_output=True)
    leftover = [line for line in left.stdout.decode().split() if line]
    # any surviving worker of *this* demo would have its home in its environment
    for pid in leftover:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert str(home).encode() not in environ, f"worker {pid} still running"
