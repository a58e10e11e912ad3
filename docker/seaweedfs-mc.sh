#!/bin/bash
# The one `mc` command docker/compose.yaml's healthcheck runs against MinIO, for the
# SeaweedFS stand-in: `mc ready local [--insecure]` exits 0 once the S3 port answers.
# The address is MC_HOST_local's (MinIO's client reads it too), http://localhost:9000
# by default; --insecure skips the https certificate check, as mc's flag does.
set -euo pipefail
[ "${1:-}" = ready ] && [ "${2:-}" = local ] || { echo "mc (stand-in): only 'mc ready local' is here" >&2; exit 2; }
insecure=0
for arg in "${@:3}"; do [ "$arg" = --insecure ] && insecure=1; done
exec python3 - "${MC_HOST_local:-http://localhost:9000}" "$insecure" <<'PY'
import ssl, sys, urllib.error, urllib.parse, urllib.request
url, insecure = sys.argv[1], sys.argv[2] == "1"
parts = urllib.parse.urlsplit(url)
host = parts.hostname + (f":{parts.port}" if parts.port else "")  # no credentials
context = ssl._create_unverified_context() if insecure else ssl.create_default_context()
try:
    urllib.request.urlopen(f"{parts.scheme}://{host}/", timeout=3, context=context)
except urllib.error.HTTPError:
    pass  # an S3 error answer: the server is up
PY
