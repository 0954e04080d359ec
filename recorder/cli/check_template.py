"""``tokengym check-template``: can a tokenizer's chat template be used token-faithfully, turn by
turn, for a real conversation (and ``fetch-tokenizers`` / ``fetch-templates``, which cache the pinned tokenizers and the template corpus)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


from .common import color, key_json_pairs, text_table

def replay_transcript(env: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Step a reset ReplayEnv (inside a RecordEpisodes wrapper) with its reference actions to the end."""
    rows = []
    done = False
    info: dict[str, Any] = {}
    while not done:
        action = env.unwrapped.reference_action()
        obs, _, term, trunc, info = env.step(action)
        done = term or trunc
        rows.append({"turn": info["turn"], "action": len(action), "observation": len(obs), "conformance": info["conformance"]})
    return info.get("trajectory"), rows


def cmd_check_template(args: argparse.Namespace) -> int:
    from tokengym.envs import ReplayEnv, load_transcript
    from tokengym.recorder import RecordEpisodes

    transcript = load_transcript(args.conversation)
    if args.tools:
        transcript["tools"] = json.loads(Path(args.tools).read_text(encoding="utf-8"))
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    env = RecordEpisodes(
        ReplayEnv(
            args.tokenizer,
            transcript,
            chat_template=template,
            template_kwargs=key_json_pairs(args.template_kwarg),
            conformance="warn",
            conformance_schedule="every_turn",  # a row per turn: each one compared with the template
            max_context_tokens=args.max_context_tokens,
        )
    )
    env.reset(seed=0)
    traj, rows = replay_transcript(env)
    paint = color(sys.stdout.isatty())
    colors = {"ok": "32", "known": "33", "mismatch": "31", "deferred": "90"}
    table = []
    for r in rows:
        c = r["conformance"]
        detail = c.detail if c.status == "mismatch" else ", ".join(c.behaviours)
        table.append([r["turn"], r["action"], r["observation"], paint(c.status, colors.get(c.status, "0")), detail])
    print(text_table(table, ["turn", "action tokens", "observation tokens", "status", "known behaviour / difference"]))
    summary = traj.conformance_summary if traj is not None else {}
    deferred = summary.get("deferred", 0)
    print(
        f"\n{len(traj) if traj is not None else 0} tokens, {len(rows)} turns: {summary.get('ok', 0)} ok, "
        f"{summary.get('known', 0)} known template behaviour, {summary.get('mismatch', 0)} mismatch"
        + (f", {deferred} deferred (not compared on their own turn)" if deferred else "")
    )
    if summary.get("mismatch", 0):
        print("mismatch: the stream differs from the template in a way tokengym cannot name (see the table)")
        return CHECK_MISMATCH
    if summary.get("behaviours"):
        from tokengym.envs.conformance import CAUSES

        turns = [r["turn"] for r in rows if r["conformance"].status == "known"]
        print(
            f"not prefix-stable on turn(s) {turns}: every difference is a named template behaviour, and the "
            "stream keeps the tokens the policy saw:"
        )
        for name in summary["behaviours"]:
            print(f"  {name}: {CAUSES.get(name, name)}")
        return CHECK_NOT_PREFIX_STABLE
    return 0


CHECK_NOT_PREFIX_STABLE = 1
"""``check-template`` exit code: every difference is a named template behaviour."""
CHECK_MISMATCH = 3
"""``check-template`` exit code: a difference tokengym cannot name."""


def cmd_fetch_tokenizers(args: argparse.Namespace) -> int:
    from tokengym.envs import PINNED_TOKENIZERS, fetch_tokenizer

    for name in args.names or sorted(PINNED_TOKENIZERS):
        print(f"{name}: {fetch_tokenizer(name, force=args.force)}")
    return 0


def cmd_fetch_templates(args: argparse.Namespace) -> int:
    """The pinned corpus (``--archive``: a local copy of its sdist), then vLLM's example templates."""
    from tokengym.envs.template_corpus import TEMPLATE_CORPUS, VLLM_EXAMPLES, fetch_templates

    for pin, archive in ((TEMPLATE_CORPUS, args.archive), (VLLM_EXAMPLES, getattr(args, "vllm_archive", None))):
        folder = fetch_templates(archive=archive, force=args.force, pin=pin)
        names = sorted(p.stem for p in folder.glob("*.jinja"))
        print(f"{pin.spec}: {len(names)} chat templates in {folder}")
        for name in names:
            print(f"  {name}")
    return 0
