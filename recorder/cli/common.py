"""What the commands share: coloured output, plain tables, KEY=JSON options, first sentences."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def color(enabled: bool):
    def paint(text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if enabled else text

    return paint


def text_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def key_json_pairs(items: Sequence[str], option: str = "--template-kwarg") -> dict[str, Any]:
    """KEY=JSON pairs (a value that is not JSON stays a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{option} expects KEY=JSON, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        except RecursionError:
            raise ValueError(f"{option} {key}: the JSON value is nested too deep to read") from None
    return out


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring, whatever its line breaks (its first paragraph when no
    sentence ends there)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = next((i + 1 for i, ch in enumerate(paragraph) if ch == "." and paragraph[i + 1 : i + 2] in ("", " ")), None)
    return paragraph[:end] if end else paragraph
