"""The README's measured numbers are the ones its scripts printed.

A number the README quotes from a benchmark or a notebook run is read here from that run's stored
output (``benchmarks/results/*.json``, written by the script's ``--json``, or the outputs stored
with the notebook) and must appear in the README as the script printed it. Re-running a script
and storing its output without updating the README (or the reverse) fails this test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _readme() -> str:
    return re.sub(r"\s+", " ", (ROOT / "README.md").read_text(encoding="utf-8"))


def _notebook_text(name: str) -> str:
    nb = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))
    return "".join(
        "".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])
    )


def _one(pattern: str, text: str, what: str) -> re.Match:
    found = re.findall(pattern, text)
    assert len(found) == 1, f"{what}: expected one match of {pattern!r} in the stored output, found {len(found)}"
    return re.search(pattern, text)  # type: ignore[return-value]


def learn_claim() -> str:
    """The README's sentence on ``learn.ipynb``, built from the notebook's stored outputs."""
    out = _notebook_text("learn.ipynb")
    per_iteration = _one(r"(\d+\.\d) s per iteration \(", out, "time per iteration").group(1)
    total = int(_one(r"\n(\d+) s in all\n", out, "total time").group(1))
    iterations = int(_one(r"(\d+) iterations; mean of the first", out, "iterations").group(1))
    held = _one(
        r"held-out accuracy on all (\d+) questions: (\d\.\d\d) before training -> (\d\.\d\d) after \d+ updates; "
        r"on the (\d+) of them training never asked: (\d\.\d\d) -> (\d\.\d\d)",
        out, "held-out accuracy",
    ).groups()
    fmt = _one(r"format_ok\s+(\d\.\d+) -> (\d\.\d+)", out, "format rate").groups()
    reward = _one(r"\n  reward\s+(\d\.\d+) -> (\d\.\d+)", out, "reward").groups()
    return (
        f"It is stored with the outputs of its {iterations}-iteration run on 2 CPU cores ({per_iteration} s per "
        f"iteration, {total} s in all, about {round(total / 60)} minutes): held-out greedy accuracy {held[1]} -> "
        f"{held[2]} on its {held[0]} held-out questions, {held[4]} -> {held[5]} on the {held[3]} of them that "
        f"training never asked, format rate {float(fmt[0]):.2f} -> {float(fmt[1]):.2f} and mean reward "
        f"{float(reward[0]):.2f} -> {float(reward[1]):.2f} over the training samples (first 3 vs last 3 iterations)."
    )


def observation_claim() -> str:
    """The README's step-cost sentence, from ``benchmarks/observation_tokens.py --json``'s stored run."""
    stored = json.loads((RESULTS / "observation_tokens.json").read_text(encoding="utf-8"))
    res = max(stored["results"], key=lambda r: r["turns"])
    step = res["methods"]["step(default)"]
    return (
        f"at {res['turns']} turns, is {step['baseline_over_this']:.0f}x faster than re-rendering the whole "
        f"conversation each turn (mean per turn; {step['baseline_over_this_last_quarter']:.0f}x in the last quarter), "
        f"measured turn by turn side by side (`python benchmarks/observation_tokens.py --json "
        f"benchmarks/results/observation_tokens.json`)"
    )


def scale_claim() -> str:
    """The README's driver-cost sentence, from ``benchmarks/scale.py --json``'s stored run."""
    stored = json.loads((RESULTS / "scale.json").read_text(encoding="utf-8"))
    by_size = {r["in_flight"]: r for r in stored["sizes"]}
    at, small, large = by_size[1000], by_size[min(by_size)], by_size[max(by_size)]
    met = all(g["met"] for g in stored["goals"])
    return (
        f"the local driver, the recorder and the env cost {at['rollout_ms_per_turn']:.2f} ms of CPU per turn at "
        f"1,000 episodes in flight, {at['ratio_to_bare']:.2f}x the env's bare `step` loop "
        f"({small['rollout_ms_per_turn']:.2f} ms at {small['in_flight']:,} in flight, "
        f"{large['rollout_ms_per_turn']:.2f} ms at {large['in_flight']:,}), building an env costs "
        f"{at['build_ms_per_env']:.1f} ms, and an episode in flight keeps "
        f"{stored['memory']['bytes_per_token']:.0f} bytes per context token "
        f"(`python benchmarks/scale.py --json benchmarks/results/scale.json`"
        + ("" if met else "; it exits 1: the goals of 0.5 ms, 1.5x, flat within 1.2x and 16 B are not all met")
        + ")"
    )


def kills_claim() -> str:
    """docs/sandboxes.md's sentence on what killed runs leave, from ``benchmarks/sandbox_kills.py --json``."""
    runs = json.loads((RESULTS / "sandbox_kills.json").read_text(encoding="utf-8"))
    parts = []
    for r in runs:
        left = ", ".join(f"{v} {k}" for k, v in r["after_next_run"].items())
        parts.append(f"{r['backend']}: {r['sandboxes_made']} sandboxes in {r['kills']} SIGKILLed runs, {left} left after the next run")
    return (
        "Measured (`python benchmarks/sandbox_kills.py --json benchmarks/results/sandbox_kills.json`): "
        + "; ".join(parts) + "."
    )


def test_the_sandbox_docs_quote_the_stored_kill_run():
    expected = kills_claim()
    doc = re.sub(r"\s+", " ", (ROOT / "docs" / "sandboxes.md").read_text(encoding="utf-8"))
    assert expected in doc, f"docs/sandboxes.md should say (from the stored output):\n{expected}"


@pytest.mark.parametrize("claim", [learn_claim, observation_claim, scale_claim], ids=lambda f: f.__name__)
def test_the_readme_quotes_the_stored_run(claim):
    expected = claim()
    assert expected in _readme(), f"README.md should say (from the stored output):\n{expected}"


def test_a_changed_number_is_caught(monkeypatch):
    readme = _readme()
    expected = observation_claim()
    changed = re.sub(r"is (\d+)x faster", lambda m: f"is {int(m.group(1)) + 1}x faster", expected)
    assert changed != expected and changed not in readme
