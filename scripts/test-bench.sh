#!/usr/bin/env bash
# The benchmark stage of .ci/run: the benchmark suite (scripts/bench.sh) and the WAN
# benchmark (bench/wan.py, network namespaces: needs root) at smoke sizes, so their
# code cannot rot. Their workers are forked from a process that has imported torch once
# (FEDQ_TEST_ZYGOTE=1, set by tests/test_bench_smoke.py; fedq/testing/zygote.py). Alone
# on this 2-core machine on a slow day (2026-11-30, torch imported in 2.8 s): 13 min 44 s,
# against 18 min 34 s started cold (the slowest: the WAN run 137 s, the language model's
# tables 123 s, bench.sh --smoke 91 s, down from 222 s). In .ci/run it runs beside the
# deploy stage's image builds. The figures themselves come from the full runs
# (docs/benchmarks.md, docs/wan.md); nothing here asserts on speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -p no:cacheprovider tests/test_bench_smoke.py "$@"
