#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and links it at ./.venv.
#
# The environment is installed from the lock file, requirements/dev.lock (every
# package pinned; `bash scripts/lock.sh` regenerates it from pyproject.toml). It lives
# outside the checkout, keyed by a hash of the lock and this script, so a fresh clone
# on the same machine reuses it; a new machine builds it from scratch (about 2 minutes:
# torch is the bulk). Override the cache folder with FEDQ_VENV_CACHE and the
# interpreter with PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${FEDQ_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq}"
python="${PYTHON:-python3}"

# The interpreter must be one the package claims (pyproject's requires-python); this
# check needs nothing newer than what it checks for.
"$python" - <<'PY'
import re, sys
text = open("pyproject.toml").read()
floor = re.search(r'^requires-python\s*=\s*">=(\d+)\.(\d+)"', text, re.M)
if floor is None:
    sys.exit("fedq: pyproject.toml has no requires-python = \">=X.Y\"")
need = (int(floor.group(1)), int(floor.group(2)))
if sys.version_info[:2] < need:
    sys.exit(f"fedq: Python {need[0]}.{need[1]} or newer is needed, {sys.executable} is "
             f"{sys.version.split()[0]}: set PYTHON=/path/to/python3")
PY

hash=$(cat requirements/dev.lock scripts/bootstrap.sh \
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
    # Exactly the lock: every package is listed there, so no resolution happens here.
    pip_quiet install -q --no-deps -r requirements/dev.lock
    # The compose-spec JSON schema that tests validate docker/compose.yaml against ships
    # inside docker-compose 1.29.2 (the Python Compose); only its data file is used.
    pip_quiet install -q --no-deps docker-compose==1.29.2
    # Its command needs packages not installed here: the Compose to run is the host's
    # (docs/deploy.md), which this one would shadow on a PATH that starts at .venv/bin.
    rm -f "$venv/bin/docker-compose"
    touch "$venv/.complete"
fi
# Editable install of this checkout: fast (no dependency resolution).
pip_quiet install -q --no-deps --no-build-isolation -e .
ln -sfn "$venv" .venv
