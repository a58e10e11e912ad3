#!/usr/bin/env bash
# The deploy stage: starts the Docker engine (scripts/docker-engine.sh), builds the
# images (scripts/images.sh: cached by Docker's layer cache, so an unchanged tree
# rebuilds nothing), checks what each image carries, then runs `docker compose up`
# with the fault cases (tests/test_deploy.py). The daemon it started is stopped at the
# end, by its pid; the built images stay in its data root for the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
sock="${FEDQ_DOCKER_HOME:-$HOME/.cache/fedq/docker}/docker.sock"
started_here=1  # unless an engine already answers on fedq's socket
if command -v docker >/dev/null && DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
    started_here=0
fi
DOCKER_HOST=$(bash scripts/docker-engine.sh)
export DOCKER_HOST
stop() { if [ "$started_here" = 1 ]; then bash scripts/docker-engine.sh stop; fi; }
trap stop EXIT
bash scripts/images.sh
.venv/bin/python -m pytest -m docker tests/test_images.py tests/test_deploy.py "$@"
