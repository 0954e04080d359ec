"""``tokengym rollout``: a run recorded into a store, continued when run again, with exit codes
that say how it ended (:data:`ROLLOUT_EXIT_CODES`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


from .common import key_json_pairs


def _print(line: str) -> None:
    print(line, flush=True)


def _quiet_print(line: str) -> None:
    """``--quiet``: the model and template lines are left out; the store's plan, the summary and errors are not."""


def _hf_policy(model: str, tokenizer: Any, device: str, engine_kwargs: dict[str, Any]) -> Any:
    from tokengym.envs import load_tokenizer
    from tokengym.policies import HFPolicy

    # A name, not a loaded model: HFPolicy reads "smollm2" from its package and fails at once on a missing folder.
    return HFPolicy(model, load_tokenizer(tokenizer), device=device, model_kwargs={"dtype": "float32", **engine_kwargs})


def policy_factory(args: argparse.Namespace, engine_kwargs: dict[str, Any], tokenizer: Any) -> Any:
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
    """``tokengym rollout``; with ``--quiet`` no library's bar either (a GGUF model's conversion,
    the hub's downloads: ``TQDM_DISABLE``, for this command only)."""
    if not args.quiet:
        return _rollout(args)
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        return _rollout(args)
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def _rollout(args: argparse.Namespace) -> int:
    from tokengym.envs import EnvRef, load_tokenizer, resolve_env_id
    from tokengym.envs.tokenizers import check_local_path
    from tokengym.policies import SamplingParams
    from tokengym.policies.model_loading import resolve_model
    from tokengym.recorder import TrajectoryWriter, rollout, summary_table
    from tokengym.recorder.drivers.model_setup import env_template

    resolve_env_id(args.env_id, args.imports)  # an unknown env fails here, before anything is loaded
    extra_env_kwargs = key_json_pairs(args.env_kwarg, "--env-kwarg")
    if "tokenizer" in extra_env_kwargs:
        raise ValueError("pass the env's tokenizer with --tokenizer, not --env-kwarg tokenizer=...")
    if args.mcp:
        if "mcp_servers" in extra_env_kwargs:
            raise ValueError("pass MCP servers with --mcp or --env-kwarg mcp_servers=..., not both")
        extra_env_kwargs["mcp_servers"] = [mcp_server_arg(m, args.mcp_sandbox) for m in args.mcp]
    elif args.mcp_sandbox:
        raise ValueError("--mcp-sandbox sandboxes the --mcp servers: name one with --mcp")

    if not (args.tokenizer or args.model):
        raise ValueError("pass --model (and --tokenizer when it differs), or --tokenizer for --policy scripted")
    if args.policy != "scripted" and not args.model:
        raise ValueError(f"--policy {args.policy} needs --model")
    if args.backend != "ray" and (args.address or args.engines is not None):
        raise ValueError("--address and --engines are for --backend ray")
    if args.backend == "local" and args.workers is not None:
        raise ValueError("--workers is for --backend processes or ray")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    tasks = _read_tasks(args.tasks) if args.tasks else None
    if args.group_size < 1:
        raise ValueError(f"--group-size must be at least 1, got {args.group_size}")
    if args.episodes is None:
        args.episodes = len(tasks) * args.group_size if tasks else 8
    if args.episodes % args.group_size:
        raise ValueError(f"--episodes {args.episodes} is not a multiple of --group-size {args.group_size}: whole groups only")
    from tokengym.recorder import Deadlines

    for flag, value in (("--step-timeout", args.step_timeout), ("--turn-timeout", args.turn_timeout)):
        if not (value >= 0 and value != float("inf")):
            raise ValueError(f"{flag} must be a number of seconds >= 0 (0: no limit), got {value}")
    deadlines = Deadlines(step_s=args.step_timeout or None, generate_s=args.turn_timeout or None)
    if args.backend != "local" and args.schedule == "lockstep":
        raise ValueError(
            f"--schedule lockstep is for --backend local: --backend {args.backend} runs every episode at its own pace"
        )
    say = _quiet_print if args.quiet else _print
    if args.policy in ("hf", "vllm"):
        check_local_path(args.model)  # a mistyped folder fails now, not after the hub's retries
        choice = resolve_model(args.model)  # a near miss of the bundled model's name fails now, by name
        if args.policy == "hf" and choice.bundled:
            say(f"model: {choice.description}")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    engine_kwargs = key_json_pairs(args.engine_kwarg)
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
        policy: Any = policy_factory(args, engine_kwargs, env_tokenizer)
        stopped = (RolloutError,)
    elif args.backend == "processes":
        from tokengym.recorder.drivers.process_backend import ProcessBackend
        from tokengym.recorder.drivers.ray_backend import RolloutError

        backend = ProcessBackend(num_workers=args.workers)
        # The policy samples here; each worker process loads the tokenizer once for its env copies.
        env_tokenizer = args.tokenizer or args.model
        policy = policy_factory(args, engine_kwargs, tokenizer)()
        stopped = (RolloutError,)
    else:
        backend, env_tokenizer = "local", tokenizer
        policy = policy_factory(args, engine_kwargs, tokenizer)()
    turns = {} if args.max_turns is None else {"max_turns": args.max_turns}  # else the env's own default
    env_kwargs = {"tokenizer": env_tokenizer, **turns, **extra_env_kwargs}
    make_env = EnvRef(args.env_id, tuple(args.imports), env_kwargs)
    template, note = env_template(make_env, args.tokenizer or args.model, env_kwargs, given="--env-kwarg chat_template")
    if note:
        say(note)
    if template is not None:
        env_kwargs["chat_template"] = template
        make_env = make_env.with_kwargs(chat_template=template)
    policy_spec: dict[str, Any] = {"kind": args.policy, "model": args.model}
    if args.policy == "scripted":
        policy_spec["replies"] = list(args.reply)
    run = {
        "env_id": args.env_id,
        "env_kwargs": {**turns, **extra_env_kwargs},
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
            ids, note = _plan_episodes(args, stored_episode_ids(writer.directory))
            print(note, flush=True)  # what the run does to the store (new, resumed, appended): said even with --quiet
            if not ids:
                return EXIT_OK
            try:
                result = rollout(
                    make_env, policy, episodes=ids, concurrency=args.concurrency, sampling=sampling,
                    seed=args.seed, on_episode=writer.write, progress=not args.quiet,
                    backend=backend, schedule=args.schedule, group_size=args.group_size, tasks=tasks,
                    deadlines=deadlines,
                )
            finally:
                # Built here, closed here: the HF policy's decode thread is stopped and joined (a daemon
                # thread still inside torch at exit aborts the process: exit 134, not 130).
                close = getattr(policy, "close", None)
                if callable(close):
                    close()
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
"""The run could not go on (an engine died for good, no env worker left, a worker could not start); finished
episodes were kept."""
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


def mcp_server_arg(value: str, sandbox: str | None) -> str | dict[str, str]:
    """One ``--mcp`` value as the env's ``mcp_servers`` entry, inside ``--mcp-sandbox`` if given."""
    if sandbox is None:
        return value
    if value.startswith(("http://", "https://")):
        raise ValueError(f"--mcp-sandbox runs a server's command; {value} is a URL (a server someone else started)")
    return {"command": value, "sandbox": sandbox}


def stored_episode_ids(directory: Path) -> set[int]:
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


def episode_spans(ids: Sequence[int]) -> str:
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
        held = f", which holds {len(stored)} (episodes {episode_spans(stored)})" if stored else ""
        return ids, f"appending {len(ids)} new episodes ({episode_spans(ids) or '-'}, new seeds) to {out}{held}"
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
        f"(episodes {episode_spans(ids)}, same seeds)"
    )


# The keys of tokengym.envs.PINNED_TOKENIZERS, written out so that --help does not import the envs.
