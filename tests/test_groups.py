"""GRPO groups in the driver: G episodes per task, same task, their own sampling seeds.

Real envs on the pinned Qwen tokenizers, a real tiny Qwen3 through ``HFPolicy`` (so the
members of a group really sample differently), the real Parquet store and the CLI.
"""

from __future__ import annotations

import pytest

from tiny_qwen3 import tiny_qwen3
from tokengym.envs import CalculatorEnv, ChatEnv, Prompt
from tokengym.policies import HFPolicy, SamplingParams, ScriptedPolicy
from tokengym.recorder import GroupSignal, TrajectoryWriter, group_signal, read_trajectories, rollout, summary_table
from tokengym.recorder.cli import main


@pytest.fixture(scope="module")
def tiny_policy(qwen25):
    return HFPolicy(tiny_qwen3(len(qwen25)), qwen25)


def prompt_of(traj):
    return traj.token_ids[: traj.prompt_len].tolist()


def test_a_group_shares_its_task_and_samples_on_its_own(tiny_policy, qwen25):
    r = rollout(
        lambda: CalculatorEnv(qwen25, max_turns=1), tiny_policy, episodes=8, group_size=4, seed=3,
        sampling=SamplingParams(max_tokens=8), progress=False,
    )
    trajs = r.trajectories
    assert [t.metadata["group"] for t in trajs] == [0] * 4 + [1] * 4
    assert [t.seed for t in trajs] == [3] * 4 + [4] * 4
    for group in (trajs[:4], trajs[4:]):
        assert len({tuple(prompt_of(t)) for t in group}) == 1  # one task per group
        assert len({t.metadata["task_id"] for t in group}) == 1
        assert len({tuple(t.token_ids.tolist()) for t in group}) > 1  # the samples differ
    assert prompt_of(trajs[0]) != prompt_of(trajs[4])  # and the groups' tasks differ
    signal = r.stats.group_signal()
    assert signal.groups == 2 and signal.singletons == 0
    assert signal == group_signal(trajs)  # the run's count is the batch's
    assert f"groups with signal: {signal.with_signal} of 2" in summary_table(r.stats)


def test_tasks_from_a_list_each_once_or_cycled(qwen25):
    tasks = [{"problem_seed": 11}, {"problem_seed": 12}, {"problem_seed": 13}]
    policy = ScriptedPolicy(lambda ctx: "I do not know.", qwen25, end_ids=[151645])
    once = rollout(lambda: CalculatorEnv(qwen25), policy, tasks=tasks, group_size=2, progress=False)
    assert len(once.trajectories) == 6
    ids = [t.metadata["task_id"] for t in once.trajectories]
    assert ids[0] == ids[1] != ids[2] == ids[3] != ids[4] == ids[5]
    # Cycled: groups 3 and 4 take tasks 0 and 1 again.
    cycled = rollout(lambda: CalculatorEnv(qwen25), policy, episodes=10, tasks=tasks, group_size=2, progress=False)
    cids = [t.metadata["task_id"] for t in cycled.trajectories]
    assert cids[6:10] == ids[0:4]
    # Equal rewards in every group: no signal, said so.
    assert once.stats.group_signal() == GroupSignal(groups=3, with_signal=0, singletons=0, equal_reward=3)
    assert "groups with signal: 0 of 3 (0 of one member, 3 with equal rewards)" in summary_table(once.stats)


def test_bad_group_settings_are_named(qwen25):
    policy = ScriptedPolicy(lambda ctx: "4", qwen25, end_ids=[151645])
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        rollout(lambda: CalculatorEnv(qwen25), policy, episodes=10, group_size=4, progress=False)
    with pytest.raises(ValueError, match="group_size >= 1"):
        rollout(lambda: CalculatorEnv(qwen25), policy, episodes=2, group_size=0, progress=False)
    with pytest.raises(ValueError, match="tasks=\\[\\]"):
        rollout(lambda: CalculatorEnv(qwen25), policy, tasks=[], progress=False)
    with pytest.raises(TypeError, match="tasks\\[1\\] must be a dict"):
        rollout(lambda: CalculatorEnv(qwen25), policy, tasks=[{}, "x"], progress=False)
    with pytest.raises(TypeError, match="episodes="):
        rollout(lambda: CalculatorEnv(qwen25), policy, progress=False)


class SeedEcho(ChatEnv):
    """Asks for the seed it was reset with and the task it was given: make_prompt sees both."""

    def make_prompt(self, options):
        return Prompt([{"role": "user", "content": f"seed {self.reset_seed} task {options.get('name')}"}],
                      task={"id": options.get("name")})

    def respond(self, turn):
        from tokengym.envs import EnvResponse

        return EnvResponse(done=True)


def test_make_prompt_sees_the_seed_and_the_task(qwen25):
    policy = ScriptedPolicy(lambda ctx: "ok", qwen25, end_ids=[151645])
    r = rollout(lambda: SeedEcho(qwen25), policy, tasks=[{"name": "a"}, {"name": "b"}], group_size=2, seed=40,
                progress=False)
    texts = [qwen25.decode(prompt_of(t)) for t in r.trajectories]
    assert ["seed 40 task a" in x for x in texts] == [True, True, False, False]
    assert ["seed 41 task b" in x for x in texts] == [False, False, True, True]


def test_the_store_and_the_cli_keep_groups(qwen25, tmp_path, capsys):
    policy = ScriptedPolicy(lambda ctx: "4", qwen25, end_ids=[151645])
    with TrajectoryWriter(tmp_path / "s", tokenizer=qwen25) as w:
        rollout(lambda: CalculatorEnv(qwen25), policy, episodes=4, group_size=2, on_episode=w.write, progress=False)
    # The store keeps the order episodes finished in: read by episode, the groups are in order.
    by_episode = lambda trajs: sorted(trajs, key=lambda t: t.metadata["episode"])  # noqa: E731
    assert [t.metadata["group"] for t in by_episode(read_trajectories(tmp_path / "s"))] == [0, 0, 1, 1]

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"problem_seed": 1}\n\n{"problem_seed": 2}\n')
    out = tmp_path / "cli"
    argv = ["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--reply", "4", "--tokenizer", "qwen2.5",
            "--tasks", str(tasks), "--group-size", "3", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    stored = by_episode(read_trajectories(out))
    assert [t.metadata["group"] for t in stored] == [0, 0, 0, 1, 1, 1]
    assert "groups with signal" in capsys.readouterr().out
    # The same command again: everything is stored; with other groups it is refused.
    assert main(argv) == 0 and "already holds all 6" in capsys.readouterr().out
    assert main([*argv[:-5], "--group-size", "2", "--out", str(out), "--quiet"]) == 2
    assert "group_size" in capsys.readouterr().err
    # --append starts a new group.
    assert main([*argv, "--append", "--episodes", "3"]) == 0
    assert sorted(t.metadata["group"] for t in read_trajectories(out)) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("content, match", [("[1]\n", "JSON object"), ("{nope\n", "not JSON"), ("\n", "no task")])
def test_bad_task_files_are_named(tmp_path, content, match, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text(content)
    code = main(["rollout", "tokengym/Calculator-v0", "--policy", "scripted", "--reply", "4", "--tokenizer",
                 "qwen2.5", "--tasks", str(bad), "--out", str(tmp_path / "o"), "--quiet"])
    assert code == 2 and match in capsys.readouterr().err
