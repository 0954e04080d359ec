"""The suite's own machinery: ``alone`` tests under two workers, each worker's thread share,
``@requires`` and ``missing``.

A small suite of its own runs in a subprocess with ``-n 2`` and the same hooks
(:mod:`side_by_side`); every test writes when it ran, and the intervals show whether an ``alone``
test overlapped any other (they must not) and whether the others ran side by side (they must,
or the check proves nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from needs import missing, required

HERE = Path(__file__).resolve().parent

SUITE = '''
import os, time
import pytest

LOG = os.environ["SIDE_BY_SIDE_LOG"]

def span(name, seconds=0.4):
    start = time.monotonic()
    time.sleep(seconds)
    with open(LOG, "a") as f:
        f.write(f"{name} {start} {time.monotonic()}\\n")

@pytest.mark.parametrize("i", range(8))
def test_together(i):
    span(f"together{i}")

@pytest.mark.alone
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    span(f"alone{i}")

@pytest.mark.requires("THING", "the thing is not here")
def test_needs_a_thing():
    pass

def test_a_worker_has_its_share_of_the_cores_for_threads():
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))
'''


def run_suite(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list]:
    (tmp_path / "conftest.py").write_text(
        "from side_by_side import _alone_or_side_by_side, pytest_configure, pytest_runtest_setup, pytest_unconfigure\n"
    )
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: x\n    requires(what, reason): x\n")
    log, tmp = tmp_path / "spans.log", tmp_path / "tmp"
    tmp.mkdir()
    # This run's own world: none of an outer run's workers, locks or promises; its own TMPDIR.
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("TOKENGYM_REQUIRE_", "TOKENGYM_PYTEST_", "PYTEST_XDIST", "PYTEST_ADDOPTS"))
                and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    full_env.update({"PYTHONPATH": str(HERE), "SIDE_BY_SIDE_LOG": str(log), "TMPDIR": str(tmp), **(env or {})})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, env=full_env, timeout=300,
    )  # fmt: skip
    spans = [(n, float(a), float(b)) for n, a, b in (line.split() for line in log.read_text().splitlines())] if log.exists() else []
    return proc, spans


def overlaps(a: tuple, b: tuple) -> bool:
    return a[1] < b[2] and b[1] < a[2]


def test_alone_tests_overlap_no_other_test_and_the_rest_run_side_by_side(tmp_path):
    proc, spans = run_suite(tmp_path, "-n", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "11 passed, 1 skipped" in proc.stdout and "the thing is not here" in proc.stdout, proc.stdout[-2000:]
    assert len(spans) == 10
    alone = [s for s in spans if s[0].startswith("alone")]
    together = [s for s in spans if s[0].startswith("together")]
    for a in alone:
        assert not [s[0] for s in spans if s is not a and overlaps(a, s)], f"{a[0]} ran beside another test: {spans}"
    assert any(overlaps(a, b) for i, a in enumerate(together) for b in together[i + 1 :]), (
        f"the other tests never ran side by side, so the check above proves nothing: {spans}"
    )
    assert not list((tmp_path / "tmp").glob("tokengym-pytest-locks-*")), "the run left its lock files behind"


def test_a_promised_thing_that_is_missing_fails_instead_of_skipping(tmp_path):
    proc, _ = run_suite(tmp_path, "-k", "needs_a_thing", env={"TOKENGYM_REQUIRE_THING": "1"})
    assert proc.returncode == 1 and "1 error" in proc.stdout, proc.stdout[-2000:]  # failed in set-up
    assert "TOKENGYM_REQUIRE_THING=1, but the thing is not here" in proc.stdout


def test_missing_skips_unless_the_run_promises_it(monkeypatch):
    monkeypatch.delenv("TOKENGYM_REQUIRE_GADGET", raising=False)
    assert not required("GADGET")
    with pytest.raises(pytest.skip.Exception, match="no gadget"):
        missing("GADGET", "no gadget")
    monkeypatch.setenv("TOKENGYM_REQUIRE_GADGET", "1")
    with pytest.raises(pytest.fail.Exception, match="TOKENGYM_REQUIRE_GADGET=1, but no gadget"):
        missing("GADGET", "no gadget")
