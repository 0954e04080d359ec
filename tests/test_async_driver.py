"""The default local driver: every episode at its own pace, over the one episode runner.

Real envs (``ReplayEnv`` and the calculator on the pinned Qwen tokenizers) and a real tiny
Qwen3 through ``HFPolicy``; a gymnasium wrapper adds tool latency where a test needs it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from tiny_qwen3 import tiny_qwen3
from tokengym.envs import CalculatorEnv, ReplayEnv
from tokengym.policies import HFPolicy, SamplingParams, ScriptedPolicy
from tokengym.policies.batching import PolicyInterrupted, RequestBatcher
from tokengym.recorder import rollout
from tokengym.recorder.drivers.episodes import EpisodeSlot, EpisodeTask
from tokengym.recorder.drivers.runner import play
from tokengym.recorder.wrapper import RecordEpisodes


@pytest.fixture(scope="module")
def tiny_policy(qwen3):
    return HFPolicy(tiny_qwen3(len(qwen3)), qwen3)


class SlowTools(gym.Wrapper):
    """A tool latency that depends on the episode's seed: some episodes are much slower than others."""

    def __init__(self, env: gym.Env, delays: dict[int, float]) -> None:
        super().__init__(env)
        self.delays, self.seed = delays, None

    def reset(self, *, seed=None, options=None):
        self.seed = seed
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        time.sleep(self.delays.get(self.seed, 0.0))
        return self.env.step(action)


def answer(qwen25):
    """Replies with the calculator's answer call on the first turn, then a final answer."""
    return ScriptedPolicy(lambda ctx: "The answer is 4.", qwen25, end_ids=[151645])


def test_async_and_lockstep_give_the_same_trajectories(tiny_policy, qwen3):
    delays = {3: 0.2, 5: 0.05}  # by reset seed: episodes 0 and 2 have slow tools, so they finish out of order

    def run(schedule, concurrency):
        order = []
        r = rollout(
            lambda: SlowTools(ReplayEnv(qwen3, max_turns=3), delays), tiny_policy, episodes=6,
            concurrency=concurrency, sampling=SamplingParams(max_tokens=6), seed=3, progress=False,
            schedule=schedule, on_episode=lambda t: order.append(t.metadata["episode"]),
        )
        assert r.stats.failed == 0 and not r.interrupted
        return r.trajectories, order

    lock, _ = run("lockstep", 3)
    fast, fast_order = run("async", 3)
    one, one_order = run("async", 1)
    # The episodes did interleave: run side by side, the slow ones finished after later ones
    # (one at a time, in order); the trajectories come back in episode order either way.
    assert sorted(fast_order) == list(range(6)) and fast_order != sorted(fast_order)
    assert one_order == list(range(6))
    assert [t.metadata["episode"] for t in fast] == list(range(6))
    # Same seeds, same tokens, whatever the schedule; the logprobs agree to float precision
    # (a batch's padding changes the last bits of a matmul, not the sampled tokens).
    for a, b, c in zip(lock, fast, one):
        assert a.token_ids.tolist() == b.token_ids.tolist() == c.token_ids.tolist()
        assert a.mask.tolist() == b.mask.tolist() and a.turn_rewards.tolist() == b.turn_rewards.tolist()
        np.testing.assert_allclose(np.nan_to_num(a.logprobs), np.nan_to_num(b.logprobs), atol=1e-5)
        np.testing.assert_allclose(np.nan_to_num(a.logprobs), np.nan_to_num(c.logprobs), atol=1e-5)


def test_a_slow_episode_holds_up_only_itself(qwen25):
    order, when = [], {}
    start = time.perf_counter()

    def finished(traj):
        order.append(traj.metadata["episode"])
        when[traj.metadata["episode"]] = time.perf_counter() - start

    # Episode 0's tool takes 1.5 s per step; the others take none.
    r = rollout(
        lambda: SlowTools(CalculatorEnv(qwen25), {0: 1.5}), answer(qwen25), episodes=6, concurrency=2,
        seed=0, progress=False, on_episode=finished,
    )
    # The five others passed the slow one on the other slot (lock-step rounds would record episode 0
    # second: its round waits for its step).
    assert r.stats.episodes == 6 and order[-1] == 0
    assert all(when[i] < when[0] for i in range(1, 6))
    assert 0 < r.stats.engine_s < r.stats.wall_s


def test_waiting_requests_form_one_batch(qwen25):
    sizes = []

    class Counting(ScriptedPolicy):
        def generate(self, contexts, sampling):
            sizes.append(len(contexts))
            time.sleep(0.05)  # busy long enough for the others to queue up
            return super().generate(contexts, sampling)

    policy = Counting(lambda ctx: "4", qwen25, end_ids=[151645])
    r = rollout(lambda: CalculatorEnv(qwen25), policy, episodes=12, concurrency=4, progress=False)
    assert r.stats.episodes == 12 and sum(sizes) == r.stats.turns
    assert max(sizes) >= 2  # requests that arrived while the policy was busy went together


def test_a_refused_request_fails_only_its_episode(qwen25):
    def script(ctx):
        if len(ctx) % 7 == 0:
            raise ValueError("this context is refused")
        return "4"

    seen = []

    class Batches(ScriptedPolicy):
        def generate(self, contexts, sampling):
            seen.append(len(contexts))
            return super().generate(contexts, sampling)

    r = rollout(
        lambda: CalculatorEnv(qwen25), Batches(script, qwen25, end_ids=[151645]), episodes=20, concurrency=4,
        progress=False,
    )
    refused = r.stats.failed
    assert r.stats.episodes + refused == 20 and refused >= 1
    assert all("this context is refused" in e for e in r.stats.errors)
    assert all(e.turn == 0 and e.type == "ValueError" for e in r.stats.errors)


def test_runs_inside_a_running_event_loop(qwen25):
    """A notebook cell runs inside the kernel's event loop: the driver then runs its own in a thread."""

    async def cell():
        return rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=3, concurrency=2, progress=False)

    inside = asyncio.run(cell())
    outside = rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=3, concurrency=2, progress=False)
    assert [t.to_dict() for t in inside.trajectories] == [t.to_dict() for t in outside.trajectories]
    assert not any(t.name == "tokengym-rollout" for t in threading.enumerate())  # its thread ended


def test_the_progress_bar_shows_live_tokens_per_second(qwen25, capsys):
    rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=4, concurrency=2, progress=True)
    err = capsys.readouterr().err
    assert "4/4" in err and "tok_s=" in err and "reward=" in err


def test_the_progress_bar_is_redrawn_at_most_twice_a_second_and_ends_on_the_run_s_numbers(qwen25, monkeypatch):
    from tqdm import std

    shown: list[dict] = []
    original = std.tqdm.set_postfix

    def counted(self, ordered_dict=None, refresh=True, **kwargs):
        shown.append(dict(ordered_dict or {}))
        return original(self, ordered_dict, refresh, **kwargs)

    monkeypatch.setattr(std.tqdm, "set_postfix", counted)
    start = time.perf_counter()
    res = rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=60, concurrency=8, progress=True)
    elapsed = time.perf_counter() - start
    assert res.stats.episodes == 60
    assert len(shown) <= 2 * elapsed + 2 < 60  # not once an episode (3 ms a redraw)
    assert shown[-1]["reward"] == f"{res.stats.mean_reward:.3f}" and shown[-1]["turns"] == str(res.stats.turns)


def test_no_episodes_is_an_empty_run(qwen25):
    for schedule in ("async", "lockstep"):
        r = rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=[], schedule=schedule, progress=False)
        assert r.trajectories == [] and r.stats.episodes == 0 and not r.interrupted


def test_bad_schedules_are_named(qwen25):
    with pytest.raises(ValueError, match="lockstep"):
        rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=1, schedule="rounds", progress=False)

    class Backend:
        def run(self, *a, **k):  # pragma: no cover - refused before
            raise AssertionError

    with pytest.raises(ValueError, match="local only"):
        rollout(lambda: CalculatorEnv(qwen25), answer(qwen25), episodes=1, schedule="lockstep", backend=Backend())


def test_a_policy_interrupt_stops_the_run_and_keeps_the_finished(qwen25):
    calls = {"n": 0}

    def script(ctx):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return "4"

    r = rollout(lambda: CalculatorEnv(qwen25), ScriptedPolicy(script, qwen25, end_ids=[151645]), episodes=10,
                concurrency=1, progress=False)
    assert r.interrupted and r.stats.episodes == 4 and r.stats.not_run == 6


def test_the_runner_on_its_own(qwen25):
    """``play`` is what the Ray workers and TRL run: one episode, its trajectory or its error."""
    batcher = RequestBatcher(answer(qwen25))
    slot = EpisodeSlot(RecordEpisodes(ReplayEnv(qwen25, max_turns=3), keep=False))
    limit = slot.env.unwrapped.max_context_tokens
    try:
        task = EpisodeTask(7, 7, (0, 7), completion_budget=3, metadata={"group": "g"})
        (traj,) = asyncio.run(play(slot, task, SamplingParams(), batcher.generate))  # one context: one row
        # the next user message does not fit a 3-token budget; the env's own limit comes back afterwards
        assert traj.stop_reason == "context_length" and traj.metadata["group"] == "g"
        assert traj.metadata["episode"] == 7 and slot.env.unwrapped.max_context_tokens == limit
        assert batcher.requests == 1 and batcher.busy_s > 0
        bad = asyncio.run(play(slot, EpisodeTask(8, 8, (0, 8), options={"messages": 5}), SamplingParams(), batcher.generate))
        assert bad.episode == 8 and bad.turn is None and "reset failed" in bad.message
    finally:
        batcher.close()
        slot.env.close()


def test_an_interrupted_batch_stops_every_request_in_it(qwen25):
    def script(ctx):
        raise KeyboardInterrupt

    batcher = RequestBatcher(ScriptedPolicy(script, qwen25))

    async def both():
        return await asyncio.gather(
            *(batcher.generate([1, 2, 3], SamplingParams()) for _ in range(2)), return_exceptions=True
        )

    try:
        assert all(isinstance(r, PolicyInterrupted) for r in asyncio.run(both()))
    finally:
        batcher.close()
    assert np.isfinite(batcher.busy_s)


# ------------------------------------------------- progress while the first turns generate
def _catch_bar(monkeypatch):
    """The run's real progress bar, kept for the test to read."""
    import tokengym.recorder.drivers.rollout as driver

    bars = []
    make = driver.progress_bar

    def keep(total, enabled):
        bars.append(make(total, enabled))
        return bars[-1]

    monkeypatch.setattr(driver, "progress_bar", keep)
    return bars


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_the_bar_counts_tokens_before_any_turn_comes_back(qwen25, monkeypatch, capsys, schedule):
    """A policy sampling here (HFPolicy) reports each decode step: the bar's token count moves while
    the first turns are still generating, with no turn and no episode finished yet."""
    from tokengym.policies import HFPolicy, StreamsTokens

    policy = HFPolicy(tiny_qwen3(len(qwen25)), qwen25)
    assert isinstance(policy, StreamsTokens)
    bars = _catch_bar(monkeypatch)
    seen = []  # (bar's tokens, turns back, episodes done) at each decode step, before the bar hears of it

    def watch(n):
        if bars:
            bar = bars[0]
            seen.append((bar.tokens_so_far, bar.turns, bar.bar.n, bar.bar.postfix))

    policy.add_token_listener(watch)  # called before the bar's own listener, which the run adds later
    r = rollout(
        lambda: ReplayEnv(qwen25, max_turns=2), policy, episodes=2, concurrency=2,
        sampling=SamplingParams(max_tokens=8), seed=0, schedule=schedule, progress=True,
    )
    assert r.stats.episodes == 2 and r.stats.turns == 4
    # Step 2 of the first turns: the bar already shows step 1's tokens, and nothing has come back.
    tokens, turns, episodes, postfix = seen[1]
    assert tokens >= 1 and turns == 0 and episodes == 0
    assert f"tok={tokens}" in postfix and "turns=0" in postfix
    # The count only grows, and ends at the run's policy tokens, counted once.
    counts = [s[0] for s in seen]
    assert counts == sorted(counts)
    assert bars[0].tokens_so_far == r.stats.policy_tokens and bars[0].turns == 4
    assert f"tok={r.stats.policy_tokens}" in capsys.readouterr().err
    assert policy._listeners == [watch]  # the run's own listener is gone


def test_an_engine_that_does_not_stream_is_counted_turn_by_turn(qwen25, monkeypatch):
    from tokengym.policies import StreamsTokens

    bars = _catch_bar(monkeypatch)
    policy = answer(qwen25)
    assert not isinstance(policy, StreamsTokens)  # a scripted policy hands back whole turns, as vLLM does
    r = rollout(lambda: CalculatorEnv(qwen25), policy, episodes=3, concurrency=2, progress=True)
    assert bars[0].sampled == 0 and bars[0].generated == bars[0].tokens_so_far == r.stats.policy_tokens
    assert bars[0].turns == r.stats.turns


def test_hf_policy_reports_every_sampled_token(qwen25):
    """The listener hears each token once, batched generate and continuous batching alike, until removed."""
    import asyncio

    from tokengym.policies import HFPolicy

    policy = HFPolicy(tiny_qwen3(len(qwen25)), qwen25)
    heard = []
    stop = policy.add_token_listener(heard.append)
    contexts = [[1, 2, 3], [4, 5]]
    params = [SamplingParams(max_tokens=5, seed=1), SamplingParams(max_tokens=3, seed=2)]
    gens = policy.generate(contexts, params)
    assert sum(heard) == sum(len(g.token_ids) for g in gens) == 8 and max(heard) == 2
    heard.clear()
    gens = asyncio.run(policy.agenerate(contexts, params))
    policy.close()
    assert sum(heard) == sum(len(g.token_ids) for g in gens) == 8
    stop()
    heard.clear()
    policy.generate(contexts, params)
    assert heard == []


class StepThreads(gym.Wrapper):
    """Records the thread of every step (and sleeps ``delay`` in it); says its steps do not wait."""

    step_waits = False

    def __init__(self, env: gym.Env, seen: list[threading.Thread], delay: float = 0.0) -> None:
        super().__init__(env)
        self.seen, self.delay = seen, delay

    def step(self, action):
        self.seen.append(threading.current_thread())
        if self.delay:
            time.sleep(self.delay)
        return self.env.step(action)


class UndeclaredStepThreads(StepThreads):
    """The same, without saying anything of its steps (a wrapper's own class body must)."""


def _stepped(qwen3, wrapper, episodes: int, delay: float = 0.0) -> tuple[list[threading.Thread], float, object]:
    seen: list[threading.Thread] = []
    start = time.perf_counter()
    r = rollout(lambda: wrapper(ReplayEnv(qwen3, max_turns=3), seen, delay), ScriptedPolicy(lambda c: [151645]),
                episodes=episodes, concurrency=episodes, progress=False)
    assert r.stats.failed == 0 and len(seen) == r.stats.turns == 3 * episodes
    return seen, time.perf_counter() - start, r


@pytest.mark.alone  # a step preempted by other tests' work reads as waiting (wall time past CPU time)
def test_steps_of_envs_that_do_not_wait_run_on_the_loops_thread(qwen3):
    seen, _, _ = _stepped(qwen3, StepThreads, 12)
    assert set(seen) == {threading.current_thread()}  # no hop to a worker thread and back


def test_steps_of_an_env_that_does_not_say_so_run_in_worker_threads(qwen3):
    from tokengym.recorder.drivers.runner import steps_wait

    seen, _, _ = _stepped(qwen3, UndeclaredStepThreads, 4)
    assert threading.current_thread() not in seen
    assert steps_wait(UndeclaredStepThreads(ReplayEnv(qwen3), [])) and not steps_wait(StepThreads(ReplayEnv(qwen3), []))
    assert steps_wait(gym.wrappers.TimeLimit(CalculatorEnv(qwen3), 5)) is False
    assert steps_wait(SlowTools(CalculatorEnv(qwen3), {})) is True


def test_steps_that_say_they_do_not_wait_but_do_move_to_worker_threads_and_overlap(qwen3):
    from tokengym.recorder.drivers.runner import INLINE_STALL_S

    delay = 2 * INLINE_STALL_S
    seen, wall, _ = _stepped(qwen3, StepThreads, 8, delay)
    assert seen[0] is threading.current_thread()  # the first step, inline, showed that steps wait
    assert all(t is not threading.current_thread() for t in seen[1:])
    assert wall < 0.5 * len(seen) * delay  # the waits overlapped: not one after another


def test_a_request_waiting_in_the_queue_is_not_engine_time():
    calls = []

    class Quick(ScriptedPolicy):
        def generate(self, contexts, sampling):
            calls.append(len(contexts))
            time.sleep(0.02)
            return super().generate(contexts, sampling)

    batcher = RequestBatcher(Quick(lambda ctx: [1]), batch_wait_s=0.3)  # requests gather 0.3 s first

    async def main():
        start = time.perf_counter()
        await asyncio.gather(*(batcher.generate([5, 6], SamplingParams(max_tokens=2)) for _ in range(3)))
        return time.perf_counter() - start

    try:
        wall = asyncio.run(main())
    finally:
        batcher.close()
    assert calls == [3] and wall >= 0.3
    assert 0.02 <= batcher.busy_s < 0.15  # the one call, not the 0.3 s the requests waited for it


class _Counted:
    """A factory of ReplayEnvs that counts its builds and raises on the ones listed in ``fail``."""

    def __init__(self, qwen3, fail: set[int] = frozenset(), env=None) -> None:
        self.qwen3, self.fail, self.made, self.env = qwen3, set(fail), [], env

    def __call__(self):
        n = len(self.made) + 1
        if n in self.fail:
            self.made.append(None)
            raise RuntimeError(f"build {n} failed")
        env = (self.env or (lambda: ReplayEnv(self.qwen3, max_turns=2)))()
        self.made.append(env)
        return env


def test_a_run_builds_one_env_before_its_first_episode_and_the_rest_as_slots_take_episodes(qwen3):
    events: list[str] = []

    class Noted(gym.Wrapper):
        step_waits = False  # resets run on the loop's thread, one slot after another: a fixed order

        def reset(self, **kw):
            events.append("reset")
            return self.env.reset(**kw)

    factory = _Counted(qwen3)

    def build():
        events.append("build")
        return Noted(factory())

    r = rollout(build, ScriptedPolicy(lambda c: [151645]), episodes=12, concurrency=8, progress=False)
    assert r.stats.episodes == 12 and r.stats.failed == 0
    assert len(factory.made) == 8  # one per slot, each built once
    assert events[:4] == ["build", "reset", "build", "reset"]  # not 8 builds before the first episode starts
    assert all(env._pieces is None or env._done for env in factory.made)  # every one was closed or finished


def test_a_slot_whose_build_fails_fails_that_episode_and_builds_again_for_the_next(qwen3):
    factory = _Counted(qwen3, fail={3})
    r = rollout(factory, ScriptedPolicy(lambda c: [151645]), episodes=10, concurrency=4, progress=False)
    assert r.stats.failed == 1 and r.stats.episodes == 9
    err = r.stats.errors[0]
    assert "build 3 failed" in str(err) and "reset failed" in str(err)
    assert len(factory.made) == 5  # 4 slots, one of them built twice


def test_a_factory_that_cannot_build_fails_the_run_before_any_episode(qwen3):
    with pytest.raises(RuntimeError, match="build 1 failed"):
        rollout(_Counted(qwen3, fail={1}), ScriptedPolicy(lambda c: [151645]), episodes=4, concurrency=2, progress=False)


def test_a_lazy_slot_has_no_env_until_it_begins(qwen3):
    from tokengym.recorder.drivers.episodes import plan_tasks

    factory = _Counted(qwen3)
    slot = EpisodeSlot.lazy(lambda: RecordEpisodes(factory(), keep=False))
    assert slot.env is None and factory.made == []
    with pytest.raises(RuntimeError, match="first begin"):
        slot.stream
    slot.begin(plan_tasks([0], 0)[0])
    assert len(factory.made) == 1 and slot.env.unwrapped is factory.made[0] and len(slot.stream) > 0


def test_a_lazily_built_env_that_waits_sends_the_runs_steps_to_worker_threads(qwen3):
    seen: list[threading.Thread] = []
    kinds = iter([StepThreads, *[UndeclaredStepThreads] * 7])  # the first env says its steps do not wait
    r = rollout(lambda: next(kinds)(ReplayEnv(qwen3, max_turns=3), seen), ScriptedPolicy(lambda c: [151645]),
                episodes=8, concurrency=8, progress=False)
    assert r.stats.failed == 0 and len(seen) == 24
    assert seen.count(threading.current_thread()) < len(seen) // 2  # the waiting envs' steps left the loop's thread
