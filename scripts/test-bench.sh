#!/usr/bin/env bash
# The benchmark stage of .ci/run: the benchmark suite (scripts/bench.sh) and the WAN
# benchmark (bench/wan.py, network namespaces: needs root) at smoke sizes, so their
# code cannot rot. Their workers are forked from a process that has imported torch once
# (FEDQ_TEST_ZYGOTE=1, set by tests/test_bench_smoke.py; fedq/testing/zygote.py), and so
# are bench.lm's runs. In .ci/run it runs beside the deploy stage. The figures come from
# the full runs (docs/benchmarks.md, docs/wan.md, docs/lm.md); nothing here asserts on
# speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -p no:cacheprovider tests/test_bench_smoke.py "$@"
