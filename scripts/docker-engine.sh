#!/usr/bin/env bash
# Starts (or finds) the Docker engine fedq's image and compose tests use, and prints
# the DOCKER_HOST to use: `export DOCKER_HOST=$(bash scripts/docker-engine.sh)`.
#
# Installs Debian's docker.io, docker-compose and debootstrap when they are missing
# (needs root and apt). The daemon gets its own socket and data root under
# FEDQ_DOCKER_HOME (default ~/.cache/fedq/docker), so built images survive between runs
# and nothing touches a system-wide engine. `bash scripts/docker-engine.sh stop` stops
# the daemon this script started, by its pid.
set -euo pipefail
home="${FEDQ_DOCKER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq/docker}"
sock="$home/docker.sock"
pidfile="$home/dockerd.pid"

if [ "${1:-}" = stop ]; then
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        pid=$(cat "$pidfile"); kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        echo "fedq: stopped dockerd (pid $pid)" >&2
    fi
    exit 0
fi

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    echo "fedq: installing ${need[*]} with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

mkdir -p "$home"
if ! [ -S "$sock" ] || ! DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
    rm -f "$sock"
    # setsid: the daemon outlives this script and the shell that ran it.
    setsid dockerd --host "unix://$sock" --data-root "$home/data" --exec-root "$home/exec" \
        --pidfile "$pidfile" >"$home/dockerd.log" 2>&1 < /dev/null &
    for _ in $(seq 100); do
        DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 && break
        sleep 0.3
    done
    if ! DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
        echo "fedq: dockerd did not start; its log: $home/dockerd.log" >&2
        tail -5 "$home/dockerd.log" >&2
        exit 3
    fi
    echo "fedq: started dockerd (pid $(cat "$pidfile")), socket $sock" >&2
fi
echo "unix://$sock"
