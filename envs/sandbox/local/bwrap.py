"""Bubblewrap: finding it, what a probe found, and its argv.

The probe itself (:func:`~tokengym.envs.sandbox.local.sandbox.bwrap_status`) is a sandbox run, so it
lives with :class:`~tokengym.envs.sandbox.local.sandbox.LocalSandbox`, which asks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from ..base import Limits
from .paths import INSIDE_UID, RUNDIR_INSIDE, WORKDIR_INSIDE, python_prefix, is_under

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


def bwrap_version(bwrap: str) -> str:
    """What ``bwrap --version`` says (``"bubblewrap"`` when it says nothing)."""
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
    prefix = python_prefix(python)
    if not any(is_under(prefix, s) for s in shown):
        a += ["--ro-bind", prefix, prefix]
        shown.append(prefix)
    a += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(limits.max_file_mb << 20), "--tmpfs", "/dev/shm",
        "--bind", work_dir, WORKDIR_INSIDE,
        "--bind", tmp_dir, "/tmp",
        "--ro-bind", run_dir, RUNDIR_INSIDE,
    ]  # fmt: skip
    for p in ro_binds:  # after /tmp: a host path under /tmp stays visible over the sandbox's own /tmp
        if os.path.exists(p) and not any(is_under(p, s) for s in shown):
            a += ["--ro-bind", p, p]
    a += [
        "--remount-ro", "/dev",
        "--remount-ro", "/",  # bwrap's own root (a tmpfs in memory): nothing may be written there
        "--chdir", WORKDIR_INSIDE,
        "--",
    ]  # fmt: skip
    return a
