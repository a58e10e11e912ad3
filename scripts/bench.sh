#!/usr/bin/env bash
# Runs the benchmark suite (bench/) and writes docs/benchmarks.md; `--smoke` for tiny
# sizes. Builds fedq's environment (scripts/bootstrap.sh) and a separate one for Flower
# (scripts/flower-env.sh, cached like fedq's).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
FEDQ_BENCH_FLOWER_PYTHON=$(bash scripts/flower-env.sh)
export FEDQ_BENCH_FLOWER_PYTHON
exec .venv/bin/python -m bench "$@"
