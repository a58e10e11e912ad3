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
# then the two tests marked quiet, which read the machine's CPU load, alone (19 min 5 s
# on this 2-core machine in .ci/run on 2026-11-27: the main 584 tests in 16 min 47 s
# and the 62 beside them in 18 min 12 s, side by side, then the quiet 2 in 30 s; on
# 2026-11-29, a slower day (torch imported in 3.4 s, not 1.7), 32 min 3 s, 31 min 19 s
# and 53 s; a busy CI machine once took 57 minutes; on 2026-11-29 at 12:46 UTC, alone
# on a quiet machine, 16 min 48 s: 616 in 15 min 51 s, 65 in 16 min 12 s, then 2 in 28 s;
# 16:04-16:35 UTC the same day, a slower machine (torch imported in 2.3 s), 30 min with
# ruff and mypy: 616 in 27 min 24 s, 66 in 26 min 54 s, 2 in 42 s; the goal is 15).
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
