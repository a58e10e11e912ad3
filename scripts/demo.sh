#!/usr/bin/env bash
# Set up (first run: ~2 min) and run the demo: federated training on scikit-learn's
# digits over real Celery workers, with no servers. Extra arguments go to `fedq demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/fedq demo "$@"
