"""The README's and the guide's Python examples run as written, and the README stays one short page."""

from __future__ import annotations

import re
from pathlib import Path

from tokengym.envs import ReplayEnv
from tokengym.policies import ScriptedPolicy
from tokengym.recorder import TrajectoryWriter, rollout

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDE = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README + GUIDE, flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 4


def test_the_readme_is_one_short_page_with_the_story_and_where_to_go():
    lines = README.splitlines()
    assert len(lines) < 150
    (example,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(example.strip().splitlines()) <= 15
    assert "# 1. install and run the main job" in README and "# 2. run the tests" in README
    table = [line for line in lines[lines.index("## Where to go next"):] if line.startswith("| ")]
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", "\n".join(table))
    assert len(table) > 8 and links
    for path, anchor in links:  # every link leads somewhere, anchors included
        target = ROOT / path
        assert target.is_file(), path
        if anchor:
            headings = {_anchor(h) for h in re.findall(r"^#+ (.*)$", target.read_text(encoding="utf-8"), re.M)}
            assert anchor in headings, f"{path}#{anchor}: no such heading"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_examples_run(capsys, tmp_path, monkeypatch, qwen25):
    # The store the README reads from, as `tokengym rollout ... --out runs/a` would write it.
    monkeypatch.chdir(tmp_path)
    with TrajectoryWriter("runs/a", tokenizer=qwen25) as writer:
        rollout(
            lambda: ReplayEnv(qwen25, max_turns=2), ScriptedPolicy(lambda c: [9707, 151645]),
            episodes=2, on_episode=writer.write, progress=False,
        )
    scope: dict = {}
    for block in BLOCKS:
        exec(compile(block, "README.md or docs/guide.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "605" in out  # the example's trajectory length on Qwen3
    assert "1.0 True" in out  # the tool env example solved its task
    assert len(scope["trajs"]) == 2 and scope["verl"].tensors["input_ids"].shape[0] == 2
    # The subclass example is a working environment.
    env = scope["Echo"]("qwen2.5")
    obs, _ = env.reset(seed=0)
    *_, term, _, info = env.step([9707, 151645])
    assert info["messages"][0]["content"] == "You said: Hello"
