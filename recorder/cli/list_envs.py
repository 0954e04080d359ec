"""``tokengym envs``: every env a rollout can name: the built-in ones, those of ``--import``ed
modules and those installed packages declare in the ``tokengym.envs`` entry points."""

from __future__ import annotations

import argparse
import importlib
import sys


from .common import first_sentence

def cmd_envs(args: argparse.Namespace) -> int:
    import gymnasium as gym

    from tokengym.envs import registered_envs
    from tokengym.envs.registry import BROKEN_DECLARATIONS, ENTRY_POINT_GROUP, import_modules, register_declared_envs

    before = set(gym.registry)
    import_modules(args.imports)
    imported = sorted(set(gym.registry) - before)
    declared = {d.env_id: d for d in register_declared_envs()}
    broken = 0
    for env_id in sorted({*registered_envs(), *imported, *declared}):
        entry = gym.spec(env_id).entry_point
        doc = ""
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            try:
                cls = getattr(importlib.import_module(module), name)
                doc = first_sentence(cls.__doc__ or "")
            except SystemExit as err:  # a package's module that ends the process: listed, not obeyed
                broken += 1
                doc = f"cannot load {entry}: importing it called sys.exit({err.code!r})"
            except Exception as err:  # noqa: BLE001 -- one broken package must not hide the others
                broken += 1
                doc = f"cannot load {entry}: {type(err).__name__}: {err}"
        if env_id in declared:
            doc = f"{doc} [{declared[env_id].distribution}]".strip()
        print(f"{env_id:28s} {doc}")
    for env_id, why in sorted(BROKEN_DECLARATIONS.items()):
        broken += 1
        print(f"{env_id:28s} broken declaration: {why}")
    if broken:
        print(f"{broken} env(s) cannot be loaded (see above)", file=sys.stderr)
        return 1
    if not declared:
        print(f"\n(no installed package declares envs in the {ENTRY_POINT_GROUP!r} entry points)")
    return 0
