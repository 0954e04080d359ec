"""Per-turn cost of producing observation token ids in multi-turn tool episodes, and of the
whole ``env.step()`` a user calls.

Why this benchmark exists
-------------------------
A "messages-in" agent loop (the TRL / verifiers style) re-renders and re-tokenizes the
whole conversation with ``tokenizer.apply_chat_template`` after every assistant turn and
keeps the suffix it did not have yet. That costs time proportional to the conversation
length, so an episode of N turns costs O(N^2). tokengym's :meth:`ChatRenderer.observation`
renders only the new messages inside a small fixed conversation, so its per-turn cost
should be *flat in the number of turns*. What a user gets is ``env.step()``, which also
checks the stream against the template's render of the whole conversation: by default on
turns 0, 1, 3, 7, ... and the last (``conformance_schedule="doubling"``), so that its cost
per step stays flat too. Every render (the observation's small conversation and the check's whole
one) goes through a sandbox that remembers its per-type safety decisions
(``tokengym.envs.whole_render``), at about a third of what ``apply_chat_template`` takes for it. Goals at 128 turns: ``step(default)`` last-quarter / first-quarter
<= 1.2, and ``step(default)`` at least 40x faster than messages-in (mean per turn), on every one
of ``--runs`` whole runs (5 by default: a VM's speed moves between runs, and a goal met once may
not be met the next time; the min and the median are reported, the table is the median run's).

What is measured (side by side, on the same synthetic transcripts, in one run)
-----------------------------------------------------------------------------
* ``observation``: ``ChatRenderer.observation(new_tool_messages, tools, assistant_tool_calls=...)``.
* ``step(default)``: the whole ``ReplayEnv.step`` (``ChatEnv.step``) with default settings
  (``conformance="warn"``, doubling schedule), fed the transcript's reference actions.
* ``step(off)``: the same with ``conformance="off"`` (no check).
* ``step(every_turn)``: the same with ``conformance_schedule="every_turn"``, the check on
  every turn (what ``"warn"`` did before the schedule; O(N) per step).
* ``messages-in``: ``tok.apply_chat_template(all_messages_so_far, tools=..., tokenize=True,
  return_dict=False, add_generation_prompt=True)``, then the ids after the assistant's
  end-of-turn token (the first ``<|im_end|>`` after the previous render's length). Note: a
  loop that cuts at ``len(previous) + len(completion_ids)`` instead would be off by the
  empty ``<think></think>`` block Qwen3 adds to a last assistant turn and drops from history.

Each synthetic transcript has a system prompt, 2 tools, one user message, then N assistant
turns (short reasoning-free content and 1-2 tool calls with realistic JSON arguments, each
answered by a tool result of a few hundred characters) and a final assistant answer. Every
turn, the tokengym observation ids are checked to equal the messages-in suffix ids (and the
``step`` observations to equal both); a mismatch prints the turn and exits with status 1.

Timing, in two passes. Pass 1 (the speed ratios): every method runs each episode ``--repeats``
times, all methods advanced together turn by turn (turn k of every method, in a shuffled order,
then turn k + 1), so that a change in the machine's speed during a run falls on all of them
alike, and no method always runs right after the same other one; each step thus starts with the
caches another method left, as in a real loop where generation runs between steps. Pass 2 (how
each method's cost grows with the turn: ``last/first, own``): each method's episode alone, twice
back to back with the second one timed, the methods in turn, ``--repeats`` rounds; in pass 1 the renders that grow with the conversation
(messages-in's, every_turn's checks) slow whatever runs after them, so that even
``observation()``, whose work is the same on every turn, comes out 1.1-1.25 there. One untimed
warm-up call each first; the garbage collector off during each episode's timed turns as in
``timeit``, and run between episodes. A turn's time is its median over repeats. The per-turn columns cover
the N tool turns, which every method has.
The ``step`` methods also time the final step (the final answer, which ends the episode and
always runs the whole-conversation check unless conformance is off): it is reported on its
own (``final step``) and in the episode total. Reported per N: mean and median microseconds
per turn, the mean over the first and the last quarter of turns and their ratio (pass 1, and
pass 2's: flat cost => ratio near 1), the final step, the episode total (N turns, plus the final
step for ``step``), tokens per observation, and the ratio of the messages-in cost to each
method's (mean per turn, last quarter, episode). The goals use pass 1's mean-per-turn ratio (its
min over the runs) and pass 2's growth (its max over the runs).

Run (from the repository root)::

    python benchmarks/observation_tokens.py                      # --turns 8 32 128, 5 runs
    python benchmarks/observation_tokens.py --turns 128 --runs 1 --repeats 3 --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from tokengym.envs import ChatRenderer, ReplayEnv, load_tokenizer

STEP_SETTINGS: dict[str, dict[str, Any]] = {
    "step(default)": {},
    "step(off)": {"conformance": "off"},
    "step(every_turn)": {"conformance_schedule": "every_turn"},
}
METHODS = ("observation", *STEP_SETTINGS, "messages-in")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository for a regular expression and return matching lines.",
            "parameters": {
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "Regular expression to search for."},
                    "path": {"type": "string", "description": "Folder to search in, relative to the root."},
                    "max_results": {"type": "integer", "description": "Maximum number of matches."},
                },
                "required": ["pattern"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a range of lines from a file in the repository.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path relative to the root."},
                    "start_line": {"type": "integer", "description": "First line, 1-based."},
                    "end_line": {"type": "integer", "description": "Last line, inclusive."},
                },
                "required": ["path"],
            },
        },
    },
]

SYSTEM = (
    "You are a careful software engineering assistant working in a Python repository. "
    "Use the tools to inspect the code before answering. Keep answers short and precise."
)
USER = "The config loader ignores environment overrides for nested keys. Find where and explain why."

_FILES = ["src/config/loader.py", "src/config/schema.py", "src/cli/main.py", "src/utils/env.py",
          "tests/test_loader.py", "src/config/merge.py", "docs/configuration.md", "src/app/settings.py"]
_SYMBOLS = ["load_config", "merge_dicts", "apply_env_overrides", "ConfigSchema", "parse_env_key",
            "DEFAULTS", "resolve_path", "Settings.from_env", "flatten_keys", "_coerce_value"]
_SAYINGS = ["Let me search for {s} to see where it is defined.",
            "I'll look at how {s} is used in {f}.",
            "Next I'll read the relevant part of {f} and check {s}.",
            "The previous result points at {s}; reading {f} around it.",
            "Checking whether {s} handles nested keys."]
_WORDS = ("value key nested override env prefix split separator dict merge default schema "
          "return none string int bool path section lower upper strip items update").split()


def _tool_result(rng: random.Random, name: str, args: dict[str, Any]) -> str:
    target = 200 + rng.randrange(400)
    lines: list[str] = []
    size = 0
    line_no = rng.randrange(1, 400)
    while size < target:
        if name == "search_code":
            f = rng.choice(_FILES)
            body = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(4, 10)))
            line = f"{f}:{line_no}:    {rng.choice(_SYMBOLS)}({body})"
        else:
            indent = " " * (4 * rng.randrange(0, 3))
            body = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 9)))
            line = f"{line_no:>4}  {indent}{rng.choice(['if', 'for', 'return', 'x =', '#'])} {body}"
        lines.append(line)
        size += len(line) + 1
        line_no += rng.randrange(1, 12)
    return "\n".join(lines)


def make_transcript(turns: int, seed: int = 0) -> dict[str, Any]:
    """A tool-use transcript with ``turns`` tool-calling assistant turns and a final answer."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    call_no = 0
    for t in range(turns):
        content = rng.choice(_SAYINGS).format(s=rng.choice(_SYMBOLS), f=rng.choice(_FILES)) + f" (step {t + 1})"
        calls = []
        for _ in range(rng.choice((1, 1, 2))):
            if rng.random() < 0.5:
                name = "search_code"
                args: dict[str, Any] = {"pattern": rf"def {rng.choice(_SYMBOLS).split('.')[-1]}\b",
                                        "path": rng.choice(["src", "src/config", "tests"]),
                                        "max_results": rng.choice((10, 20, 50))}
            else:
                start = rng.randrange(1, 300)
                name = "read_file"
                args = {"path": rng.choice(_FILES), "start_line": start, "end_line": start + rng.randrange(20, 80)}
            calls.append({"id": f"call_{call_no}", "type": "function", "function": {"name": name, "arguments": args}})
            call_no += 1
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for c in calls:
            fn = c["function"]
            messages.append({"role": "tool", "tool_call_id": c["id"], "name": fn["name"],
                             "content": _tool_result(rng, fn["name"], fn["arguments"])})
    messages.append({"role": "assistant", "content": "The override is applied before nested keys are merged, "
                     "so merge_dicts overwrites it; apply it after the merge."})
    return {"messages": messages, "tools": TOOLS}


def split_turns(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """(prompt messages, [(assistant message, tool messages that answer it)]) for tool-calling turns."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    turns = []
    i = first
    while i < len(messages):
        assistant = messages[i]
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if assistant.get("tool_calls"):
            turns.append((assistant, messages[i + 1 : j]))
        i = j
    return messages[:first], turns


# ------------------------------------------------------------------ the methods
# Each method is a generator that does one turn's work per ``next()`` and yields
# (nanoseconds, observation ids, conformance status or None); the step methods yield the final
# step last. The driver advances all of them turn by turn, so that a change in the machine's
# speed during a run falls on every method at the same turn.
Turn = tuple[int, list[int], "str | None"]


def observation_turns(renderer: ChatRenderer, tools, turns) -> Iterator[Turn]:
    clock = time.perf_counter_ns
    for assistant, new in turns:
        calls = assistant["tool_calls"]
        t0 = clock()
        ids = renderer.observation(new, tools, assistant_tool_calls=calls).ids
        yield clock() - t0, ids, None


def messages_in_turns(tok, im_end: int, prompt, tools, turns) -> Iterator[Turn]:
    clock = time.perf_counter_ns
    history = list(prompt)
    prev_len = len(tok.apply_chat_template(history, tools=tools, tokenize=True, return_dict=False,
                                           add_generation_prompt=True))
    for assistant, new in turns:
        history.append(assistant)
        history.extend(new)
        t0 = clock()
        full = tok.apply_chat_template(history, tools=tools, tokenize=True, return_dict=False,
                                       add_generation_prompt=True)
        suffix = full[full.index(im_end, prev_len) + 1 :]
        elapsed = clock() - t0
        prev_len = len(full)
        yield elapsed, suffix, None


def step_turns(env: ReplayEnv, actions, n: int) -> Iterator[Turn]:
    """The n tool turns, then the final step (which must end the episode)."""
    clock = time.perf_counter_ns
    env.reset(seed=0)
    for k in range(n + 1):
        t0 = clock()
        o, _, terminated, truncated, info = env.step(actions[k])
        elapsed = clock() - t0
        if k < n and (terminated or truncated):
            raise RuntimeError(f"ReplayEnv ended early at turn {k}: {info.get('stop_reason')}")
        if k == n and not (terminated or truncated):
            raise RuntimeError(f"ReplayEnv did not end after the final answer (turn {n})")
        yield elapsed, o.tolist(), info["conformance"].status


def warm_up(method: str, renderer: ChatRenderer, tok, prompt, tools, turns) -> None:
    """One untimed call of the method's work, so the first timed turn is not a cold one."""
    if method == "observation":
        renderer.observation(turns[0][1], tools, assistant_tool_calls=turns[0][0]["tool_calls"])
    elif method == "messages-in":
        tok.apply_chat_template([*prompt, turns[0][0], *turns[0][1]], tools=tools, tokenize=True,
                                return_dict=False, add_generation_prompt=True)
    else:
        renderer.prompt(prompt, tools)


def verify_prefix_stable(tok, prompt, turns) -> None:
    """Each full render starts with the previous one (so a suffix is a fair observation)."""
    history = list(prompt)
    prev = tok.apply_chat_template(history, tools=TOOLS, tokenize=True, return_dict=False, add_generation_prompt=True)
    for k, (assistant, new) in enumerate(turns):
        history += [assistant, *new]
        full = tok.apply_chat_template(history, tools=TOOLS, tokenize=True, return_dict=False, add_generation_prompt=True)
        if full[: len(prev)] != prev:
            fail(f"turn {k}: the messages-in render is not prefix-stable (history tokens changed)")
        prev = full


def fail(msg: str) -> None:
    print(f"MISMATCH: {msg}", file=sys.stderr)
    sys.exit(1)


def summarize(times_ns: list[int]) -> dict[str, float]:
    us = [t / 1000 for t in times_ns]
    q = max(1, len(us) // 4)
    first, last = statistics.fmean(us[:q]), statistics.fmean(us[-q:])
    return {"mean_us": statistics.fmean(us), "median_us": statistics.median(us),
            "first_quarter_us": first, "last_quarter_us": last, "last_over_first": last / first}


def interleave(
    methods: tuple[str, ...], repeats: int, n: int, make_run, warm, shuffle: random.Random
) -> tuple[dict[str, list[list[int]]], dict[str, list[int]], dict[str, list[list[int]]], dict[str, list[str]]]:
    """Run ``methods`` ``repeats`` times, advanced together turn by turn: (per-turn ns per repeat,
    final-step ns per repeat, the first repeat's observation ids, its conformance statuses)."""
    per_turn: dict[str, list[list[int]]] = {m: [] for m in methods}
    finals: dict[str, list[int]] = {m: [] for m in methods if m in STEP_SETTINGS}
    outputs: dict[str, list[list[int]]] = {}
    statuses: dict[str, list[str]] = {}
    for r in range(repeats):
        order = list(methods)
        for method in order:
            warm(method)
        runs = {method: make_run(method) for method in order}
        results: dict[str, list[Turn]] = {m: [] for m in order}
        gc.collect()
        gc.disable()
        try:
            for _ in range(n):
                shuffle.shuffle(order)  # each turn in another order: no method always follows the same one
                for method in order:
                    results[method].append(next(runs[method]))
            for method in order:
                if method in STEP_SETTINGS:
                    results[method].append(next(runs[method]))  # the final step
        finally:
            gc.enable()
        for method, got in results.items():
            per_turn[method].append([t for t, _, _ in got[:n]])
            if method in STEP_SETTINGS:
                finals[method].append(got[n][0])
            if r == 0:
                outputs[method] = [o for _, o, _ in got[:n]]
                if method in STEP_SETTINGS:
                    statuses[method] = [st for _, _, st in got if st is not None]
    return per_turn, finals, outputs, statuses


def bench(n: int, repeats: int, renderer: ChatRenderer, tok) -> dict[str, Any]:
    transcript = make_transcript(n, seed=n)
    prompt, turns = split_turns(transcript["messages"])
    assert len(turns) == n
    tools = transcript["tools"]
    im_end = renderer.turn_end_ids[-1]
    envs = {method: ReplayEnv(renderer, transcript, max_context_tokens=1 << 24, **settings)
            for method, settings in STEP_SETTINGS.items()}
    envs["step(off)"].reset(seed=0)
    actions = [envs["step(off)"].reference_action(k) for k in range(n + 1)]

    def make_run(method: str) -> Iterator[Turn]:
        if method == "observation":
            return observation_turns(renderer, tools, turns)
        if method == "messages-in":
            return messages_in_turns(tok, im_end, prompt, tools, turns)
        return step_turns(envs[method], actions, n)

    def warm(method: str) -> None:
        warm_up(method, renderer, tok, prompt, tools, turns)

    # Pass 1, every method advanced together turn by turn: the speed ratios. Pass 2, each method's
    # episode alone (methods in turn, `repeats` rounds, see below): how its cost grows with the turn. In pass 1
    # the renders that grow with the conversation (messages-in's, every_turn's checks) slow whatever
    # runs after them: observation(), whose work is the same on every turn, shows 1.15-1.25 there
    # and ~1.04 alone (its last quarter has 5% more tokens).
    per_turn, finals, outputs, statuses = interleave(METHODS, repeats, n, make_run, warm, random.Random(n))
    flat_per_turn: dict[str, list[list[int]]] = {m: [] for m in METHODS if m != "messages-in"}
    for _ in range(repeats):
        for method in flat_per_turn:
            # Twice back to back, the second timed: it starts with the caches its own episode left,
            # not those of the method before it (every_turn's last whole render, say).
            alone, _, _, _ = interleave((method,), 2, n, make_run, warm, random.Random(n))
            flat_per_turn[method].append(alone[method][1])

    # Correctness: tokengym == messages-in suffix for every turn; step() observations too.
    ref = outputs["messages-in"]
    for method in METHODS:
        for k, (a, b) in enumerate(zip(outputs[method], ref, strict=True)):
            if a != b:
                at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                fail(f"N={n}, turn {k}: {method} ids differ from the messages-in suffix at token {at} "
                     f"({len(a)} vs {len(b)} tokens)\n"
                     f"  {method}: {renderer.decode(a)!r}\n  messages-in: {renderer.decode(b)!r}")
    verify_prefix_stable(tok, prompt, turns)
    for method, status in statuses.items():
        bad = [k for k, s in enumerate(status) if s == "mismatch"]
        if bad:
            fail(f"N={n}: {method} reported a conformance mismatch on turns {bad}")
    if statuses["step(default)"][-1] == "deferred" or statuses["step(every_turn)"].count("deferred"):
        fail(f"N={n}: a turn that must be checked was deferred: {statuses}")

    tokens = [len(o) for o in ref]
    result: dict[str, Any] = {
        "turns": n,
        "tokens_per_observation": statistics.fmean(tokens),
        "episode_tokens": len(renderer.prompt(prompt, tools).ids) + sum(len(a) for a in actions[:n]) + sum(tokens),
        "conformance_statuses": {m: {s: st.count(s) for s in sorted(set(st))} for m, st in statuses.items()},
        "methods": {},
    }
    for method in METHODS:
        median_per_turn = [int(statistics.median(col)) for col in zip(*per_turn[method], strict=True)]
        s = summarize(median_per_turn)
        # How the cost grows, each method's episode alone (pass 2; messages-in is not in it: its figure is pass 1's).
        s["own_last_over_first"] = s["last_over_first"]
        if method in flat_per_turn:
            own = summarize([int(statistics.median(col)) for col in zip(*flat_per_turn[method], strict=True)])
            s["own_last_over_first"] = own["last_over_first"]
        s["final_step_us"] = statistics.median(finals[method]) / 1000 if method in finals else None
        s["episode_ms"] = (sum(median_per_turn) / 1000 + (s["final_step_us"] or 0.0)) / 1000
        s["per_turn_us"] = [t / 1000 for t in median_per_turn]
        result["methods"][method] = s
    base = result["methods"]["messages-in"]
    for method, s in result["methods"].items():
        s["baseline_over_this"] = base["mean_us"] / s["mean_us"]
        s["baseline_over_this_last_quarter"] = base["last_quarter_us"] / s["last_quarter_us"]
        s["baseline_over_this_episode"] = base["episode_ms"] / s["episode_ms"]
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    print("| turns | method | mean µs/turn | median µs/turn | first ¼ µs | last ¼ µs | last/first | last/first, "
          "own | final step µs | episode ms | tokens/obs | messages-in ÷ method (mean) | (last ¼) | (episode) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        for method, s in res["methods"].items():
            final = "-" if s["final_step_us"] is None else f"{s['final_step_us']:,.0f}"
            print(f"| {res['turns']} | {method} | {s['mean_us']:,.0f} | {s['median_us']:,.0f} "
                  f"| {s['first_quarter_us']:,.0f} | {s['last_quarter_us']:,.0f} | {s['last_over_first']:.2f} "
                  f"| {s['own_last_over_first']:.2f} "
                  f"| {final} | {s['episode_ms']:,.1f} | {res['tokens_per_observation']:.0f} "
                  f"| {s['baseline_over_this']:.1f}x | {s['baseline_over_this_last_quarter']:.1f}x "
                  f"| {s['baseline_over_this_episode']:.1f}x |")


def over_runs(runs: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per turn count, messages-in ÷ step(default) (mean per turn) of every run, with its min and median."""
    out: dict[str, dict[str, Any]] = {}
    for results in zip(*runs, strict=True):
        ratios = [r["methods"]["step(default)"]["baseline_over_this"] for r in results]
        flats = [r["methods"]["step(default)"]["own_last_over_first"] for r in results]
        out[str(results[0]["turns"])] = {"ratios": ratios, "min": min(ratios), "median": statistics.median(ratios),
                                         "own_last_over_first": flats}
    return out


def print_goals(results: list[dict[str, Any]], spread: dict[str, dict[str, Any]]) -> list[str]:
    """The goals for the default ``step()``, met or not, at the largest turn count run, on every
    run (``spread``: :func:`over_runs`); returns the goals missed (the script then exits 1)."""
    res = max(results, key=lambda r: r["turns"])
    s = res["methods"]["step(default)"]
    runs = spread[str(res["turns"])]
    flat, speed = max(runs["own_last_over_first"]), runs["min"]
    print(f"\nGoals at {res['turns']} turns, step(default):")
    print(f"  last ¼ / first ¼ per step = {flat:.2f} (the most of any run; goal <= 1.2): {'met' if flat <= 1.2 else 'NOT met'} "
          f"(with messages-in between: {s['last_over_first']:.2f}; observation() "
          f"{res['methods']['observation']['own_last_over_first']:.2f} / "
          f"{res['methods']['observation']['last_over_first']:.2f})")
    print(f"  messages-in ÷ step(default), mean per turn, over {len(runs['ratios'])} run(s): min {speed:.1f}x, "
          f"median {runs['median']:.1f}x (goal >= 40x on every run): {'met' if speed >= 40 else 'NOT met'}; "
          f"in the median run: last ¼ {s['baseline_over_this_last_quarter']:.1f}x, "
          f"episode incl. the final step {s['baseline_over_this_episode']:.1f}x")
    off = res["methods"]["step(off)"]
    print(f"  for reference: step(off) {off['mean_us']:,.0f} µs/turn ({off['baseline_over_this']:.1f}x), "
          f"step(every_turn) last/first {res['methods']['step(every_turn)']['own_last_over_first']:.2f}")
    return [name for name, met in (("flat per step", flat <= 1.2), ("40x cheaper than messages-in", speed >= 40)) if not met]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 32, 128], help="assistant tool turns per episode")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each episode per method (median per turn)")
    parser.add_argument("--tokenizer", default="qwen3", help="pinned name, local folder or hub name")
    parser.add_argument("--runs", type=int, default=5,
                        help="whole runs, one after another (the goal holds on every one; the table is the median run's)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.runs < 1 or any(n < 1 for n in args.turns):
        parser.error("--repeats, --runs and --turns must be positive")

    tok = load_tokenizer(args.tokenizer)
    renderer = ChatRenderer(tok)
    started = time.perf_counter()
    runs: list[list[dict[str, Any]]] = []
    for run in range(args.runs):
        results = []
        for n in args.turns:
            res = bench(n, args.repeats, renderer, tok)
            results.append(res)
            print(f"run {run + 1}/{args.runs}, N={n}: ids verified equal on all {n} turns; conformance statuses "
                  f"(incl. the final step) {res['conformance_statuses']}; episode {res['episode_tokens']:,} tokens; "
                  f"messages-in ÷ step(default) {res['methods']['step(default)']['baseline_over_this']:.1f}x",
                  flush=True)
        runs.append(results)
    elapsed = time.perf_counter() - started
    spread = over_runs(runs)
    largest = str(max(args.turns))
    median_run = sorted(range(len(runs)), key=lambda i: spread[largest]["ratios"][i])[len(runs) // 2]
    results = runs[median_run]
    print(f"\nObservation token ids per turn, {args.tokenizer} chat template, repeats={args.repeats}, "
          f"the median of {args.runs} run(s) (run {median_run + 1}), Python {platform.python_version()}, "
          f"{elapsed:.0f} s total\n")
    print_table(results)
    missed = print_goals(results, spread)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"tokenizer": args.tokenizer, "repeats": args.repeats, "runs": args.runs, "elapsed_s": elapsed,
                       "python": platform.python_version(), "over_runs": spread, "median_run": median_run,
                       "results": results}, fh, indent=2)
    if missed:
        print(f"goal missed: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
