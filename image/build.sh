#!/usr/bin/env bash
# Builds the container image with podman where no container registry is reachable: `make image-test` runs
# this, then tests/image_smoke.py. It owns the host side of the build only (packages, the local base image,
# the wheels, the podman settings); what the image contains is the Dockerfile's business.
#
#   1. podman, runc and mmdebstrap from Debian, installed when missing (apt-get; needs root);
#   2. the base image: Debian bookworm with python3, python3-venv and passwd, made by mmdebstrap and
#      `podman import`ed as $BASE_IMAGE (kept between runs; REBUILD_BASE=1 makes it again);
#   3. the proxy and its dependencies as wheels, built with the host's pip (which trusts the host's CA bundle)
#      into image/wheels/, so the image build itself needs no network: the Dockerfile's WHEELS build argument;
#   4. `podman build` of the Dockerfile with BASE=$BASE_IMAGE, tagged $IMAGE.
#
# podman runs with --runtime runc and the containers.conf written to $WORK/containers.conf (cgroupfs, no
# default ulimits), through CONTAINERS_CONF: nothing on the machine is configured beyond the packages.
# Timings go to $WORK/build-times (read by the smoke test's report).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$ROOT/build/image}
IMAGE=${IMAGE:-localhost/mcp-tasks-proxy:image-test}
BASE_IMAGE=${BASE_IMAGE:-localhost/mcp-tasks-proxy-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
WHEELS=image/wheels

log() { printf 'image-test: %s\n' "$*" >&2; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

mkdir -p "$WORK"
: >"$WORK/build-times"

# --- 1. packages ------------------------------------------------------------------------------------------
missing=()
for tool in podman runc mmdebstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
    [[ $(id -u) == 0 ]] || { log "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"; exit 1; }
    log "installing ${missing[*]} from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- podman settings for this sandbox, by file, for this process tree only -----------------------------
cat >"$WORK/containers.conf" <<'EOF'
# Written by image/build.sh for `make image-test`; podman reads it through CONTAINERS_CONF.
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
EOF
export CONTAINERS_CONF=$WORK/containers.conf
podman() { command podman --runtime runc "$@"; }

# --- 2. the base image ------------------------------------------------------------------------------------
if [[ ${REBUILD_BASE:-0} == 1 ]] || ! podman image exists "$BASE_IMAGE"; then
    log "making $BASE_IMAGE with mmdebstrap ($SUITE, $MIRROR)"
    start=$(now)
    rm -f "$WORK/base.tar"
    # merged-usr hook: /usr merged by the hook, not by the usrmerge package (which would pull in all of perl).
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,passwd \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --format=tar "$SUITE" "$WORK/base.tar" "$MIRROR"
    previous=$(podman image inspect --format '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || true)
    podman import --quiet --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$BASE_IMAGE" >/dev/null
    [[ -z $previous ]] || podman image rm "$previous" >/dev/null 2>&1 || true  # unless an image still uses it
    rm -f "$WORK/base.tar"
    echo "base_seconds $(elapsed "$start" "$(now)")" >>"$WORK/build-times"
else
    log "reusing $BASE_IMAGE (REBUILD_BASE=1 makes it again)"
fi

# --- 3. wheels, built on the host -------------------------------------------------------------------------
# The base's Python must accept them: the host and the base are the same Debian release (CPython 3.11).
base_python=$(podman run --rm --network none "$BASE_IMAGE" python3 -c 'import sys; print(*sys.version_info[:2], sep=".")')
host_python=$("$PYTHON" -c 'import sys; print(*sys.version_info[:2], sep=".")')
[[ $base_python == "$host_python" ]] || { log "the base has Python $base_python, the host $host_python: the wheels would not fit"; exit 1; }
log "building wheels of the proxy and its dependencies into $WHEELS"
start=$(now)
rm -rf "${ROOT:?}/$WHEELS"
"$PYTHON" -m pip wheel -qq --wheel-dir "$ROOT/$WHEELS" "$ROOT"
rm -rf "$ROOT/build/lib" "$ROOT/build/bdist."*  # what setuptools leaves behind when it builds the proxy's wheel
echo "wheels_seconds $(elapsed "$start" "$(now)")" >>"$WORK/build-times"

# --- 4. the image -----------------------------------------------------------------------------------------
log "podman build $IMAGE (BASE=$BASE_IMAGE, WHEELS=$WHEELS)"
previous=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
start=$(now)
podman build --quiet --layers=false --format docker --network none --build-arg "BASE=$BASE_IMAGE" --build-arg "WHEELS=$WHEELS" \
    --tag "$IMAGE" "$ROOT" >/dev/null
echo "build_seconds $(elapsed "$start" "$(now)")" >>"$WORK/build-times"
[[ -z $previous ]] || podman image rm "$previous" >/dev/null 2>&1 || true  # the last run's, now untagged
echo "image_bytes $(podman image inspect --format '{{.Size}}' "$IMAGE")" >>"$WORK/build-times"
log "built $IMAGE"
