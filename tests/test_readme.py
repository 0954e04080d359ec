"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

from tokengym.envs import ReplayEnv
from tokengym.policies import ScriptedPolicy
from tokengym.recorder import TrajectoryWriter, rollout

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 4


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
        exec(compile(block, "README.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "605" in out  # the example's trajectory length on Qwen3
    assert "1.0 True" in out  # the tool env example solved its task
    assert len(scope["trajs"]) == 2 and scope["verl"].tensors["input_ids"].shape[0] == 2
    # The subclass example is a working environment.
    env = scope["Echo"]("qwen2.5")
    obs, _ = env.reset(seed=0)
    *_, term, _, info = env.step([9707, 151645])
    assert info["messages"][0]["content"] == "You said: Hello"
