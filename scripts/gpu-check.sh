#!/usr/bin/env bash
# On a machine with a GPU: set up (first run: ~2 min), check the hardware and torch
# build, then train one real round on the queue this machine's class maps to and print
# samples/s, GPU memory and utilisation. Extra arguments go to `fedq doctor --smoke`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/fedq doctor --smoke "$@"
