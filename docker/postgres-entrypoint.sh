#!/bin/sh
# Debian's PostgreSQL, set up on first start as the official image does: a cluster in
# $PGDATA owned by $POSTGRES_USER with its password (from $POSTGRES_PASSWORD_FILE or
# $POSTGRES_PASSWORD; never on a command line), the database $POSTGRES_DB, and password
# (scram) logins over the network. Its arguments go to the server (`-c ssl=on ...`).
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
user=${POSTGRES_USER:-postgres}
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
    POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE}"
    pwfile=$(mktemp)
    printf '%s' "$POSTGRES_PASSWORD" > "$pwfile"
    "$bin/initdb" -D "$PGDATA" -U "$user" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "listen_addresses = '*'" >> "$PGDATA/postgresql.conf"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    "$bin/pg_ctl" -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
    if [ "${POSTGRES_DB:-$user}" != postgres ]; then
        "$bin/createdb" -U "$user" "${POSTGRES_DB:-$user}"
    fi
    "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
    echo "postgres: initialised $PGDATA (user $user, database ${POSTGRES_DB:-$user})"
fi
exec "$bin/postgres" -D "$PGDATA" "$@"  # -c options (docker/postgres-tls.sh)
