"""A user's own env, found by name: gymnasium's ``module:id`` form, ``--import MODULE``, and envs an
installed package declares in the ``tokengym.envs`` entry points, through the library and the CLI.

The package is real: a folder on ``sys.path`` with a module and a ``.dist-info`` whose
``entry_points.txt`` is what pip writes for ``[project.entry-points."tokengym.envs"]``, which
is all ``importlib.metadata`` reads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import gymnasium as gym
import pytest

from tokengym.envs import ENTRY_POINT_GROUP, EnvRef, declared_envs, make_env, resolve_env_id
from tokengym.recorder import read_trajectories
from tokengym.recorder.cli import main

TODO_MODULE = '''
"""A todo-list env."""
from tokengym.envs import ToolEnv, answer_reward

TASKS = [{"id": "milk", "prompt": "Add milk to my list, then answer <answer>DONE</answer>.", "answer": "DONE"}]


def add(item: str) -> str:
    """Add an item to the todo list.

    Args:
        item: what to add
    """
    return f"added {item}"


class TodoEnv(ToolEnv):
    """Todo: add items to a list with a tool."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, TASKS, [add], reward_fn=answer_reward, **kwargs)
'''

CALL = '<tool_call>\n{"name": "add", "arguments": {"item": "milk"}}\n</tool_call>'
OWN_IDS = ("Todo-v0", "mylab/Todo-v0", "mylab/Broken-v0")


def write_package(root: Path, entry_points: str) -> Path:
    """``mylab`` (registers ``Todo-v0`` on import, gymnasium's convention) and a dist-info declaring envs."""
    pkg = root / "mylab"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        'import gymnasium\n\ngymnasium.register("Todo-v0", entry_point="mylab.todo:TodoEnv")\n', encoding="utf-8"
    )
    (pkg / "todo.py").write_text(TODO_MODULE, encoding="utf-8")
    dist = root / "mylab-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mylab\nVersion: 0.1\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points), encoding="utf-8")
    return root


DECLARED = f"""
[{ENTRY_POINT_GROUP}]
mylab/Todo-v0 = mylab.todo:TodoEnv
"""


@pytest.fixture
def mylab(tmp_path, monkeypatch):
    """The package on sys.path for this test only; its registrations and modules are removed afterwards."""
    root = write_package(tmp_path / "site", DECLARED)
    monkeypatch.syspath_prepend(str(root))
    yield root
    for env_id in OWN_IDS:
        gym.registry.pop(env_id, None)
    for name in [m for m in sys.modules if m == "mylab" or m.startswith("mylab.")]:
        del sys.modules[name]


def test_declared_envs_are_found_without_importing_the_package(mylab):
    assert [(d.env_id, d.entry_point, d.distribution) for d in declared_envs()] == [
        ("mylab/Todo-v0", "mylab.todo:TodoEnv", "mylab")
    ]
    assert resolve_env_id("mylab/Todo-v0") == "mylab/Todo-v0"
    assert "mylab" not in sys.modules  # registered by name; imported only when made
    env = make_env("mylab/Todo-v0", kwargs={"tokenizer": "qwen2.5", "max_turns": 2})
    obs, info = env.reset(seed=0)
    assert info["task"]["id"] == "milk" and len(obs) > 0
    assert env.spec.id == "mylab/Todo-v0"


def test_module_id_form_and_imports(mylab):
    assert "Todo-v0" not in gym.registry
    assert resolve_env_id("mylab:Todo-v0") == "Todo-v0"
    gym.registry.pop("Todo-v0")
    del sys.modules["mylab"]
    assert resolve_env_id("Todo-v0", imports=["mylab"]) == "Todo-v0"
    # A picklable factory resolves the same way in the process that makes the env.
    ref = EnvRef("mylab:Todo-v0", (), {"tokenizer": "qwen2.5"})
    assert ref.with_kwargs(max_turns=3).kwargs == {"tokenizer": "qwen2.5", "max_turns": 3}
    assert type(ref().unwrapped).__name__ == "TodoEnv"


def test_unknown_names_say_how_to_register(mylab):
    with pytest.raises(ValueError, match=r"unknown environment 'mylab/Todo-v9'.*--import MODULE.*'tokengym.envs'"):
        resolve_env_id("mylab/Todo-v9")
    with pytest.raises(ValueError, match=r"did you mean 'tokengym/Calculator-v0'"):
        resolve_env_id("tokengym/Calculater-v0")
    with pytest.raises(ValueError, match=r"cannot import 'mylab_typo'.*PYTHONPATH"):
        resolve_env_id("mylab_typo:Todo-v0")
    with pytest.raises(ValueError, match=r"cannot import 'nowhere'"):
        resolve_env_id("tokengym/Calculator-v0", imports=["nowhere"])


def test_a_malformed_or_conflicting_declaration_is_an_error(tmp_path, monkeypatch):
    other = tmp_path / "other"
    dist = other / "otherlab-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: otherlab\nVersion: 1.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmylab/Todo-v0 = otherlab:Todo\n", encoding="utf-8")
    write_package(tmp_path / "site", DECLARED)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(ValueError, match=r"'mylab/Todo-v0' is declared twice.*otherlab.*mylab.*uninstall one"):
        declared_envs()
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nmylab/Broken-v0 = otherlab\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"otherlab declares env 'mylab/Broken-v0'.*must be 'module:attribute'"):
        declared_envs()


def test_a_broken_declaration_fails_only_the_run_that_names_it(tmp_path, monkeypatch, capsys):
    """A package whose declaration is malformed, conflicting or whose module raises at import
    leaves the built-in envs (and every other one) usable; ``tokengym envs`` lists it as broken."""
    other = tmp_path / "other"
    dist = other / "otherlab-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: otherlab\nVersion: 1.0\n", encoding="utf-8")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmylab/Todo-v0 = otherlab:Todo\nother/Bad-v0 = otherlab\nother/Raises-v0 = otherlab_raises:Env\n",
        encoding="utf-8",
    )
    (other / "otherlab_raises.py").write_text("raise RuntimeError('needs a GPU')\n", encoding="utf-8")
    write_package(tmp_path / "site", DECLARED)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(other))
    try:
        assert resolve_env_id("tokengym/Calculator-v0") == "tokengym/Calculator-v0"
        with pytest.raises(ValueError, match=r"'mylab/Todo-v0' cannot be used: .*declared twice"):
            resolve_env_id("mylab/Todo-v0")
        with pytest.raises(ValueError, match=r"'other/Bad-v0' cannot be used: .*must be 'module:attribute'"):
            resolve_env_id("other/Bad-v0")
        assert main(["envs"]) == 1
        out = capsys.readouterr().out
        assert re.search(r"^tokengym/Calculator-v0 +\S", out, re.M)
        assert re.search(r"^mylab/Todo-v0 +broken declaration: .*declared twice", out, re.M)
        assert re.search(r"^other/Raises-v0 +cannot load otherlab_raises:Env: RuntimeError: needs a GPU", out, re.M)
    finally:
        for env_id in ("other/Raises-v0", *OWN_IDS):
            gym.registry.pop(env_id, None)
        from tokengym.envs.registry import BROKEN_DECLARATIONS

        BROKEN_DECLARATIONS.clear()  # the test's packages leave with it


def test_cli_envs_lists_declared_and_imported_envs(mylab, capsys):
    assert main(["envs", "--import", "mylab"]) == 0
    out = capsys.readouterr().out
    assert "mylab/Todo-v0" in out and "Todo: add items to a list with a tool. [mylab]" in out
    assert re.search(r"^Todo-v0 +Todo:", out, re.M) and "tokengym/Calculator-v0" in out
    (mylab / "mylab-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmylab/Broken-v0 = mylab.todo:Missing\n", encoding="utf-8"
    )
    assert main(["envs"]) == 1
    captured = capsys.readouterr()
    assert "cannot load mylab.todo:Missing" in captured.out and "1 env(s) cannot be loaded" in captured.err


def test_cli_rollout_errors_name_the_fix(mylab, tmp_path, capsys):
    base = ["--policy", "scripted", "--tokenizer", "qwen2.5", "--reply", "x", "--out", str(tmp_path / "s"), "--quiet"]
    assert main(["rollout", "mylab/Todo-v9", *base]) == 2
    assert "--import MODULE" in capsys.readouterr().err
    assert main(["rollout", "Todo-v0", "--import", "nowhere", *base]) == 2
    assert "cannot import 'nowhere'" in capsys.readouterr().err
    assert main(["rollout", "mylab/Todo-v0", "--env-kwarg", 'tokenizer="qwen3"', *base]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["rollout", "mylab/Todo-v0", "--env-kwarg", "max_turn=3", *base]) == 2
    err = capsys.readouterr().err
    assert "mylab/Todo-v0 cannot be made with the arguments ['max_turn', 'tokenizer']" in err
    assert "did you mean 'max_turns'?" in err and len(err) < 600  # the names, not the tokenizer's repr
    assert main(["rollout", "mylab/Todo-v0", "--env-kwarg", "max_turns", *base]) == 2
    assert "--env-kwarg expects KEY=JSON, got 'max_turns'" in capsys.readouterr().err
    assert not list((tmp_path / "s").glob("**/*.parquet"))  # nothing was recorded


def run_cli(args: list[str], root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "tokengym.recorder.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["mylab:Todo-v0", "mylab/Todo-v0"])
def test_tokengym_rollout_runs_a_users_env_end_to_end(spec, tmp_path):
    """A fresh process finds the env by ``module:id`` and by its entry point; --env-kwarg reaches the env."""
    root = write_package(tmp_path / "site", DECLARED)
    out = tmp_path / "store"
    proc = run_cli(
        [
            "rollout", spec, "--policy", "scripted", "--tokenizer", "qwen2.5", "--reply", CALL,
            "--reply", "<answer>DONE</answer>", "--episodes", "2", "--concurrency", "2", "--out", str(out),
            "--env-kwarg", 'system_prompt="Keep the list short."', "--env-kwarg", "max_turns=3", "--quiet",
        ],
        root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 done, 0 failed" in proc.stdout
    trajs = list(read_trajectories(out))
    assert [t.env_id for t in trajs] == [spec.split(":")[-1]] * 2
    assert [t.reward for t in trajs] == [1.0, 1.0] and [t.num_turns for t in trajs] == [2, 2]
    assert all(t.metadata["tool_stats"]["calls"] == 1 for t in trajs)
    from tokengym.envs import load_tokenizer

    tok = load_tokenizer("qwen2.5")
    assert all("Keep the list short." in tok.decode(t.segments[0].token_ids.tolist()) for t in trajs)


def test_plain_gymnasium_finds_tokengym_envs_by_module_in_a_fresh_process():
    """Gymnasium 1.x loads no plugins: ``tokengym/...`` needs the import, which the module:id form does."""
    code = (
        "import gymnasium as gym\n"
        "try:\n"
        "    gym.make('tokengym/Calculator-v0', tokenizer='qwen2.5')\n"
        "except gym.error.NamespaceNotFound:\n"
        "    print('not found without the import')\n"
        "env = gym.make('tokengym.envs:tokengym/Calculator-v0', tokenizer='qwen2.5')\n"
        "print(env.spec.id, len(env.reset(seed=0)[0]) > 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["not found without the import", "tokengym/Calculator-v0 True"]


def test_the_tokengym_script_finds_a_module_in_the_current_folder(tmp_path):
    """A first env is a file beside the terminal: the script (unlike ``python -m``) does not put the
    current folder on the path by itself, so it adds it (last); elsewhere the error names the fix."""
    root = write_package(tmp_path / "here", DECLARED)
    script = Path(sys.executable).parent / "tokengym"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([str(script), "envs", "--import", "mylab"], cwd=root, capture_output=True, text=True,
                           env=env, timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    assert any(line.split()[:1] == ["Todo-v0"] for line in found.stdout.splitlines())
    elsewhere = subprocess.run([str(script), "envs", "--import", "mylab"], cwd=tmp_path, capture_output=True,
                               text=True, env=env, timeout=300)
    assert elsewhere.returncode == 2 and "add its folder to PYTHONPATH" in elsewhere.stderr


def test_the_current_folder_is_searched_only_for_the_named_module_after_installed_ones(tmp_path, monkeypatch):
    """A file in the current folder named like an optional dependency (``accelerate.py``) is never
    imported by another import: the folder is on the path only while ``MODULE:ID`` or ``--import``
    loads its module, and an installed module of the same name wins."""
    import importlib.util

    from tokengym.envs import registry

    (tmp_path / "here_only_mod.py").write_text("FOUND = 'here'\n", encoding="utf-8")
    (tmp_path / "shadow_dep.py").write_text("raise SystemExit('a file of the current folder was run')\n", encoding="utf-8")
    (tmp_path / "json.py").write_text("raise SystemExit('the installed module was shadowed')\n", encoding="utf-8")
    monkeypatch.setattr(registry, "MODULE_FOLDERS", [str(tmp_path)])
    before = list(sys.path)
    try:
        registry.import_modules(["here_only_mod", "json"])
        assert sys.modules["here_only_mod"].FOUND == "here" and sys.modules["json"].__file__ != str(tmp_path / "json.py")
        assert sys.path == before and importlib.util.find_spec("shadow_dep") is None
    finally:
        sys.modules.pop("here_only_mod", None)
