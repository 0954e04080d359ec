#!/usr/bin/env bash
# Build the Docker sandbox image (default tokengym-sandbox:bookworm) in the engine that DOCKER_HOST
# (or the default socket) names, without any registry: a minimal Debian bookworm with python3 from
# debootstrap, imported with `docker import`. Does nothing when the image is already there.
#
#   bash .ci/sandbox-image.sh                 # as root (debootstrap needs it); ~40 s
#   TOKENGYM_SANDBOX_IMAGE=name:tag bash .ci/sandbox-image.sh
#
# The root file system is cached as a tarball in $TOKENGYM_IMAGE_CACHE (if set), so a second
# build after the engine's state was wiped takes seconds.
set -euo pipefail

IMAGE=${TOKENGYM_SANDBOX_IMAGE:-tokengym-sandbox:bookworm}
CACHE=${TOKENGYM_IMAGE_CACHE:-}
SUITE=${TOKENGYM_SANDBOX_SUITE:-bookworm}
# The user the sandbox runs as (the DockerSandbox default is 1000:1000, this image's `sandbox`).
SANDBOX_UID=1000

log() { echo "sandbox-image: $*" >&2; }

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "image $IMAGE is there"
    exit 0
fi

# The machine's configured Debian mirror (deb.debian.org when none is found).
mirror() {
    if [[ -n ${TOKENGYM_DEBIAN_MIRROR:-} ]]; then echo "$TOKENGYM_DEBIAN_MIRROR"; return; fi
    local uri
    uri=$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- '-security' | head -n1 || true)
    if [[ -z $uri ]]; then
        uri=$(grep -hsE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' | grep -v -- '-security' | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tokengym-rootfs.XXXXXX")
cleanup() {
    # debootstrap may leave /proc or /sys mounted inside the root on failure.
    for m in $(awk -v d="$WORK/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
        umount -l "$m" 2>/dev/null || true
    done
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

TARBALL=
if [[ -n $CACHE ]]; then
    mkdir -p "$CACHE"
    TARBALL=$CACHE/rootfs-$SUITE.tar
fi

if [[ -n $TARBALL && -s $TARBALL ]]; then
    log "using the cached root file system $TARBALL"
else
    if [[ $(id -u) != 0 ]]; then log "debootstrap needs root"; exit 1; fi
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap with apt"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    fi
    ROOTFS=$WORK/rootfs
    log "debootstrap --variant=minbase --include=python3 $SUITE from $(mirror) (~40 s)"
    if ! debootstrap --variant=minbase --include=python3 "$SUITE" "$ROOTFS" "$(mirror)" >"$WORK/debootstrap.log" 2>&1; then
        log "debootstrap failed; the end of its log:"
        tail -n 30 "$WORK/debootstrap.log" >&2
        [[ -f $ROOTFS/debootstrap/debootstrap.log ]] && tail -n 30 "$ROOTFS/debootstrap/debootstrap.log" >&2
        exit 1
    fi
    # Strip caches and documentation (nothing in the sandbox needs them).
    rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* \
        "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
        "$ROOTFS"/usr/share/locale/* "$ROOTFS"/debootstrap
    find "$ROOTFS/usr/lib" -name __pycache__ -type d -prune -exec rm -rf {} +
    # The unprivileged user the code runs as; its home is the workspace (a tmpfs at run time).
    echo "sandbox:x:$SANDBOX_UID:$SANDBOX_UID:tokengym sandbox:/workspace:/bin/sh" >>"$ROOTFS/etc/passwd"
    echo "sandbox:x:$SANDBOX_UID:" >>"$ROOTFS/etc/group"
    echo "sandbox:*:19000:0:99999:7:::" >>"$ROOTFS/etc/shadow"
    mkdir -p "$ROOTFS/workspace"
    chown "$SANDBOX_UID:$SANDBOX_UID" "$ROOTFS/workspace"
    TARBALL=${TARBALL:-$WORK/rootfs.tar}
    tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.part" . && mv "$TARBALL.part" "$TARBALL"
fi

log "importing $IMAGE"
docker import \
    --change "USER $SANDBOX_UID:$SANDBOX_UID" \
    --change "WORKDIR /workspace" \
    --change "ENV HOME=/workspace PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1" \
    --change 'CMD ["sleep", "infinity"]' \
    --change "LABEL org.tokengym.sandbox-image=$SUITE" \
    "$TARBALL" "$IMAGE" >/dev/null
log "image $IMAGE: $(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
