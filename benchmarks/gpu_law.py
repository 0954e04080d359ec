"""The law on a GPU: episodes sampled by ``HFPolicy`` on CUDA, recomputed by one teacher-forced pass.

Why: every other test of the law runs on a CPU. On a GPU the same code takes other paths (CUDA
kernels, per-request generators on the device, the continuous decode batch on the device), and
a trainer's forward pass runs there too. This plays multi-turn episodes of ``tokengym/Replay-v0``
on the real Qwen3 tokenizer with a small random Qwen3 (no weights to download) through
``rollout()`` (its default: continuous batching, every episode at its own pace), lays them out
with ``to_verl`` and recomputes every policy token's logprob with ``policy_logprobs`` on the
same device:

* float32: the largest ``|recomputed - rollout|`` must stay under 1e-4, as on a CPU (the goal;
  the exit status is 1 when it is missed);
* bfloat16 (reported, no goal): the gap between a decode batch's kernels and a full-sequence
  forward pass in half precision, the training-inference mismatch that float32 removes;
* the driver's share of the run: the time no request was in the engine
  (``RolloutStats.outside_engine_share``), with the policy tokens per second.

    python benchmarks/gpu_law.py                       # cuda, 256 episodes, 64 in flight
    python benchmarks/gpu_law.py --device cpu --episodes 8 --concurrency 4 --hidden 64   # a quick try here

The stored runs (``benchmarks/results/gpu_law*.json``, on an NVIDIA H200) are what the README quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tokengym.envs import ReplayEnv, load_tokenizer
from tokengym.policies import HFPolicy, SamplingParams
from tokengym.recorder import policy_logprobs, rollout, to_verl

GOAL = 1e-4
"""The float32 law's bound, as the CPU tests hold it."""


def small_qwen3(vocab: int, hidden: int, layers: int, dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).to(dtype).eval()


def play(args: argparse.Namespace, tok, dtype: torch.dtype, episodes: int) -> dict:
    model = small_qwen3(len(tok), args.hidden, args.layers, dtype)
    policy = HFPolicy(model, tok, device=args.device)
    try:
        turns = [1 + i % args.turns for i in range(episodes)]
        made = iter(turns)
        start = time.perf_counter()
        result = rollout(
            lambda: ReplayEnv(tok, max_turns=next(made)), policy, episodes=episodes, concurrency=args.concurrency,
            sampling=SamplingParams(max_tokens=args.max_tokens, temperature=1.0), seed=0, progress=False,
        )
        wall = time.perf_counter() - start
    finally:
        policy.close()
    trajs = result.trajectories
    s = result.stats
    batch = to_verl(trajs)
    with torch.no_grad():
        recomputed = policy_logprobs(model.to(args.device), batch)
    mask = batch.tensors["response_mask"].to(recomputed.device).bool()
    rollout_lp = batch.tensors["rollout_log_probs"].to(recomputed.device)
    diff = (recomputed[mask] - rollout_lp[mask]).abs()
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "episodes": s.episodes,
        "failed": s.failed,
        "policy_tokens": int(mask.sum()),
        "tokens": int(sum(len(t) for t in trajs)),
        "wall_s": wall,
        "policy_tokens_per_s": s.policy_tokens / s.wall_s if s.wall_s else 0.0,
        "outside_engine_share": s.outside_engine_share,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--turns", type=int, default=4, help="episodes play 1..TURNS turns")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: pass --device cpu for a quick try", file=sys.stderr)
        return 2
    tok = load_tokenizer("qwen3")
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"{device_name}, torch {torch.__version__}; a random Qwen3 of hidden {args.hidden}, {args.layers} layers, "
          f"the real Qwen3 tokenizer; {args.episodes} episodes of 1-{args.turns} turns, {args.concurrency} in flight, "
          f"{args.max_tokens} tokens a turn at most", flush=True)
    runs = [play(args, tok, torch.float32, args.episodes)]
    runs.append(play(args, tok, torch.bfloat16, max(args.concurrency, args.episodes // 4)))
    print("| dtype | episodes | policy tokens | policy tokens/s | outside the engine | max abs diff | mean abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['dtype']} | {r['episodes']} ({r['failed']} failed) | {r['policy_tokens']:,} | {r['policy_tokens_per_s']:,.0f} | "
              f"{r['outside_engine_share']:.0%} | {r['max_abs_diff']:.2e} | {r['mean_abs_diff']:.2e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name, "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": runs}, indent=1))
    law = runs[0]
    ok = law["failed"] == 0 and law["max_abs_diff"] < GOAL
    print(f"float32 law on {device_name}: max |recomputed - rollout| {law['max_abs_diff']:.2e} "
          f"(goal < {GOAL:g}: {'met' if ok else 'MISSED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
