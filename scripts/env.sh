#!/usr/bin/env bash
# Writes the coordinator's settings for its compose stack:
#   docker/.env        docker/env.example, with variables set in the environment overriding
#                      the example's values (the address, the ports);
#   docker/secrets/    one file per secret, random passwords: redis_password,
#                      postgres_password, s3_password, flower_password, and the URLs the
#                      fedq services read (broker_url, result_backend, database_url). The
#                      folder is mode 700 (root only on the host); the files are 644 so that
#                      each service's own user can read the ones mounted into it.
#
#   bash scripts/env.sh                              # the defaults, random passwords
#   FEDQ_BIND=100.64.0.1 REDIS_PORT=6380 bash scripts/env.sh
#
# Existing files are kept (their passwords are the stack's): remove them to start over.
# A variable of docker/env.example set in the environment (a port taken on this host)
# is written into an existing docker/.env too. A placeholder password (change-me...,
# from an older docker/.env or secret file) is never kept: a random one replaces it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docker/.env
placeholder() { case "$1" in *change-me*) return 0 ;; *) return 1 ;; esac; }
if [ -e "$out" ]; then
    changed=""
    tmp=$(mktemp docker/.env.XXXXXX)
    trap 'rm -f "$tmp"' EXIT
    while IFS= read -r line; do
        case "$line" in
            ""|\#*) printf '%s\n' "$line" ;;
            *=*) name=${line%%=*}
                 if grep -q "^$name=" docker/env.example && [ -n "${!name:-}" ] \
                         && [ "${!name}" != "${line#*=}" ]; then
                     printf '%s=%s\n' "$name" "${!name}"; changed="$changed $name"
                 else
                     printf '%s\n' "$line"
                 fi ;;
            *) printf '%s\n' "$line" ;;
        esac
    done < "$out" > "$tmp"
    if [ -n "$changed" ]; then
        chmod --reference="$out" "$tmp" 2>/dev/null || chmod 600 "$tmp"
        mv "$tmp" "$out"
        echo "fedq: $out exists; set$changed in it from the environment" >&2
    else
        rm -f "$tmp"
        echo "fedq: $out exists; keeping it (remove it and docker/secrets/ to start over)" >&2
    fi
    trap - EXIT
else
    umask 077
    tmp=$(mktemp docker/.env.XXXXXX)
    trap 'rm -f "$tmp"' EXIT
    while IFS= read -r line; do
        case "$line" in
            ""|\#*) printf '%s\n' "$line" ;;
            *=*) name=${line%%=*}; printf '%s=%s\n' "$name" "${!name:-${line#*=}}" ;;
        esac
    done < docker/env.example > "$tmp"
    mv "$tmp" "$out"
    trap - EXIT
    echo "fedq: wrote $out" >&2
fi
dir=$(awk -F= '$1 == "SECRETS_DIR" {print $2}' "$out")
case "${dir:=./secrets}" in /*) ;; *) dir="docker/${dir#./}" ;; esac
mkdir -p "$dir" && chmod 700 "$dir"
made=0
secret() {  # name value: write the file unless it exists (and is no placeholder)
    if [ -e "$dir/$1" ]; then
        placeholder "$(cat "$dir/$1")" || return 0
        echo "fedq: $dir/$1 held a placeholder password; writing a random one" >&2
    fi
    umask 022; printf '%s' "$2" > "$dir/$1.tmp" && mv "$dir/$1.tmp" "$dir/$1"
    made=$((made + 1))
}
for name in redis postgres s3 flower; do
    # a docker/.env from before secrets were files holds the stack's passwords: keep them
    # (never a placeholder, which anyone who read the repository knows)
    old=$(awk -F= -v k="$(echo "$name" | tr a-z A-Z)_PASSWORD" '$1 == k {print $2}' "$out")
    if placeholder "$old"; then
        echo "fedq: $out's ${name} password is a placeholder; writing a random one" >&2
        old=""
    fi
    secret "${name}_password" "${old:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
done
# The URLs the services use inside the compose network (service names, container ports).
secret broker_url "redis://:$(cat "$dir/redis_password")@redis:6379/0"
secret result_backend "redis://:$(cat "$dir/redis_password")@redis:6379/1"
secret database_url "postgresql+psycopg://fedq:$(cat "$dir/postgres_password")@postgres:5432/fedq"
echo "fedq: $dir holds the stack's secrets ($made written, the rest kept)" >&2
