#!/usr/bin/env bash
# The benchmark stage of .ci/run: the benchmark suite (scripts/bench.sh) and the WAN
# benchmark (bench/wan.py, network namespaces: needs root) at smoke sizes, so their
# code cannot rot; about 8 minutes on 2 cores. The figures themselves come from the
# full runs (docs/benchmarks.md, docs/wan.md); nothing here asserts on speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -p no:cacheprovider tests/test_bench_smoke.py "$@"
