"""``did you mean ...?`` for a misspelled name: one wording for every error and warning that has one."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(name: str, choices: Iterable[str], *, n: int = 2, cutoff: float = 0.6) -> str:
    """``"did you mean 'a' or 'b'? "`` for the choices close to ``name``, else ``""``."""
    near = difflib.get_close_matches(str(name), sorted(choices), n=n, cutoff=cutoff)
    return f"did you mean {' or '.join(map(repr, near))}? " if near else ""
