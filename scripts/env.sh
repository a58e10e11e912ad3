#!/usr/bin/env bash
# Writes docker/.env for the coordinator's compose stack: docker/env.example with every
# placeholder password replaced by a random one (fedq refuses the placeholders), readable
# by its owner only. Variables set in the environment override the example's values:
#
#   bash scripts/env.sh                              # the defaults, random passwords
#   FEDQ_BIND=100.64.0.1 REDIS_PORT=6380 bash scripts/env.sh
#
# An existing docker/.env is kept (its passwords are the stack's): remove it to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docker/.env
if [ -e "$out" ]; then
    echo "fedq: $out exists; keeping it (remove it to write a new one)" >&2
    exit 0
fi
umask 077
tmp=$(mktemp docker/.env.XXXXXX)
trap 'rm -f "$tmp"' EXIT
while IFS= read -r line; do
    case "$line" in
        ""|\#*) printf '%s\n' "$line" ;;
        *=*)
            name=${line%%=*} value=${line#*=}
            if [ -n "${!name:-}" ]; then
                value=${!name}
            elif [ "${value#change-me}" != "$value" ]; then
                value=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
            fi
            printf '%s=%s\n' "$name" "$value" ;;
    esac
done < docker/env.example > "$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "fedq: wrote $out (random passwords, mode 600)" >&2
