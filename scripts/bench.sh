#!/usr/bin/env bash
# Runs the benchmark suite (bench/) and writes docs/benchmarks.md; `--smoke` for tiny
# sizes. Builds fedq's environment (scripts/bootstrap.sh) and a separate one for Flower,
# cached like fedq's, keyed by a hash of requirements/bench-flower.txt and this script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh

cache="${FEDQ_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq}"
python="${PYTHON:-python3}"
hash=$(cat requirements/bench-flower.txt scripts/bench.sh \
       | "$python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
flower="$cache/flower-$hash"
if [ ! -f "$flower/.complete" ]; then
    echo "fedq bench: building the Flower environment in $flower (first run: ~1 min)" >&2
    rm -rf "$flower"
    mkdir -p "$cache"
    "$python" -m venv "$flower"
    log=$(mktemp)
    # flwr 1.42.0 asks for a certifi newer than the package registry here has: its other
    # dependencies first, then flwr itself without dependency resolution.
    if ! { "$flower/bin/python" -m pip install -q -r requirements/bench-flower.txt \
           && "$flower/bin/python" -m pip install -q --no-deps flwr==1.42.0; } >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; exit 1
    fi
    rm -f "$log"
    touch "$flower/.complete"
fi
export FEDQ_BENCH_FLOWER_PYTHON="$flower/bin/python"
exec .venv/bin/python -m bench "$@"
