"""Run a notebook the way the tests do, and refresh the outputs stored with it.

The notebooks are committed with their outputs, so that a reader sees the token views and the
plots on the repository page without running anything. The tests execute each notebook again,
on a copy in memory (nothing is written back). To refresh the stored outputs after changing a
notebook or the library, from the repository root::

    .venv/bin/python tests/notebook_run.py notebooks/quickstart.ipynb notebooks/rl_step.ipynb
    .venv/bin/python tests/notebook_run.py --timeout 3600 notebooks/learn.ipynb   # its full run: minutes

It runs each notebook top to bottom in a fresh kernel of this interpreter, from an empty
temporary folder, drops timings, writes paths inside the repository relative to its root (a
warning names the library file it came from), and refuses to store outputs that show any other
path of this machine, its host name or its user (say what the reader needs with relative paths
instead).
"""

from __future__ import annotations

import getpass
import json
import re
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

CELL_TIMEOUT_S = 300  # each notebook takes well under a minute on 2 CPU cores; this is for slow CI machines

# An absolute path of a machine: a Unix home, temp or system folder, a macOS or Windows user folder.
ABSOLUTE_PATH_RE = re.compile(
    r"(?<![\w.:/])(/(home|work|tmp|root|Users|private|var/folders|opt|usr/(local/)?lib|mnt|srv)/[^\s'\"<>]*"
    r"|[A-Za-z]:\\\\?(Users|Windows|Program Files)[^\s'\"<>]*)"
)


GENERIC_USERS = {"root", "user", "admin", "ubuntu", "debian", "runner", "jovyan", "vscode", "python", "node"}
"""Account names too common to tell a machine by (they also appear in ordinary text)."""


def _machine_words() -> list[str]:
    """This machine's host name and user name, where they are distinctive enough to look for:
    a host name with a digit or a hyphen (``gpu-node-3``, not a plain word that text may hold)
    and a user name that is not a generic account."""
    words = []
    host = socket.gethostname().split(".")[0]
    if len(host) >= 4 and any(c.isdigit() or c == "-" for c in host):
        words.append(host)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        user = ""
    if len(user) >= 4 and user.lower() not in GENERIC_USERS:
        words.append(user)
    return words


def output_texts(nb: Mapping[str, Any]) -> Iterator[tuple[int, str]]:
    """(cell index, text) of every text in the stored outputs (streams, tracebacks, text and HTML data)."""
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            for key in ("text", "traceback"):
                if key in out:
                    yield i, "".join(out[key]) if isinstance(out[key], list) else str(out[key])
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") or mime.endswith("+json") or mime.endswith("+xml"):
                    yield i, "".join(value) if isinstance(value, list) else json.dumps(value)


def machine_leaks(nb: Mapping[str, Any], words: list[str] | None = None) -> list[str]:
    """Where the outputs show an absolute path, or this machine's host or user name: ``cell N: ...``."""
    words = _machine_words() if words is None else words
    found = []
    for i, text in output_texts(nb):
        for m in ABSOLUTE_PATH_RE.finditer(text):
            found.append(f"cell {i}: absolute path {m.group()!r}")
        for word in words:
            if re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text):
                found.append(f"cell {i}: the machine's name {word!r}")
    return found


def execute(path: Path, workdir: Path, kernel_dir: Path, *, timeout: int = CELL_TIMEOUT_S) -> Any:
    """``path`` executed top to bottom in a fresh kernel running this interpreter, from ``workdir``;
    returns the notebook (nbformat) with its outputs. Raises ``CellExecutionError`` on the first
    failing cell. Timings are not recorded."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        startup_timeout=120,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": str(workdir)}},  # the kernel's working directory
    )
    try:
        client.execute()
    finally:
        # nbclient shuts down only a kernel it made itself: this one is ours to stop (a learn
        # notebook's kernel holds gigabytes and would live until the test process ends).
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return nb


def write_kernel(root: Path) -> Path:
    """A ``python3`` kernel spec under ``root`` whose kernel is the interpreter running this."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(root / "python3")  # argv: [sys.executable, "-m", "ipykernel_launcher", ...]
    return root


def relative_to_repository(nb: Any, root: Path) -> int:
    """Write paths inside the repository relative to its root in the outputs (a warning names the
    library file that raised it: ``recorder/learning.py:255:``, not where this checkout lives);
    returns how many texts changed."""
    prefix = str(root.resolve()) + "/"
    changed = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            for key in ("text", "traceback"):
                value = out.get(key)
                if isinstance(value, str) and prefix in value:
                    out[key], changed = value.replace(prefix, ""), changed + 1
                elif isinstance(value, list) and any(prefix in v for v in value):
                    out[key], changed = [v.replace(prefix, "") for v in value], changed + 1
    return changed


def refresh(path: Path, *, timeout: int = CELL_TIMEOUT_S) -> None:
    """Execute ``path`` and store it with its outputs (refused when they would show this machine)."""
    import nbformat

    with tempfile.TemporaryDirectory() as tmp:
        kernels = write_kernel(Path(tmp) / "kernels")
        work = Path(tmp) / "work"
        work.mkdir()
        nb = execute(path, work, kernels, timeout=timeout)
    relative_to_repository(nb, Path(__file__).resolve().parents[1])
    leaks = machine_leaks(nb)
    if leaks:
        raise SystemExit(f"{path}: not stored, its outputs show this machine:\n  " + "\n  ".join(leaks))
    nb.metadata.pop("widgets", None)
    nb.metadata["language_info"] = {"name": "python"}  # no interpreter version in the file
    nbformat.write(nb, path)
    size = path.stat().st_size
    print(f"{path}: stored with its outputs ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument(
        "--timeout", type=int, default=CELL_TIMEOUT_S,
        help="seconds per cell (learn.ipynb's training cell runs for minutes: e.g. --timeout 3600)",
    )
    args = parser.parse_args()
    for name in args.notebooks:
        refresh(name, timeout=args.timeout)
