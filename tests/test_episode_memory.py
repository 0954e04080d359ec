"""What an episode in flight keeps: bytes per context token and per turn, held to a bound.

``benchmarks/scale.py`` measures it against the cost-of-scale goal; this fails when a change
makes an episode keep more. Two episodes of the calculator on the real Qwen3 tokenizer, with
logprobs recorded as a sampling policy gives them, one with short turns (a bare call, 42 tokens)
and one with long ones (the call after some 600 tokens of text): the difference between them
is what a context token costs, the rest what a turn costs whatever its length.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tracemalloc

import numpy as np

from tokengym.envs import CalculatorEnv
from tokengym.policies import Generation
from tokengym.recorder import RecordEpisodes
from tokengym.recorder.drivers.episodes import EpisodeSlot, plan_tasks

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'
TURNS = 128  # as benchmarks/scale.py: fewer turns measure a buffer's growth steps more than its size

BYTES_PER_TOKEN = 10
"""What one more context token may cost (int32 ids, float32 logprobs, a byte per action for the
recorder): about 8.4 now (20 when each piece was its own int64 array and its text was kept)."""
BYTES_PER_TURN = 400
"""What one more turn may cost whatever its length (the packed tool message and parsed calls, the
reference that stands for the assistant message, the stream's table, the recorder's entries):
about 220 now (3,900 before the compact stream)."""
BYTES_PER_SHORT_TOKEN = 16
"""The cost-of-scale goal: what a context token of the issue's workload (42-token turns) costs,
its turn's share included: 14.9 to 15.8 over runs now, in a fresh interpreter (180 before the compact stream)."""


def _kept(qwen3, words: int) -> tuple[float, float]:
    """(bytes, tokens) one more turn adds to an episode in flight, over its second half."""
    env = CalculatorEnv(qwen3, max_turns=TURNS + 1, max_context_tokens=10**7)
    slot = EpisodeSlot(RecordEpisodes(env, keep=False))
    r = env.renderer
    ids = r.encode_action_text("Let me think about it. " * words + CALL) + list(r.turn_end_ids)
    slot.begin(plan_tasks([0], 0)[0])
    gc.collect()
    tracemalloc.start()
    try:
        marks = []
        for turn in range(1, TURNS + 1):
            gen = Generation(np.array(ids), np.full(len(ids), -0.25, np.float32), "stop")
            assert slot.advance(gen, slot.step(gen)) is None
            if turn in (TURNS // 2, TURNS):
                gc.collect()
                marks.append((tracemalloc.get_traced_memory()[0], env.num_tokens))
    finally:
        tracemalloc.stop()
    env.close()
    (m1, t1), (m2, t2) = marks
    turns = TURNS - TURNS // 2
    return (m2 - m1) / turns, (t2 - t1) / turns


def _kept_in_a_fresh_process(*words: int) -> list[tuple[float, float]]:
    """:func:`_kept` for each of ``words``, in an interpreter of its own (one, so the imports and the
    tokenizer load once): tracemalloc counts every thread's allocations, and a test worker has the
    threads earlier tests left (an IO thread, pools, loops): a side-by-side run counted 16.8 B a token
    on short turns, a fresh interpreter counts 14.9 to 15.8."""
    out = subprocess.run([sys.executable, __file__, *map(str, words)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [tuple(kept) for kept in json.loads(out.stdout.strip().splitlines()[-1])]


def test_an_episode_in_flight_keeps_a_bounded_number_of_bytes_per_token_and_per_turn():
    (short_b, short_t), (long_b, long_t) = _kept_in_a_fresh_process(0, 100)
    assert long_t > 10 * short_t
    per_token = (long_b - short_b) / (long_t - short_t)
    per_turn = short_b - per_token * short_t
    assert 0 < per_token <= BYTES_PER_TOKEN, f"{per_token:.1f} B per context token (bound {BYTES_PER_TOKEN})"
    assert per_turn <= BYTES_PER_TURN, f"{per_turn:.0f} B per turn (bound {BYTES_PER_TURN})"
    short = short_b / short_t
    assert short <= BYTES_PER_SHORT_TOKEN, f"{short:.1f} B per token on 42-token turns (bound {BYTES_PER_SHORT_TOKEN})"


WHOLE_EPISODE_BYTES = 20_000
"""What a whole tool episode in flight holds after four turns (~430 context tokens): its env, renderer,
spaces, recorder and driver slot, built as a run builds them: about 17,300 now (23,100 when each
env's token spaces made gymnasium's random generators and each renderer copied its render caches)."""


def test_a_whole_episode_in_flight_holds_a_bounded_number_of_bytes_env_included(qwen3):
    import gymnasium as gym

    import tokengym.envs  # noqa: F401  (registers the envs)

    def make() -> EpisodeSlot:
        return EpisodeSlot(RecordEpisodes(gym.make("tokengym/Calculator-v0", tokenizer=qwen3, max_turns=8,
                                                   disable_env_checker=True), keep=False))

    def play(slot: EpisodeSlot, task, turns: int) -> None:
        slot.begin(task)
        r = slot.recorder.unwrapped.renderer
        ids = r.encode_action_text(CALL) + list(r.turn_end_ids)
        for _ in range(turns):
            gen = Generation(np.array(ids), np.full(len(ids), -0.25, np.float32), "stop")
            assert slot.advance(gen, slot.step(gen)) is None

    n = 60
    tasks = plan_tasks(list(range(n + 1)), 0)
    play(make(), tasks[0], 4)  # the first env probes the template: its twins adopt what it found
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        slots = [make() for _ in range(n)]
        for slot, task in zip(slots, tasks[1:]):
            play(slot, task, 4)
        gc.collect()
        held = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    tokens = np.mean([len(s.stream) for s in slots])
    assert 300 < tokens < 600
    assert held <= WHOLE_EPISODE_BYTES, f"{held:,.0f} B an episode of {tokens:.0f} tokens (bound {WHOLE_EPISODE_BYTES:,})"
    for slot in slots:
        slot.recorder.close()


def test_token_spaces_make_their_random_generators_only_when_sampled(qwen3):
    env = CalculatorEnv(qwen3)
    space = env.action_space
    assert "_stacked" not in vars(space) and space.feature_space._np_random is None
    space.seed(3)
    a = space.sample()
    space.seed(3)
    assert np.array_equal(space.sample(), a)  # seeded sampling repeats
    assert a.dtype == np.int64 and a.ndim == 1 and space.contains(a) and space.stack
    assert space == env.observation_space  # same vocabulary, same space
    env.close()


def test_envs_of_one_tokenizer_share_their_render_caches_and_render_alike(qwen3):
    first, second = CalculatorEnv(qwen3), CalculatorEnv(qwen3)
    assert first.renderer._histories is second.renderer._histories
    assert first.renderer._capabilities is not second.renderer._capabilities  # probed facts: each its own
    messages = [{"role": "tool", "content": "84"}]
    a = first.renderer.observation(messages, None)
    b = second.renderer.observation(messages, None)
    assert a.ids == b.ids and a.text == b.text
    first.close()
    second.close()


if __name__ == "__main__":  # _kept_in_a_fresh_process: python tests/test_episode_memory.py WORDS...
    from conftest import real_tokenizer  # tests/ is this script's folder, so it is on the path

    print(json.dumps([_kept(real_tokenizer("qwen3"), int(w)) for w in sys.argv[1:]]))
