#!/usr/bin/env bash
# The benchmark stage of .ci/run: the benchmark suite (scripts/bench.sh) and the WAN
# benchmark (bench/wan.py, network namespaces: needs root) at smoke sizes, so their
# code cannot rot. Their workers are forked from a process that has imported torch once
# (FEDQ_TEST_ZYGOTE=1, set by tests/test_bench_smoke.py; fedq/testing/zygote.py), and so
# are bench.lm's runs. In .ci/run it runs beside the deploy stage. On 2026-11-30 beside
# it, with the deploy stage's images cached: 9 min 21 s (the slowest: the WAN run 118 s,
# bench.lm's whole smoke run 101 s, bench.sh --smoke 62 s), its seven bench.lm tests
# 212 s. Before those runs were forked and stepped on batches of 4, the same afternoon
# beside a deploy stage that built its images from scratch: 18 min 8 s, the seven 705 s
# (the seven alone: 248 s before, 116 s after). The figures themselves come from the
# full runs (docs/benchmarks.md, docs/wan.md, docs/lm.md); nothing here asserts on speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -p no:cacheprovider tests/test_bench_smoke.py "$@"
