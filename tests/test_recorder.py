"""Segments, trajectories and the RecordEpisodes wrapper."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

import tokengym.envs  # noqa: F401
from tokengym.envs import ReplayEnv
from tokengym.recorder import RecordEpisodes, Segment, SegmentKind, Trajectory


def seg(kind, ids, turn=0, **kw):
    return Segment(SegmentKind(kind), np.array(ids), turn, **kw)


def test_segment_mask_and_validation():
    a = seg("action", [1, 2, 3], logprobs=[-0.1, -0.2, -0.3], reward=1.0)
    assert a.mask.tolist() == [1, 1, 1] and a.logprobs.dtype == np.float32
    assert seg("observation", [4, 5]).mask.tolist() == [0, 0]
    with pytest.raises(ValueError, match="2 logprobs for 3"):
        seg("action", [1, 2, 3], logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="only action segments"):
        seg("observation", [1], logprobs=[0.0])
    with pytest.raises(ValueError, match="rewards belong"):
        seg("prompt", [1], reward=1.0)
    with pytest.raises(ValueError):
        seg("reply", [1])
    with pytest.raises(ValueError, match="read-only"):
        a.token_ids[0] = 9


def test_trajectory_arrays_are_views_of_the_segments():
    t = Trajectory(
        [
            seg("prompt", [10, 11, 12]),
            seg("action", [20, 21], 0, logprobs=[-1.0, -2.0], reward=0.5),
            seg("observation", [30], 0),
            seg("action", [40, 41, 42], 1, reward=1.0),
        ]
    )
    assert t.token_ids.tolist() == [10, 11, 12, 20, 21, 30, 40, 41, 42]
    assert t.mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    assert t.logprobs[3:5].tolist() == [-1.0, -2.0] and np.isnan(t.logprobs[[0, 5, 6]]).all()
    assert t.prompt_len == 3 and t.num_turns == 2 and len(t) == 9
    assert t.action_spans == [(3, 5), (6, 9)]
    assert t.context(1).tolist() == [10, 11, 12, 20, 21, 30]
    assert t.turn_rewards.tolist() == [0.5, 1.0] and t.reward == 1.5
    assert not t.has_logprobs
    d = json.loads(json.dumps(t.to_dict()))
    assert d["logprobs"][0] is None and d["logprobs"][3] == -1.0
    assert [s["kind"] for s in d["segments"]] == ["prompt", "action", "observation", "action"]


@pytest.mark.parametrize(
    "kinds, match",
    [
        (["action"], "starts with exactly one prompt"),
        (["prompt", "prompt"], "only one prompt"),
        (["prompt", "action", "action"], "two action segments"),
        (["prompt", "observation"], "must follow an action"),
    ],
)
def test_trajectory_refuses_bad_structure(kinds, match):
    segments = [seg(k, [1], 0) for k in kinds]
    with pytest.raises(ValueError, match=match):
        Trajectory(segments)


def test_wrapper_records_every_token_in_order(tokenizer):
    env = RecordEpisodes(gym.make("tokengym/Replay-v0", tokenizer=tokenizer))
    obs, _ = env.reset(seed=3)
    stream, contexts, done = list(obs), [], False
    rng = np.random.default_rng(0)
    while not done:
        action = env.unwrapped.reference_action()
        lp = -rng.random(len(action)).astype(np.float32)
        contexts.append(list(stream))
        obs, reward, term, trunc, info = env.step(action, logprobs=lp)
        stream += list(action) + list(obs)
        done = term or trunc
    traj = info["trajectory"]
    assert env.trajectories == [traj]
    assert traj.token_ids.tolist() == stream
    for k, ctx in enumerate(contexts):
        assert traj.context(k).tolist() == ctx
    for (start, end), a in zip(traj.action_spans, traj.actions):
        assert traj.mask[start:end].all() and np.array_equal(traj.logprobs[start:end], a.logprobs)
    assert int(traj.mask.sum()) == sum(len(a) for a in traj.actions)
    assert np.isnan(traj.logprobs[traj.mask == 0]).all() and traj.has_logprobs
    assert traj.env_id == "tokengym/Replay-v0" and traj.seed == 3 and traj.stop_reason == "done"
    assert traj.terminated and not traj.truncated
    summary = traj.conformance_summary
    assert summary["turns_checked"] + summary["deferred"] == traj.num_turns == 5 and summary["mismatch"] == 0
    # The default schedule compares turns 0, 1, 3 and the last; turn 2 is left to a later check.
    assert [c["status"] != "deferred" for c in traj.conformance] == [True, True, False, True, True]
    assert summary["deferred"] == 1 and summary["turns_checked"] == summary["ok"] + summary["known"] == 4
    assert env.pop_trajectories() == [traj] and env.trajectories == []


def test_wrapper_rejects_logprobs_of_the_wrong_length(qwen25):
    env = RecordEpisodes(ReplayEnv(qwen25))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="one value per action token"):
        env.step([1, 2, 3], logprobs=[0.0])
    # Nothing was recorded for the refused step; the episode goes on.
    env.step(env.unwrapped.reference_action())
    assert env._segments is not None and len(env._segments) == 3


def test_wrapper_calls_back_and_handles_truncation(qwen25):
    seen = []
    env = RecordEpisodes(ReplayEnv(qwen25, max_turns=2), on_episode=seen.append, keep=False, sampling={"temperature": 1.0})
    for seed in (0, 1):
        env.reset(seed=seed)
        done = False
        while not done:
            *_, term, trunc, info = env.step([9707, 151645])
            done = term or trunc
    assert env.trajectories == [] and len(seen) == 2
    assert seen[1].seed == 1 and seen[1].truncated and seen[1].stop_reason == "max_turns"
    assert seen[1].sampling == {"temperature": 1.0} and seen[1].num_turns == 2


def test_the_stream_is_held_once_by_the_env_and_shared_with_the_recorder_and_the_driver(qwen25):
    from tokengym.recorder.drivers.episodes import EpisodeSlot, plan_tasks

    slot = EpisodeSlot(RecordEpisodes(ReplayEnv(qwen25, max_turns=3), keep=False))
    slot.begin(plan_tasks([0], 0)[0])
    env, rec = slot.env.unwrapped, slot.env
    action = env.reference_action()
    obs, *_ = rec.step(action)
    assert rec._shared and rec._stream is env.token_stream  # the recorder reads the env's own ids
    pieces, segments = env._pieces, rec._segments
    assert [p.kind for p in pieces] == [s.kind.value for s in segments] == ["prompt", "action", "observation"]
    for p, s in zip(pieces, segments):
        assert p.ids.tolist() == s.token_ids.tolist() and not p.ids.flags.writeable
    assert segments[2].token_ids.tolist() == obs.tolist() and segments[1].token_ids.tolist() == list(action)
    assert slot.stream == np.concatenate([p.ids for p in pieces]).tolist() == env.token_stream.tolist()
    assert env.token_stream.ids().dtype == np.int64 and env.token_stream._ids.typecode == "i"  # int32 inside
    with pytest.raises(ValueError, match="read-only"):
        obs[0] = 1  # what the env returned cannot be changed under anyone


def test_a_wrapper_that_changes_what_the_env_returns_makes_the_recorder_keep_its_own_ids(qwen25):
    class Appends(gym.Wrapper):
        """Adds a token to every observation after the first step: the policy sees more than the env keeps."""

        def step(self, action):
            obs, *rest = self.env.step(action)
            return np.concatenate([obs, [11]]), *rest

    rec = RecordEpisodes(Appends(ReplayEnv(qwen25, max_turns=3)))
    prompt, _ = rec.reset(seed=0)
    assert rec._shared  # the prompt was passed on as the env made it
    action = rec.unwrapped.reference_action()
    obs, *_ = rec.step(action)
    assert not rec._shared and obs[-1] == 11
    assert rec.context_ids() == [*prompt.tolist(), *action, *obs.tolist()]  # what the policy was given
    assert [s.token_ids.tolist() for s in rec._segments] == [prompt.tolist(), list(action), obs.tolist()]


def test_a_wrappers_writable_arrays_are_copied_by_the_recorder(qwen25):
    class Writable(gym.Wrapper):
        """Hands out writable copies of the env's arrays (and could change them later)."""

        def reset(self, **kw):
            obs, info = self.env.reset(**kw)
            self.obs = np.array(obs)
            return self.obs, info

    rec = RecordEpisodes(Writable(ReplayEnv(qwen25, max_turns=3)))
    obs, _ = rec.reset(seed=0)
    first = obs.tolist()
    assert not np.shares_memory(rec._segments[0].token_ids, obs)
    obs[0] = 99  # the array changes after the fact: the record does not
    assert rec._segments[0].token_ids.tolist() == first and rec.context_ids() == first
