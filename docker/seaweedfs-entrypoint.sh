#!/bin/bash
# SeaweedFS as fedq's S3 server, with one way in: its master, volume server, filer and
# S3 gateway listen on the container's loopback only (none of the first three asks for
# credentials), and socat publishes the S3 gateway, which checks every request's
# signature, on port 9000. The secret key comes from AWS_SECRET_ACCESS_KEY_FILE (a Docker
# secret) or AWS_SECRET_ACCESS_KEY; the access key from AWS_ACCESS_KEY_ID.
set -euo pipefail
if [ -n "${AWS_SECRET_ACCESS_KEY_FILE:-}" ]; then
    AWS_SECRET_ACCESS_KEY=$(cat "$AWS_SECRET_ACCESS_KEY_FILE")
    export AWS_SECRET_ACCESS_KEY
fi
: "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID}" "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY(_FILE)}"
weed server -dir=/data -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3 -s3.port=8333 \
    -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false -webdav=false &
socat TCP-LISTEN:9000,fork,reuseaddr TCP:127.0.0.1:8333 &
wait -n  # either one ending ends the container (its restart policy starts it again)
exit 1
