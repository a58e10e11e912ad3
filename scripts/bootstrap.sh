#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and links it at ./.venv.
#
# The environment lives outside the checkout, keyed by a hash of the dependency
# files, so a fresh clone on the same machine reuses it; a new machine builds it
# from scratch (about 2 minutes: torch is the bulk). Override the cache folder
# with FEDQ_VENV_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${FEDQ_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq}"
python="${PYTHON:-python3}"
hash=$(cat pyproject.toml requirements/dev-constraints.txt scripts/bootstrap.sh \
       | "$python" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
venv="$cache/venv-$hash"

pip_quiet() {  # pip, with the noise of this machine's extra indexes filtered out
    local log; log=$(mktemp)
    if ! "$venv/bin/python" -m pip "$@" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1
    fi
    rm -f "$log"
}

if [ ! -f "$venv/.complete" ]; then
    echo "fedq: building the virtual environment in $venv (first run on this machine: ~2 min)" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    "$python" -m venv "$venv"
    reqs="$venv/requirements.txt"
    "$python" - >"$reqs" <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p["optional-dependencies"]
print("\n".join(p["dependencies"] + extras["test"] + extras["dashboard"]))
PY
    # Dependencies only; the project itself is installed editable below, so the
    # cached environment serves any checkout.
    pip_quiet install -q -c requirements/dev-constraints.txt -r "$reqs"
    # The compose-spec JSON schema that tests validate docker/compose.yaml against ships
    # inside docker-compose 1.29.2 (the Python Compose); only its data file is used.
    pip_quiet install -q --no-deps docker-compose==1.29.2
    touch "$venv/.complete"
fi
# Editable install of this checkout: fast (no dependency resolution).
pip_quiet install -q --no-deps --no-build-isolation -e .
ln -sfn "$venv" .venv
