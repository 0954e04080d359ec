"""Running one command in a container: the wrapper inside it, the multiplexed stream, the status line."""

from __future__ import annotations

import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from .engine import docker_sdk
from .spec import SANDBOX_USER, WORKSPACE

GRACE_S = 3.0
"""How long past a command's timeout the client waits for the engine before giving up on it."""


# The wrapper every command runs in (dash; builtins only after the command, so that it still works
# when a fork bomb has used up the pids limit). $1: a nonce for the status line, $2: the timeout.
_WRAPPER = r"""
n=$1; t=$2; shift 2
oomk() {
  k=-
  for f in /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    if [ -r "$f" ]; then
      while read -r a b; do if [ "$a" = oom_kill ]; then k=$b; fi; done < "$f"
      break
    fi
  done
}
oomk; o1=$k
timeout -s KILL "$t" "$@"
rc=$?
kill -9 -1 2>/dev/null
kill -9 -1 2>/dev/null
oomk; o2=$k
printf '\036%s:%s:%s:%s\036' "$n" "$rc" "$o1" "$o2" >&2
exit $rc
"""

# write_file / read_file: walk the path one component at a time from the workspace and never follow
# a symlink (nothing else runs in the container between calls, so nothing can swap one in meanwhile).
# Exit codes: 2 no such file, 3 a symlink, 4 anything else.
_WALK = r"""
cd /workspace || exit 4
while [ $# -gt 1 ]; do
  if [ -L "$1" ]; then echo "$1 is a symlink; it is not followed" >&2; exit 3; fi
  if [ ! -e "$1" ] && [ "$op" = write ]; then mkdir -- "$1" || exit 4; fi
  if [ ! -e "$1" ]; then echo "no such file" >&2; exit 2; fi
  if [ ! -d "$1" ]; then echo "$1 is not a directory" >&2; exit 4; fi
  cd -P -- "$1" || exit 4
  shift
done
"""
WRITE = "op=write" + _WALK + r"""
if [ -d "$1" ] && [ ! -L "$1" ]; then echo "it is a directory" >&2; exit 4; fi
rm -f -- "$1" || exit 4
exec cat > "$1"
"""
READ = "op=read" + _WALK + r"""
if [ -L "$1" ]; then echo "it is a symlink; it is not followed" >&2; exit 3; fi
if [ ! -e "$1" ]; then echo "no such file" >&2; exit 2; fi
if [ ! -f "$1" ]; then echo "it is not a regular file" >&2; exit 4; fi
if [ -n "$max" ]; then exec head -c "$max" -- "$1"; fi
exec cat -- "$1"
"""
# Nothing of the sandbox user runs now: every call's wrapper killed what it left (or _kill_all did).
WIPE = r"""
chmod -R u+rwX /workspace /tmp /dev/shm 2>/dev/null
find /workspace /tmp /dev/shm /dev/mqueue -mindepth 1 -delete 2>/dev/null
ipcrm --all 2>/dev/null
[ -z "$(ls -A /workspace)" ] && [ -z "$(ls -A /tmp)" ] && [ -z "$(ls -A /dev/shm)" ]
"""


# ---------------------------------------------------------------------------------------------------
# Running one command


class _Output:
    """The head of a stream up to a limit, the number of bytes dropped, and a short tail."""

    def __init__(self, limit: int, tail: int = 0) -> None:
        self.limit = limit
        self.head = bytearray()
        self.total = 0
        self.tail_size = tail
        self.tail = bytearray()

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += data[:room]
        if self.tail_size:
            self.tail += data[-self.tail_size :]
            del self.tail[: -self.tail_size]


@dataclass
class Raw:
    """What one exec produced, before it is judged."""

    stdout: _Output
    stderr: _Output
    exit_code: int | None
    oom: bool
    timed_out: bool  # the client-side watchdog fired
    duration_s: float
    marker: bool  # the wrapper's status line was seen


class ExecFailed(Exception):
    """The engine did not run the exec (container gone, engine error)."""


def exec_in_container(
    client: Any,
    cid: str,
    argv: list[str],
    *,
    timeout_s: float,
    stdin: bytes | None,
    stdout_limit: int,
    stderr_limit: int,
    env: dict[str, str],
) -> Raw:
    docker = docker_sdk()
    api = client.api
    nonce = secrets.token_hex(6)
    cmd = ["/bin/sh", "-c", _WRAPPER, "tokengym", nonce, f"{timeout_s:.3f}", *argv]
    start = time.monotonic()
    deadline = start + timeout_s + GRACE_S
    try:
        exec_id = api.exec_create(
            cid, cmd, stdout=True, stderr=True, stdin=stdin is not None, user=SANDBOX_USER, environment=env, workdir=WORKSPACE
        )["Id"]
        res = api._post_json(
            api._url("/exec/{0}/start", exec_id),
            headers={"Connection": "Upgrade", "Upgrade": "tcp"},
            data={"Tty": False, "Detach": False},
            stream=True,
        )
        api._raise_for_status(res)
    except docker.errors.DockerException as e:
        raise ExecFailed(str(e)) from e
    except OSError as e:  # the engine went away, a request timed out
        raise ExecFailed(f"{type(e).__name__}: {e}") from e
    # The hijacked connection: read through http.client's buffered reader (it may hold the first
    # bytes already), write stdin to the socket underneath.
    fp = res.raw._fp.fp
    sock = fp.raw._sock if hasattr(fp.raw, "_sock") else fp.raw
    out = _Output(stdout_limit)
    err = _Output(stderr_limit + 64, tail=2048)
    timed_out = False
    writer = None
    if stdin is not None:

        def write() -> None:
            try:
                sock.sendall(stdin)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        writer = threading.Thread(target=write, daemon=True, name="tokengym-sandbox-stdin")
        writer.start()
    buf = bytearray()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            sock.settimeout(remaining)
            try:
                chunk = fp.read1(1 << 16)
            except TimeoutError:
                timed_out = True
                break
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            while len(buf) >= 8:
                kind, size = buf[0], struct.unpack(">I", buf[4:8])[0]
                if len(buf) < 8 + size:
                    break
                (out if kind == 1 else err).add(bytes(buf[8 : 8 + size]))
                del buf[: 8 + size]
    finally:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass
        res.close()
    duration = time.monotonic() - start

    # The wrapper's status line ends stderr: \x1e nonce:rc:oom-before:oom-after \x1e
    exit_code: int | None = None
    oom = marker = False
    tail = bytes(err.tail)
    tag = b"\x1e" + nonce.encode() + b":"
    at = tail.rfind(tag)
    if not timed_out and at >= 0 and tail.endswith(b"\x1e"):
        fields = tail[at + len(tag) : -1].decode(errors="replace").split(":")
        marker = True
        marker_len = len(tail) - at
        err.total -= marker_len
        err.tail = bytearray(tail[:at])
        del err.head[err.total :]
        try:
            exit_code = int(fields[0])
        except (ValueError, IndexError):
            exit_code = None
        try:
            oom = int(fields[2]) > int(fields[1])
        except (ValueError, IndexError):
            oom = False
    elif not timed_out:
        try:
            exit_code = api.exec_inspect(exec_id).get("ExitCode")
        except Exception:
            exit_code = None
    if len(err.head) > stderr_limit:
        del err.head[stderr_limit:]
    return Raw(out, err, exit_code, oom, timed_out, duration, marker)
