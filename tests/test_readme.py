"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


def test_readme_examples_run(capsys):
    scope: dict = {}
    for block in BLOCKS:
        exec(compile(block, "README.md", "exec"), scope)
    out = capsys.readouterr().out
    assert "605" in out  # the example's trajectory length on Qwen3
    # The subclass example is a working environment.
    env = scope["Echo"]("qwen2.5")
    obs, _ = env.reset(seed=0)
    *_, term, _, info = env.step([9707, 151645])
    assert info["messages"][0]["content"] == "You said: Hello"
