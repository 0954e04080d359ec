"""The local process pool (``backend="processes"``): env steps in worker processes, the policy here.

Every test runs real worker processes (forked from multiprocessing's fork server) with the real
Qwen3 tokenizer and ``tokengym/Calculator-v0``, against a local run of the same episodes where
it says so: the same trajectories token for token, a worker that dies mid-episode (its episode
started again, or counted as failed), a policy that refuses a request, an env that cannot be
sent or built, a script without a main guard, ``on_episode`` raising, SIGTERM, a step past its
deadline, the CLI. Each test checks that the workers it started are gone afterwards.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tokengym.envs import CalculatorEnv, load_tokenizer
from tokengym.policies import ScriptedPolicy
from tokengym.recorder import Deadlines, rollout
from tokengym.recorder.cli import main
from tokengym.recorder.drivers.process_backend import ProcessBackend
from tokengym.recorder.drivers.ray_backend import RolloutError

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'
ENV = "tokengym/Calculator-v0"
ENV_KWARGS = {"tokenizer": "qwen3", "max_turns": 3}
ROOT = Path(__file__).resolve().parents[1]


def call_ids() -> list[int]:
    env = CalculatorEnv(load_tokenizer("qwen3"))
    return env.renderer.encode_action_text(CALL) + list(env.renderer.turn_end_ids)


def _reply(ids: list[int], context: list[int]) -> list[int]:
    return ids


def call_policy() -> ScriptedPolicy:
    return ScriptedPolicy(functools.partial(_reply, call_ids()), name="scripted-call")


def gone(pids: list[int], within: float = 10.0) -> bool:
    """Every process in ``pids`` has exited (the test's own workers only)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def same(a, b) -> None:
    assert [t.metadata["episode"] for t in a.trajectories] == [t.metadata["episode"] for t in b.trajectories]
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        assert x.token_ids.tolist() == y.token_ids.tolist()
        assert x.mask.tolist() == y.mask.tolist()
        assert x.turn_rewards.tolist() == y.turn_rewards.tolist()
        assert np.array_equal(x.logprobs, y.logprobs, equal_nan=True)


class DyingCalculator(CalculatorEnv):
    """Calculator-v0 whose process exits in the step of an episode reset with ``seed``, the first
    time only (a file under ``mark`` remembers it): the worker dies mid-episode."""

    def __init__(self, mark: str, seed: int, **kwargs) -> None:
        super().__init__(load_tokenizer("qwen3"), max_turns=3, **kwargs)
        self.mark, self.die_seed = Path(mark), seed

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._seed == self.die_seed and not (self.mark / "died").exists():
            (self.mark / "died").touch()
            os._exit(3)
        return super().step(action)


class SlowStepCalculator(CalculatorEnv):
    """Calculator-v0 whose steps in episodes reset with ``seed`` sleep ``seconds`` (a hung tool)."""

    step_waits = True

    def __init__(self, seed: int, seconds: float) -> None:
        super().__init__(load_tokenizer("qwen3"), max_turns=3)
        self.slow_seed, self.seconds = seed, seconds

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self._seed == self.slow_seed:
            time.sleep(self.seconds)
        return super().step(action)


class DyingOnRestartCalculator(DyingCalculator):
    """As :class:`DyingCalculator`, and once its process has died, every later build exits too:
    the replacement worker exits before it starts."""

    def __init__(self, mark: str, seed: int, **kwargs) -> None:
        if (Path(mark) / "died").exists():
            os._exit(4)
        super().__init__(mark, seed, **kwargs)


def broken_env() -> CalculatorEnv:
    raise RuntimeError("no such sandbox image: calc:latest")


def test_the_pool_gives_the_local_trajectories_token_for_token():
    policy = call_policy()
    local = rollout(ENV, policy, env_kwargs=ENV_KWARGS, episodes=12, concurrency=6, progress=False)
    pool = ProcessBackend(num_workers=2)
    result = rollout(ENV, policy, env_kwargs=ENV_KWARGS, episodes=12, concurrency=6, progress=False, backend=pool)
    assert result.stats.failed == 0 and result.stats.episodes == 12
    same(local, result)
    assert result.stats.turns == local.stats.turns and result.stats.tokens == local.stats.tokens
    assert len(pool.worker_pids) == 2 and os.getpid() not in pool.worker_pids
    assert pool.worker_cpu_s > 0  # the workers said what they spent
    assert gone(pool.worker_pids)
    with pytest.raises(ValueError, match="lockstep"):
        rollout(ENV, policy, env_kwargs=ENV_KWARGS, episodes=1, backend="processes", schedule="lockstep")
    with pytest.raises(ValueError, match="address= is for backend='ray'"):
        rollout(ENV, policy, env_kwargs=ENV_KWARGS, episodes=1, backend="processes", address="auto")


@pytest.mark.slow
def test_a_worker_that_dies_loses_only_its_episode_which_runs_again(tmp_path):
    policy = call_policy()
    make = functools.partial(DyingCalculator, str(tmp_path), 3)  # episode 3 (seed 0 + 3) kills its worker once
    local = rollout(functools.partial(CalculatorEnv, load_tokenizer("qwen3"), max_turns=3), policy, episodes=8,
                    concurrency=4, progress=False)
    pool = ProcessBackend(num_workers=2)  # one slot each: episode 3 is its worker's only one in flight
    result = rollout(make, policy, episodes=8, concurrency=2, progress=False, backend=pool)
    assert (tmp_path / "died").exists()
    assert result.stats.failed == 0 and result.stats.episodes == 8
    assert result.stats.lost == [3] and result.stats.rerun == 1
    assert any(e.type == "WorkerDied" and not e.failed for e in result.stats.errors)
    same(local, result)  # the rerun is the same episode, token for token
    assert len(pool.worker_pids) == 3  # a fresh worker took the dead one's place
    assert gone(pool.worker_pids)


@pytest.mark.slow
def test_with_no_reruns_the_lost_episode_counts_as_failed(tmp_path):
    pool = ProcessBackend(num_workers=1, max_reruns=0)
    result = rollout(functools.partial(DyingCalculator, str(tmp_path), 1), call_policy(), episodes=3, concurrency=1,
                     progress=False, backend=pool)
    assert result.stats.failed == 1 and result.stats.episodes == 2
    assert [e.episode for e in result.stats.errors if e.failed] == [1]
    assert "counted as failed" in str(result.stats.errors[-1])
    assert len(pool.worker_pids) == 2  # the fresh worker ran episode 2
    assert gone(pool.worker_pids)


@pytest.mark.slow
def test_a_refused_request_fails_its_episode_by_name_and_the_run_goes_on():
    from tokengym.recorder.drivers.episodes import plan_tasks, turn_seed

    (task,) = plan_tasks([2], 0)
    refused = turn_seed(*task.seed_key, 0)  # episode 2's first turn

    class Picky(ScriptedPolicy):
        def generate(self, contexts, params):
            if any(p.seed == refused for p in params):
                raise ValueError("context too long for this engine")
            return super().generate(contexts, params)

    pool = ProcessBackend(num_workers=1)
    result = rollout(ENV, Picky(functools.partial(_reply, call_ids())), env_kwargs=ENV_KWARGS, episodes=4, concurrency=2,
                     progress=False, backend=pool)
    assert result.stats.episodes == 3 and result.stats.failed == 1
    (error,) = [e for e in result.stats.errors if e.failed]
    assert (error.episode, error.turn, error.type) == (2, 0, "ValueError")
    assert "context too long" in error.message
    assert gone(pool.worker_pids)


def test_an_env_that_cannot_be_sent_or_built_ends_the_run_by_name():
    with pytest.raises(TypeError, match="functools.partial"):
        rollout(lambda: CalculatorEnv(load_tokenizer("qwen3")), call_policy(), episodes=2, backend="processes",
                progress=False)
    pool = ProcessBackend(num_workers=1)
    with pytest.raises(RolloutError, match="could not build its env: RuntimeError: no such sandbox image"):
        rollout(broken_env, call_policy(), episodes=2, progress=False, backend=pool)
    assert gone(pool.worker_pids)


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_so(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from tokengym.policies import ScriptedPolicy
        from tokengym.recorder import rollout
        rollout({ENV!r}, ScriptedPolicy(lambda c: [1]), env_kwargs={ENV_KWARGS!r}, episodes=1, progress=False,
                backend="processes")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "exited before it started" in proc.stderr


@pytest.mark.slow
def test_on_episode_raising_ends_the_run_with_its_error_and_no_worker_is_left():
    pool = ProcessBackend(num_workers=1)

    def full_disk(traj):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        rollout(ENV, call_policy(), env_kwargs=ENV_KWARGS, episodes=4, concurrency=2, progress=False,
                backend=pool, on_episode=full_disk)
    assert pool.worker_pids and gone(pool.worker_pids)


@pytest.mark.slow
def test_sigterm_keeps_the_finished_episodes_and_ends_the_workers(tmp_path):
    script = tmp_path / "stopped.py"
    script.write_text(textwrap.dedent(f"""
        import functools, json, os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tokengym.recorder import rollout
        from tokengym.recorder.drivers.process_backend import ProcessBackend
        from test_process_backend import SlowStepCalculator, call_policy

        def stop_after_first(traj):
            os.kill(os.getpid(), signal.SIGTERM)

        if __name__ == "__main__":
            pool = ProcessBackend(num_workers=1)
            # episode 1 (seed 1) steps slowly: it is in flight when episode 0 finishes and the stop comes
            result = rollout(functools.partial(SlowStepCalculator, 1, 2.0), call_policy(), episodes=4, concurrency=2,
                             progress=False, backend=pool, on_episode=stop_after_first)
            print(json.dumps({{"interrupted": result.interrupted, "done": [t.metadata["episode"] for t in result.trajectories],
                              "not_run": result.stats.not_run, "pids": pool.worker_pids}}))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["interrupted"] and out["done"] == [0] and out["not_run"] == 3
    assert gone(out["pids"])


@pytest.mark.slow
def test_a_step_past_its_deadline_fails_its_episode_and_retires_its_env():
    pool = ProcessBackend(num_workers=1)
    # a deadline a loaded machine's env build and steps keep well inside; episode 1's step sleeps far past it
    result = rollout(functools.partial(SlowStepCalculator, 1, 12.0), call_policy(), episodes=3, concurrency=2,
                     progress=False, backend=pool, deadlines=Deadlines(step_s=3.0))
    assert result.stats.episodes == 2 and result.stats.failed == 1
    (error,) = [e for e in result.stats.errors if e.failed]
    assert error.episode == 1 and error.type == "EpisodeTimeout" and "Deadlines.step_s" in error.message
    assert result.stats.stuck_envs == 1
    assert gone(pool.worker_pids)


@pytest.mark.slow
def test_the_cli_runs_the_pool_and_refuses_ray_only_flags(tmp_path, capsys):
    args = ["rollout", ENV, "--policy", "scripted", "--tokenizer", "qwen3", "--reply", CALL, "--episodes", "4",
            "--max-turns", "2", "--quiet"]
    assert main([*args, "--backend", "processes", "--workers", "2", "--out", str(tmp_path / "pool")]) == 0
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    from tokengym.recorder import read_trajectories

    pool = sorted(read_trajectories(tmp_path / "pool"), key=lambda t: t.metadata["episode"])
    local = sorted(read_trajectories(tmp_path / "local"), key=lambda t: t.metadata["episode"])
    assert [t.token_ids.tolist() for t in pool] == [t.token_ids.tolist() for t in local]
    capsys.readouterr()
    assert main([*args, "--backend", "processes", "--engines", "2", "--out", str(tmp_path / "x")]) == 2
    assert "--address and --engines are for --backend ray" in capsys.readouterr().err
    assert main([*args, "--workers", "2", "--out", str(tmp_path / "y")]) == 2
    assert "--workers is for --backend processes or ray" in capsys.readouterr().err


@pytest.mark.slow
def test_a_thread_that_runs_a_loop_gets_the_same_run_as_a_notebook_does():
    import asyncio

    pool = ProcessBackend(num_workers=1)

    async def cell():  # a notebook cell: the kernel's thread runs a loop
        return rollout(ENV, call_policy(), env_kwargs=ENV_KWARGS, episodes=3, concurrency=3, progress=False,
                       backend=pool)

    result = asyncio.run(cell())
    assert result.stats.episodes == 3 and not result.interrupted
    local = rollout(ENV, call_policy(), env_kwargs=ENV_KWARGS, episodes=3, concurrency=3, progress=False)
    same(local, result)
    assert gone(pool.worker_pids)


@pytest.mark.slow
def test_a_replacement_that_exits_before_it_starts_is_noted_and_the_run_ends_by_name(tmp_path):
    pool = ProcessBackend(num_workers=1, max_worker_replacements=1)
    with pytest.raises(RolloutError, match=r"no env worker is left \(2 episodes not run\)") as caught:
        rollout(functools.partial(DyingOnRestartCalculator, str(tmp_path), 1), call_policy(), episodes=3,
                concurrency=1, progress=False, backend=pool)
    stats = caught.value.result.stats
    assert stats.episodes == 1  # episode 0, before the death
    assert stats.lost == [1] and stats.rerun == 1  # queued again beside episode 2; neither ran: no worker was left
    notes = [e for e in stats.errors if e.type == "WorkerStartFailed"]
    assert len(notes) == 1 and "exited before it started (exit code 4)" in notes[0].message and not notes[0].failed
    assert len(pool.worker_pids) == 2 and gone(pool.worker_pids)
