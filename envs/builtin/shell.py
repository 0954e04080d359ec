"""``tokengym/Shell-v0``: file-system tasks in a sandbox (find, count, edit, rename, sort), checked inside it.

Each episode generates a task from a seed (``reset(seed=...)``, or ``options={"problem_seed": s,
"kind": "count"}``) and lays its files out in a fresh sandbox: a tree of source files to
search, logs to count, an ini file to edit, notes to rename, a list to sort, files to
compare by size. The model works with ``run_shell`` (and ``read_file``/``write_file``) and
ends with a reply without a tool call.

The reward is checked **inside the sandbox**, on the state the model left behind: a fixed
checker runs under ``python3 -I`` with the expected state on its standard input (never in its
argv or environment, where another sandbox on the host could read it; it enters the sandbox
only after the model's last call) and reports pass or fail. Reward 1.0 on pass, else
0.0; ``info["check"]`` on the final step says what was found.

Kinds: ``find`` (which file mentions a ticket id; path into ``answer.txt``), ``count`` (how
many ``.log`` files hold an ERROR line; number into ``answer.txt``), ``edit`` (change one key
of one ini section, nothing else), ``rename`` (every ``.txt`` in ``notes/`` becomes ``.md``),
``sort`` (the distinct lines of a file, sorted, into another), ``largest`` (the biggest file
under ``data/``; path into ``answer.txt``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from ..chat import EnvResponse
from ..sandbox.base import Sandbox, SandboxError
from ..sandbox.env import SandboxToolEnv

__all__ = ["SHELL_KINDS", "ShellEnv", "check_in_sandbox", "shell_task"]

SHELL_KINDS = ("find", "count", "edit", "rename", "sort", "largest")

_WORDS = (
    "alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "iris", "jasper", "kestrel",
    "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "sierra", "tango", "umber", "violet",
    "willow", "xenon", "yarrow", "zephyr", "acorn", "basil", "cobalt", "dune", "fjord", "glacier",
)  # fmt: skip
_NAMES = (
    "Ada", "Alan", "Barbara", "Claude", "Dennis", "Donald", "Edsger", "Frances", "Grace", "Guido", "Hedy",
    "Ken", "Linus", "Margaret", "Niklaus", "Radia", "Richard", "Shafi", "Tim", "Vint", "Whitfield", "Yukihiro",
)  # fmt: skip
_DONE = "When you are done, reply with a short message without any tool call."

CHECKER = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
import hashlib, json, os

spec = json.loads(sys.stdin.read())
kind = spec["kind"]


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def lines(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        out = [line.rstrip() for line in f.read().splitlines()]
    while out and not out[-1]:
        out.pop()
    return out


try:
    if kind == "answer":
        with open(spec["path"], encoding="utf-8", errors="replace") as f:
            got = f.read().strip()
        if spec.get("is_path"):
            got = os.path.normpath(got) if got else got
        ok = got == spec["expected"]
        detail = "%s holds %r" % (spec["path"], got[:200])
    elif kind == "lines":
        got = lines(spec["path"])
        ok = got == spec["expected"]
        detail = "%s has %d lines" % (spec["path"], len(got))
        if not ok:
            wrong = [i for i, (a, b) in enumerate(zip(got, spec["expected"])) if a != b]
            if wrong:
                detail += "; line %d differs: %r" % (wrong[0] + 1, got[wrong[0]][:200])
            elif len(got) != len(spec["expected"]):
                detail += ", not %d" % len(spec["expected"])
    elif kind == "tree":
        got = {}
        for d, dirs, files in os.walk(spec["root"]):
            for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                p = os.path.join(d, n)
                got[os.path.relpath(p, spec["root"])] = "symlink" if os.path.islink(p) else digest(p)
        ok = got == spec["expected"]
        missing = sorted(set(spec["expected"]) - set(got))[:5]
        extra = sorted(set(got) - set(spec["expected"]))[:5]
        changed = sorted(k for k in got if k in spec["expected"] and got[k] != spec["expected"][k])[:5]
        detail = "missing %s, unexpected %s, changed %s" % (missing, extra, changed) if not ok else "as expected"
    else:
        ok, detail = False, "unknown check %r" % kind
except OSError as e:
    ok, detail = False, "%s: %s" % (type(e).__name__, e)
print(json.dumps({"pass": bool(ok), "detail": detail}))
"""


# ------------------------------------------------------------------ tasks
def _sentence(r: np.random.Generator, n: int | None = None) -> str:
    k = int(n if n is not None else r.integers(3, 9))
    return " ".join(str(r.choice(_WORDS)) for _ in range(k))


def _unique_names(r: np.random.Generator, n: int, exts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = f"{r.choice(_WORDS)}{'_' + str(r.choice(_WORDS)) if r.random() < 0.4 else ''}.{r.choice(exts)}"
        if name not in out:
            out.append(name)
    return out


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _find(r: np.random.Generator) -> tuple[str, dict[str, str], dict[str, Any]]:
    dirs = ["project", "project/src", "project/src/utils", "project/docs", "project/tests", "project/assets/old"]
    n = int(r.integers(15, 30))
    files: dict[str, str] = {}
    names = _unique_names(r, n, ("txt", "md", "py", "cfg", "log"))
    codes: set[str] = set()
    for name in names:
        path = f"{r.choice(dirs)}/{name}"
        body = [_sentence(r) for _ in range(int(r.integers(2, 8)))]
        if r.random() < 0.35:
            code = f"TG-{int(r.integers(1000, 10000))}"
            codes.add(code)
            body.insert(int(r.integers(len(body) + 1)), f"ticket: {code}")
        files[path] = "\n".join(body) + "\n"
    while True:
        target_code = f"TG-{int(r.integers(1000, 10000))}"
        if target_code not in codes:
            break
    target = sorted(files)[int(r.integers(len(files)))]
    body = files[target].splitlines()
    body.insert(int(r.integers(len(body) + 1)), f"ticket: {target_code}")
    files[target] = "\n".join(body) + "\n"
    prompt = (
        f"Exactly one file under project/ mentions the ticket {target_code}. Write the path of that file, "
        f"relative to the working directory (like project/docs/notes.txt), into a file named answer.txt. {_DONE}"
    )
    return prompt, files, {"kind": "answer", "path": "answer.txt", "expected": target, "is_path": True}


def _count(r: np.random.Generator) -> tuple[str, dict[str, str], dict[str, Any]]:
    dirs = ["logs", "logs/app", "logs/db", "logs/archive/2023"]
    files: dict[str, str] = {}
    count = 0
    n_log, n_txt = int(r.integers(8, 20)), int(r.integers(2, 6))
    for i, name in enumerate(_unique_names(r, n_log + n_txt, ("log",))):
        is_log = i < n_log
        path = f"{r.choice(dirs)}/{name if is_log else name[:-4] + '.txt'}"
        if path in files:
            continue
        has_error = r.random() < 0.45
        lines = []
        for k in range(int(r.integers(3, 12))):
            level = str(r.choice(["INFO", "WARN", "DEBUG"]))
            lines.append(f"2024-05-{int(r.integers(1, 29)):02d} 10:{k:02d}:00 {level} {_sentence(r, 4)}")
        if has_error:
            lines.insert(int(r.integers(len(lines) + 1)), f"2024-05-14 11:00:00 ERROR {_sentence(r, 4)}")
            count += is_log
        files[path] = "\n".join(lines) + "\n"
    prompt = (
        "How many files with the extension .log under logs/ (in any of its subdirectories) contain at least one "
        f"line with the level ERROR? Write the number into a file named answer.txt. {_DONE}"
    )
    return prompt, files, {"kind": "answer", "path": "answer.txt", "expected": str(count)}


def _edit(r: np.random.Generator) -> tuple[str, dict[str, str], dict[str, Any]]:
    ports = [int(p) for p in r.choice(np.arange(1024, 9999), size=4, replace=False)]
    sections = {
        "server": [("host", "0.0.0.0"), ("port", str(ports[0])), ("workers", str(int(r.integers(2, 17))))],
        "database": [("host", f"db-{r.choice(_WORDS)}.internal"), ("port", str(ports[1])), ("name", str(r.choice(_WORDS)))],
        "metrics": [("enabled", str(r.choice(["true", "false"]))), ("port", str(ports[2]))],
    }
    which = str(r.choice(list(sections)))
    old = dict(sections[which])["port"]
    new = str(ports[3])

    def render(edit: bool) -> list[str]:
        out = []
        for name, items in sections.items():
            out.append(f"[{name}]")
            for k, v in items:
                out.append(f"{k} = {new if (edit and name == which and k == 'port') else v}")
            out.append("")
        return out[:-1]

    files = {"config/app.ini": "\n".join(render(False)) + "\n"}
    prompt = (
        f"In config/app.ini, change the port of the [{which}] section from {old} to {new}. Leave every other "
        f"line of the file exactly as it is. {_DONE}"
    )
    return prompt, files, {"kind": "lines", "path": "config/app.ini", "expected": render(True)}


def _rename(r: np.random.Generator) -> tuple[str, dict[str, str], dict[str, Any]]:
    n_txt, n_other = int(r.integers(3, 9)), int(r.integers(1, 4))
    stems = [name[:-4] for name in _unique_names(r, n_txt + n_other, ("txt",))]  # distinct stems: no clashes
    files: dict[str, str] = {}
    expected: dict[str, str] = {}
    for i, stem in enumerate(stems):
        body = _sentence(r) + "\n"
        name = f"{stem}.txt" if i < n_txt else f"{stem}.{r.choice(['md', 'csv', 'txt.bak'])}"
        files[f"notes/{name}"] = body
        expected[f"{stem}.md" if i < n_txt else name] = _sha(body)
    prompt = (
        "Rename every file in notes/ whose name ends in .txt so that it ends in .md instead (keep the rest of "
        f"the name and the content; leave the other files alone). {_DONE}"
    )
    return prompt, files, {"kind": "tree", "root": "notes", "expected": expected}


def _sort(r: np.random.Generator) -> tuple[str, dict[str, str], dict[str, Any]]:
    names = [str(r.choice(_NAMES)) for _ in range(int(r.integers(12, 30)))]
    files = {"names.txt": "\n".join(names) + "\n"}
    prompt = (
        "names.txt lists names, some more than once. Write each distinct name once, sorted alphabetically, one "
        f"per line, into a file named sorted.txt (leave names.txt as it is). {_DONE}"
    )
    return prompt, files, {"kind": "lines", "path": "sorted.txt", "expected": sorted(set(names))}


def _largest(r: np.random.Generator) -> tuple[str, dict[str, str], dict[str, Any]]:
    dirs = ["data", "data/raw", "data/raw/2024", "data/cache"]
    names = _unique_names(r, int(r.integers(6, 15)), ("bin", "csv", "dat", "json"))
    sizes = [int(s) for s in r.choice(np.arange(100, 20000), size=len(names), replace=False)]
    files: dict[str, str] = {}
    for name, size in zip(names, sizes, strict=True):
        path = f"{r.choice(dirs)}/{name}"
        files[path] = "".join(str(r.choice(list("abcdefgh"))) for _ in range(size // 8)).ljust(size, "x")
    target = max(files, key=lambda p: len(files[p]))
    prompt = (
        "Find the largest file (in bytes) under data/, in any of its subdirectories. Write its path, relative to "
        f"the working directory (like data/raw/file.csv), into a file named answer.txt. {_DONE}"
    )
    return prompt, files, {"kind": "answer", "path": "answer.txt", "expected": target, "is_path": True}


_MAKERS = {"find": _find, "count": _count, "edit": _edit, "rename": _rename, "sort": _sort, "largest": _largest}


def shell_task(seed: int, kind: str | None = None) -> dict[str, Any]:
    """The task for ``seed`` (``kind`` drawn from the seed unless given):
    ``{"id", "kind", "prompt", "files", "check"}``. The same seed always gives the same task."""
    if kind is not None and kind not in _MAKERS:
        raise ValueError(f"kind must be one of {SHELL_KINDS}, got {kind!r}")
    if kind is None:
        kind = SHELL_KINDS[int(np.random.default_rng([int(seed), 3]).integers(len(SHELL_KINDS)))]
    r = np.random.default_rng([int(seed), SHELL_KINDS.index(kind), 13])
    prompt, files, check = _MAKERS[kind](r)
    return {"id": f"shell-{kind}-{int(seed)}", "kind": kind, "prompt": prompt, "files": files, "check": check}


def check_in_sandbox(sandbox: Sandbox, check: dict[str, Any], *, timeout_s: float = 30.0) -> dict[str, Any]:
    """Run a task's check inside ``sandbox``: ``{"pass": bool, "detail": str}``."""
    try:
        r = sandbox.run(["python3", "-I", "-c", CHECKER], stdin=json.dumps(check), timeout_s=timeout_s)
    except SandboxError as err:
        return {"pass": False, "detail": f"the sandbox refused the check: {err}"}
    for line in reversed(r.stdout.strip().splitlines()):
        try:
            out = json.loads(line)
        except (RecursionError, ValueError, OverflowError, MemoryError):
            continue  # not the checker's line: something the model's files made the checker print
        if isinstance(out, dict) and "pass" in out:
            return {"pass": bool(out["pass"]), "detail": str(out.get("detail", ""))}
    return {"pass": False, "detail": f"the check did not run: {r.message or r.stderr[-300:]}"}


# --------------------------------------------------------------------- env
class ShellEnv(SandboxToolEnv):
    """File-system tasks in a sandbox, checked inside the sandbox.

    Args:
        tokenizer: as for :class:`~tokengym.envs.ChatEnv`.
        kinds: the task kinds to draw from (default: all of :data:`SHELL_KINDS`).
        sandbox, sandbox_kwargs, sandbox_factory, sandbox_tools: see
            :class:`~tokengym.envs.sandbox.SandboxToolEnv` (tools default to ``run_shell``,
            ``read_file``, ``write_file``).
        **kwargs: as for :class:`~tokengym.envs.ToolEnv` (``max_turns`` defaults to 12).

    ``reset(options={"problem_seed": s, "kind": k})`` picks a task; ``{"task": {...}}`` sets one.
    """

    reset_options = frozenset({"task", "index", "kind", "problem_seed"})

    default_tools = ("run_shell", "read_file", "write_file")

    def __init__(self, tokenizer: Any, kinds: tuple[str, ...] | list[str] | None = None, **kwargs: Any) -> None:
        self.kinds = tuple(kinds) if kinds is not None else SHELL_KINDS
        bad = [k for k in self.kinds if k not in SHELL_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {SHELL_KINDS}, got {kinds!r}")
        kwargs.setdefault("max_turns", 12)
        super().__init__(tokenizer, **kwargs)
        self.last_check: dict[str, Any] | None = None

    def sample_task(self, options: dict[str, Any]) -> dict[str, Any]:
        if "task" in options:
            return super().sample_task(options)
        seed = int(options["problem_seed"]) if "problem_seed" in options else int(self.np_random.integers(2**31))
        kind = options.get("kind")
        if kind is None:
            kind = self.kinds[int(self.np_random.integers(len(self.kinds)))]
        return shell_task(seed, kind)

    def setup_sandbox(self, sandbox: Sandbox, task: dict[str, Any]) -> None:
        for path, content in task.get("files", {}).items():
            sandbox.write_file(path, content)

    def final_reward(self, completion: str, task: dict[str, Any]) -> float:
        if self.reward_fn is not None:
            return super().final_reward(completion, task)
        sb = self.sandbox
        if sb is None or sb.closed or "check" not in task:
            self.last_check = {"pass": False, "detail": "no sandbox or no check"}
            return 0.0
        self.last_check = check_in_sandbox(sb, task["check"])
        return float(self.last_check["pass"])

    def respond(self, turn: Any) -> EnvResponse:
        self.last_check = None
        response = super().respond(turn)
        if response.done and self.last_check is not None:
            response.info["check"] = dict(self.last_check)
        return response
