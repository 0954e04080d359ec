"""The Ray backend of the rollout driver, on a real Ray.

A cluster of three nodes of one CPU each is simulated on this machine
(``ray.cluster_utils.Cluster``, every node and the driver on 127.0.0.1). One backend
session keeps its three env workers (one per node) across the tests, and the tests check
against one local run of the same episodes: identical trajectories token for token, a
killed worker that loses only its in-flight episodes (counted as failed, or started
again), an engine that is restarted, and one that stays dead and ends the run with a
clear error; a slow tool that holds up only its own episode; episodes that stick to one
engine, at most ``max_inflight_per_engine`` at a time.

Skipped when Ray is not installed, unless ``TOKENGYM_REQUIRE_RAY=1`` (then a failure).
The tests that need no Ray (the local backend works without it, a clear install hint) always run.
"""

from __future__ import annotations

import functools
import re
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # nodes and driver on loopback (read when ray is imported)

import pytest  # noqa: E402

from tokengym.envs import CalculatorEnv, ReplayEnv  # noqa: E402
from tokengym.policies import SamplingParams, ScriptedPolicy, scripted_replies  # noqa: E402
from tokengym.policies.base import per_request  # noqa: E402
from tokengym.recorder import TrajectoryWriter, read_trajectories, summary_table  # noqa: E402
from tokengym.recorder.cli import main  # noqa: E402
from tokengym.recorder.drivers.rollout import rollout  # noqa: E402

import test_env_registry as registry  # noqa: E402  (its declared-env package, for the Ray workers)

try:
    import ray
except ImportError:
    if os.environ.get("TOKENGYM_REQUIRE_RAY"):  # CI's run with Ray: a missing Ray is a failure
        raise
    ray = None

NO_RAY = 'Ray is not installed: pip install "tokengym[ray]" (TOKENGYM_REQUIRE_RAY=1 makes this a failure)'


def ray_test(fn):
    return pytest.mark.ray(pytest.mark.skipif(ray is None, reason=NO_RAY)(fn))


# -- an env whose tool takes its time, and the scripted policy that calls it ---------------

CALL = '<tool_call>\n{"name": "work", "arguments": {"n": 21}}\n</tool_call>'
ANSWER = "<answer>42</answer>"
POLICY = functools.partial(scripted_replies, (CALL, ANSWER), "qwen2.5")  # built inside each engine actor
N = 9
# Reset seeds (episode i resets with seed + i) whose tool call takes this long. With seed 0,
# episode 0 and 3 are fast: when the first of them is in, every other worker still has
# episodes in flight. Seed 1000 is the slow-tool test's episode 0.
DELAYS = {1: 2.0, 2: 2.0, 4: 2.0, 5: 2.0, 1000: 3.0}


class SlowCalculator(CalculatorEnv):
    """tokengym/Calculator-v0 plus a ``work`` tool that sleeps ``delays[seed]`` in the episodes reset with ``seed``."""

    def __init__(self, tokenizer, delays: dict[int, float], **kwargs) -> None:
        self.delays = dict(delays)
        kwargs.setdefault("tool_timeout", 60)
        super().__init__(tokenizer, tool_factory=self._tools, max_turns=3, **kwargs)

    def reset(self, *, seed=None, options=None):
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def _tools(self, task):
        delay = self.delays.get(self._seed, 0.0)

        def work(n: int) -> int:
            """Work on a number.

            Args:
                n: the number to work on
            """
            time.sleep(delay)
            return 2 * n

        return [work]


class PrefixCachePolicy:
    """Calls ``work``, then answers ``hit`` when this engine served the episode's earlier turn, else ``miss``.

    A stand-in for an engine's prefix cache: an episode whose requests went to two
    engines would answer ``miss``.
    """

    name = "prefix-cache"
    logprob_kind = "none"

    def __init__(self) -> None:
        from tokengym.envs import load_tokenizer

        tokenizer = load_tokenizer("qwen2.5")
        self.hit = scripted_replies((CALL, "<answer>hit</answer>"), tokenizer)
        self.miss = scripted_replies(("<answer>miss</answer>",), tokenizer)
        self.seen: list[list[int]] = []
        self.call_ids = self.hit.generate([[0]], SamplingParams())[0].token_ids.tolist()  # the first turn's reply

    def generate(self, contexts, sampling):
        out = []
        for context, sp in zip(contexts, per_request(sampling, len(contexts))):
            context = [int(i) for i in context]
            gen = self.hit.generate([context], sp)[0]
            if gen.token_ids.tolist() != self.call_ids and not any(context[: len(s)] == s for s in self.seen):
                gen = self.miss.generate([context], sp)[0]
            self.seen.append(context)
            out.append(gen)
        return out


def same(a, b) -> None:
    """Two runs' trajectories are equal: tokens, masks, segments, rewards, metadata, settings."""
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]


# -- no Ray needed ------------------------------------------------------------------------


def test_the_local_backend_needs_no_ray_and_the_ray_backend_says_how_to_get_it(qwen25, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    policy = ScriptedPolicy(lambda context: [9707, 151645])
    result = rollout(lambda: ReplayEnv(qwen25, max_turns=1), policy, episodes=2, concurrency=2, progress=False)
    assert result.stats.episodes == 2
    with pytest.raises(ImportError, match=r'pip install "tokengym\[ray\]"'):
        rollout(lambda: ReplayEnv(qwen25, max_turns=1), policy, episodes=2, backend="ray", progress=False)
    args = ["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen2.5", "--reply", ANSWER,
            "--out", str(tmp_path / "x"), "--quiet"]
    assert main([*args, "--backend", "ray"]) == 2
    assert 'pip install "tokengym[ray]"' in capsys.readouterr().err
    assert main([*args, "--address", "auto"]) == 2  # --address is for --backend ray
    with pytest.raises(ValueError, match="unknown backend"):
        rollout(lambda: ReplayEnv(qwen25, max_turns=1), policy, episodes=1, backend="dask")


# -- a simulated 3-node cluster ------------------------------------------------------------


def stored(path):
    trajs = list(read_trajectories(path))
    episodes = [t.metadata["episode"] for t in trajs]
    assert len(episodes) == len(set(episodes)), f"an episode was written twice: {sorted(episodes)}"
    return sorted(trajs, key=lambda t: t.metadata["episode"])


@ray_test
def test_the_cli_starts_a_local_ray_and_records_what_the_local_backend_records(tmp_path, capsys):
    """The first Ray test of the module: no Ray is running, so the backend starts one and shuts it down."""
    assert not ray.is_initialized()
    args = ["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--tokenizer", "qwen2.5",
            "--reply", '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
            "--reply", "<answer>5</answer>", "--episodes", "4", "--concurrency", "2", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "ray"), "--backend", "ray"]) == 0
    out = capsys.readouterr().out
    assert "4 done, 0 failed" in out and re.search(r"nodes +1 \(", out), out
    assert not ray.is_initialized()  # the Ray it started is gone
    assert main([*args, "--out", str(tmp_path / "local")]) == 0
    same(stored(tmp_path / "ray"), stored(tmp_path / "local"))


@ray_test
@pytest.mark.slow
def test_ray_workers_find_a_declared_env_the_same_way(tmp_path):
    """The env workers are other processes: they resolve the name themselves (tokengym.envs.EnvRef).
    (Here, not in test_env_registry.py: the Ray tests share one worker of a side-by-side run, so
    the Ray this starts is never another test's cluster.)"""
    root = registry.write_package(tmp_path / "site", registry.DECLARED)
    out = tmp_path / "store"
    proc = registry.run_cli(
        [
            "rollout", "mylab/Todo-v0", "--backend", "ray", "--workers", "1", "--policy", "scripted",
            "--tokenizer", "qwen2.5", "--reply", registry.CALL, "--reply", "<answer>DONE</answer>", "--episodes", "2",
            "--concurrency", "2", "--env-kwarg", "max_turns=3", "--out", str(out), "--quiet",
        ],
        root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 done, 0 failed" in proc.stdout
    trajs = list(read_trajectories(out))
    assert [t.env_id for t in trajs] == ["mylab/Todo-v0"] * 2 and [t.reward for t in trajs] == [1.0, 1.0]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(2):
            c.add_node(num_cpus=1)
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        # This module's env and policy classes travel to the actors by value (the workers cannot import it).
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def env(qwen25):
    return functools.partial(SlowCalculator, qwen25, DELAYS)


@pytest.fixture(scope="module")
def local_run(env):
    """The reference: the same episodes on the local backend."""
    result = rollout(env, POLICY, episodes=N, concurrency=N, seed=0, progress=False)
    assert result.stats.episodes == N and result.stats.failed == 0
    assert all(t.num_turns == 2 and t.metadata["tool_stats"]["ok"] == 1 for t in result.trajectories)
    return result


@pytest.fixture(scope="module")
def backend(cluster):
    """One session for the module: three env workers of two slots (one per node), kept between runs."""
    from tokengym.recorder.drivers.ray_backend import RayBackend

    with RayBackend(num_workers=3, slots_per_worker=2) as b:
        yield b


@ray_test
def test_episodes_spread_over_three_nodes_are_identical_to_the_local_run(backend, env, local_run, tmp_path, qwen25):
    arrived = []
    with TrajectoryWriter(tmp_path / "store", tokenizer=qwen25) as writer:

        def write(traj):
            arrived.append((traj.metadata["episode"], time.perf_counter()))
            writer.write(traj)

        result = rollout(env, POLICY, episodes=N, concurrency=6, seed=0, progress=False, backend=backend, on_episode=write)
    assert result.stats.episodes == N and result.stats.failed == 0 and not result.stats.lost
    assert len(result.stats.per_node) == 3, result.stats.per_node  # every node ran episodes
    same(result.trajectories, local_run.trajectories)
    same(stored(tmp_path / "store"), local_run.trajectories)
    # Streamed: the fast episodes were written while the slow ones were still running.
    assert arrived[-1][1] - arrived[0][1] > 1.0
    assert "nodes" in summary_table(result.stats)


@ray_test
def test_a_slow_tool_holds_up_only_its_own_episode(backend, env):
    order = []
    result = rollout(env, POLICY, episodes=6, concurrency=6, seed=1000, progress=False, backend=backend,
                     on_episode=lambda t: order.append(t.metadata["episode"]))
    assert result.stats.episodes == 6
    assert order[-1] == 0, order  # episode 0's tool sleeps 3 s; the five others did not wait for it


@ray_test
def test_a_killed_worker_loses_only_its_in_flight_episodes(backend, env, local_run, tmp_path, qwen25):
    backend.max_reruns = 0
    killed = []

    def kill_once(traj):
        if not killed:  # the first episode is in: the other workers have slow ones in flight
            victim = next(w for w in backend.fleet.alive if w not in killed)
            killed.append(victim)
            ray.kill(backend.workers[victim])

    try:
        with TrajectoryWriter(tmp_path / "store", tokenizer=qwen25) as writer:
            result = rollout(env, POLICY, episodes=N, concurrency=6, seed=0, progress=False, backend=backend,
                             on_episode=lambda t: (writer.write(t), kill_once(t)))
    finally:
        backend.max_reruns = 1
    s = result.stats
    assert s.lost and s.rerun == 0 and s.failed == len(s.lost) and s.episodes + s.failed == N
    assert any(f"env worker {killed[0]}" in e and "died" in e for e in s.errors)
    for episode in s.lost:  # named in the report
        assert any(f"episode {episode} was lost" in e for e in s.errors)
    assert "lost" in summary_table(s) and "counted as failed" in summary_table(s)
    kept = stored(tmp_path / "store")
    assert sorted(t.metadata["episode"] for t in kept) == sorted(set(range(N)) - set(s.lost))
    same(kept, [t for t in local_run.trajectories if t.metadata["episode"] not in s.lost])
    assert len(backend.fleet.alive) == 3  # a new worker took the dead one's place


@ray_test
def test_lost_episodes_are_started_again_and_recorded_once(backend, env, local_run, tmp_path, qwen25):
    killed = []

    def kill_once(traj):
        if not killed:
            killed.append(backend.fleet.alive[0])
            ray.kill(backend.workers[killed[0]])

    with TrajectoryWriter(tmp_path / "store", tokenizer=qwen25) as writer:
        result = rollout(env, POLICY, episodes=N, concurrency=6, seed=0, progress=False, backend=backend,
                         on_episode=lambda t: (writer.write(t), kill_once(t)))
    s = result.stats
    assert s.episodes == N and s.failed == 0 and s.lost and s.rerun == len(s.lost)
    assert "re-run" in summary_table(s)
    same(result.trajectories, local_run.trajectories)
    same(stored(tmp_path / "store"), local_run.trajectories)


@ray_test
def test_an_engine_killed_mid_run_is_restarted(backend, env, local_run):
    killed = []

    def kill_once(traj):
        if not killed:
            killed.append(True)
            ray.kill(backend.engines[0], no_restart=False)  # Ray restarts it; its requests are retried

    result = rollout(env, POLICY, episodes=N, concurrency=6, seed=0, progress=False, backend=backend,
                     on_episode=kill_once)
    assert result.stats.engine_restarts == 1 and result.stats.failed == 0
    same(result.trajectories, local_run.trajectories)


@ray_test
@pytest.mark.slow
def test_seeded_sampling_is_identical_token_for_token(backend, env, qwen25, tmp_path):
    """A tiny random model sampled at temperature 1: every turn's seed reaches the engine actor."""
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tokengym.policies import HFPolicy

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(qwen25), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "tiny")
    factory = functools.partial(HFPolicy, str(tmp_path / "tiny"), model_kwargs={"dtype": torch.float32})
    kwargs = dict(episodes=6, concurrency=6, seed=7, sampling=SamplingParams(max_tokens=8, temperature=1.0), progress=False)
    remote = rollout(env, factory, backend=backend, **kwargs).trajectories
    local = rollout(env, factory, **kwargs).trajectories
    assert len(remote) == len(local) == 6 and all(t.has_logprobs for t in remote)
    for r, l in zip(remote, local):
        assert r.token_ids.tolist() == l.token_ids.tolist() and r.mask.tolist() == l.mask.tolist()
        np.testing.assert_allclose(r.logprobs, l.logprobs, atol=1e-4)
        assert r.sampling == l.sampling and r.sampling["policy"].startswith("hf:")


@ray_test
def test_episodes_stick_to_one_engine_and_each_engine_has_at_most_its_bound(backend, env, qwen25):
    backend.num_engines, backend.max_inflight_per_engine = 2, 2
    result = rollout(env, PrefixCachePolicy, episodes=N, concurrency=6, seed=0, progress=False, backend=backend)
    stats = ray.get([e.stats.remote() for e in backend.engines])
    assert result.stats.episodes == N
    answers = [qwen25.decode(t.actions[-1].token_ids.tolist()) for t in result.trajectories]
    assert all("<answer>hit</answer>" in a for a in answers), answers  # else a turn went to another engine
    assert all(s["requests"] > 0 for s in stats) and max(s["peak"] for s in stats) <= 2, stats


@ray_test
def test_sigterm_stops_a_ray_run_like_ctrl_c(backend, env, local_run, tmp_path, qwen25):
    import signal

    def stop_after_two(traj, count=[]):
        writer.write(traj)
        count.append(traj)
        if len(count) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as SLURM or Kubernetes would

    with TrajectoryWriter(tmp_path / "store", tokenizer=qwen25) as writer:
        result = rollout(env, POLICY, episodes=N, concurrency=6, seed=0, progress=False, backend=backend,
                         on_episode=stop_after_two)
    s = result.stats
    assert result.interrupted and s.episodes == 2 and s.not_run == N - 2 - s.failed
    assert f"interrupted: 2 finished, {s.not_run} not run" in summary_table(s)
    kept = stored(tmp_path / "store")
    same(kept, [t for t in local_run.trajectories if t.metadata["episode"] in {k.metadata["episode"] for k in kept}])
    assert len(kept) == 2 and backend.workers == []  # in-flight episodes dropped with their actors


@ray_test
def test_an_engine_that_stays_dead_ends_the_run_with_a_clear_error(backend, env, tmp_path, qwen25):
    """The last test of the module (the failed run ends the session's actors); the two engines of the test before."""
    from tokengym.recorder.drivers.ray_backend import RolloutError

    def kill_once(traj):
        if not getattr(kill_once, "done", False):
            kill_once.done = True
            ray.kill(backend.engines[0])  # for good: Ray does not restart it

    with pytest.raises(RolloutError, match="policy engine 0 died and was not restarted") as err:
        with TrajectoryWriter(tmp_path / "store", tokenizer=qwen25) as writer:
            rollout(env, PrefixCachePolicy, episodes=N, concurrency=6, seed=0, progress=False, backend=backend,
                    on_episode=lambda t: (writer.write(t), kill_once(t)))
    kept = err.value.result.trajectories
    assert 1 <= len(kept) < N and "finished episodes were kept" in str(err.value)
    assert [t.to_dict() for t in stored(tmp_path / "store")] == [t.to_dict() for t in kept]  # nothing recorded is lost
    assert all(t.num_turns == 2 for t in kept)
    assert backend.engines == [] and backend.workers == []


@ray_test
def test_groups_on_ray_are_the_local_groups(backend, env):
    kwargs = dict(episodes=6, group_size=3, concurrency=6, seed=7, progress=False)
    local = rollout(env, POLICY, **kwargs)
    result = rollout(env, POLICY, backend=backend, **kwargs)
    same(result.trajectories, local.trajectories)
    assert [t.metadata["group"] for t in result.trajectories] == [0, 0, 0, 1, 1, 1]
    assert [t.seed for t in result.trajectories] == [7, 7, 7, 8, 8, 8]
    assert "groups with signal" in summary_table(result.stats)


@ray_test
def test_episodes_of_several_contexts_come_back_whole_from_ray(backend):
    from test_deploy_history import CHAT, SYSTEM_LAST

    kwargs = dict(episodes=3, concurrency=3, seed=0, progress=False,
                  env_kwargs={"tokenizer": "qwen2.5", "transcript": CHAT, "history": "deploy", "chat_template": SYSTEM_LAST})
    local = rollout("tokengym/Replay-v0", POLICY, **kwargs)
    result = rollout("tokengym/Replay-v0", POLICY, backend=backend, **kwargs)
    same(result.trajectories, local.trajectories)
    assert result.stats.episodes == 3 and result.stats.context_resets == 6 and len(result.trajectories) == 9
    assert [(t.metadata["episode"], t.metadata["sequence"]) for t in result.trajectories] == [
        (e, k) for e in range(3) for k in range(3)]


@ray_test
def test_timed_out_tool_calls_still_running_in_the_workers_are_counted(backend, qwen25):
    """A tool call that timed out keeps its thread in the env worker's process: the run's summary
    says so, as it does for the local backend."""
    env = functools.partial(SlowCalculator, qwen25, {1000: 3.0}, tool_timeout=0.3)
    result = rollout(env, POLICY, episodes=1, seed=1000, progress=False, backend=backend)
    (traj,) = result.trajectories
    assert traj.metadata["tool_stats"]["timeout"] == 1
    assert result.stats.abandoned_tool_threads == 1
    assert "1 timed-out tool calls still running" in summary_table(result.stats)


class HangingStep(SlowCalculator):
    """SlowCalculator whose step blocks for good (as on a dead socket) in the episode reset with seed 1."""

    def step(self, action):
        if self._seed == 1:
            time.sleep(120)
        return super().step(action)


@ray_test
def test_a_hung_step_in_an_env_worker_fails_its_episode_and_the_run_goes_on(backend, qwen25):
    """The step deadline holds inside the env workers: the hung episode fails by name, the worker
    sets the stuck env copy aside and a fresh copy runs the episodes after it."""
    from tokengym.recorder import Deadlines

    result = rollout(functools.partial(HangingStep, qwen25, {}), POLICY, episodes=6, concurrency=2, seed=0,
                     progress=False, backend=backend, deadlines=Deadlines(step_s=1.0))
    s = result.stats
    assert (s.episodes, s.failed, s.not_run) == (5, 1, 0) and not s.interrupted, s.errors
    (error,) = s.errors
    assert (error.episode, error.type) == (1, "EpisodeTimeout")
    assert "did not return within 1 s (Deadlines.step_s)" in error.message
    assert s.stuck_envs == 1
    assert s.wall_s < 60, s.wall_s  # not the 120 s the step hangs (the workers' start-up is not in it)
    assert "1 env copies left inside a step" in summary_table(s)
