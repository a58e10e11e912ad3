#!/usr/bin/env bash
# Regenerates requirements/dev.lock, the development and CI environment, from
# pyproject.toml (the default dependencies, the [test], [coordinator], [plot] and [llm] extras) and
# requirements/dev-constraints.txt (this machine's torch). One lock for every Python
# that requires-python admits (uv's universal resolution); tests/test_packaging.py
# fails when pyproject.toml and the lock disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
uv="${UV:-.venv/bin/uv}"
"$uv" pip compile --quiet --universal --python-version 3.10 --no-emit-index-url \
    --extra test --extra coordinator --extra plot --extra llm --constraint requirements/dev-constraints.txt \
    --output-file requirements/dev.lock pyproject.toml
echo "wrote requirements/dev.lock ($(grep -c '==' requirements/dev.lock) pins)"
