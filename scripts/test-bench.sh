#!/usr/bin/env bash
# The benchmark stage of .ci/run: the benchmark suite (scripts/bench.sh) and the WAN
# benchmark (bench/wan.py, network namespaces: needs root) at smoke sizes, so their
# code cannot rot: 9 min 41 s alone on this 2-core machine (2026-11-29; the slowest:
# bench.sh --smoke 114 s, the WAN run 110 s, the language model's tables 67 s), 14-17
# min in .ci/run beside the deploy stage's image builds. The figures themselves come
# from the full runs (docs/benchmarks.md, docs/wan.md); nothing here asserts on speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -p no:cacheprovider tests/test_bench_smoke.py "$@"
