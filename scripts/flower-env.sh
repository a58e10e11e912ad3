#!/usr/bin/env bash
# Builds (once) the environment Flower 1.42 runs in for the benchmarks — its own, never
# a fedq dependency — cached like fedq's, keyed by a hash of requirements/bench-flower.txt
# and this script; prints its python. scripts/bench.sh uses it; for bench/wan.py:
#   .venv/bin/python -m bench.wan --flower-python "$(bash scripts/flower-env.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${FEDQ_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq}"
python="${PYTHON:-python3}"
hash=$(cat requirements/bench-flower.txt scripts/flower-env.sh \
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
echo "$flower/bin/python"
