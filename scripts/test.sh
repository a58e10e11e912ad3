#!/usr/bin/env bash
# Set up (first run: ~2 min) and run the checks: ruff, mypy and the test suite
# against the real PostgreSQL, Redis and RabbitMQ on 127.0.0.1, a SeaweedFS S3
# server it starts itself, and real `celery worker` processes.
# With CI=true a missing service fails the run instead of skipping its tests.
#
# With no arguments the suite runs as three pytest processes side by side (the smoke
# runs of the benchmarks are .ci/run's own stage, scripts/test-bench.sh): two groups of
# slow end-to-end files (fault tests, strategy jobs, identity, owners, sites, WAN,
# inference) beside everything else, on disjoint Redis database numbers and temporary
# folders, with ruff and mypy beside them too; then the two tests marked quiet, which
# read the machine's CPU load, alone. The tests' workers and `fedq` commands are forked
# from a process that has imported torch once (fedq/testing/zygote.py). The budget is
# 15 minutes on 2 cores. With arguments, ruff, mypy and one pytest process with them:
# `bash scripts/test.sh tests/test_spec.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
lint() { .venv/bin/ruff check fedq tests bench && .venv/bin/mypy -p fedq -p bench; }
if [ "$#" -gt 0 ]; then
    lint
    exec .venv/bin/python -m pytest "$@"
fi
# Two groups of slow end-to-end files run in pytest processes of their own beside the
# rest: the suite waits on deadlines, heartbeats and killed processes more than it
# computes.
side_a=(tests/test_faults.py tests/test_buffered.py tests/test_finalize.py
        tests/test_strategy_jobs.py tests/test_presigned.py)
side_b=(tests/test_identity.py tests/test_owner.py tests/test_sites.py tests/test_wan.py
        tests/test_inference.py tests/test_serve.py)
tmp="${TMPDIR:-/tmp}/fedq-tests-$$"
mkdir -p "$tmp"
# ruff and mypy run beside the tests (mypy: 46 s of one core from a clean clone); their
# output comes after the tests' and a finding fails the run.
lint >"$tmp/lint.log" 2>&1 &
lint_pid=$!
# The tests marked quiet read the machine's CPU load: they run alone, after the others.
together="not docker and not quiet"
FEDQ_TEST_REDIS_DBS=11-15 .venv/bin/python -m pytest -p no:cacheprovider --durations=25 \
    -m "$together" --basetemp="$tmp/side_a" "${side_a[@]}" >"$tmp/side_a.log" 2>&1 &
side_a_pid=$!
FEDQ_TEST_REDIS_DBS=6-10 .venv/bin/python -m pytest -p no:cacheprovider --durations=25 \
    -m "$together" --basetemp="$tmp/side_b" "${side_b[@]}" >"$tmp/side_b.log" 2>&1 &
side_b_pid=$!
trap 'kill "$side_a_pid" "$side_b_pid" "$lint_pid" 2>/dev/null || true' EXIT
main_rc=0
FEDQ_TEST_REDIS_DBS=1-5 .venv/bin/python -m pytest --durations=30 --basetemp="$tmp/main" \
    -m "$together" $(printf -- '--ignore=%s ' "${side_a[@]}" "${side_b[@]}") \
    --ignore=tests/test_bench_smoke.py || main_rc=$?
side_a_rc=0
wait "$side_a_pid" || side_a_rc=$?
side_b_rc=0
wait "$side_b_pid" || side_b_rc=$?
trap - EXIT
lint_rc=0
wait "$lint_pid" || lint_rc=$?
echo "---- run beside the others: ${side_a[*]}"
cat "$tmp/side_a.log"
echo "---- run beside the others: ${side_b[*]}"
cat "$tmp/side_b.log"
echo "---- ruff and mypy"
cat "$tmp/lint.log"
echo "---- run alone (marked quiet)"
# .ci/run prepares the deploy stage's images beside the tests: the quiet ones, which
# read the machine's CPU load, wait for it to end (the pid in FEDQ_TEST_QUIET_AFTER)
if [ -n "${FEDQ_TEST_QUIET_AFTER:-}" ]; then
    while kill -0 "$FEDQ_TEST_QUIET_AFTER" 2>/dev/null; do sleep 1; done
fi
quiet_rc=0
FEDQ_TEST_REDIS_DBS=1-9 .venv/bin/python -m pytest -p no:cacheprovider -m quiet \
    --basetemp="$tmp/quiet" --ignore=tests/test_bench_smoke.py || quiet_rc=$?
rm -rf "$tmp"
if [ "$lint_rc" != 0 ]; then
    echo "fedq: ruff or mypy found a problem (above, after the tests)" >&2
fi
if [ "$main_rc" != 0 ] || [ "$side_a_rc" != 0 ] || [ "$side_b_rc" != 0 ] \
        || [ "$quiet_rc" != 0 ] || [ "$lint_rc" != 0 ]; then
    echo "fedq: checks failed (tests: exit $main_rc; beside them, ${side_a[*]}: exit" \
         "$side_a_rc; ${side_b[*]}: exit $side_b_rc; alone, the quiet ones: exit" \
         "$quiet_rc; ruff and mypy: exit $lint_rc)" >&2
    exit 1
fi
