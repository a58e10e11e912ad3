#!/usr/bin/env bash
# Set up (first run: ~2 min) and run the checks: ruff, mypy, then the test suite
# against the real PostgreSQL, Redis and RabbitMQ on 127.0.0.1, a SeaweedFS S3
# server it starts itself, and real `celery worker` processes.
# With CI=true a missing service fails the run instead of skipping its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check fedq tests bench
.venv/bin/mypy -p fedq -p bench
exec .venv/bin/python -m pytest "$@"
