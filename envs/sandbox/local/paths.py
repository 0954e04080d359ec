"""Where things are, inside and outside the local sandbox (shared by its modules)."""

from __future__ import annotations

import os
import shutil
import sys

from ..base import SandboxError

WORKDIR_INSIDE = "/workspace"
RUNDIR_INSIDE = "/sandbox"
INSIDE_UID = 1000
TMP_PREFIX = "tokengym-sandbox-"


def is_under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def python_prefix(python: str) -> str:
    """The installation directory to expose for ``python`` (``<prefix>/bin/python3.X`` -> ``<prefix>``)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))


def accessible(path: str, uid: int, gid: int, *, need: int = os.X_OK | os.R_OK) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) may reach and use ``path`` (by mode bits)."""

    def allowed(st: os.stat_result, bits: int) -> bool:
        mode = st.st_mode
        if uid == 0:
            return True
        if st.st_uid == uid:
            shift = 6
        elif st.st_gid == gid:
            shift = 3
        else:
            shift = 0
        have = (mode >> shift) & 7
        return (have & bits) == bits

    try:
        path = os.path.realpath(path)
        parts = path.split("/")
        for i in range(1, len(parts) - 1):
            d = "/".join(parts[: i + 1]) or "/"
            if not allowed(os.stat(d), 1):  # search permission on every ancestor
                return False
        return allowed(os.stat(path), need)
    except OSError:
        return False


def pick_python(uid: int, gid: int) -> str:
    """An interpreter the sandbox user can run: this one (its base install), else a system python3."""
    candidates = [
        getattr(sys, "_base_executable", None) or sys.executable,
        sys.executable,
        "/usr/bin/python3",
        "/usr/local/bin/python3",
        shutil.which("python3") or "",
    ]
    for c in candidates:
        if not c:
            continue
        real = os.path.realpath(c)
        if os.path.isfile(real) and accessible(real, uid, gid):
            return real
    raise SandboxError(
        "no Python interpreter that the sandbox user can run (this one lies under a private directory); "
        "install python3 under /usr or pass python=..."
    )
