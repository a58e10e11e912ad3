#!/bin/bash
# SeaweedFS as fedq's S3 server, with one way in: its master, volume server, filer and
# S3 gateway listen on the container's loopback only (none of the first three asks for
# credentials), and socat publishes the S3 gateway, which checks every request's
# signature, on port 9000. The secret key comes from AWS_SECRET_ACCESS_KEY_FILE (a Docker
# secret) or AWS_SECRET_ACCESS_KEY; the access key from AWS_ACCESS_KEY_ID.
#
# It takes MinIO's arguments, so that docker/compose.yaml's lines serve both images:
#   server DIR [--address A] [--console-address A] [--certs-dir DIR | -S DIR]
# With a certificates folder holding public.crt and private.key (MinIO's names), port
# 9000 speaks https only (socat ends TLS; plain http gets no answer). The rest of
# MinIO's options are accepted and ignored.
set -euo pipefail
certs=
while [ $# -gt 0 ]; do
    case "$1" in
        --certs-dir|-S) certs=${2:?--certs-dir needs a folder}; shift 2 ;;
        --certs-dir=*) certs=${1#*=}; shift ;;
        --address|--console-address) shift 2 ;;
        *) shift ;;  # "server", the data folder (this image keeps its data in /data)
    esac
done
if [ -n "${AWS_SECRET_ACCESS_KEY_FILE:-}" ]; then
    AWS_SECRET_ACCESS_KEY=$(cat "$AWS_SECRET_ACCESS_KEY_FILE")
    export AWS_SECRET_ACCESS_KEY
fi
: "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID}" "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY(_FILE)}"
weed server -dir=/data -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3 -s3.port=8333 \
    -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false -webdav=false &
if [ -n "$certs" ]; then
    for f in public.crt private.key; do
        [ -r "$certs/$f" ] || { echo "seaweedfs-entrypoint: $certs/$f is missing or unreadable" >&2; exit 1; }
    done
    socat "OPENSSL-LISTEN:9000,fork,reuseaddr,cert=$certs/public.crt,key=$certs/private.key,verify=0" \
        TCP:127.0.0.1:8333 &
else
    socat TCP-LISTEN:9000,fork,reuseaddr TCP:127.0.0.1:8333 &
fi
wait -n  # either one ending ends the container (its restart policy starts it again)
exit 1
