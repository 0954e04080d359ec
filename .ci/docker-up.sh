#!/usr/bin/env bash
# Start a private Docker engine for the sandbox tests and build the sandbox image in it.
#
#   bash .ci/docker-up.sh          # then:  . .ci-docker/env   (sets DOCKER_HOST)
#   bash .ci/docker-down.sh        # stops it and removes its state
#
# The engine is Debian's docker.io (installed with apt when no dockerd is on PATH). It gets a
# data root, exec root, pid file, socket and config of its own under $TOKENGYM_DOCKER_DIR
# (default: .ci-docker/ in the repo) and runs with --iptables=false --bridge=none, so it changes
# nothing in the host's networking (no docker0, no iptables rules; containers get only `lo`).
# It never touches /var/run/docker.sock or an engine already running there.
#
# Prints `export DOCKER_HOST=unix://...` and writes the same line to $TOKENGYM_DOCKER_DIR/env.
# Idempotent: when the private engine already answers, it is reused.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${TOKENGYM_DOCKER_DIR:-$ROOT/.ci-docker}
IMAGE=${TOKENGYM_SANDBOX_IMAGE:-tokengym-sandbox:bookworm}
START_TIMEOUT_S=${TOKENGYM_DOCKER_START_TIMEOUT_S:-60}

log() { echo "docker-up: $*" >&2; }

if [[ $(id -u) != 0 ]]; then
    log "must run as root (it installs packages and starts dockerd)"
    exit 1
fi

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
SOCK=$DIR/docker.sock
# A Unix socket path must fit in 108 bytes.
if (( ${#SOCK} > 100 )); then
    log "socket path $SOCK is too long for a Unix socket: set TOKENGYM_DOCKER_DIR to a shorter directory"
    exit 1
fi
touch "$DIR/.tokengym-docker"   # marks the directory as ours for docker-down.sh
export DOCKER_HOST=unix://$SOCK

# --- 1. the engine's packages ------------------------------------------------------------------
install_packages() {
    log "installing $* with apt"
    # Keep the package's maintainer scripts from starting a daemon with the default (bridge,
    # iptables) settings: a policy-rc.d that refuses every start, only if none is there.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added_policy=1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    if (( added_policy )); then rm -f "$policy"; fi
}

need=()
command -v dockerd >/dev/null || need+=(docker.io)
# The docker CLI is used below (docker.io ships one; a separately installed CLI also works).
command -v docker >/dev/null || need+=(docker.io)
if (( ${#need[@]} )); then install_packages docker.io; fi

# --- 2. the private engine ---------------------------------------------------------------------
engine_answers() { timeout 5 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

if engine_answers; then
    log "engine already answers at $SOCK"
else
    if [[ -f $DIR/dockerd.pid ]] && kill -0 "$(cat "$DIR/dockerd.pid")" 2>/dev/null; then
        log "dockerd $(cat "$DIR/dockerd.pid") runs but does not answer: stop it with .ci/docker-down.sh"
        exit 1
    fi
    mkdir -p "$DIR/data" "$DIR/exec"
    # Its own (empty) config, so that /etc/docker/daemon.json on the host changes nothing here.
    echo '{}' >"$DIR/daemon.json"
    log "starting dockerd (data root $DIR/data, socket $SOCK)"
    # setsid: the daemon outlives this script and is not killed with its process group;
    # docker-down.sh stops it by its pid file.
    setsid dockerd \
        --config-file "$DIR/daemon.json" \
        --data-root "$DIR/data" \
        --exec-root "$DIR/exec" \
        --pidfile "$DIR/dockerd.pid" \
        --host "unix://$SOCK" \
        --iptables=false \
        --ip-masq=false \
        --bridge=none \
        --userland-proxy=false \
        --log-level=warn \
        </dev/null >"$DIR/dockerd.log" 2>&1 &
    for ((i = 0; i < START_TIMEOUT_S * 5; i++)); do
        engine_answers && break
        sleep 0.2
    done
    if ! engine_answers; then
        log "dockerd did not answer within ${START_TIMEOUT_S}s; the end of its log:"
        tail -n 30 "$DIR/dockerd.log" >&2 || true
        exit 1
    fi
    log "engine $(docker version --format '{{.Server.Version}}') is up"
fi

# --- 3. the sandbox image ----------------------------------------------------------------------
TOKENGYM_SANDBOX_IMAGE=$IMAGE TOKENGYM_IMAGE_CACHE=${TOKENGYM_IMAGE_CACHE:-$DIR/cache} \
    bash "$ROOT/.ci/sandbox-image.sh"

echo "export DOCKER_HOST=$DOCKER_HOST" >"$DIR/env"
echo "export DOCKER_HOST=$DOCKER_HOST"
