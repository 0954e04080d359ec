"""Find environments by name wherever they are declared, and make them, the same way in every process.

An env name reaches tokengym from a command line or a Ray worker, far from the code that
registered it, so resolving it cannot rely on the caller having imported that code. A name
resolves through, in order:

* gymnasium's ``module:id`` form (``mylab:Todo-v0`` imports ``mylab``, then makes ``Todo-v0``);
* modules to import first (``tokengym rollout --import mylab.envs``), which register on import;
* envs that installed packages declare in the ``tokengym.envs`` entry-point group, one per
  entry: the name is the env id and the value its gymnasium entry point, e.g. in the
  package's ``pyproject.toml``::

      [project.entry-points."tokengym.envs"]
      "mylab/Todo-v0" = "mylab.todo:TodoEnv"

  Declared envs are registered with gymnasium without importing the package (it is imported
  when the env is made), and ``tokengym envs`` lists them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import register, registry

from .near_names import did_you_mean

__all__ = [
    "ENTRY_POINT_GROUP",
    "DeclaredEnv",
    "EnvRef",
    "BROKEN_DECLARATIONS",
    "declared_envs",
    "scan_declared_envs",
    "import_modules",
    "make_env",
    "register_builtin_envs",
    "register_declared_envs",
    "registered_envs",
    "resolve_env_id",
]

ENTRY_POINT_GROUP = "tokengym.envs"
"""The entry-point group where installed packages declare envs (name: env id, value: ``module:attr``)."""

BUILTIN_ENVS = {
    "tokengym/Replay-v0": "tokengym.envs.replay:ReplayEnv",
    "tokengym/Addition-v0": "tokengym.envs.builtin.addition:AdditionEnv",
    "tokengym/Calculator-v0": "tokengym.envs.builtin.calculator:CalculatorEnv",
    "tokengym/DotCount-v0": "tokengym.envs.builtin.dots:DotCountEnv",
    "tokengym/ToolAddition-v0": "tokengym.envs.builtin.tool_addition:ToolAdditionEnv",
    "tokengym/KeyValue-v0": "tokengym.envs.builtin.keyvalue:KeyValueEnv",
    "tokengym/PythonSandbox-v0": "tokengym.envs.builtin.python_sandbox:PythonSandboxEnv",
    "tokengym/Shell-v0": "tokengym.envs.builtin.shell:ShellEnv",
}
"""The ``tokengym/`` envs, registered when ``tokengym.envs`` is imported (by entry point: made lazily)."""


def register_builtin_envs() -> None:
    """Register :data:`BUILTIN_ENVS` with gymnasium (those not registered yet)."""
    for env_id, entry_point in BUILTIN_ENVS.items():
        if env_id not in registry:
            register(id=env_id, entry_point=entry_point)


def registered_envs() -> list[str]:
    """Ids of every environment registered under ``tokengym/``."""
    return sorted(i for i in registry if i.startswith("tokengym/"))


@dataclass(frozen=True)
class DeclaredEnv:
    """An env an installed package declares in :data:`ENTRY_POINT_GROUP`."""

    env_id: str
    entry_point: str
    distribution: str


def scan_declared_envs() -> tuple[list[DeclaredEnv], dict[str, str]]:
    """The envs installed packages declare, sorted by id, and the broken declarations (id ->
    why): a value that is not ``module:attribute``, or an id two packages declare differently
    (which one a name means would otherwise depend on the install order). A broken declaration
    leaves every other env usable; only a run that names it fails, with the reason."""
    found: dict[str, DeclaredEnv] = {}
    broken: dict[str, str] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "?"
        env = DeclaredEnv(ep.name, ep.value, dist)
        if ":" not in ep.value:
            broken[ep.name] = (
                f"package {dist} declares env {ep.name!r} in the {ENTRY_POINT_GROUP!r} entry points as "
                f"{ep.value!r}; the value must be 'module:attribute' (an env class or a factory)"
            )
            continue
        other = found.get(ep.name)
        if other is not None and (other.entry_point, other.distribution) != (env.entry_point, env.distribution):
            broken[ep.name] = (
                f"env {ep.name!r} is declared twice in the {ENTRY_POINT_GROUP!r} entry points: by {other.distribution} "
                f"({other.entry_point}) and by {dist} ({ep.value}); uninstall one of them"
            )
            continue
        found[ep.name] = env
    return [found[k] for k in sorted(found) if k not in broken], broken


def declared_envs() -> list[DeclaredEnv]:
    """Every env declared by an installed package, sorted by id; a ValueError that names the first
    broken declaration (see :func:`scan_declared_envs`, which keeps them apart)."""
    envs, broken = scan_declared_envs()
    if broken:
        raise ValueError(next(iter(broken.values())))
    return envs


BROKEN_DECLARATIONS: dict[str, str] = {}
"""Declared ids that cannot be used, and why (filled by :func:`register_declared_envs`)."""


def register_declared_envs() -> list[DeclaredEnv]:
    """Register with gymnasium every declared env not registered yet (a package's own
    ``register`` call, made when it is imported, is kept). Returns the declared envs."""
    envs, broken = scan_declared_envs()
    BROKEN_DECLARATIONS.clear()
    BROKEN_DECLARATIONS.update(broken)
    for env in envs:
        if env.env_id not in registry:
            register(id=env.env_id, entry_point=env.entry_point)
    return envs


MODULE_FOLDERS: list[str] = []
"""Folders searched, after the installed modules, for a module named by ``MODULE:ID`` or an
import of :func:`import_modules` (the ``tokengym`` script puts the current folder here). They
are on ``sys.path`` only while such a module is imported, so no other import (an optional
dependency, say) ever finds a file of theirs."""


@contextlib.contextmanager
def _searched(folders: Sequence[str]) -> Iterator[None]:
    added = [f for f in folders if f not in sys.path]
    sys.path.extend(added)
    try:
        yield
    finally:
        for f in added:
            if f in sys.path:
                sys.path.remove(f)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def import_modules(modules: Sequence[str]) -> None:
    """Import the modules that register envs, with an error that names the module and the fix.
    A module not installed is looked for in :data:`MODULE_FOLDERS` (after the installed ones)."""
    for name in modules:
        try:
            if MODULE_FOLDERS and name not in sys.modules and not _installed(name):
                with _searched(MODULE_FOLDERS):
                    importlib.import_module(name)
            else:
                importlib.import_module(name)
        except ImportError as err:
            raise ValueError(
                f"cannot import {name!r} to register its envs ({err}); install its package or add its folder "
                "to PYTHONPATH"
            ) from err
        except SystemExit as err:  # a module that ends the process when imported must not end the run quietly
            raise ValueError(f"importing {name!r} to register its envs called sys.exit({err.code!r})") from None
        except Exception as err:  # noqa: BLE001 -- a relative name (TypeError), or the module's own failure
            raise ValueError(
                f"importing {name!r} to register its envs failed: {type(err).__name__}: {err}"
                + (" (name an absolute module: MODULE:ID takes no leading dot)" if name.startswith(".") else "")
            ) from err


def resolve_env_id(spec: str, imports: Sequence[str] = ()) -> str:
    """The registered id ``spec`` names, after importing ``imports`` and ``spec``'s module part
    and registering the declared envs; a ValueError with the near names and the ways to
    register an env when there is none."""
    register_builtin_envs()  # a fresh process may not have imported tokengym.envs' facade
    module, sep, env_id = spec.rpartition(":")
    import_modules([*imports, *([module] if sep else [])])
    register_declared_envs()
    if env_id in BROKEN_DECLARATIONS and env_id not in registry:
        raise ValueError(f"environment {env_id!r} cannot be used: {BROKEN_DECLARATIONS[env_id]}")
    try:
        return gym.spec(env_id).id
    except gym.error.Error as err:
        hint = did_you_mean(env_id, registry, cutoff=0.85)
        raise ValueError(
            f"unknown environment {env_id!r} ({err}). {hint}An env is found when a module that registers it "
            f"is imported (write MODULE:{env_id}, or pass --import MODULE) or when an installed package "
            f"declares it in the {ENTRY_POINT_GROUP!r} entry points; `tokengym envs` lists the known ones"
        ) from None


def make_env(spec: str, imports: Sequence[str] = (), kwargs: Mapping[str, Any] | None = None) -> gym.Env:
    """``gym.make`` of the env ``spec`` names (see :func:`resolve_env_id`), with ``kwargs``; an
    argument the env does not take is a ValueError that lists the ones passed."""
    env_id, kwargs = resolve_env_id(spec, imports), dict(kwargs or {})
    entry = gym.spec(env_id).entry_point
    if isinstance(entry, str):
        from gymnasium.envs.registration import load_env_creator

        try:
            load_env_creator(entry)
        except (ImportError, AttributeError) as err:
            raise ValueError(
                f"{env_id} cannot be made: its entry point {entry!r} does not load ({type(err).__name__}: {err}); "
                f"install the package that provides {entry.partition(':')[0]!r}, or fix the entry point where "
                f"{env_id} is registered"
            ) from err
    try:
        return gym.make(env_id, **kwargs)
    except TypeError as err:
        if "argument" not in str(err):
            raise
        # gymnasium's message repeats the kwargs' values (a tokenizer's repr is kilobytes): the names do
        said = str(err).split(" was raised from the environment creator")[0]
        raise ValueError(f"{env_id} cannot be made with the arguments {sorted(kwargs)}: {said}{_near_kwarg(env_id, err)}") from err


def _near_kwarg(env_id: str, err: TypeError) -> str:
    """``"; did you mean 'max_turns'?"`` for a misspelled keyword argument of the env (and of the
    classes it passes its keywords on to), else ``""``."""
    bad = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    entry = gym.spec(env_id).entry_point
    if bad is None or not isinstance(entry, str):
        return ""
    module, _, attr = entry.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception:  # noqa: BLE001 -- only a hint
        return ""
    names: set[str] = set()
    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__", klass if klass is cls else None)
        try:
            names.update(p for p in inspect.signature(init).parameters if p not in ("self", "args", "kwargs"))
        except (TypeError, ValueError):
            continue
    hint = did_you_mean(bad.group(1), names, cutoff=0.7)
    return f"; {hint.rstrip()}" if hint else ""


@dataclass(frozen=True)
class EnvRef:
    """A picklable env factory by name: the same resolution in the process that makes the env
    (a Ray worker) as in the one that named it (the command line)."""

    spec: str
    imports: tuple[str, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self) -> gym.Env:
        return make_env(self.spec, self.imports, self.kwargs)

    def with_kwargs(self, **kwargs: Any) -> EnvRef:
        """A copy whose env kwargs are updated with ``kwargs``."""
        return replace(self, kwargs={**self.kwargs, **kwargs})
