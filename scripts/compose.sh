#!/usr/bin/env bash
# fedq's compose stack with whichever Compose this host has: the `docker compose` plugin
# (v2: Docker's own packages, Docker Desktop) where it answers, else `docker-compose`
# (v1: Debian's docker.io, what scripts/docker-engine.sh installs). The same arguments
# either way:
#   bash scripts/compose.sh [--debian] [--secure] COMMAND [ARGS...]
# runs Compose from the repository's root with --env-file docker/.env and
# -f docker/compose.yaml, then -f docker/compose.debian.yaml with --debian (a host that
# reaches no registry: the images scripts/images.sh built) and -f
# docker/compose.secure.yaml with --secure (identity and TLS: docs/deploy.md). Paths
# in ARGS are taken from the repository's root; COMPOSE_PROJECT_NAME and DOCKER_HOST
# pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
files=(-f docker/compose.yaml)
while [ $# -gt 0 ]; do
    case "$1" in
        --debian) files+=(-f docker/compose.debian.yaml); shift ;;
        --secure) secure=1; shift ;;
        *) break ;;
    esac
done
if [ "${secure:-0}" = 1 ]; then
    files+=(-f docker/compose.secure.yaml)
fi
if [ $# -eq 0 ]; then
    echo "fedq: scripts/compose.sh: give a Compose command (up -d, down, ps, exec ...)" >&2
    exit 2
fi
if [ ! -f docker/.env ]; then
    echo "fedq: scripts/compose.sh: docker/.env is missing: run bash scripts/env.sh first" >&2
    exit 2
fi
if docker compose version >/dev/null 2>&1; then
    exec docker compose --env-file docker/.env "${files[@]}" "$@"
fi
if command -v docker-compose >/dev/null; then
    exec docker-compose --env-file docker/.env "${files[@]}" "$@"
fi
echo "fedq: scripts/compose.sh: neither 'docker compose' nor 'docker-compose' is installed" \
     "(bash scripts/docker-engine.sh installs Debian's docker.io and docker-compose)" >&2
exit 2
