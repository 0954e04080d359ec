"""The notebooks in notebooks/ run top to bottom, and are stored without outputs.

Each notebook is executed with nbclient in a fresh kernel that runs *this* interpreter (so it
imports the tokengym under test, whatever other kernels are installed on the machine), from
a temporary working directory, with a time limit per cell. Any error in any cell fails the
test with the cell's traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # each notebook takes well under a minute on 2 CPU cores; this is for slow CI machines


def test_the_notebooks_are_there():
    assert {"quickstart.ipynb", "new_tool_env.ipynb", "rl_step.ipynb"} <= {p.name for p in PATHS}


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
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


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``python3`` kernel spec whose kernel is the interpreter running the tests."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(root / "python3")  # argv: [sys.executable, "-m", "ipykernel_launcher", ...]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, kernel_dir: Path, tmp_path: Path):
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        allow_errors=False,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError, with the traceback, on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
