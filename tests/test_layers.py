"""Dependencies go one way: envs <- policies <- recorder <- recorder.drivers <- integrations and the CLI;
and what one module takes from another is public in it (no ``from .x import _private``).

Every module's imports are read with ``ast`` (nothing is imported), including the imports
inside functions: a lazy import is still a dependency, it only runs later. An import under
``if TYPE_CHECKING:`` never runs, so it cannot close a cycle, but it still may not point up.

Why: a cycle makes the import order decide which names exist (an import from a half-built
module), and an upward import (an env that needs the recorder) makes the lower layer
impossible to use, test or install alone.
"""

from __future__ import annotations

import ast
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS = ("tokengym.envs", "tokengym.policies", "tokengym.recorder", "tokengym.recorder.drivers", "top")
"""Bottom to top: a module may import its own layer and the layers below it. The recording
(segments, trajectories, the wrapper, the store, the batch layouts) is below the drivers that run
episodes: it knows nothing of how they are scheduled."""

TOP = ("tokengym.recorder.cli", "tokengym.recorder.integrations", "tokengym.recorder.learning")
"""The integrations (TRL, SkyRL), the training loop and the command line: they may use
everything, nothing below uses them."""

FACADES = ("tokengym.recorder",)
"""Package ``__init__`` modules that re-export names from every layer of their package for users
(``from tokengym.recorder import rollout``); no module of the project may import them from below."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    type_checking: bool  # under ``if TYPE_CHECKING:``: read by type checkers only

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line})"


def package_dirs(root: Path) -> dict[str, Path]:
    """The package -> folder mapping of pyproject.toml (``tokengym`` is a namespace over them)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    return {pkg: root / folder for pkg, folder in config["tool"]["setuptools"]["package-dir"].items()}


def modules(dirs: dict[str, Path]) -> dict[str, Path]:
    """Every module of the mapped packages, by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for pkg, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((pkg, *parts))] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, type_checking: bool = False):
    """(node, under TYPE_CHECKING) for every import statement, at any depth."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), type_checking)
        else:
            yield from _imports(node, type_checking)


def _from_module(name: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in module ``name`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def import_edges(mods: dict[str, Path]) -> list[Edge]:
    """The imports between the given modules, each resolved to the most specific module it names."""
    edges = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, tc in _imports(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                module = _from_module(name, is_pkg, node)
                # ``from pkg import sub`` imports the module pkg.sub when there is one.
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in mods]
                targets = subs if subs and len(subs) == len(node.names) else [module, *subs]
            for target in targets:
                while target and target not in mods:  # ``import a.b.c`` where only a.b is ours
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append(Edge(name, target, node.lineno, tc))
    return edges


def layer(module: str) -> int:
    if module in FACADES or any(module == t or module.startswith(t + ".") for t in TOP):
        return LAYERS.index("top")
    for i, pkg in reversed(list(enumerate(LAYERS[:-1]))):  # the most specific package first
        if module == pkg or module.startswith(pkg + "."):
            return i
    raise ValueError(f"{module} is in no layer: add its package to LAYERS")


def upward(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if layer(e.target) > layer(e.source)]


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The import cycles (strongly connected components of more than one module, or a self-loop)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if not e.type_checking:
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def explain(cycle: list[str], edges: list[Edge]) -> str:
    members = set(cycle)
    inner = [str(e) for e in edges if e.source in members and e.target in members and not e.type_checking]
    return " / ".join(cycle) + ":\n    " + "\n    ".join(inner)


@pytest.fixture(scope="module")
def project_edges() -> list[Edge]:
    return import_edges(modules(package_dirs(ROOT)))


def test_every_module_is_read(project_edges):
    mods = modules(package_dirs(ROOT))
    assert {"tokengym.envs", "tokengym.recorder.store", "tokengym.recorder.cli", "tokengym.policies.hf"} <= set(mods)
    assert len(mods) > 40
    # The reader sees lazy imports inside functions (the CLI imports its commands' needs there).
    assert any(e.source.startswith("tokengym.recorder.cli.") and e.target == "tokengym.policies" for e in project_edges)
    for m in mods:
        layer(m)


def test_no_import_cycle_between_modules(project_edges):
    found = cycles(project_edges)
    assert not found, "import cycles:\n" + "\n".join(explain(c, project_edges) for c in found)


def test_no_upward_import_between_layers(project_edges):
    bad = upward(project_edges)
    assert not bad, (
        f"upward imports ({' <- '.join(LAYERS)}; the top is {', '.join(TOP)}):\n" + "\n".join(map(str, bad))
    )


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path):
    # A tree with both faults, read the same way: the checks above can fail.
    for folder, files in {
        "envs": {
            "__init__.py": "from .a import A\n",
            "a.py": "def f():\n    from tokengym.recorder.w import W\n\nA = 1\n",
            "b.py": "from . import c\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nimport tokengym.envs.b\n",
        },
        "policies": {"__init__.py": "from tokengym.envs import b\n"},
        "recorder": {
            "__init__.py": "",
            "w.py": "from tokengym.policies import X\nW = 1\n",
            "x.py": "from .drivers import d\n",
            "drivers/__init__.py": "",
            "drivers/d.py": "from ..w import W\n",
        },
    }.items():
        for name, text in files.items():
            (tmp_path / folder / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / folder / name).write_text(text)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "tokengym.envs" = "envs", "tokengym.recorder" = "recorder", '
        '"tokengym.policies" = "policies" }\n'
    )
    edges = import_edges(modules(package_dirs(tmp_path)))
    assert sorted(str(e) for e in upward(edges)) == [
        "tokengym.envs.a -> tokengym.recorder.w (line 2)",
        "tokengym.recorder.x -> tokengym.recorder.drivers.d (line 1)",  # the recording below its drivers
    ]
    # b -> c -> b is a cycle; c -> b under TYPE_CHECKING alone would not be one.
    assert cycles(edges) == [["tokengym.envs.b", "tokengym.envs.c"]]
    assert cycles([e for e in edges if e.line != 4]) == []
    assert "tokengym.policies -> tokengym.envs.b (line 1)" in map(str, edges)  # ``from pkg import module``


def private_imports(mods: dict[str, Path]) -> list[str]:
    """Every ``from M import _name`` of one project module from another: what crosses a module
    boundary is public in its module (dunder names aside)."""
    found = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = _from_module(name, is_pkg, node)
            if module == name or not module.startswith("tokengym"):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name} imports {module}.{alias.name} (line {node.lineno})")
    return found


def test_no_module_imports_another_modules_private_names():
    bad = private_imports(modules(package_dirs(ROOT)))
    assert not bad, "private names used across modules (make them public where they are defined):\n" + "\n".join(bad)


def test_the_private_import_check_finds_one(tmp_path):
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "__init__.py").write_text("")
    (tmp_path / "envs" / "a.py").write_text("def _helper():\n    pass\n\n_OK = 1\n")
    (tmp_path / "envs" / "b.py").write_text(
        "from .a import _helper\nfrom . import a\nfrom .a import __doc__\n\ndef f():\n    from tokengym.envs.a import _OK\n"
    )
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "tokengym.envs" = "envs" }\n')
    assert private_imports(modules(package_dirs(tmp_path))) == [
        "tokengym.envs.b imports tokengym.envs.a._helper (line 1)",
        "tokengym.envs.b imports tokengym.envs.a._OK (line 6)",
    ]


def test_the_architecture_doc_names_these_layers_and_files_that_exist():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    top = ", ".join(t.removeprefix("tokengym.") for t in TOP)
    order = "  ←  ".join([*(p.removeprefix("tokengym.") for p in LAYERS[:-1]), top])
    assert order in doc, f"docs/architecture.md should show the layers as: {order}"
    paths = set(re.findall(r"`((?:envs|policies|recorder|tests)/[\w/]+\.py)`", doc))
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


# ------------------------------------------------------------------ the walk of one token
WALK_START, WALK_END = "| # | file | its one job |", "Off that path:"


def _walk_files(doc: str) -> set[str]:
    """The project files the walk of docs/architecture.md names (its table, brackets included)."""
    table = doc[doc.index(WALK_START) : doc.index(WALK_END)]
    named = set(re.findall(r"`((?:envs|policies|recorder)/[\w/<>]+\.py)`", table))
    engines = re.search(r"`policies/<engine>\.py` \(([^)]*)\)", table)
    if engines:  # the adapters row: policies/<engine>.py for each engine it names
        named.discard("policies/<engine>.py")
        named |= {f"policies/{e.strip(' `')}.py" for e in engines.group(1).split(",")}
    return named


def _traced_turns(tmp_path) -> set[str]:
    """The project files whose code runs while episodes' turns are generated, stepped, recorded
    and written (construction and reset not counted: they are not the path of a token), with the
    files of the functions that called them."""
    import sys
    import threading

    from conftest import real_tokenizer
    from tokengym.envs import CalculatorEnv
    from tokengym.policies import ScriptedPolicy
    from tokengym.recorder import TrajectoryWriter, rollout
    from tokengym.recorder.drivers.episodes import EpisodeSlot

    roots = {str(ROOT / d): d for d in ("envs", "policies", "recorder")}
    seen: set[str] = set()

    def note(filename: str) -> None:
        for root, name in roots.items():
            if filename.startswith(root + "/"):
                seen.add(name + filename[len(root) :])

    def profile(frame, event, arg):
        if event == "call":
            note(frame.f_code.co_filename)

    def traced(fn):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1)
            while caller is not None:
                note(caller.f_code.co_filename)
                caller = caller.f_back
            before = sys.getprofile()
            sys.setprofile(profile)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(before)

        return wrapper

    tok = real_tokenizer("qwen2.5")
    answer = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
    policy = ScriptedPolicy(lambda ctx: answer if ctx.tolist().count(151644) < 4 else "<answer>4</answer>", tok,
                            end_ids=[151645])
    originals = {(EpisodeSlot, m): getattr(EpisodeSlot, m) for m in ("params", "step", "advance")}
    originals[(ScriptedPolicy, "generate")] = ScriptedPolicy.generate
    originals[(TrajectoryWriter, "write")] = TrajectoryWriter.write
    try:
        for (cls, name), fn in originals.items():
            setattr(cls, name, traced(fn))
        with TrajectoryWriter(tmp_path / "store", tokenizer=tok, shard_size=1) as writer:
            r = rollout(lambda: CalculatorEnv(tok), policy, episodes=2, concurrency=1, seed=0, progress=False,
                        on_episode=writer.write)
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
    assert r.stats.failed == 0 and r.stats.turns == 4, r.stats.errors
    assert threading.current_thread() is threading.main_thread()
    return seen


def test_the_architecture_walk_names_the_files_a_token_crosses(tmp_path):
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named, traced = _walk_files(doc), _traced_turns(tmp_path)
    assert traced - named == set(), f"docs/architecture.md's walk leaves out files a turn runs: {sorted(traced - named)}"
    assert named - traced <= {"policies/hf.py", "policies/vllm.py", "policies/openai_server.py", "policies/continuous.py"}, (
        f"docs/architecture.md's walk names files a turn does not run: {sorted(named - traced)}"
    )
    count = re.search(r"a token crosses (\d+) files", doc)
    assert count and int(count.group(1)) == len(traced), f"the walk should say: a token crosses {len(traced)} files"
