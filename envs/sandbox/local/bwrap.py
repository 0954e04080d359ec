"""Bubblewrap: finding it, a probe run that shows whether it really isolates here, and its argv."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..base import Limits, SandboxError
from .paths import INSIDE_UID, RUNDIR_INSIDE, WORKDIR_INSIDE, _python_prefix, _under
from .uids import _is_root

_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/mime.types",
)


def find_bwrap() -> str | None:
    """The ``bwrap`` executable on ``PATH`` (or in ``/usr/bin``), or ``None``."""
    return shutil.which("bwrap") or (shutil.which("bwrap", path="/usr/bin:/bin") if os.path.exists("/usr/bin") else None)


def _bwrap_version(bwrap: str) -> str:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or "bubblewrap"
    except (OSError, subprocess.SubprocessError):
        return "bubblewrap"


# --------------------------------------------------------------------- probe
@dataclass(frozen=True)
class BwrapStatus:
    """What a probe run of bubblewrap showed on this machine."""

    works: bool
    reason: str
    version: str = ""
    network: bool = False
    filesystem: bool = False


_PROBES: dict[tuple[str, bool], BwrapStatus] = {}
_PROBE_LOCK = threading.Lock()


def bwrap_status(bwrap: str | None = None) -> BwrapStatus:
    """Whether bubblewrap really works here (a probe run, cached per process): isolated network,
    host files hidden, ``/usr`` read-only. ``works`` is False with the reason when anything fails."""
    path = bwrap or find_bwrap()
    if path is None:
        return BwrapStatus(False, "bubblewrap (bwrap) is not installed")
    if not os.path.isfile(path):
        return BwrapStatus(False, f"no bubblewrap at {path}")
    key = (path, _is_root())
    with _PROBE_LOCK:
        if key not in _PROBES:
            _PROBES[key] = _probe(path)
        return _PROBES[key]


def _probe(bwrap: str) -> BwrapStatus:
    from .sandbox import LocalSandbox  # noqa: PLC0415  (the probe is a sandbox run)

    version = _bwrap_version(bwrap)
    try:
        sb = LocalSandbox(Limits(timeout_s=20), isolation="none", _bwrap_for_probe=bwrap)
    except SandboxError as err:
        return BwrapStatus(False, f"probe could not start: {err}", version)
    try:
        secret = os.path.join(sb.root, "run", "probe-secret")
        with open(secret, "w") as f:
            f.write("x")
        script = (
            f"cat /proc/net/dev; "
            f"if [ -e {secret} ]; then echo HOST-VISIBLE; fi; "
            f"if touch /usr/.tokengym-probe 2>/dev/null; then echo USR-WRITABLE; fi; "
            f"echo ok > probe.txt && echo PROBE-OK"
        )
        res = sb._exec_bwrap_probe(["/bin/sh", "-c", script])
    finally:
        sb.close()
    if res.status != "ok" or "PROBE-OK" not in res.stdout:
        why = (res.stderr or res.message or res.stdout).strip().splitlines()
        return BwrapStatus(False, f"bubblewrap is installed but does not run here: {why[-1] if why else res.status}", version)
    ifaces = [line.split(":")[0].strip() for line in res.stdout.splitlines() if ":" in line and "|" not in line]
    network = ifaces == ["lo"] or ifaces == []
    filesystem = "HOST-VISIBLE" not in res.stdout and "USR-WRITABLE" not in res.stdout
    if not (network and filesystem):
        return BwrapStatus(False, f"bubblewrap ran but did not isolate (interfaces {ifaces}, output {res.stdout[-200:]!r})", version)
    return BwrapStatus(True, "ok", version, network, filesystem)


def bwrap_argv(
    bwrap: str,
    *,
    run_dir: str,
    work_dir: str,
    tmp_dir: str,
    python: str,
    ro_binds: Sequence[str],
    limits: Limits,
) -> list[str]:
    """The bubblewrap prefix of one call: new namespaces, a read-only view of the system, the workspace."""
    a = [
        bwrap,
        "--die-with-parent",
        "--new-session",
        "--unshare-all",
        "--unshare-user",
        "--uid", str(INSIDE_UID),
        "--gid", str(INSIDE_UID),
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr",
    ]  # fmt: skip
    for p in _SYSTEM_LINKS:
        if os.path.islink(p):
            a += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            a += ["--ro-bind", p, p]
    for p in _ETC_FILES:
        if os.path.exists(p):
            a += ["--ro-bind", p, p]
    a += ["--ro-bind", os.path.join(run_dir, "etc", "passwd"), "/etc/passwd"]
    a += ["--ro-bind", os.path.join(run_dir, "etc", "group"), "/etc/group"]
    shown = ["/usr"]
    prefix = _python_prefix(python)
    if not any(_under(prefix, s) for s in shown):
        a += ["--ro-bind", prefix, prefix]
        shown.append(prefix)
    for p in ro_binds:
        if os.path.exists(p) and not any(_under(p, s) for s in shown):
            a += ["--ro-bind", p, p]
    a += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(limits.max_file_mb << 20), "--tmpfs", "/dev/shm",
        "--bind", work_dir, WORKDIR_INSIDE,
        "--bind", tmp_dir, "/tmp",
        "--ro-bind", run_dir, RUNDIR_INSIDE,
        "--remount-ro", "/dev",
        "--remount-ro", "/",  # bwrap's own root (a tmpfs in memory): nothing may be written there
        "--chdir", WORKDIR_INSIDE,
        "--",
    ]  # fmt: skip
    return a
