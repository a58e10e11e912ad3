#!/usr/bin/env bash
# Set up (first run: ~2 min) and run the checks: ruff, mypy, then the test suite
# against the real PostgreSQL, Redis and RabbitMQ on 127.0.0.1, a SeaweedFS S3
# server it starts itself, and real `celery worker` processes.
# With CI=true a missing service fails the run instead of skipping its tests.
#
# With no arguments the suite runs as two pytest processes side by side (the smoke
# runs of the benchmarks are .ci/run's own stage, scripts/test-bench.sh): the fault
# tests (mostly waiting on deadlines and killed processes) and the strategy jobs
# beside everything else, on disjoint Redis database numbers and temporary folders;
# then the two tests marked quiet, which read the machine's CPU load, alone. The tests'
# workers and `fedq` commands are forked from a process that has imported torch once
# (fedq/testing/zygote.py). On 2026-11-30, a slow day for this 2-core machine (torch
# imported in 2.9 s), 21 min 30 s in all: the main 622 tests in 20 min 7 s and the 69
# beside them in 18 min 2 s, then the quiet 2 in 44 s. The same morning, before the
# zygote: 619 in 31 min 40 s, 69 in 31 min 20 s, 2 in 39 s. The goal is 15 minutes.
# With arguments, one
# pytest process gets them: `bash scripts/test.sh tests/test_spec.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check fedq tests bench
.venv/bin/mypy -p fedq -p bench
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
side=(tests/test_faults.py tests/test_buffered.py tests/test_finalize.py tests/test_strategy_jobs.py
      tests/test_identity.py tests/test_presigned.py tests/test_owner.py tests/test_sites.py)
tmp="${TMPDIR:-/tmp}/fedq-tests-$$"
mkdir -p "$tmp"
# The tests marked quiet read the machine's CPU load: they run alone, after both.
together="not docker and not quiet"
FEDQ_TEST_REDIS_DBS=10-15 .venv/bin/python -m pytest -p no:cacheprovider --durations=30 \
    -m "$together" --basetemp="$tmp/side" "${side[@]}" >"$tmp/side.log" 2>&1 &
side_pid=$!
trap 'kill "$side_pid" 2>/dev/null || true' EXIT
main_rc=0
FEDQ_TEST_REDIS_DBS=1-9 .venv/bin/python -m pytest --durations=40 --basetemp="$tmp/main" \
    -m "$together" $(printf -- '--ignore=%s ' "${side[@]}") --ignore=tests/test_bench_smoke.py \
    || main_rc=$?
side_rc=0
wait "$side_pid" || side_rc=$?
trap - EXIT
echo "---- run beside the others: ${side[*]}"
cat "$tmp/side.log"
echo "---- run alone (marked quiet)"
quiet_rc=0
FEDQ_TEST_REDIS_DBS=1-9 .venv/bin/python -m pytest -p no:cacheprovider -m quiet \
    --basetemp="$tmp/quiet" --ignore=tests/test_bench_smoke.py || quiet_rc=$?
rm -rf "$tmp"
if [ "$main_rc" != 0 ] || [ "$side_rc" != 0 ] || [ "$quiet_rc" != 0 ]; then
    echo "fedq: tests failed (exit $main_rc; beside them, ${side[*]}: exit $side_rc;" \
         "alone, the quiet ones: exit $quiet_rc)" >&2
    exit 1
fi
