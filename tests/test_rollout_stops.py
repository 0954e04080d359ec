"""A rollout's failures and stops are loud: SIGTERM stops it like Ctrl-C, failed episodes are
recorded as data and grouped in the summary, and chosen episode indices keep their seeds."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tokengym.envs import CalculatorEnv
from tokengym.policies import ScriptedPolicy
from tokengym.recorder import TrajectoryWriter, read_trajectories, rollout, summary_table
from tokengym.recorder.drivers.rollout import EpisodeError
from tokengym.recorder.stopping import stop_on_signals, uninterrupted


class FlakyCalculator(CalculatorEnv):
    """tokengym/Calculator-v0 whose reset fails for seeds 2 and 7 and whose first step fails for seeds 1 and 4."""

    def reset(self, *, seed=None, options=None):
        self._flaky_seed = seed
        if seed in (2, 7):
            raise ValueError(f"no task for seed {seed}")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._flaky_seed in (1, 4):
            raise RuntimeError(f"calculator backend down (seed {self._flaky_seed})")
        return super().step(action)


def answer_policy(tok) -> ScriptedPolicy:
    return ScriptedPolicy(lambda context: "<answer>5</answer>", tok, end_ids=[tok.convert_tokens_to_ids("<|im_end|>")])


def test_failed_episodes_are_structured_and_grouped_by_type(qwen25):
    result = rollout(lambda: FlakyCalculator(qwen25), answer_policy(qwen25), episodes=8, concurrency=3, progress=False)
    s = result.stats
    assert (s.episodes, s.failed, s.requested, s.not_run) == (4, 4, 8, 0) and not s.interrupted
    assert sorted(t.metadata["episode"] for t in result.trajectories) == [0, 3, 5, 6]
    errors = sorted(s.errors, key=lambda e: e.episode)
    assert [(e.episode, e.turn, e.type) for e in errors] == [
        (1, 0, "RuntimeError"), (2, None, "ValueError"), (4, 0, "RuntimeError"), (7, None, "ValueError"),
    ]
    assert errors[0].message == "calculator backend down (seed 1)" and errors[1].message == "reset failed: no task for seed 2"
    assert str(errors[0]) == "episode 1 turn 0: RuntimeError: calculator backend down (seed 1)"
    groups = s.failures_by_type()
    assert {k: sorted(e.episode for e in v) for k, v in groups.items()} == {"RuntimeError": [1, 4], "ValueError": [2, 7]}
    table = summary_table(s)
    assert "4 done, 4 failed" in table
    assert "2 × RuntimeError (episodes 1, 4); first: episode " in table
    assert "2 × ValueError (episodes 2, 7); first: episode " in table and "reset failed: no task for seed" in table
    assert s.as_dict()["errors"][0].keys() == {"episode", "turn", "type", "message", "failed", "where"}
    # Where it was raised: the env's own line, in the log and the summary.
    assert errors[0].where.startswith(f"{__file__}:") and errors[0].where.endswith(" in step")
    assert f"(raised at {errors[0].where})" in table


def test_chosen_episode_indices_keep_their_seeds(qwen25):
    policy = answer_policy(qwen25)
    whole = rollout(lambda: CalculatorEnv(qwen25), policy, episodes=6, seed=10, progress=False).trajectories
    part = rollout(lambda: CalculatorEnv(qwen25), policy, episodes=[4, 1], seed=10, progress=False).trajectories
    assert [t.metadata["episode"] for t in part] == [1, 4] and [t.seed for t in part] == [11, 14]
    assert [t.to_dict() for t in part] == [whole[1].to_dict(), whole[4].to_dict()]
    with pytest.raises(ValueError, match="unique and >= 0"):
        rollout(lambda: CalculatorEnv(qwen25), policy, episodes=[1, 1], progress=False)


def test_sigterm_stops_a_rollout_like_ctrl_c(qwen25, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with TrajectoryWriter(tmp_path, tokenizer=qwen25) as writer:
        count = []

        def on_episode(traj):
            writer.write(traj)
            count.append(traj)
            if len(count) == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # lands inside the bookkeeping: takes effect after it

        result = rollout(
            lambda: CalculatorEnv(qwen25), answer_policy(qwen25), episodes=40, concurrency=2, progress=False,
            on_episode=on_episode,
        )
    s = result.stats
    assert result.interrupted and s.interrupted and s.episodes == 3 and s.not_run == 37
    assert len(result.trajectories) == 3 and len(list(read_trajectories(tmp_path))) == 3  # stored = counted
    assert "interrupted: 3 finished, 37 not run" in summary_table(s)
    assert signal.getsignal(signal.SIGTERM) == before  # the run's handler is gone


def test_a_stop_inside_an_uninterrupted_section_waits_for_its_end():
    done = []
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        with stop_on_signals():
            with uninterrupted():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs in here, between bytecodes
                    pass
                done.append("finished")
    assert done == ["finished"]


def test_episode_error_reads_as_its_log_line():
    e = EpisodeError(None, None, "WorkerDied", "env worker 2 died: gone", failed=False)
    assert str(e) == "WorkerDied: env worker 2 died: gone" and "worker 2" in e


class Garbage(CalculatorEnv):
    """Calculator-v0 whose step returns what a buggy env might, for some seeds: a list as the
    observation (seed 1), no info dict (seed 3); every step also writes a non-numeric
    ``remaining_context`` into the user's info (the driver reads the step's record instead)."""

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        obs, reward, term, trunc, info = super().step(action)
        info["remaining_context"] = "plenty"
        if self._seed == 1:
            return obs.tolist(), reward, term, trunc, info
        if self._seed == 3:
            return obs, reward, term, trunc, None
        return obs, reward, term, trunc, info


@pytest.mark.parametrize("schedule", ["async", "lockstep"])
def test_an_env_that_returns_garbage_fails_its_episode_by_name_not_the_run(qwen25, schedule):
    result = rollout(lambda: Garbage(qwen25), answer_policy(qwen25), episodes=5, concurrency=2, progress=False,
                     schedule=schedule)
    s = result.stats
    assert (s.episodes, s.failed) == (3, 2) and sorted(t.metadata["episode"] for t in result.trajectories) == [0, 2, 4]
    errors = {e.episode: e for e in s.errors}
    assert errors[1].type == "TypeError" and "returned a list as its observation" in errors[1].message
    assert errors[3].type == "TypeError" and "returned no info dict" in errors[3].message  # the recorder says it first


def test_answers_cut_at_the_token_limit_are_counted_and_said(qwen25):
    from tokengym.policies import SamplingParams

    full = rollout(lambda: CalculatorEnv(qwen25), answer_policy(qwen25), episodes=2, progress=False)
    assert full.stats.finish_reasons == {"stop": 2} and "cut" not in summary_table(full.stats)
    cut = rollout(lambda: CalculatorEnv(qwen25, max_turns=1), answer_policy(qwen25), episodes=2, progress=False,
                  sampling=SamplingParams(max_tokens=3))
    assert cut.stats.finish_reasons == {"length": 2} and cut.stats.as_dict()["finish_reasons"] == {"length": 2}
    table = summary_table(cut.stats)
    assert re.search(r"^finish reasons +length 2$", table, re.M)
    assert "2 actions stopped at the token limit (finish reason 'length')" in table


# ------------------------------------------------------------ deadlines: one hung episode never hangs the run
import threading  # noqa: E402
import time  # noqa: E402

from tokengym.recorder import Deadlines  # noqa: E402

RELEASE = threading.Event()  # set at the end of each test: the hung steps return, their threads end


class HangingCalculator(CalculatorEnv):
    """tokengym/Calculator-v0 whose step blocks (as on a dead socket) in the episodes reset with seed 1."""

    step_waits = True  # it does: its steps run on worker threads, under the step deadline

    def reset(self, *, seed=None, options=None):
        self._hang = seed == 1
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._hang:
            RELEASE.wait(120)
        return super().step(action)


def run_with_a_hang(env_cls, tok):
    """Six episodes, two at a time, under a 0.5 s step deadline, one of them hung: (stats, wall seconds)."""
    RELEASE.clear()
    start = time.monotonic()
    try:
        result = rollout(lambda: env_cls(tok), answer_policy(tok), episodes=6, concurrency=2,
                         progress=False, deadlines=Deadlines(step_s=0.5))
        return result.stats, time.monotonic() - start
    finally:
        RELEASE.set()


@pytest.mark.alone  # a wall-clock bound
def test_a_hung_env_step_fails_its_episode_by_name_and_the_run_goes_on(qwen25):
    s, wall = run_with_a_hang(HangingCalculator, qwen25)
    assert (s.episodes, s.failed, s.not_run) == (5, 1, 0) and not s.interrupted
    (error,) = s.errors
    assert (error.episode, error.type) == (1, "EpisodeTimeout")
    assert "did not return within 0.5 s (Deadlines.step_s)" in error.message
    assert s.stuck_envs == 1  # the hung copy took no more episodes; the other ran the rest
    assert wall < 5.0, wall  # not the 120 s the step hangs, nor the 5 s grace at the end
    table = summary_table(s)
    assert "1 × EpisodeTimeout (episodes 1)" in table and "1 env copies left inside a step" in table


class HangingReset(CalculatorEnv):
    """tokengym/Calculator-v0 whose reset blocks (a sandbox that never starts) for seed 3."""

    step_waits = True

    def reset(self, *, seed=None, options=None):
        if seed == 3:
            RELEASE.wait(120)
        return super().reset(seed=seed, options=options)


@pytest.mark.alone  # a wall-clock bound
def test_a_hung_reset_fails_its_episode_by_name_and_the_run_goes_on(qwen25):
    s, wall = run_with_a_hang(HangingReset, qwen25)
    assert (s.episodes, s.failed, s.not_run) == (5, 1, 0) and not s.interrupted
    (error,) = s.errors
    assert (error.episode, error.type) == (3, "EpisodeTimeout") and "the env's reset did not return within 0.5 s" in error.message
    assert s.stuck_envs == 1 and wall < 5.0, wall


class NeverAnswers:
    """An async engine that never answers the requests whose context holds ``hang``'s tokens."""

    name = "never-answers"
    logprob_kind = "none"

    def __init__(self, tok) -> None:
        self.inner = answer_policy(tok)

    def generate(self, contexts, sampling):
        return self.inner.generate(contexts, sampling)

    async def agenerate(self, contexts, sampling):
        import asyncio

        if any(c[-40:].count(self.marker) for c in contexts):
            await asyncio.Event().wait()
        return self.inner.generate(contexts, sampling)


def test_a_policy_turn_past_its_deadline_fails_its_episode_and_the_run_goes_on(qwen25):
    policy = NeverAnswers(qwen25)
    env = CalculatorEnv(qwen25)
    prompts = {seed: env.reset(seed=seed)[0].tolist() for seed in range(4)}
    policy.marker = next(t for t in prompts[2][-60:] if all(t not in prompts[s][-60:] for s in (0, 1, 3)))
    result = rollout(lambda: CalculatorEnv(qwen25), policy, episodes=4, concurrency=4, progress=False,
                     deadlines=Deadlines(generate_s=0.5))
    s = result.stats
    assert (s.episodes, s.failed) == (3, 1) and s.stuck_envs == 0
    (error,) = s.errors
    assert (error.episode, error.type) == (2, "EpisodeTimeout") and "Deadlines.generate_s" in error.message


@pytest.mark.alone  # a wall-clock bound
def test_ctrl_c_ends_a_run_whose_step_hangs_within_seconds(qwen25):
    RELEASE.clear()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        result = rollout(lambda: HangingCalculator(qwen25), answer_policy(qwen25), episodes=[1], progress=False)
        wall = time.monotonic() - start
    finally:
        timer.cancel()
        RELEASE.set()
    assert result.interrupted and result.stats.not_run == 1
    assert result.stats.stuck_envs == 1
    assert wall < 10.0, wall  # the stop, then at most the 5 s grace for the step under way


def test_deadlines_are_checked():
    from tokengym.recorder.cli.parser import build_parser

    # The defaults the README and `tokengym rollout -h` give.
    assert (Deadlines().step_s, Deadlines().generate_s) == (600.0, 3600.0)
    args = build_parser().parse_args(["rollout", "tokengym/Calculator-v0"])
    assert (args.step_timeout, args.turn_timeout) == (600.0, 3600.0)
    with pytest.raises(ValueError, match="step_s must be a positive number of seconds or None"):
        Deadlines(step_s=0)
    with pytest.raises(ValueError, match="generate_s"):
        Deadlines(generate_s=float("nan"))


class _Reply:
    """What an engine actor's ``generate.remote`` returns, for the worker unit test below: its ``future()``."""

    def __init__(self, gen):
        self.gen = gen

    def future(self):
        import concurrent.futures

        f = concurrent.futures.Future()
        f.set_result(self.gen)
        return f


def test_an_env_worker_that_cannot_replace_a_stuck_env_says_it_lost_the_slot(qwen25):
    """The Ray env worker (as a plain object, with an engine stand-in that answers at once): its
    episode's step hangs past the deadline, the stuck copy is set aside, and making a fresh one
    fails, so the worker tells the driver it has one slot fewer instead of blocking its next episode."""
    from types import SimpleNamespace

    from tokengym.policies import SamplingParams
    from tokengym.recorder.drivers.episodes import plan_tasks, sampling_record
    from tokengym.recorder.drivers.ray_actors import EnvWorker

    builds = []

    def make():
        builds.append(1)
        if len(builds) > 1:
            raise RuntimeError("the env's backend is gone")
        return HangingCalculator(qwen25)

    policy = answer_policy(qwen25)
    engine = SimpleNamespace(generate=SimpleNamespace(remote=lambda ctx, params: _Reply(policy.generate([ctx], params)[0])))
    base = SamplingParams(max_tokens=16)
    (task,) = plan_tasks([1], 0, base)  # episode 1 resets with seed 1: its step hangs
    RELEASE.clear()
    worker = EnvWorker(make, None, slots=1)
    try:
        out = worker.run_episode(task, engine, (base, 0, sampling_record(base, "scripted", "none", 0), Deadlines(step_s=0.5)))
        assert out["stuck"] is True and out["slot_lost"] is True and out["error"].type == "EpisodeTimeout"
        assert len(builds) == 2
    finally:
        RELEASE.set()
        worker.close()
