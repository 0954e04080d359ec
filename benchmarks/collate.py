"""Collating trajectories into the verl layout, and the Parquet store's throughput.

Why this benchmark exists
-------------------------
Between rollout and the PPO/GRPO update, every trajectory is padded into the batch
tensors verl's trainer consumes. verl's agent loop does that one sample at a time: it
pads each prompt on the left and each response on the right to fixed lengths, builds
that sample's attention mask and position ids, and concatenates the per-sample tensors
at the end. That is a dozen small tensor operations over the full padded width per
sample, and then a second copy of everything. :func:`tokengym.recorder.to_verl` writes
each row's real tokens straight into preallocated batch arrays. The goal: at least 10x
faster than the per-sample loop, and within 3x of a plain memory copy of the same
number of bytes.

What is measured (in one run, on the same data, interleaved)
-----------------------------------------------------------
Data: ``--n`` trajectories (default 1,024) built directly from Segments (no model, no
tokenizer): total lengths log-uniform in [``--min-len``, ``--max-len``] (default 256 to
16,384 tokens), prompts of 32 to 2,048 tokens (at most a quarter of the trajectory), 2 to
8 turns of action + observation (the last observation present half of the time), random
token ids below Qwen3's vocabulary size, random logprobs on every action, a random
reward per turn.

* ``to_verl``: ``to_verl(trajs)`` with minimal padding (P = longest prompt, R = longest response).
* ``per-sample loop (torch ops)``: the same eight tensors built the way verl's agent loop
  post-processes, written with torch ops on the trajectory's numpy arrays
  (``torch.from_numpy``): per sample ``F.pad`` of prompt ids and prompt attention on the
  left, of response ids, response attention, response mask and logprobs on the right, a
  reward row, ``torch.cat`` of prompt and response, position ids as
  ``clip(cumsum(attention_mask) - 1, 0)``; then ``torch.cat`` of all samples per key.
  This is the baseline the goal refers to.
* ``per-sample loop (torch ops, list inputs)``: the same loop fed what verl's agent loop
  holds per sample, Python lists (``torch.tensor(list)`` per field; the lists are built
  before timing).
* ``verl as written (tokenizer.pad per sample)``: verl's own post-processing pattern,
  ``tokenizer.pad`` (Qwen3 tokenizer) per sample for the prompt (left), the response and
  its mask (right), logprobs padded as a list. About 15-25 s, so it runs
  ``--tokenizer-pad-runs`` times (default 1, no warm-up; 0 skips it).
* ``memcpy (fresh destination)``: ``np.copy`` of a preallocated, touched buffer of the
  batch's total byte size: the destination is new memory, as for any function that
  returns new tensors.
* ``memcpy (into preallocated)``: ``np.copyto`` into a preallocated, already touched
  destination: pure memory bandwidth.

Every loop's output is checked to equal ``to_verl``'s, tensor for tensor (the
``tokenizer.pad`` loop on the first 64 rows, against ``to_verl`` with the tokenizer's pad id).

How to read the numbers: collating a padded batch is bound by memory, and on Linux the
first write to each page of new memory costs a page fault (expensive in virtual
machines). ``to_verl`` allocates zeroed buffers (``calloc``: pages stay unmapped until
written) and writes only the real tokens plus the right padding of ``position_ids``, so
it can take less time than copying the whole batch into fresh memory; the loops write
every padded byte several times and then copy everything once more.

Before each timed collation the trajectories' cached arrays (``token_ids``, ``mask``,
``logprobs``, ``offsets``) are cleared, so the collations start from freshly recorded
trajectories. Each method runs once untimed, then ``--repeats`` times interleaved with the
garbage collector off; the table shows the median and the minimum (the minimum is the
better estimate on a machine shared with other work).

Store: the same trajectories written with ``TrajectoryWriter`` (real Qwen3 tokenizer for
the fingerprint, ``--shard-size`` per shard, zstd) into a temporary directory, then read
back with ``read_trajectories`` (exact Trajectory objects, every row checked) and with
``read_table`` (Arrow only). MB/s is reported against the payload (token ids as int32,
mask int8, logprobs float32: 9 bytes per token, as the schema stores them) and against
the bytes on disk.

Memory: the padded batch of the default data is about 0.86 GB (1,024 rows x ~18k
columns, six int64 and two float32 tensors). A per-sample loop holds its per-sample
tensors and the concatenated batch at once, and the Python-list inputs take about 1 GB,
so the process peaks at about 5 GB.

Run (from the repository root; about 1.5 to 2 minutes on 2 cores)::

    python benchmarks/collate.py
    python benchmarks/collate.py --repeats 7 --tokenizer-pad-runs 0 --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tokengym.envs import load_tokenizer
from tokengym.recorder import Segment, SegmentKind, Trajectory, to_verl
from tokengym.recorder.store import TrajectoryWriter, read_table, read_trajectories, shard_paths

QWEN3_VOCAB = 151_643  # ids below the first added token of Qwen3
KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
    "token_level_rewards",
)


# ------------------------------------------------------------------------- data
def make_trajectories(n: int, min_len: int, max_len: int, seed: int) -> list[Trajectory]:
    """Synthetic multi-turn trajectories (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        total = int(round(np.exp(rng.uniform(np.log(min_len), np.log(max_len)))))
        prompt = int(rng.integers(32, max(33, min(2048, total // 4)) + 1))
        turns = int(rng.integers(2, 9))
        parts = 2 * turns - (0 if rng.integers(0, 2) else 1)  # with or without a last observation
        rest = total - prompt
        cuts = np.sort(rng.choice(np.arange(1, rest), size=parts - 1, replace=False))
        sizes = np.diff(np.concatenate([[0], cuts, [rest]]))
        ids = rng.integers(0, QWEN3_VOCAB, size=total)
        segs = [Segment(SegmentKind.PROMPT, ids[:prompt], 0)]
        pos = prompt
        for j, size in enumerate(sizes.tolist()):
            chunk = ids[pos : pos + size]
            if j % 2 == 0:
                lp = -rng.exponential(0.5, size).astype(np.float32)
                segs.append(Segment(SegmentKind.ACTION, chunk, j // 2, logprobs=lp, reward=float(rng.normal())))
            else:
                segs.append(Segment(SegmentKind.OBSERVATION, chunk, j // 2))
            pos += size
        out.append(
            Trajectory(segs, env_id="bench/Synthetic-v0", seed=i, stop_reason="done", metadata={"task_id": i // 8})
        )
    return out


def clear_caches(trajs: list[Trajectory]) -> None:
    """Drop the arrays a Trajectory caches, as if freshly recorded."""
    for t in trajs:
        for name in ("token_ids", "mask", "logprobs", "offsets"):
            t.__dict__.pop(name, None)


# ------------------------------------------------------------------ collations
def _finish_sample(
    prompt_ids: torch.Tensor,
    prompt_attn: torch.Tensor,
    response_ids: torch.Tensor,
    response_attn: torch.Tensor,
    response_mask: torch.Tensor,
    logprobs: torch.Tensor,
    reward_at: list[tuple[int, float]],
    R: int,
) -> dict[str, torch.Tensor]:
    """The rest of one sample, as verl builds it: rewards, concatenation, position ids."""
    rewards = torch.zeros(1, R, dtype=torch.float32)
    for pos, reward in reward_at:
        rewards[0, pos] += reward
    attention = torch.cat([prompt_attn, response_attn], dim=1)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    position_ids = torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0)
    return {
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "rollout_log_probs": logprobs,
        "token_level_rewards": rewards,
    }


def _pad_sample(
    prompt: torch.Tensor, response: torch.Tensor, mask: torch.Tensor, lp: torch.Tensor, P: int, R: int, pad: int
) -> tuple[torch.Tensor, ...]:
    pl, n = prompt.shape[0], response.shape[0]
    prompt_ids = F.pad(prompt, (P - pl, 0), value=pad).unsqueeze(0)
    prompt_attn = F.pad(torch.ones(pl, dtype=torch.int64), (P - pl, 0)).unsqueeze(0)
    response_ids = F.pad(response, (0, R - n), value=pad).unsqueeze(0)
    response_attn = F.pad(torch.ones(n, dtype=torch.int64), (0, R - n)).unsqueeze(0)
    response_mask = F.pad(mask, (0, R - n)).unsqueeze(0) * response_attn
    logprobs = F.pad(torch.nan_to_num(lp, nan=0.0), (0, R - n)).unsqueeze(0)
    return prompt_ids, prompt_attn, response_ids, response_attn, response_mask, logprobs


def _concat(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([r[k] for r in rows], dim=0) for k in KEYS}


def reward_positions(t: Trajectory) -> list[tuple[int, float]]:
    """Each turn's reward and the response column of its action's last token."""
    return [(end - 1 - t.prompt_len, a.reward) for (_, end), a in zip(t.action_spans, t.actions)]


def per_sample_loop(trajs: list[Trajectory], P: int, R: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """verl's agent-loop post-processing pattern with torch ops, fed the trajectories' numpy arrays."""
    rows = []
    for t in trajs:
        pl = t.prompt_len
        ids = torch.from_numpy(t.token_ids)
        mask = torch.from_numpy(t.mask[pl:]).to(torch.int64)
        padded = _pad_sample(ids[:pl], ids[pl:], mask, torch.from_numpy(t.logprobs[pl:]), P, R, pad_token_id)
        rows.append(_finish_sample(*padded, reward_positions(t), R))
    return _concat(rows)


def agent_loop_outputs(trajs: list[Trajectory]) -> list[tuple[list[int], list[int], list[int], list[float], Any]]:
    """What verl's agent loop holds per sample: Python lists (prompt_ids, response_ids, response_mask, logprobs)."""
    out = []
    for t in trajs:
        pl = t.prompt_len
        lp = np.nan_to_num(t.logprobs[pl:], nan=0.0)
        out.append((t.token_ids[:pl].tolist(), t.token_ids[pl:].tolist(), t.mask[pl:].tolist(), lp.tolist(),
                    reward_positions(t)))
    return out


def per_sample_loop_lists(
    outputs: list[tuple[Any, ...]], P: int, R: int, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """The same torch-op loop fed what verl's agent loop actually holds: Python lists per sample."""
    rows = []
    for prompt_ids, response_ids, response_mask, response_logprobs, reward_at in outputs:
        padded = _pad_sample(
            torch.tensor(prompt_ids, dtype=torch.int64),
            torch.tensor(response_ids, dtype=torch.int64),
            torch.tensor(response_mask, dtype=torch.int64),
            torch.tensor(response_logprobs, dtype=torch.float32),
            P,
            R,
            pad_token_id,
        )
        rows.append(_finish_sample(*padded, reward_at, R))
    return _concat(rows)


def per_sample_tokenizer_pad(outputs: list[tuple[Any, ...]], P: int, R: int, tok: Any) -> dict[str, torch.Tensor]:
    """verl's agent loop as written: ``tokenizer.pad`` per sample (left for the prompt, right for the
    response and its mask), logprobs padded as a list, then the same concatenations."""
    rows = []
    for prompt_ids, response_ids, response_mask, response_logprobs, reward_at in outputs:
        tok.padding_side = "left"
        p = tok.pad({"input_ids": prompt_ids}, padding="max_length", max_length=P, return_tensors="pt",
                    return_attention_mask=True)
        tok.padding_side = "right"
        r = tok.pad({"input_ids": response_ids}, padding="max_length", max_length=R, return_tensors="pt",
                    return_attention_mask=True)
        m = tok.pad({"input_ids": response_mask}, padding="max_length", max_length=R, return_tensors="pt",
                    return_attention_mask=False)
        p_ids, p_attn = p["input_ids"].reshape(1, -1), p["attention_mask"].reshape(1, -1)
        r_ids, r_attn = r["input_ids"].reshape(1, -1), r["attention_mask"].reshape(1, -1)
        mask = m["input_ids"].reshape(1, -1) * r_attn
        logprobs = torch.tensor(response_logprobs + [0.0] * (R - len(response_logprobs))).unsqueeze(0)
        rows.append(_finish_sample(p_ids, p_attn, r_ids, r_attn, mask, logprobs, reward_at, R))
    return _concat(rows)


def timed(fn: Callable[[], Any], setup: Callable[[], None] | None = None) -> float:
    if setup is not None:
        setup()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    del out
    return elapsed


# ------------------------------------------------------------------------ bench
def _check(name: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in KEYS:
        if not torch.equal(got[k], want[k]):
            print(f"error: {name}: {k} differs from to_verl's", file=sys.stderr)
            raise SystemExit(1)


def bench_collate(trajs: list[Trajectory], repeats: int, tok: Any, pad_runs: int) -> dict[str, Any]:
    clear_caches(trajs)
    batch = to_verl(trajs)
    P, R = batch.prompt_length, batch.response_length
    nbytes = sum(v.numel() * v.element_size() for v in batch.tensors.values())
    shape = {k: list(v.shape) for k, v in batch.tensors.items()}
    outputs = agent_loop_outputs(trajs)  # verl's per-sample inputs: built once, not timed

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    dst.fill(2)
    methods: dict[str, tuple[Callable[[], Any], Callable[[], None] | None]] = {
        "to_verl": (lambda: to_verl(trajs), lambda: clear_caches(trajs)),
        "per-sample loop (torch ops)": (lambda: per_sample_loop(trajs, P, R), lambda: clear_caches(trajs)),
        "per-sample loop (torch ops, list inputs)": (lambda: per_sample_loop_lists(outputs, P, R), None),
        "memcpy (fresh destination)": (lambda: np.copy(src), None),
        "memcpy (into preallocated)": (lambda: np.copyto(dst, src), None),
    }
    # Warm-up, and proof that the loops build the same batch (first touches of memory are slow in VMs).
    _check("per-sample loop", per_sample_loop(trajs, P, R), batch.tensors)
    _check("per-sample loop (list inputs)", per_sample_loop_lists(outputs, P, R), batch.tensors)
    del batch
    times: dict[str, list[float]] = {m: [] for m in methods}
    for fn, setup in methods.values():
        timed(fn, setup)
    for _ in range(repeats):
        for m, (fn, setup) in methods.items():
            times[m].append(timed(fn, setup))
    del src, dst
    if pad_runs:
        name = "verl as written (tokenizer.pad per sample)"
        times[name] = [timed(lambda: per_sample_tokenizer_pad(outputs, P, R, tok)) for _ in range(pad_runs)]
        _check(name, per_sample_tokenizer_pad(outputs[:64], P, R, tok),
               {k: v[:64] for k, v in to_verl(trajs, pad_token_id=tok.pad_token_id).tensors.items()})
    rows = {m: {"median_s": statistics.median(ts), "min_s": min(ts), "runs_s": ts} for m, ts in times.items()}
    for r in rows.values():
        r["GB_per_s"] = nbytes / r["median_s"] / 1e9
    return {"batch_bytes": nbytes, "prompt_length": P, "response_length": R, "shapes": shape, "methods": rows}


def bench_store(trajs: list[Trajectory], shard_size: int, repeats: int, tok: Any) -> dict[str, Any]:
    tokens = sum(len(t) for t in trajs)
    payload = tokens * 9  # int32 id + int8 mask + float32 logprob
    n = len(trajs)
    write, read, table = [], [], []
    disk = 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="tokengym-bench-") as tmp:
            writer = TrajectoryWriter(tmp, tokenizer=tok, shard_size=shard_size)  # fingerprint: not timed

            def write_all() -> None:
                for t in trajs:
                    writer.write(t)
                writer.close()

            write.append(timed(write_all))
            disk = sum(p.stat().st_size for p in shard_paths(tmp))
            back: list[Trajectory] = []
            read.append(timed(lambda: back.extend(read_trajectories(tmp))))
            if len(back) != n or any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(trajs, back)):
                print("error: the store did not read back the trajectories written", file=sys.stderr)
                raise SystemExit(1)
            del back
            table.append(timed(lambda: read_table(tmp)))

    def row(ts: list[float]) -> dict[str, float]:
        s = statistics.median(ts)
        return {"median_s": s, "payload_MB_per_s": payload / s / 1e6, "disk_MB_per_s": disk / s / 1e6,
                "trajectories_per_s": n / s}

    return {
        "tokens": tokens,
        "payload_bytes": payload,
        "disk_bytes": disk,
        "shards": -(-n // shard_size),
        "methods": {
            "write (TrajectoryWriter, zstd)": row(write),
            "read (read_trajectories -> Trajectory)": row(read),
            "read (read_table -> Arrow)": row(table),
        },
    }


def print_tables(res: dict[str, Any], args: argparse.Namespace) -> None:
    c = res["collate"]
    m = c["methods"]
    print(
        f"\nverl layout: {args.n} trajectories, {res['tokens']:,} tokens, P={c['prompt_length']} "
        f"R={c['response_length']}, {c['batch_bytes'] / 1e6:,.0f} MB of tensors; median of {args.repeats}\n"
    )
    print("| method | median s | min s | GB/s (batch bytes, median) | time ÷ to_verl (median) | (min) |")
    print("|---|---:|---:|---:|---:|---:|")
    base, base_min = m["to_verl"]["median_s"], m["to_verl"]["min_s"]
    for name, r in m.items():
        print(
            f"| {name} | {r['median_s']:.3f} | {r['min_s']:.3f} | {r['GB_per_s']:.2f} "
            f"| {r['median_s'] / base:.2f}x | {r['min_s'] / base_min:.2f}x |"
        )
    loop = m["per-sample loop (torch ops)"]["median_s"] / base
    fresh = base / m["memcpy (fresh destination)"]["median_s"]
    pre = base / m["memcpy (into preallocated)"]["median_s"]
    print(
        f"\nto_verl: {loop:.1f}x faster than the per-sample loop with torch ops (goal >= 10x: "
        f"{'met' if loop >= 10 else 'missed'}); {base / m['memcpy (fresh destination)']['median_s']:.2f}x the time of "
        f"a memory copy into fresh memory (goal <= 3x: {'met' if fresh <= 3 else 'missed'}), "
        f"{pre:.2f}x a copy into a preallocated buffer"
    )
    s = res.get("store")
    if s is None:
        return
    print(
        f"\nParquet store: {args.n} trajectories, {s['tokens']:,} tokens, payload {s['payload_bytes'] / 1e6:.1f} MB, "
        f"{s['disk_bytes'] / 1e6:.1f} MB on disk in {s['shards']} shards; median of {args.store_repeats}\n"
    )
    print("| operation | median s | MB/s (payload) | MB/s (on disk) | trajectories/s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in s["methods"].items():
        print(
            f"| {name} | {r['median_s']:.3f} | {r['payload_MB_per_s']:,.0f} | {r['disk_MB_per_s']:,.0f} "
            f"| {r['trajectories_per_s']:,.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1024, help="trajectories")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per collation method")
    parser.add_argument("--store-repeats", type=int, default=2, help="timed write/read rounds of the store")
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--tokenizer-pad-runs", type=int, default=1,
                        help="timed runs of verl's tokenizer.pad loop (15-25 s each; 0 skips it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-store", action="store_true", help="skip the Parquet part")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if min(args.n, args.repeats, args.store_repeats, args.shard_size) < 1 or args.tokenizer_pad_runs < 0:
        parser.error("--n, --repeats, --store-repeats, --shard-size must be positive, --tokenizer-pad-runs >= 0")
    if not 64 <= args.min_len <= args.max_len:
        parser.error("64 <= --min-len <= --max-len")

    started = time.perf_counter()
    trajs = make_trajectories(args.n, args.min_len, args.max_len, args.seed)
    res: dict[str, Any] = {"n": args.n, "tokens": sum(len(t) for t in trajs)}
    tok = load_tokenizer("qwen3")
    res["collate"] = bench_collate(trajs, args.repeats, tok, args.tokenizer_pad_runs)
    print("every per-sample loop's output verified equal to to_verl's (all eight tensors)", flush=True)
    if not args.no_store:
        res["store"] = bench_store(trajs, args.shard_size, args.store_repeats, tok)
        print("store read back verified (token ids of every trajectory)", flush=True)
    res["elapsed_s"] = time.perf_counter() - started
    res["python"] = platform.python_version()
    res["torch"] = torch.__version__
    res["torch_threads"] = torch.get_num_threads()
    print(
        f"\nPython {res['python']}, torch {res['torch']} ({res['torch_threads']} threads), numpy {np.__version__}; "
        f"{res['elapsed_s']:.0f} s total"
    )
    print_tables(res, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
