"""Running one command of a local sandbox: capped pipes, the deadline, killing what it leaves, the verdict."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import threading
import time
from typing import Any

from ..base import (
    DISK_FULL_HINTS,
    OOM_HINTS,
    ExecResult,
    Limits,
    Status,
    disk_full_message,
    oom_message,
    quota_message,
    signal_message,
)
from .cgroups import Cgroup
from .quota import usage
from .uids import kill_by_marker, kill_uid

_DRAIN_GRACE_S = 0.5  # after the main process ends (or is killed): how long pipes may stay open
_READ_CHUNK = 1 << 16
_WATCH_EVERY_S = 0.2  # how often the quota watchdog measures the workspace during a call


class Call:
    """One running command: its process, and whether it was killed for the time limit."""

    def __init__(self, proc: subprocess.Popen[bytes], marker: str) -> None:
        self.proc = proc
        self.marker = marker
        self.killed = False
        self.baseline: tuple[int, int] | None = None
        """The workspace's (bytes, files) when the call started (watchdog quota only)."""
        self.over_quota = False


def killpg(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


class Runner:
    """The part of :class:`LocalSandbox` that runs one call and judges what it did."""

    limits: Limits
    _lock: threading.Lock
    _calls: set[Call]
    _starting: int
    _use_bwrap: bool
    _own_uid: int | None
    _cgroup: Cgroup | None
    _watched: Any  # LocalSandbox's: () -> (paths, max bytes, max files) | None

    def _check_quota(self, call: Call) -> bool:
        """Watchdog: True (and the call killed) when the workspace went past its quota and grew
        during this call (a call that only deletes is never stopped)."""
        watched = self._watched()
        if watched is None or call.baseline is None:
            return False
        paths, max_bytes, max_files = watched
        used, files = usage(paths, max_bytes=max_bytes, max_files=max_files)
        over = (used > max_bytes and used > call.baseline[0]) or (files > max_files and files > call.baseline[1])
        if over and not call.over_quota:
            call.over_quota = True
            self._kill_call(call)
        return over

    def _communicate(
        self, call: Call, stdin: str | None, deadline: float
    ) -> tuple[bytes, bytes, tuple[int, int], bool]:
        proc = call.proc
        cap = self.limits.max_output_bytes
        bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
        drop = dict.fromkeys(bufs, 0)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        pending = b""
        stdin_fd = None
        if proc.stdin is not None:
            pending = (stdin or "").encode("utf-8", "surrogateescape")
            stdin_fd = proc.stdin.fileno()
            if pending:
                os.set_blocking(stdin_fd, False)
                sel.register(stdin_fd, selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
                stdin_fd = None
        pidfd = None
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            pidfd = None
        exited = False
        timed_out = False
        drain_until: float | None = None
        next_watch = time.monotonic() + _WATCH_EVERY_S if call.baseline is not None else None
        try:
            while True:
                open_pipes = sum(1 for fd in bufs if fd in sel.get_map())
                if not open_pipes and (exited or pidfd is None):
                    break
                now = time.monotonic()
                if not exited and not timed_out and now >= deadline:
                    timed_out = True
                    call.killed = True
                    self._kill_call(call)
                    drain_until = time.monotonic() + _DRAIN_GRACE_S
                if drain_until is not None and now >= drain_until:
                    break
                if next_watch is not None and not exited and now >= next_watch:
                    if self._check_quota(call):
                        next_watch = None
                        drain_until = time.monotonic() + _DRAIN_GRACE_S
                    else:
                        next_watch = time.monotonic() + _WATCH_EVERY_S
                limit = (drain_until if drain_until is not None else deadline) - now
                if pidfd is None and not exited:
                    limit = min(limit, 0.01)
                if next_watch is not None and not exited:
                    limit = min(limit, max(0.0, next_watch - now))
                for key, _ in sel.select(timeout=max(0.0, limit)):
                    fd = key.fd
                    if fd == pidfd:
                        sel.unregister(pidfd)
                        exited = True
                        self._after_exit(call)
                        drain_until = time.monotonic() + _DRAIN_GRACE_S
                    elif fd == stdin_fd:
                        try:
                            n = os.write(fd, pending[:_READ_CHUNK])
                            pending = pending[n:]
                        except (BrokenPipeError, OSError):
                            pending = b""
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()  # type: ignore[union-attr]
                            stdin_fd = None
                    else:
                        try:
                            chunk = os.read(fd, _READ_CHUNK)
                        except BlockingIOError:
                            continue
                        except OSError:
                            chunk = b""
                        if not chunk:
                            sel.unregister(fd)
                            continue
                        buf = bufs[fd]
                        room = cap - len(buf)
                        if room > 0:
                            buf += chunk[:room]
                        drop[fd] += max(0, len(chunk) - max(room, 0))
                if pidfd is None and not exited and proc.poll() is not None:
                    exited = True
                    drain_until = time.monotonic() + _DRAIN_GRACE_S
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            if not exited or timed_out:
                self._kill_call(call)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                killpg(proc)
                proc.wait()
            for f in (proc.stdout, proc.stderr, proc.stdin):
                if f is not None:
                    try:
                        f.close()
                    except OSError:
                        pass
        fds = list(bufs)
        return bytes(bufs[fds[0]]), bytes(bufs[fds[1]]), (drop[fds[0]], drop[fds[1]]), timed_out

    def _kill_call(self, call: Call) -> None:
        """Kill one call's processes: its process group (and, without bwrap, its leftovers)."""
        killpg(call.proc)
        if not self._use_bwrap and not self._own_uid:
            kill_by_marker(call.marker)

    def _after_exit(self, call: Call) -> None:
        """The main process has exited (not yet reaped): kill what it left in the background,
        so that nothing keeps the output pipes open."""
        killpg(call.proc)  # under bwrap: the outer bwrap; the pid namespace takes the rest with it
        if self._use_bwrap:
            return
        if self._own_uid is None:
            kill_by_marker(call.marker)
            return
        with self._lock:
            alone = self._calls == {call} and not self._starting
        if alone:  # (with other calls running, the last one to finish sweeps)
            kill_uid(self._own_uid)

    def _finish(self, call: Call) -> None:
        with self._lock:
            self._calls.discard(call)
            last = not self._calls and not self._starting  # a call starting now sweeps when it ends
        if last and self._own_uid is not None and not self._use_bwrap:
            # nothing of this sandbox may outlive its last running call (nor, as zombies, hold
            # its process limit against the next call)
            kill_uid(self._own_uid, zombies_at_most=self.limits.max_processes // 4)
        if last and self._cgroup is not None and not self._use_bwrap:
            self._cgroup.kill_all()  # whatever left the process group and changed its environment

    def _result(
        self,
        rc: int | None,
        out: bytes,
        err: bytes,
        dropped: tuple[int, int],
        timed_out: bool,
        duration: float,
        timeout: float,
        *,
        oom: bool = False,
        over_quota: bool = False,
    ) -> ExecResult:
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        status: Status
        sig: int | None = None
        if rc is not None and rc < 0:
            sig = -rc
        elif rc is not None and 128 < rc <= 128 + 64 and (rc - 128) in _SIGNAL_NUMBERS:
            sig = rc - 128  # bubblewrap and shells report a child killed by signal N as 128 + N
        if over_quota:
            status, code = "killed", rc
            message = quota_message(self.limits)
        elif timed_out:
            status, code = "timeout", None
            message = f"timed out after {timeout:g} s; the process and its children were killed"
        elif oom:  # the memory cgroup's OOM killer ended a process of this call
            status, code = "oom", rc
            message = oom_message(self.limits)
        elif self._use_bwrap and rc == 1 and stderr.startswith("bwrap:"):
            status, code = "crashed", rc
            message = f"the sandbox failed to start: {stderr.strip().splitlines()[0]}"
        elif rc == 0:
            status, code, message = "ok", 0, ""
        elif any(h in stderr[-2048:] for h in OOM_HINTS) and sig in (None, signal.SIGKILL, signal.SIGABRT, signal.SIGSEGV):
            status, code = "oom", rc
            message = oom_message(self.limits)
        elif sig is not None:
            status, code = "killed", rc
            message = signal_message(sig, self.limits)
        elif any(h in stderr[-2048:] for h in DISK_FULL_HINTS):
            status, code = "error", rc
            message = disk_full_message(self.limits, rc)
        else:
            status, code = "error", rc
            message = f"exited with code {rc}"
        return ExecResult(
            status, code, stdout, stderr, duration, stdout_dropped=dropped[0], stderr_dropped=dropped[1], message=message
        )


_SIGNAL_NUMBERS = {int(s) for s in signal.Signals}
