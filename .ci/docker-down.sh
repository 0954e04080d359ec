#!/usr/bin/env bash
# Stop the private Docker engine that .ci/docker-up.sh started and remove its state.
#
#   bash .ci/docker-down.sh            # keeps $DIR/cache (the image's root file system tarball)
#   bash .ci/docker-down.sh --purge    # removes that too
#
# Safe: it only acts on a directory that docker-up.sh marked as its own, stops the daemon by its
# pid file (never by name), unmounts whatever the engine left mounted under the directory, and
# deletes with --one-file-system only when no mount is left under it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${TOKENGYM_DOCKER_DIR:-$ROOT/.ci-docker}
PURGE=0
[[ ${1:-} == --purge ]] && PURGE=1

log() { echo "docker-down: $*" >&2; }

if [[ ! -d $DIR ]]; then
    log "nothing to do: no $DIR"
    exit 0
fi
DIR=$(cd "$DIR" && pwd)
if [[ $DIR == / || ! -f $DIR/.tokengym-docker ]]; then
    log "$DIR is not a directory made by docker-up.sh; leaving it alone"
    exit 1
fi
export DOCKER_HOST=unix://$DIR/docker.sock

# --- 1. containers, then the daemon --------------------------------------------------------------
if [[ -f $DIR/dockerd.pid ]]; then
    PID=$(cat "$DIR/dockerd.pid")
    if [[ $PID =~ ^[0-9]+$ ]] && kill -0 "$PID" 2>/dev/null && [[ $(cat "/proc/$PID/comm" 2>/dev/null) == dockerd ]]; then
        # Every container of this private engine (the tests' leftovers, if any) goes first.
        ids=$(timeout 20 docker ps -aq 2>/dev/null || true)
        if [[ -n $ids ]]; then
            log "removing $(echo "$ids" | wc -l) container(s)"
            # shellcheck disable=SC2086
            timeout 60 docker rm -f $ids >/dev/null 2>&1 || true
        fi
        log "stopping dockerd $PID"
        kill -TERM "$PID" 2>/dev/null || true
        for ((i = 0; i < 150; i++)); do
            kill -0 "$PID" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$PID" 2>/dev/null; then
            log "dockerd $PID did not stop in 30 s: killing it"
            kill -KILL "$PID" 2>/dev/null || true
            sleep 1
        fi
    fi
fi
# The containerd that dockerd supervised writes its own pid file under the exec root.
for pidfile in "$DIR"/exec/containerd/containerd.pid "$DIR"/exec/containerd/*.pid; do
    [[ -f $pidfile ]] || continue
    PID=$(cat "$pidfile")
    if [[ $PID =~ ^[0-9]+$ ]] && kill -0 "$PID" 2>/dev/null && [[ $(cat "/proc/$PID/comm" 2>/dev/null) == containerd* ]]; then
        log "stopping containerd $PID"
        kill -TERM "$PID" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do kill -0 "$PID" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$PID" 2>/dev/null || true
    fi
done

# --- 2. mounts the engine left under the directory (overlays, netns, shm), deepest first ----------
mounts_under() { awk -v d="$DIR/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r; }
for m in $(mounts_under); do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
left=$(mounts_under)
if [[ -n $left ]]; then
    log "mounts are still there under $DIR; not deleting anything:"
    echo "$left" >&2
    exit 1
fi

# --- 3. the state -----------------------------------------------------------------------------------
for entry in "$DIR"/* "$DIR"/.[!.]*; do
    [[ -e $entry || -L $entry ]] || continue
    case $(basename "$entry") in
        cache) (( PURGE )) || continue ;;
        .tokengym-docker) continue ;;
    esac
    rm -rf --one-file-system "$entry"
done
(( PURGE )) && rm -f "$DIR/.tokengym-docker" && rmdir "$DIR" 2>/dev/null
log "stopped; state removed from $DIR"
