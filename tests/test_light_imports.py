"""Reading a store, listing envs and asking for help do not load the heavy libraries.

torch, transformers, Ray, docker and vLLM cost seconds and hundreds of MB to import; they load
where they are used (a policy built, a tensor layout made, a cluster started). Each probe runs
in a fresh interpreter and reports which of them ended up in ``sys.modules``. The time this
saves is measured by ``benchmarks/imports.py``; these tests only keep a regression visible.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "ray", "docker", "vllm")


def loaded_after(code: str) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter; the heavy modules it loaded and what it printed."""
    probe = textwrap.dedent(code) + textwrap.dedent(f"""
        import json as _json, sys as _sys
        _sys.stderr.write("HEAVY=" + _json.dumps([m for m in {HEAVY!r} if m in _sys.modules]) + "\\n")
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("HEAVY="))
    return json.loads(line.removeprefix("HEAVY=")), proc.stdout


@pytest.mark.parametrize(
    "module", ["tokengym.recorder.store", "tokengym.recorder", "tokengym.envs", "tokengym.policies"]
)
def test_importing_a_package_loads_no_heavy_library(module):
    heavy, _ = loaded_after(f"import {module}")
    assert heavy == [], f"import {module} loaded {heavy}: import them where they are used"


def test_cli_help_loads_no_heavy_library():
    # What the `tokengym` script runs (its entry point), with --help.
    heavy, out = loaded_after("""
        from tokengym.recorder.cli import main
        try:
            main(["--help"])
        except SystemExit as e:
            assert e.code == 0, e.code
    """)
    assert out.startswith("usage: tokengym")
    assert heavy == [], f"tokengym --help loaded {heavy}"


def test_the_probe_sees_torch_once_a_tensor_layout_is_built():
    # The check above can fail: building a packed batch is where torch loads.
    heavy, _ = loaded_after("""
        import numpy as np
        from tokengym.recorder import Segment, SegmentKind, Trajectory, to_packed
        t = Trajectory([Segment(SegmentKind.PROMPT, np.array([1, 2]), 0), Segment(SegmentKind.ACTION, np.array([3]), 0)])
        to_packed([t])
    """)
    assert "torch" in heavy


def test_reading_a_store_loads_neither_the_drivers_nor_the_policies():
    # tokengym.recorder re-exports its names lazily: the store alone pulls in only the recording.
    probe = """
        import sys
        import tokengym.recorder.store
        print(sorted(m for m in sys.modules if m.startswith(("tokengym.recorder.drivers", "tokengym.recorder.learning", "tokengym.policies"))))
    """
    _, out = loaded_after(probe)
    assert out.strip() == "[]", f"import tokengym.recorder.store loaded {out.strip()}"


def test_every_exported_recorder_name_resolves_to_its_module():
    # The lazy re-exports stay true: each name in __all__ is the object its module defines.
    _, out = loaded_after("""
        import importlib
        import tokengym.recorder as r
        wrong = [n for n in r.__all__ if getattr(r, n) is not getattr(importlib.import_module(r._EXPORTS[n], r.__name__), n)]
        missing = sorted(set(r.__all__) ^ set(r._EXPORTS))
        print(wrong, missing, "rollout" in dir(r))
    """)
    assert out.strip() == "[] [] True"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        import tokengym.recorder

        tokengym.recorder.not_a_name  # noqa: B018
