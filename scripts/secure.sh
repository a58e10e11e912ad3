#!/usr/bin/env bash
# Identity, least privilege and TLS for the coordinator's compose stack
# (docker/compose.secure.yaml; docs/deploy.md, "The stack with identity and TLS"):
#
#   bash scripts/env.sh && bash scripts/secure.sh [WORKER...]
#
# Makes docker/pki with `fedq provision` (a CA; the services' certificate for `redis`,
# `postgres` and `s3`, their names inside the compose network, and FEDQ_BIND, where the CLI
# and the workers reach them; the coordinator's client certificate; one per WORKER) and adds to the
# secrets folder what the secure stack mounts:
#   tls_ca, server_tls_cert, server_tls_key (Redis, PostgreSQL, S3 and the dashboard's),
#   coordinator_tls_cert, coordinator_tls_key
#   broker_url_tls, result_backend_tls   rediss:// URLs with the coordinator's certificate
#   control_database_url                 the control worker's own database role (not the
#                                        schema owner), with a random password that the
#                                        stack's `roles` service sets, over TLS
#   owner_database_url                   env.sh's database_url, over TLS
# Existing files are kept; run it again with more WORKER names to add their certificates
# (docker/pki/workers/NAME/: copy that folder to the worker's machine).
set -euo pipefail
cd "$(dirname "$0")/.."
env=${FEDQ_ENV_FILE:-docker/.env}  # another stack's settings file (the deploy tests')
if [ ! -e "$env" ]; then
    echo "fedq: $env is missing: run bash scripts/env.sh first" >&2
    exit 1
fi
get() { awk -F= -v k="$1" '$1 == k {print $2}' "$env"; }
bind=$(get FEDQ_BIND)
dir=$(get SECRETS_DIR)
case "${dir:=./secrets}" in /*) ;; *) dir="docker/${dir#./}" ;; esac
pki=${FEDQ_PKI_DIR:-docker/pki}
args=(--host redis --host postgres --host s3 --host "${bind:-127.0.0.1}")
for name in "$@"; do args+=(--worker "$name"); done
mkdir -p "$pki" && chmod 700 "$pki"
if command -v fedq >/dev/null; then
    fedq provision "$pki" "${args[@]}"
elif [ -x .venv/bin/fedq ]; then
    .venv/bin/fedq provision "$pki" "${args[@]}"
else  # fedq from the coordinator's image (bash scripts/images.sh, or compose build)
    docker run --rm --user "$(id -u):$(id -g)" -v "$(cd "$pki" && pwd):/pki" \
        fedq-coordinator fedq provision /pki "${args[@]}"
fi
made=0
put() {  # name source: a copy each service's own user can read (the folder is root's)
    [ -e "$dir/$1" ] && return
    cp "$2" "$dir/$1.tmp" && chmod 644 "$dir/$1.tmp" && mv "$dir/$1.tmp" "$dir/$1"
    made=$((made + 1))
}
text() {  # name value
    [ -e "$dir/$1" ] && return
    umask 022; printf '%s' "$2" > "$dir/$1.tmp" && mv "$dir/$1.tmp" "$dir/$1"
    made=$((made + 1))
}
put tls_ca "$pki/ca.crt"
put server_tls_cert "$pki/server/server.crt"
put server_tls_key "$pki/server/server.key"
put coordinator_tls_cert "$pki/coordinator/client.crt"
put coordinator_tls_key "$pki/coordinator/client.key"
tls="ssl_cert_reqs=required&ssl_ca_certs=/run/secrets/tls_ca"
tls="$tls&ssl_certfile=/run/secrets/coordinator_tls_cert&ssl_keyfile=/run/secrets/coordinator_tls_key"
password=$(cat "$dir/redis_password")
text broker_url_tls "rediss://:$password@redis:6379/0?$tls"
text result_backend_tls "rediss://:$password@redis:6379/1?$tls"
pg_tls="sslmode=verify-full&sslrootcert=/run/secrets/tls_ca"
role_password=$(od -An -N18 -tx1 /dev/urandom | tr -d ' \n')
text control_database_url "postgresql+psycopg://fedq_control:$role_password@postgres:5432/fedq?$pg_tls"
text owner_database_url "$(cat "$dir/database_url")?$pg_tls"
echo "fedq: $pki holds the CA and certificates; $dir the secure stack's secrets ($made written, the rest kept)" >&2
