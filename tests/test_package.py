"""The package's face: its version (from the installed metadata), ``tokengym --version``, ``py.typed``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from tokengym.recorder.cli import main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PARTS = sorted(PYPROJECT["tool"]["setuptools"]["package-dir"])


def test_the_installed_metadata_is_this_checkout():
    # An editable install of an older pyproject would make every version check below vacuous.
    assert version("tokengym") == PYPROJECT["project"]["version"]


@pytest.mark.parametrize("part", PARTS)
def test_each_part_gives_the_namespace_its_version(part):
    # tokengym has no __init__: whichever part is imported first, tokengym.__version__ works.
    code = f"import {part}, tokengym; print({part}.__version__, tokengym.__version__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [PYPROJECT["project"]["version"]] * 2


def test_other_missing_attributes_still_raise():
    import tokengym
    import tokengym.envs

    with pytest.raises(AttributeError, match="no_such_name"):
        tokengym.envs.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="no_such_name"):
        tokengym.no_such_name  # noqa: B018


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"tokengym {PYPROJECT['project']['version']}\n"


def test_every_part_is_marked_typed():
    # PEP 561: each portion of a namespace package carries its own marker (it covers its subpackages).
    dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for part in PARTS:
        assert (ROOT / dirs[part] / "py.typed").is_file(), f"{dirs[part]}/py.typed is missing"
        assert "py.typed" in data.get(part, []), f'pyproject package-data of "{part}" does not ship py.typed'
