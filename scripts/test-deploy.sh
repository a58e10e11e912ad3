#!/usr/bin/env bash
# The deploy stage: starts the Docker engine (scripts/docker-engine.sh), builds the
# images (scripts/images.sh: cached by Docker's layer cache, so an unchanged tree
# rebuilds nothing), checks what each image carries, then runs `docker compose up`
# with the fault cases and the dashboard in headless Chromium (tests/test_deploy.py).
# The daemon it started is stopped at the end, by its pid; the built images stay in
# its data root for the next run.
#
# `--beside` (what .ci/run runs beside the benchmark stage, which uses the virtual
# environment meanwhile) is the whole stage without scripts/bootstrap.sh: the
# environment must be there already. `--images` (what .ci/run runs beside the tests
# before that) is its preparation alone, without bootstrap.sh either: the engine, the
# images and the browser, no tests; it leaves the engine running for the stage after it
# (`bash scripts/docker-engine.sh stop` stops it). In two halves: `--prepare` leaves the
# virtual environment alone too, gets the engine, the images and the browser ready and runs
# tests/test_images.py; `--compose` then runs the docker compose tests. The image tests
# use Redis databases FEDQ_TEST_REDIS_DBS (1-9 unless set) on the host's Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
    --prepare) mode=prepare; shift ;;
    --compose) mode=compose; shift ;;
    --beside) mode=beside; shift ;;
    --images) mode=images; shift ;;
esac
if [ "$mode" = all ] || [ "$mode" = compose ]; then
    bash scripts/bootstrap.sh
fi
sock="${FEDQ_DOCKER_HOME:-$HOME/.cache/fedq/docker}/docker.sock"
started_here=1  # unless an engine already answers on fedq's socket
if command -v docker >/dev/null && DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
    started_here=0
fi
DOCKER_HOST=$(bash scripts/docker-engine.sh)
export DOCKER_HOST
if [ "$mode" = images ]; then
    started_here=0  # the engine stays up for the stage after it
fi
stop() { if [ "$started_here" = 1 ]; then bash scripts/docker-engine.sh stop; fi; }
trap stop EXIT
bash scripts/images.sh
# The dashboard test opens Flower in headless Chromium: Debian's browser and the
# matching driver (tests/test_deploy.py drives it with Selenium).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    echo "fedq: installing chromium chromium-driver with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
case "$mode" in
    images) ;;
    prepare)
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"; stop' EXIT
        FEDQ_TEST_REDIS_DBS="${FEDQ_TEST_REDIS_DBS:-1-9}" .venv/bin/python -m pytest \
            -p no:cacheprovider --basetemp="$tmp" -m docker tests/test_images.py "$@" ;;
    compose)
        .venv/bin/python -m pytest -m docker tests/test_deploy.py tests/test_deploy_secure.py "$@" ;;
    beside)
        tmp=$(mktemp -d)
        trap 'rm -rf "$tmp"; stop' EXIT
        FEDQ_TEST_REDIS_DBS="${FEDQ_TEST_REDIS_DBS:-1-9}" .venv/bin/python -m pytest \
            -p no:cacheprovider --basetemp="$tmp" -m docker tests/test_images.py \
            tests/test_deploy.py tests/test_deploy_secure.py "$@" ;;
    *)
        .venv/bin/python -m pytest -m docker tests/test_images.py tests/test_deploy.py \
            tests/test_deploy_secure.py "$@" ;;
esac
