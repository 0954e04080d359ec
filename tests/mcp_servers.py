"""The real MCP servers the tests talk to, installed from the package registries, pinned.

Each PyPI server gets a venv of its own (as ``uvx``/``pipx`` would give it: ``mcp-server-sqlite``
needs the 1.x SDK, the tests the 2.x one), installed with ``pip --require-hashes`` from the
hash-pinned files in ``tests/mcp_pins/``; the npm server comes from ``npm ci`` on the committed
lock file (every package's integrity checked). They live in the user cache, keyed by the pin
file's hash, and are installed once (a file lock keeps side-by-side test workers from racing).

``python tests/mcp_servers.py`` installs them all (CI's "mcp servers" phase); a test calls
:func:`server_command`, which installs on first use, or skips (fails where CI promises
``TOKENGYM_REQUIRE_MCP``) when a registry or npm is out of reach.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

PINS = Path(__file__).parent / "mcp_pins"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokengym" / "mcp-servers"
SHARED_CACHE = Path(tempfile.gettempdir()) / "tokengym-mcp-servers"
"""Where the servers a sandbox's own uid runs are installed (readable by every user)."""

PYPI = {"time": ("time.txt", "mcp-server-time"), "sqlite": ("sqlite.txt", "mcp-server-sqlite")}
"""Server name -> (pin file, console script)."""
NPM = {"everything": "node_modules/@modelcontextprotocol/server-everything/dist/index.js"}
"""Server name -> its entry point under the npm folder (run with ``node``)."""


class ServerInstallError(RuntimeError):
    pass


def _key(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _locked_install(folder: Path, install, cache: Path = CACHE) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    done = folder / ".installed"
    if done.exists():
        return folder
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        try:
            install(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        done.write_text("ok\n")
    return folder


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=900)
    if proc.returncode != 0:
        raise ServerInstallError(f"{what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}")


def install_pypi(name: str, *, any_user: bool = False) -> Path:
    """The server's console script. ``any_user``: a venv of the system's ``/usr/bin/python3`` in a
    folder every user can read (under the temp directory), for a local sandbox that runs as a uid
    of its own, which cannot reach this user's cache or interpreter (under a 0700 ``/root``)."""
    pin_file, script = PYPI[name]
    pins = PINS / pin_file
    system = "/usr/bin/python3"
    if any_user and not os.path.exists(system):
        raise ServerInstallError(f"{system} is not installed (the sandboxed servers' interpreter)")

    def install(folder: Path) -> None:
        if any_user:
            _run([system, "-m", "venv", str(folder)], f"{system} -m venv")
        else:
            venv.create(folder, with_pip=True)
        pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--require-hashes", "--only-binary", ":all:", "-r", str(pins)], f"pip install -r {pins.name}")
        if any_user:
            shutil.copy(Path(__file__).with_name("mcp_fault_server.py"), folder / "mcp_fault_server.py")
            for root, dirs, files in os.walk(folder):  # whatever this process's umask made
                for d in dirs:
                    os.chmod(os.path.join(root, d), 0o755)
                for f in files:
                    path = os.path.join(root, f)
                    if not os.path.islink(path):
                        os.chmod(path, os.stat(path).st_mode | 0o444)

    cache = SHARED_CACHE if any_user else CACHE
    key = _key(pins, Path(__file__).with_name("mcp_fault_server.py")) if any_user else _key(pins)
    folder = _locked_install(cache / f"{name}-{key}", install, cache)
    return folder / "bin" / script


def any_user_fault_server() -> list[str]:
    """The fault server's argv in the ``any_user`` time-server venv (its SDK is the 2.x one)."""
    from needs import missing

    try:
        folder = install_pypi("time", any_user=True).parent.parent
    except (ServerInstallError, OSError, subprocess.TimeoutExpired) as err:
        missing("MCP", f"the sandboxed MCP servers cannot be installed here: {err}")
        raise
    return [str(folder / "bin" / "python"), str(folder / "mcp_fault_server.py")]


def install_npm() -> Path:
    lock = PINS / "npm" / "package-lock.json"
    package = PINS / "npm" / "package.json"
    npm = shutil.which("npm")
    if npm is None:
        raise ServerInstallError("npm is not installed (apt-get install npm)")

    def install(folder: Path) -> None:
        folder.mkdir(parents=True)
        shutil.copy(package, folder / "package.json")
        shutil.copy(lock, folder / "package-lock.json")
        _run([npm, "ci", "--silent", "--no-audit", "--no-fund", "--ignore-scripts"], "npm ci", cwd=folder)

    return _locked_install(CACHE / f"npm-{_key(package, lock)}", install)


def server_command(name: str, *, any_user: bool = False) -> list[str]:
    """The argv that starts server ``name`` over stdio, installing it on first use (or skipping).
    ``any_user``: a PyPI server installed where a sandbox's own uid can run it."""
    from needs import missing

    try:
        if name in PYPI:
            return [str(install_pypi(name, any_user=any_user))]
        folder = install_npm()
        node = shutil.which("node")
        if node is None:
            raise ServerInstallError("node is not installed")
        return [node, str(folder / NPM[name]), "stdio"]
    except (ServerInstallError, OSError, subprocess.TimeoutExpired) as err:
        missing("MCP", f"the MCP server {name!r} cannot be installed here: {err}")
        raise


if __name__ == "__main__":
    for n in PYPI:
        print(n, install_pypi(n), flush=True)
    print("everything", install_npm() / NPM["everything"], flush=True)
    print("time (any user)", install_pypi("time", any_user=True), flush=True)
    sys.exit(0)
