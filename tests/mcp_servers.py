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
import venv
from pathlib import Path

PINS = Path(__file__).parent / "mcp_pins"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokengym" / "mcp-servers"

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


def _locked_install(folder: Path, install) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    done = folder / ".installed"
    if done.exists():
        return folder
    with open(CACHE / ".lock", "w") as lock:
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


def install_pypi(name: str) -> Path:
    pin_file, script = PYPI[name]
    pins = PINS / pin_file

    def install(folder: Path) -> None:
        venv.create(folder, with_pip=True)
        pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--require-hashes", "--only-binary", ":all:", "-r", str(pins)], f"pip install -r {pins.name}")

    folder = _locked_install(CACHE / f"{name}-{_key(pins)}", install)
    return folder / "bin" / script


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


def server_command(name: str) -> list[str]:
    """The argv that starts server ``name`` over stdio, installing it on first use (or skipping)."""
    from needs import missing

    try:
        if name in PYPI:
            return [str(install_pypi(name))]
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
    sys.exit(0)
