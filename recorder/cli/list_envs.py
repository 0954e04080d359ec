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
    from tokengym.envs.registry import ENTRY_POINT_GROUP, import_modules, register_declared_envs

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
            except (ImportError, AttributeError) as err:
                broken += 1
                doc = f"cannot load {entry}: {err}"
        if env_id in declared:
            doc = f"{doc} [{declared[env_id].distribution}]".strip()
        print(f"{env_id:28s} {doc}")
    if broken:
        print(f"{broken} env(s) cannot be loaded (see above)", file=sys.stderr)
        return 1
    if not declared:
        print(f"\n(no installed package declares envs in the {ENTRY_POINT_GROUP!r} entry points)")
    return 0
