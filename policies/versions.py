"""Weight versions: which weights sampled each token, and how a policy takes new weights mid-run.

Asynchronous RL (AReaL, slime, prime-rl, SkyRL's and verl's fully async modes) trains while
episodes are still being generated, so the weights change under turns in flight. A trainer then
needs to know, token by token, which weights sampled what it trains on (its importance ratios are
against those weights), and the user decides what a turn in flight does at an update:

- ``"continue"``: the turn goes on with the new weights; its later tokens carry the new version.
  The engine's KV cache is rebuilt with the new weights first, so a token of version ``v`` was
  sampled from version ``v``'s own forward pass over the whole prefix (what a trainer recomputes).
- ``"restart"``: the turn's tokens so far are dropped and the turn is generated again, from its
  context, with the new weights (the same seed: as if it had started after the update).
- ``"finish"``: turns in flight end on the old weights; new turns wait until the update is in.

A version is an int that only grows: each policy starts at 0 and every ``update_weights`` names a
newer one (or takes the next). Mistakes are named errors, and a failed update changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "ON_UPDATE", "OnUpdate", "PolicyClosed", "VersionWentBackwards", "Versioned", "WeightUpdateError",
    "WeightsMismatch", "check_on_update", "checked_state_dict", "load_weights", "next_version", "version_of",
]

OnUpdate = Literal["continue", "restart", "finish"]
ON_UPDATE: tuple[OnUpdate, ...] = ("continue", "restart", "finish")


class WeightUpdateError(ValueError):
    """An update a policy refused before changing anything."""


class WeightsMismatch(WeightUpdateError):
    """The weights do not fit the model: names it lacks or does not know, or other shapes."""


class VersionWentBackwards(WeightUpdateError):
    """An update named a version that is not newer than the policy's."""


class PolicyClosed(RuntimeError):
    """The policy was closed (or the interpreter is exiting): it takes no more requests or updates."""


@runtime_checkable
class Versioned(Protocol):
    """A policy whose weights can change during a run, and which says which weights sampled what."""

    version: int

    def update_weights(self, weights: Any, version: int | None = None, *, on_update: OnUpdate | None = None) -> int:
        """Take ``weights`` as ``version`` (default: the next one); returns the version now in place."""
        ...


def version_of(policy: Any) -> int | None:
    """The weight version ``policy`` samples with now, or None for a policy that cannot say."""
    v = getattr(policy, "version", None)
    return None if v is None else int(v)


def check_on_update(mode: Any) -> OnUpdate:
    """``mode`` when it is one of :data:`ON_UPDATE`, else a ValueError that lists them."""
    if mode not in ON_UPDATE:
        raise ValueError(f"on_update={mode!r}: use one of {', '.join(map(repr, ON_UPDATE))}")
    return mode  # type: ignore[no-any-return]


def next_version(current: int, version: int | None) -> int:
    """The version an update makes: ``version`` when it is newer than ``current``, else the next one."""
    if version is None:
        return current + 1
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"a weight version is an int, got {type(version).__name__}")
    if version <= current:
        raise VersionWentBackwards(
            f"version {version} is not newer than the policy's version {current}: versions only grow "
            f"(pass version={current + 1} or more, or leave it out for the next one)"
        )
    return version


def load_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict saved in ``path``: a ``.safetensors`` or ``.bin``/``.pt`` file, or a folder of
    them (``save_pretrained``'s, sharded or not)."""
    import torch

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no weights at {p}: pass a state dict, a folder saved by save_pretrained, or a .safetensors file")
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) or sorted(p.glob("*.bin")) or sorted(p.glob("*.pt"))
    if not files:
        raise FileNotFoundError(f"{p} holds no .safetensors, .bin or .pt file of weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        else:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
    return out


def checked_state_dict(weights: Any, model: Any) -> dict[str, torch.Tensor]:
    """``weights`` (a state dict or a path, :func:`load_weights`) checked against ``model``: every
    name known, every shape the same, and every parameter given except those tied to one that is
    (``save_pretrained`` leaves a tied ``lm_head.weight`` out). A :class:`WeightsMismatch` names
    what differs; nothing of the model has changed then."""
    import torch

    if isinstance(weights, (str, os.PathLike)):
        weights = load_weights(weights)
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a state dict (a mapping of names to tensors) or a path, got {type(weights).__name__}")
    own = model.state_dict()
    unknown = sorted(k for k in weights if k not in own)
    shapes = [
        f"{k}: {tuple(v.shape)} (the model's is {tuple(own[k].shape)})"
        for k, v in weights.items() if k in own and tuple(getattr(v, "shape", ())) != tuple(own[k].shape)
    ]
    given_storage = {own[k].data_ptr() for k in weights if k in own}
    missing = sorted(k for k in own if k not in weights and own[k].data_ptr() not in given_storage)
    if unknown or shapes or missing:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's tensors missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
        if unknown:
            parts.append(f"{len(unknown)} names the model does not have ({', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''})")
        if shapes:
            parts.append(f"{len(shapes)} other shapes ({'; '.join(shapes[:3])}{'; ...' if len(shapes) > 3 else ''})")
        raise WeightsMismatch(
            f"the weights do not fit {type(model).__name__}: {', '.join(parts)}; nothing was changed "
            "(were they saved from another model or config?)"
        )
    bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"weights[{bad[0]!r}] is a {type(weights[bad[0]]).__name__}, not a torch.Tensor")
    return dict(weights)


def copy_weights(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Copy checked weights (:func:`checked_state_dict`) into ``model``'s own tensors, in place."""
    import torch

    own = model.state_dict()
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))
