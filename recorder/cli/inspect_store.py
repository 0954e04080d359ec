"""``tokengym inspect``: what a trajectory store holds, and one episode's tokens in colour.

``tokengym inspect PATH`` prints the store's summary (:mod:`tokengym.recorder.summary`) and one
trajectory as the exact token stream the policy saw, decoded segment by segment (the views of
:mod:`tokengym.recorder.views`); ``--html FILE`` writes the report of :mod:`tokengym.recorder.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


from ..report import REPORT_EPISODES, check_ids, render_report
from ..store import StoreError, accept_shards
from ..summary import format_summary, summarize_with_totals
from ..trajectory import Trajectory
from ..views import episode_notes, printable, render_legend_text, render_trajectory_text, render_turn_table

__all__ = ["add_inspect_parser", "cmd_inspect", "main"]

def add_inspect_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``inspect`` sub-command to ``parser.add_subparsers(...)``; returns its parser."""
    p = subparsers.add_parser(
        "inspect",
        help="summarize a trajectory store and show one episode's tokens",
        description=(
            "Summarize a trajectory store (episodes, tokens, rewards, turns, stop reasons, conformance) and show "
            "one episode: policy tokens (mask 1) in green, prompt in grey, observations (mask 0) in blue."
        ),
    )
    p.add_argument("path", help="the store directory (written by TrajectoryWriter or tokengym rollout)")
    p.add_argument("--episode", type=int, default=0, metavar="N", help="which episode to show (-1 = last)")
    p.add_argument(
        "--tokenizer",
        help="for decoding: local folder, pinned name or hub name (default: the store's tokenizer when pinned)",
    )
    p.add_argument("--no-color", action="store_true", help="no ANSI colours (also: NO_COLOR=1)")
    p.add_argument(
        "--html",
        metavar="FILE",
        help="also write a report as one self-contained HTML page (inline SVG and CSS, no scripts): the summary, "
        "histograms of rewards and of episode lengths in tokens and turns, and a few episodes in colour",
    )
    p.add_argument(
        "--html-episodes",
        type=int,
        default=REPORT_EPISODES,
        metavar="K",
        help=f"episodes the report shows in full (default {REPORT_EPISODES}): the one --episode names, the highest and "
        "lowest reward, the longest and shortest, then the store's order",
    )
    p.add_argument(
        "--accept-shards",
        action="store_true",
        help="make the manifest list the shards on disk: accept a deleted shard as lost, or a shard put there by hand",
    )
    p.set_defaults(func=cmd_inspect)
    return p


def _use_color(args: argparse.Namespace) -> bool:
    if args.no_color or os.environ.get("NO_COLOR"):
        return False
    return bool(os.environ.get("FORCE_COLOR")) or sys.stdout.isatty()


@functools.lru_cache(maxsize=4)
def _load_tokenizer(spec: str) -> Any:
    """``load_tokenizer(spec)``, once per process (loading and fingerprinting take a second or two)."""
    from tokengym.envs import load_tokenizer

    return load_tokenizer(spec)


def _decoding_tokenizer(args: argparse.Namespace, summary: dict[str, Any]) -> tuple[Any, str | None]:
    """(tokenizer or None, a note for the user). Only pinned or packaged names are loaded implicitly (no network)."""
    from tokengym.envs.tokenizers import is_offline_name

    from ..store import tokenizer_fingerprint

    spec = args.tokenizer
    if spec is None:
        name = summary["tokenizer_name"]
        if not (name and is_offline_name(name)):
            return None, (
                f"the store's tokenizer {name!r} is not a pinned or packaged name; pass --tokenizer to decode the tokens"
            )
        try:
            tok = _load_tokenizer(name)
        except (OSError, RuntimeError, ValueError, ImportError) as err:  # e.g. not cached and no way to fetch it
            return None, f"could not load the tokenizer {name!r} ({err}); pass --tokenizer to decode"
        spec = name
    else:
        tok = _load_tokenizer(spec)
    note = None
    want = summary["tokenizer_hash"]
    if want and tokenizer_fingerprint(tok) != want:
        note = (
            f"warning: tokenizer {spec!r} has another fingerprint than the store's ({want[:12]}…): "
            "another vocabulary or chat template; the text below may not be what the policy saw"
        )
    return tok, note


def _pick(path: str, index: int, total: int) -> Trajectory:
    from ..store import read_trajectories

    if not -total <= index < total:
        raise IndexError(f"--episode {index} is out of range: the store holds {total} episodes")
    index %= total
    for i, traj in enumerate(read_trajectories(path)):
        if i == index:
            return traj
    raise StoreError(f"{path}: episode {index} not found")  # pragma: no cover - summary and shards disagree


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``tokengym inspect``. Exit status: 0 shown; 2 not a readable store, bad ``--episode``,
    tokenizer that cannot be loaded, or an ``--html`` file that cannot be written (message on stderr)."""
    try:
        if getattr(args, "accept_shards", False):
            changes = accept_shards(args.path)
            for what, names in (("dropped from", changes["dropped"]), ("added to", changes["added"])):
                for name in names:
                    print(f"accepted: {name} {what} the manifest")
            if not (changes["dropped"] or changes["added"]):
                print("accepted: the manifest already listed exactly the shards on disk")
        summary, totals = summarize_with_totals(args.path)
        print(format_summary(summary))
        if summary["episodes"] == 0:
            print("\nthe store holds no episodes yet")
            if args.html:
                raise StoreError("--html: the store holds no episode to show")
            return 0
        traj = _pick(args.path, args.episode, summary["episodes"])
        index = args.episode % summary["episodes"]
        tok, note = _decoding_tokenizer(args, summary)
        m = traj.mask
        print(
            f"\nepisode {index} of {summary['episodes']}: env {printable(traj.env_id)} · seed {traj.seed} · "
            f"{len(traj):,} tokens "
            f"({int(m.sum()):,} policy, {int((m == 0).sum()):,} context) · {traj.num_turns} turns · "
            f"reward {traj.reward:.4g} · stop reason {printable(traj.stop_reason)}"
            + "".join(f" · {n}" for n in episode_notes(traj))
        )
        if note:
            print(note, file=sys.stderr)
        if tok is not None:
            check_ids(traj, index, tok)
        if tok is None:
            if args.html:
                raise ValueError(f"--html needs a tokenizer to decode the tokens: {note}")
        else:
            color = _use_color(args)
            print(render_legend_text(color) + "\n")
            print(render_trajectory_text(traj, tok, color=color, escape_controls=True))
        print()
        print(render_turn_table(traj))
        if args.html:
            out = Path(args.html)
            page = render_report(summary, totals, tok, episode=args.episode, show=args.html_episodes, document=True)
            out.write_text(page, encoding="utf-8")
            shown = min(args.html_episodes, summary["episodes"])
            print(f"\nwrote {out}: the summary, histograms of rewards and lengths, {shown} episodes in colour")
        return 0
    except BrokenPipeError:  # e.g. `tokengym inspect runs/x | head`
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (StoreError, OSError, IndexError, KeyError, ValueError, RuntimeError) as err:
        # FileNotFoundError is an OSError; TokenizerFetchError a RuntimeError.
        print(f"tokengym inspect: error: {err}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tokengym.recorder.cli.inspect_store PATH ...`` (the same as ``tokengym inspect``)."""
    parser = argparse.ArgumentParser(prog="tokengym")
    add_inspect_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["inspect", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
