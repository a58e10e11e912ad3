#!/usr/bin/env bash
# Builds fedq's images on this host: the coordinator, a worker per hardware class, and
# Redis, PostgreSQL and an S3 server (SeaweedFS) from Debian packages.
#
#   bash scripts/images.sh            build what is missing or out of date (Docker's layer
#                                     cache makes an unchanged image a no-op)
#
# For a host that reaches no container registry (this one): the base image is made
# with debootstrap from Debian's packages and `docker import`ed as fedq-debian:bookworm,
# and every Python package comes from a wheelhouse of the lock file
# (requirements/dev.lock) that the host's pip downloads once and a throwaway HTTP server
# on 127.0.0.1 serves to `docker build --network host`. Torch in a GPU image is then
# the build PyPI serves for its class (pins.toml's default_index: 2.7.1+cu126 for
# gpu_sm61, 2.14.1+cu130 for gpu_new), in the CPU images the lock's (2.14.1, a CUDA build:
# PyPI has no CPU-only Linux wheel); docs/deploy.md has the matrix. On a normal
# host, plain `docker build` with the Dockerfiles' defaults uses the public images
# and indexes instead.
set -euo pipefail
cd "$(dirname "$0")/.."
export DOCKER_HOST="${DOCKER_HOST:-$(bash scripts/docker-engine.sh)}"
cache="${FEDQ_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedq/images}"
mirror="${FEDQ_DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)}"
mirror="${mirror:-http://deb.debian.org/debian}"
python=.venv/bin/python
[ -x "$python" ] || bash scripts/bootstrap.sh  # a fresh clone: the host's pip and packaging
mkdir -p "$cache"

# 1. The base: Debian bookworm with Python 3.11, nothing more (every fedq image is made
#    from it; the services' images add their packages from the mirror with apt-get).
packages="python3,python3-venv,ca-certificates,procps"
base_tag="fedq-debian:bookworm-$(echo "$packages" | sha256sum | cut -c1-12)"
if ! docker image inspect "$base_tag" >/dev/null 2>&1; then
    echo "fedq: debootstrap of Debian bookworm from $mirror (about a minute)" >&2
    rootfs=$(mktemp -d "$cache/rootfs.XXXX")
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" \
        >"$cache/debootstrap.log" 2>&1 || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import -c 'CMD ["/bin/bash"]' - "$base_tag" >/dev/null
    rm -rf "$rootfs"; trap - EXIT
fi
docker tag "$base_tag" fedq-debian:bookworm

# 2. The wheelhouse: every wheel of the lock, downloaded by the host's pip.
wheels="$cache/wheels-$(sha256sum requirements/dev.lock | cut -c1-12)"
if [ ! -f "$wheels/.complete" ]; then
    echo "fedq: downloading the lock's wheels into $wheels" >&2
    # Markers evaluated for the images' Python, Debian bookworm's 3.11.2, not this
    # host's: some wheels apply only below 3.11.3 (async-timeout, say).
    log=$(mktemp); reqs=$(mktemp)
    "$python" - requirements/dev.lock > "$reqs" <<'PY'
import sys
from packaging.requirements import Requirement
env = {"python_version": "3.11", "python_full_version": "3.11.2", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}
for line in open(sys.argv[1]):
    if line[:1].isalnum():
        req = Requirement(line.strip())
        if req.marker is None or req.marker.evaluate(env):
            print(f"{req.name}{req.specifier}")
PY
    if ! "$python" -m pip download -q --no-deps -r "$reqs" -d "$wheels" >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2; rm -f "$log" "$reqs"; exit 1
    fi
    rm -f "$log" "$reqs"
    touch "$wheels/.complete"
fi
# 2b. A GPU class's image carries the build PyPI serves for its class (fedq/pins.toml's
#     default_index table: gpu_sm61 gets torch 2.7.1, the newest CUDA 12.6 wheel, whose
#     kernels start at sm_50); its wheels join the wheelhouse, resolved for the images'
#     Python (3.11, manylinux x86_64) and cached by version.
default_index() {  # class -> "torch torchvision" of its default_index pin, or nothing
    "$python" - "$1" <<'PY'
import sys, tomllib
pin = tomllib.load(open("fedq/pins.toml", "rb"))[sys.argv[1]].get("default_index")
print(f"{pin['torch']} {pin['torchvision']}" if pin else "")
PY
}
lock_torch=$(awk -F'==' '/^torch==/ {print $2}' requirements/dev.lock | cut -d' ' -f1)
for cls in gpu_new gpu_sm61; do
    read -r t tv <<<"$(default_index "$cls")"
    # the lock's own torch (gpu_new's) is in the wheelhouse already
    if [ -n "${t:-}" ] && [ "$t" != "$lock_torch" ] && [ ! -f "$wheels/.torch-$t" ]; then
        echo "fedq: downloading torch $t and torchvision $tv (with their CUDA wheels) for $cls" >&2
        log=$(mktemp)
        if ! "$python" -m pip download -q "torch==$t" "torchvision==$tv" -d "$wheels" \
                --python-version 3.11 --only-binary=:all: --platform manylinux_2_28_x86_64 \
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
                --platform manylinux1_x86_64 --platform linux_x86_64 >"$log" 2>&1; then
            grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; exit 1
        fi
        rm -f "$log"
        touch "$wheels/.torch-$t"
    fi
done
# A fixed port: the wheelhouse URL is a build argument, and Docker's layer cache keys
# on it, so a new port each run would rebuild every image.
port="${FEDQ_WHEELHOUSE_PORT:-47381}"
if "$python" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1',$port)) != 0)"; then
    echo "fedq: port $port is taken; set FEDQ_WHEELHOUSE_PORT to a free one" >&2; exit 3
fi
"$python" -m http.server --bind 127.0.0.1 --directory "$wheels" "$port" >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
torch=$(awk -F'==' '/^torch==/ {print $2}' requirements/dev.lock | cut -d' ' -f1)
torchvision=$(awk -F'==' '/^torchvision==/ {print $2}' requirements/dev.lock | cut -d' ' -f1)
offline=(--network host
         --build-arg BASE=fedq-debian:bookworm
         --build-arg PIP_NO_INDEX=1
         --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/"
         --build-arg "TORCH=$torch" --build-arg "TORCHVISION=$torchvision"
         # the same values for every class, so all images share one torch layer
         --build-arg PYTHON=3.11 --build-arg "TORCH_INDEX=http://127.0.0.1:$port/")

build() {  # tag dockerfile [extra args]
    local tag=$1 file=$2; shift 2
    local started=$SECONDS
    if ! docker build -q "${offline[@]}" "$@" -f "$file" -t "$tag" . >"$cache/build.log" 2>&1; then
        echo "fedq: building $tag failed; the end of its log:" >&2
        tail -30 "$cache/build.log" >&2
        exit 1
    fi
    echo "fedq: $tag built ($((SECONDS - started)) s)" >&2
}

docker image prune -f >/dev/null 2>&1 || true  # superseded builds
images=("${@:-coordinator worker-cpu worker-gpu_new worker-gpu_sm61 redis postgres seaweedfs}")
for name in ${images[*]}; do
    case $name in
        coordinator) build fedq-coordinator docker/Dockerfile.coordinator ;;
        worker-*)
            cls=${name#worker-}
            read -r t tv <<<"$(default_index "$cls")"
            if [ -n "${t:-}" ]; then  # PyPI's build for the class, and the image says so
                build "fedq-worker:$cls" "worker-images/Dockerfile.$cls" --build-arg "TORCH=$t" \
                    --build-arg "TORCHVISION=$tv" --build-arg TORCH_FROM=default_index
            else
                build "fedq-worker:$cls" "worker-images/Dockerfile.$cls"
            fi ;;
        redis|postgres|seaweedfs) build "fedq-$name" "docker/Dockerfile.$name" ;;
        *) echo "fedq: no image called $name" >&2; exit 2 ;;
    esac
done
