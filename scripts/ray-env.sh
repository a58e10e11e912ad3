#!/usr/bin/env bash
# Builds (once) the environment Ray Serve and Ray Data run in for bench/inference.py —
# its own, never a fedq dependency — cached like fedq's, keyed by a hash of
# requirements/bench-ray.txt and this script; prints its python:
#   .venv/bin/python -m bench.inference --ray-python "$(bash scripts/ray-env.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${FEDQ_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq}"
python="${PYTHON:-python3}"
hash=$(cat requirements/bench-ray.txt scripts/ray-env.sh \
       | "$python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
ray="$cache/ray-$hash"
if [ ! -f "$ray/.complete" ]; then
    echo "fedq bench: building the Ray environment in $ray (first run: ~3 min)" >&2
    rm -rf "$ray"
    mkdir -p "$cache"
    "$python" -m venv "$ray"
    log=$(mktemp)
    if ! "$ray/bin/python" -m pip install -q -r requirements/bench-ray.txt >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; exit 1
    fi
    rm -f "$log"
    touch "$ray/.complete"
fi
echo "$ray/bin/python"
