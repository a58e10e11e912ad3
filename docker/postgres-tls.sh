#!/bin/sh
# PostgreSQL with TLS for docker/compose.secure.yaml, in either image (the official
# postgres image, or fedq-postgres from Debian's package): the server's certificate and
# key copied where only PostgreSQL's user reads them (it refuses a key others can read),
# and a pg_hba.conf that refuses every TCP login without TLS.
set -eu
dir=/tmp/fedq-tls
mkdir -p "$dir"
cp /run/secrets/server_tls_cert "$dir/server.crt"
cp /run/secrets/server_tls_key "$dir/server.key"
chmod 600 "$dir/server.key"
printf '%s\n' "local all all trust" "hostnossl all all all reject" \
    "hostssl all all all scram-sha-256" > "$dir/pg_hba.conf"
set -- -c ssl=on -c "ssl_cert_file=$dir/server.crt" -c "ssl_key_file=$dir/server.key" \
    -c "hba_file=$dir/pg_hba.conf"
if command -v docker-entrypoint.sh >/dev/null; then  # the official image, as root
    chown -R postgres:postgres "$dir"
    exec docker-entrypoint.sh postgres "$@"
fi
exec /usr/local/bin/postgres-entrypoint.sh "$@"  # fedq-postgres, as its postgres user
