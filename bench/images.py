"""What fedq's images are made of, measured in the images this host built, into
docs/deploy.md (the table between the image-size markers).

    bash scripts/images.sh && .venv/bin/python -m bench.images     # a few seconds

For each fedq image: its size as `docker images` reports it, and inside it, with `du`
over the image's files: the operating system (everything outside the virtual
environment), torch and torchvision, the CUDA libraries that come with a CUDA torch
(the `nvidia-*` wheels), triton, and every other Python package. The virtual
environment's groups are measured by file sizes in the running image, so they add up
to a little less than the total, which counts the layers."""

from __future__ import annotations

import json
import os
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deploy.md"
BEGIN, END = "<!-- image sizes -->", "<!-- end of image sizes -->"
IMAGES = ["fedq-coordinator", "fedq-worker:cpu", "fedq-worker:gpu_new", "fedq-worker:gpu_sm61"]

# run inside an image: bytes per group of the virtual environment, and outside it
MEASURE = r"""
import json, os, sys
def size(top):
    total = 0
    for folder, _, files in os.walk(top):
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                total += os.lstat(path).st_size
    return total
site = [p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix)][0]
groups = {"torch": 0, "cuda": 0, "triton": 0, "other": 0}
for entry in os.listdir(site):
    low = entry.lower()
    path = os.path.join(site, entry)
    grow = size(path) if os.path.isdir(path) else os.lstat(path).st_size
    if low.startswith(("torch", "functorch")):
        groups["torch"] += grow
    elif low.startswith(("nvidia", "cuda")):
        groups["cuda"] += grow
    elif low.startswith("triton"):
        groups["triton"] += grow
    else:
        groups["other"] += grow
venv = size(sys.prefix)
groups["other"] += venv - sum(groups.values())
system = sum(size(top) for top in ("/usr", "/etc", "/var", "/home", "/root", "/opt")
             if os.path.isdir(top)) - venv
print(json.dumps({**groups, "system": system}))
"""


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True,
                          timeout=600).stdout


def measure(image: str) -> dict[str, int]:
    """The image's size and its groups, in bytes."""
    total = int(_docker("image", "inspect", "-f", "{{.Size}}", image).strip())
    inside = json.loads(_docker("run", "--rm", "--entrypoint", "python", image, "-c", MEASURE))
    return {"total": total, **inside}


def render(rows: dict[str, dict[str, int]]) -> str:
    """The markdown table, with its command and date."""
    gb = 1e9

    def cell(value: int) -> str:
        return f"{value / gb:.2f} GB" if value >= 0.1 * gb else f"{value / 1e6:.0f} MB"

    lines = [BEGIN,
             f"Measured {datetime.now(timezone.utc):%Y-%m-%d} by `.venv/bin/python -m "
             "bench.images` in the images `scripts/images.sh` built here:",
             "",
             "| image | size | system | torch, torchvision | CUDA libraries | triton "
             "| other Python packages |",
             "|---|---|---|---|---|---|---|"]
    for image, row in rows.items():
        lines.append(f"| `{image}` | {cell(row['total'])} | {cell(row['system'])} | "
                     f"{cell(row['torch'])} | {cell(row['cuda'])} | {cell(row['triton'])} | "
                     f"{cell(row['other'])} |")
    lines.append(END)
    return "\n".join(lines)


def main() -> None:
    os.environ.setdefault("DOCKER_HOST", subprocess.run(
        ["bash", str(ROOT / "scripts" / "docker-engine.sh")], capture_output=True, text=True,
        check=True).stdout.strip())
    rows = {image: measure(image) for image in IMAGES}
    table = render(rows)
    text = DOC.read_text()
    if BEGIN not in text:
        raise SystemExit(f"bench.images: {DOC} has no {BEGIN} marker")
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: table, text,
                  flags=re.S)
    DOC.write_text(text)
    print(table)


if __name__ == "__main__":
    main()
