"""The notebooks in notebooks/ run top to bottom, and are stored with the outputs of a full run.

A reader on the repository page sees the token views and the plots without running anything;
the tests still execute every notebook. Each is run with nbclient in a fresh kernel that runs
*this* interpreter (so it imports the tokengym under test, whatever other kernels are installed
on the machine), from a temporary working directory, with a time limit per cell, on a copy in
memory: nothing is written back into the repository. Any error in any cell fails the test with
the cell's traceback. ``tests/notebook_run.py`` refreshes the stored outputs.

learn.ipynb is stored with the outputs of its full run (the learning curve takes minutes of CPU
to make). The test suite runs it in its short mode (``TOKENGYM_LEARN_ITERATIONS``): a few
iterations, the loop and the logprob check, not the curve (``benchmarks/learning.py`` measures that).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from notebook_run import CELL_TIMEOUT_S, execute, machine_leaks, relative_to_repository, write_kernel
from needs import SMOLLM2_MISSING, needs

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
SHORT_MODE = {"learn.ipynb": {"TOKENGYM_LEARN_ITERATIONS": "2"}, "async_rl.ipynb": {"TOKENGYM_ASYNC_ITERATIONS": "2"}}
SLOW_CELL_TIMEOUT_S = {"learn.ipynb": 1200, "async_rl.ipynb": 1200}  # model loading and two training iterations of a 135M model
NEEDS_SMOLLM2 = {"learn.ipynb", "async_rl.ipynb"}
SHOWS_TOKENS = {"quickstart.ipynb", "new_tool_env.ipynb"}  # coloured token views (text/html)
MAX_OUTPUT_BYTES = 200_000  # one output (a plot is a few tens of KiB)
MAX_NOTEBOOK_BYTES = 512_000


def test_the_notebooks_are_there():
    assert {"quickstart.ipynb", "new_tool_env.ipynb", "rl_step.ipynb", "learn.ipynb", "images.ipynb", "async_rl.ipynb"} <= {
        p.name for p in PATHS
    }


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_a_notebook_is_stored_with_the_outputs_of_a_complete_run(path: Path):
    """Every code cell ran, in order, without an error, and nothing but outputs is left over (no timings)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), f"{path.name}: run it top to bottom once"
    for i, cell in enumerate(nb["cells"]):
        assert "execution" not in cell.get("metadata", {}), f"{path.name} cell {i} has execution timings"
        errors = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{path.name} cell {i} stored an error: {errors[0].get('ename')}"
    outputs = [o for c in code for o in c["outputs"]]
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in outputs)
    if path.name in SHOWS_TOKENS:
        assert any("tokengym-trajectory" in "".join(o.get("data", {}).get("text/html", "")) for o in outputs)


def test_quickstart_lists_the_envs_that_are_registered_now():
    """The stored list of envs is the one a fresh run prints (it once showed 6 of 7)."""
    import ast

    import tokengym.envs

    nb = json.loads((NOTEBOOKS / "quickstart.ipynb").read_text(encoding="utf-8"))
    (cell,) = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).rstrip().endswith("registered_envs()")]
    (shown,) = ["".join(o["data"]["text/plain"]) for o in cell["outputs"] if "text/plain" in o.get("data", {})]
    assert ast.literal_eval(shown) == tokengym.envs.registered_envs(), (
        "refresh notebooks/quickstart.ipynb with tests/notebook_run.py"
    )


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_stored_outputs_are_small_and_show_nothing_of_the_machine(path: Path):
    """No absolute path (a home, a temp folder, the checkout), host or user name, and no megabyte blob."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert machine_leaks(nb) == [], f"{path.name}: refresh it with tests/notebook_run.py after removing these"
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            assert len(json.dumps(out)) < MAX_OUTPUT_BYTES, f"{path.name} cell {i}: an output of {len(json.dumps(out))} bytes"


def test_the_async_docs_code_is_the_notebooks():
    """docs/async.md's examples are cells of async_rl.ipynb, which the suite runs: they cannot rot."""
    import re

    doc = (NOTEBOOKS.parent / "docs" / "async.md").read_text(encoding="utf-8")
    blocks = [b.strip() for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S)]
    nb = json.loads((NOTEBOOKS / "async_rl.ipynb").read_text(encoding="utf-8"))
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert blocks, "docs/async.md has no python example"
    missing = [b.splitlines()[0] for b in blocks if b not in source]
    assert not missing, f"docs/async.md examples that async_rl.ipynb does not run: {missing}"


def test_the_scan_finds_machine_paths_and_names():
    def nb(*texts: str) -> dict:
        outputs = [{"output_type": "stream", "name": "stdout", "text": [t]} for t in texts]
        return {"cells": [{"cell_type": "code", "outputs": outputs}]}

    leaky = [
        "wrote /home/alice/runs/x",
        "store /tmp/pytest-of-dana/pytest-3/store (2 shards)",
        "/srv/repo/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning",
        "File '/opt/cache/tokengym/qwen3'",
        "C:\\Users\\bob\\runs",
        "/Users/carol/Library",
    ]
    for text in leaky:
        assert machine_leaks(nb(text), words=[]), text
    clean = ["wrote runs/dates (6 episodes)", "1/2 of the tokens", "and/or", "see https://example.org/home/x", "a/tmp/b"]
    assert machine_leaks(nb(*clean), words=[]) == []
    assert machine_leaks(nb("kernel on gpu-box-17 ready"), words=["gpu-box-17"]) == ["cell 0: the machine's name 'gpu-box-17'"]
    html = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "display_data", "data": {"text/html": ["<b>/tmp/x</b>"]}}]}]}
    assert machine_leaks(html, words=[]) == ["cell 0: absolute path '/tmp/x'"]


def test_paths_inside_the_repository_are_stored_relative_to_it(tmp_path: Path):
    root = tmp_path / "checkout"
    warning = f"{root}/recorder/learning.py:255: NoGroupSignalWarning: no GRPO signal\n"
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "stream", "name": "stderr", "text": warning},
        {"output_type": "error", "traceback": [f"File {root}/envs/chat.py:1", "ValueError: x"]},
        {"output_type": "stream", "name": "stdout", "text": [f"wrote {tmp_path}/elsewhere/x"]},
    ]}]}
    assert relative_to_repository(nb, root) == 2
    outputs = nb["cells"][0]["outputs"]
    assert outputs[0]["text"] == "recorder/learning.py:255: NoGroupSignalWarning: no GRPO signal\n"
    assert outputs[1]["traceback"] == ["File envs/chat.py:1", "ValueError: x"]
    assert machine_leaks(nb, words=[]) == [f"cell 0: absolute path '{tmp_path}/elsewhere/x'"]  # outside: still refused


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python3`` kernel spec whose kernel is the interpreter running the tests."""
    return write_kernel(tmp_path_factory.mktemp("kernels"))


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, kernel_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if path.name in NEEDS_SMOLLM2:
        needs("SMOLLM2", SMOLLM2_MISSING)
    for name, value in SHORT_MODE.get(path.name, {}).items():
        monkeypatch.setenv(name, value)  # the kernel inherits this process's environment
    before = path.read_bytes()
    nb = execute(path, tmp_path, kernel_dir, timeout=SLOW_CELL_TIMEOUT_S.get(path.name, CELL_TIMEOUT_S))
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert path.read_bytes() == before  # run on a copy: the stored notebook is untouched
    # What a fresh run shows is what may be stored: nothing of this machine (the temp folder included).
    assert machine_leaks(nb, words=[str(tmp_path)]) == []


def test_the_kernel_is_stopped_after_a_run(kernel_dir: Path, tmp_path: Path):
    # A kernel left running holds its memory (gigabytes for learn.ipynb) until the test process ends.
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint(os.getpid())")]
    nbformat.write(nb, tmp_path / "pid.ipynb")
    out = execute(tmp_path / "pid.ipynb", tmp_path, kernel_dir)
    pid = int(out.cells[0].outputs[0]["text"].strip())
    status = Path(f"/proc/{pid}/status")
    alive = status.exists() and "zombie" not in status.read_text()
    assert not alive, f"the notebook's kernel (pid {pid}) still runs after execute()"
