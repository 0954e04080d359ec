"""Where things are, inside and outside the local sandbox (shared by its modules)."""

from __future__ import annotations

import os

WORKDIR_INSIDE = "/workspace"
RUNDIR_INSIDE = "/sandbox"
INSIDE_UID = 1000
TMP_PREFIX = "tokengym-sandbox-"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def _python_prefix(python: str) -> str:
    """The installation directory to expose for ``python`` (``<prefix>/bin/python3.X`` -> ``<prefix>``)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))
