"""CI's own promises: it runs the README's test command, every promised machine part is
promised by it, the oldest-transformers pass names files that exist, and a failing step fails
its phase (and CI) however the phase is written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = (ROOT / ".ci" / "run").read_text()
INTEGRATIONS = (ROOT / ".ci" / "integrations.sh").read_text()
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readmes_test_command():
    block = re.search(r"# 2\. run the tests.*?\n(.+?)\n", README)
    assert block, "the README's second command is gone"
    assert block.group(1).strip() in RUN, f"{block.group(1)!r} is not what .ci/run runs"


def test_every_part_a_test_may_require_is_one_ci_promises():
    """A test that skips for a missing part fails instead where its variable is 1: CI must set it for
    every part it provides, or a broken install there passes as skips."""
    named = set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"\b(?:needs|requires|missing)\(\s*\"([A-Z0-9_]+)\"", text))
        named |= set(re.findall(r"TOKENGYM_REQUIRE_([A-Z0-9_]+)", text))
    named -= {"THING", "GADGET"}  # test_side_by_side.py's made-up parts
    promised = set(re.findall(r"TOKENGYM_REQUIRE_([A-Z0-9_]+)=1", RUN + INTEGRATIONS))
    assert {"DOCKER", "RAY", "SMOLLM2", "CGROUPS"} <= named
    assert named - promised == set(), "tests can require these, but CI does not promise them"


def test_the_oldest_transformers_pass_names_only_files_that_exist():
    listed = re.search(r"OLDEST_TRANSFORMERS_TESTS=\((.*?)\)", RUN, re.S)
    assert listed
    files = listed.group(1).split()
    assert len(files) >= 10 and all((ROOT / f).is_file() for f in files), [f for f in files if not (ROOT / f).is_file()]


def run_bash(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; cd {ROOT}; . .ci/lib.sh; {script}"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)},
    )  # fmt: skip


def test_a_phase_fails_on_its_first_failing_step(tmp_path):
    """A phase is a function of several steps: the first one that fails fails the phase and the
    run, even when a later step would succeed (bash drops -e inside `f || ...`, so phase may not)."""
    proc = run_bash("two() { false; echo second-step; }; phase 'two steps' two; echo unreachable", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "second-step" not in proc.stdout and "unreachable" not in proc.stdout
    assert "ci: two steps FAILED (exit 1)" in proc.stdout
    assert re.search(r"ci: two steps +\d+ s +FAILED", proc.stdout) and "ci: total" in proc.stdout


def test_phases_print_their_times_and_the_total(tmp_path):
    proc = run_bash("phase one true; phase 'two' sleep 1; ci_on_exit 'echo cleaned'", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^ci: one 0 s$", proc.stdout, re.M) and re.search(r"^ci: two [12] s$", proc.stdout, re.M)
    table = proc.stdout[proc.stdout.index("ci: ---- phases ----") :]
    assert re.search(r"ci: one +0 s +ok", table) and re.search(r"ci: total \d+ s \(exit 0\)", table)
    assert proc.stdout.rstrip().endswith("cleaned")
    assert not list(tmp_path.glob("tokengym-ci-phases.*")), "the phase file is removed at the end"
