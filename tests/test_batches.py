"""Trainer batches (verl, TRL, packed) are pure views of the recorded tokens."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from tokengym.envs import ReplayEnv
from tokengym.recorder import RecordEpisodes, Segment, SegmentKind, Trajectory
from tokengym.recorder.batches import (
    GroupSignal,
    GRPOAdvantages,
    NoGroupSignalWarning,
    PackedBatch,
    VerlBatch,
    from_packed,
    from_trl,
    from_verl,
    group_by_task,
    group_signal,
    grpo_advantages,
    to_packed,
    to_trl,
    to_verl,
)


# ------------------------------------------------------------------ builders
def make(prompt, *turns, task_id=None, **metadata) -> Trajectory:
    """A hand-made trajectory: ``turns`` are ``(action, logprobs | None, reward, observation | None)``;
    an action with logprobs is stamped with weight versions (turn k's tokens: k, then k + 1 from its
    middle, as an update mid-turn leaves them)."""
    segs = [Segment(SegmentKind.PROMPT, np.array(prompt), 0)]
    for k, (action, lp, reward, obs) in enumerate(turns):
        n = len(action)
        versions = None if lp is None else np.array([k] * (n // 2) + [k + 1] * (n - n // 2))
        segs.append(Segment(SegmentKind.ACTION, np.array(action), k, logprobs=lp, reward=reward, versions=versions))
        if obs:
            segs.append(Segment(SegmentKind.OBSERVATION, np.array(obs), k))
    if task_id is not None:
        metadata["task_id"] = task_id
    return Trajectory(segs, env_id="hand", seed=len(turns), stop_reason="done", metadata=metadata)


def with_rewards(traj: Trajectory, rewards, **metadata) -> Trajectory:
    """The same tokens with turn rewards set (ReplayEnv itself rewards nothing)."""
    segs, k = [], 0
    for s in traj.segments:
        if s.kind is SegmentKind.ACTION:
            s = dataclasses.replace(s, reward=float(rewards[k]))
            k += 1
        segs.append(s)
    return dataclasses.replace(traj, segments=segs, metadata={**traj.metadata, **metadata})


def record(tokenizer, seed: int, max_turns: int | None = None) -> Trajectory:
    """One real episode: the transcript's reference actions with random logprobs."""
    kwargs = {} if max_turns is None else {"max_turns": max_turns}
    env = RecordEpisodes(ReplayEnv(tokenizer, **kwargs))
    env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    done = False
    while not done:
        action = env.unwrapped.reference_action()
        *_, term, trunc, info = env.step(action, logprobs=-rng.random(len(action)).astype(np.float32))
        done = term or trunc
    traj = info["trajectory"]
    return with_rewards(traj, rng.integers(-2, 3, traj.num_turns) / 2, task_id=f"replay-{max_turns}")


HAND = [
    make([1, 2], ([3, 4, 5], [-0.1, -0.2, -0.3], 1.0, None), task_id="a"),
    make(
        [6, 7, 8, 9, 10],
        ([11], [-0.5], 0.25, [12, 13]),
        ([14, 15], None, -1.0, [16]),
        ([17, 18, 19, 20], [-1.0, -2.0, -3.0, -4.0], 2.0, None),
        task_id="b",
        tool_rewards=[0.1, 0.2],
    ),
    make([21], ([22, 23], [-0.7, -0.8], 0.0, [24, 25, 26]), task_id="a"),
]


@pytest.fixture(scope="module")
def real_trajs(tokenizer) -> list[Trajectory]:
    """Two full replays and one cut to two turns, on the real template."""
    return [record(tokenizer, 0), record(tokenizer, 1, max_turns=2), record(tokenizer, 2)]


@pytest.fixture(scope="module")
def trajs(real_trajs) -> list[Trajectory]:
    """Real and hand-made trajectories of very different lengths, in one batch."""
    return [real_trajs[0], HAND[0], real_trajs[1], HAND[1], HAND[2], real_trajs[2]]


def expected(t: Trajectory, n: int | None = None):
    """What every layout must give back: ids, mask, logprobs with 0.0 where none (first n tokens)."""
    n = len(t) if n is None else n
    return t.token_ids[:n], t.mask[:n], np.nan_to_num(t.logprobs, nan=0.0)[:n]


def assert_same_tokens(views, trajs, lengths=None):
    assert len(views) == len(trajs)
    for i, (v, t) in enumerate(zip(views, trajs)):
        ids, mask, lp = expected(t, None if lengths is None else lengths[i])
        assert v.token_ids.dtype == np.int64 and v.mask.dtype == np.int8 and v.logprobs.dtype == np.float32
        assert np.array_equal(v.token_ids, ids), f"row {i}: tokens differ"
        assert np.array_equal(v.mask, mask), f"row {i}: mask differs"
        assert np.array_equal(v.logprobs, lp), f"row {i}: logprobs differ"


# ---------------------------------------------------------------------- verl
def test_verl_layout(trajs):
    b = to_verl(trajs, pad_token_id=-7)
    assert isinstance(b, VerlBatch) and len(b) == len(trajs)
    t = b.tensors
    B = len(trajs)
    P = max(x.prompt_len for x in trajs)
    R = max(len(x) - x.prompt_len for x in trajs)
    assert (b.prompt_length, b.response_length) == (P, R)
    shapes = {k: tuple(v.shape) for k, v in t.items()}
    assert shapes == {
        "prompts": (B, P),
        "responses": (B, R),
        "response_mask": (B, R),
        "input_ids": (B, P + R),
        "attention_mask": (B, P + R),
        "position_ids": (B, P + R),
        "rollout_log_probs": (B, R),
        "token_level_rewards": (B, R),
        "rollout_versions": (B, R),
    }
    assert t["rollout_versions"].dtype == torch.int32
    for k in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert t[k].dtype == torch.int64, k
    assert t["rollout_log_probs"].dtype == t["token_level_rewards"].dtype == torch.float32
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    expect_pos = torch.clip(torch.cumsum(t["attention_mask"], dim=-1) - 1, min=0)
    assert torch.equal(t["position_ids"], expect_pos)

    for i, x in enumerate(trajs):
        pl, rl = x.prompt_len, len(x) - x.prompt_len
        attn, ids = t["attention_mask"][i], t["input_ids"][i]
        # Left padding before the prompt, right padding after the response.
        assert attn.tolist() == [0] * (P - pl) + [1] * pl + [1] * rl + [0] * (R - rl)
        assert (ids[attn == 0] == -7).all()
        assert t["prompts"][i, P - pl :].tolist() == x.token_ids[:pl].tolist()
        assert t["responses"][i, :rl].tolist() == x.token_ids[pl:].tolist()
        # Positions count real tokens only: 0..L-1 on the real tokens.
        assert t["position_ids"][i][attn == 1].tolist() == list(range(len(x)))
        # response_mask is 1 exactly on the action tokens.
        rmask = t["response_mask"][i]
        action_cols = {c - pl for s, e in x.action_spans for c in range(s, e)}
        assert set(torch.nonzero(rmask).flatten().tolist()) == action_cols
        lp = t["rollout_log_probs"][i]
        assert (lp[rmask == 0] == 0).all() and not torch.isnan(lp).any()
        assert lp[:rl].numpy().tolist() == np.nan_to_num(x.logprobs[pl:], nan=0.0).tolist()
        # Each turn's reward on the last token of its action; the row sums to the return.
        rew = t["token_level_rewards"][i]
        for (_, e), a in zip(x.action_spans, x.actions):
            assert rew[e - 1 - pl].item() == pytest.approx(a.reward)
        ends = {e - 1 - pl for _, e in x.action_spans}
        assert all(rew[c].item() == 0 for c in range(R) if c not in ends)
        assert rew.sum().item() == pytest.approx(x.reward)


def test_verl_non_tensors_are_one_entry_per_row(trajs):
    nt = to_verl(trajs).non_tensors
    for k, v in nt.items():
        assert v.dtype == object and v.shape == (len(trajs),), k
    assert nt["num_turns"].tolist() == [x.num_turns for x in trajs]
    assert nt["turn_rewards"][3] == [0.25, -1.0, 2.0]
    assert nt["turn_scores"].tolist() == nt["turn_rewards"].tolist()  # verl's own name
    assert nt["__num_turns__"].tolist() == [len(x.segments) for x in trajs]  # verl's: messages, the prompt included
    assert nt["tool_rewards"][3] == [0.1, 0.2] and nt["tool_rewards"][1] == []
    assert nt["uid"].tolist() == [x.metadata["task_id"] for x in trajs]
    assert nt["env_id"][0] == "ReplayEnv" and nt["env_id"][1] == "hand" and nt["seed"][2] == 1
    assert nt["stop_reason"][2] == "max_turns" and nt["stop_reason"][1] == "done"
    assert nt["conformance"][0]["mismatch"] == 0 and nt["conformance"][0]["turns_checked"] > 0
    assert not any(nt["truncated_to_fit"])


def test_equal_length_lists_stay_one_object_per_row():
    """np.array([[..], [..]], dtype=object) would be 2-D; DataProto needs length-B arrays."""
    same = [HAND[0], HAND[0]]
    nt = to_verl(same).non_tensors
    assert nt["turn_rewards"].shape == (2,) and nt["turn_rewards"][0] == [1.0]


def test_verl_fixed_lengths_pad_and_round_trip(trajs):
    P = max(x.prompt_len for x in trajs) + 3
    R = max(len(x) - x.prompt_len for x in trajs) + 5
    b = to_verl(trajs, prompt_length=P, response_length=R, pad_token_id=151643)
    assert b.tensors["input_ids"].shape == (len(trajs), P + R)
    assert (b.tensors["attention_mask"][:, :3] == 0).all() and (b.tensors["attention_mask"][:, -5:] == 0).all()
    assert_same_tokens(from_verl(b), trajs)
    assert_same_tokens(from_verl(b.tensors), trajs)


VERL_KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
    "token_level_rewards",
    "rollout_versions",
)


def reference_verl(trajs, P: int, R: int, pad: int) -> dict[str, torch.Tensor]:
    """The verl layout built the plain way, row by row from Python lists (responses cut at R)."""
    rows: dict[str, list] = {k: [] for k in VERL_KEYS}
    for t in trajs:
        pl = t.prompt_len
        n = min(len(t) - pl, R)
        ids, mask = t.token_ids.tolist(), t.mask.tolist()
        lp = np.nan_to_num(t.logprobs, nan=0.0).tolist()
        attn = [0] * (P - pl) + [1] * (pl + n) + [0] * (R - n)
        rewards = np.zeros(R, dtype=np.float32)
        lost = 0.0
        for (_, end), a in zip(t.action_spans, t.actions):
            if pl < end <= pl + n:
                rewards[end - 1 - pl] += a.reward
            else:
                lost += a.reward
        if lost:
            kept = [c for c in range(n) if mask[pl + c]]
            rewards[kept[-1] if kept else n - 1] += lost
        rows["prompts"].append([pad] * (P - pl) + ids[:pl])
        rows["responses"].append(ids[pl : pl + n] + [pad] * (R - n))
        rows["response_mask"].append(mask[pl : pl + n] + [0] * (R - n))
        rows["input_ids"].append(rows["prompts"][-1] + rows["responses"][-1])
        rows["attention_mask"].append(attn)
        rows["position_ids"].append(np.clip(np.cumsum(attn) - 1, 0, None).tolist())  # verl's formula
        rows["rollout_log_probs"].append(lp[pl : pl + n] + [0.0] * (R - n))
        rows["token_level_rewards"].append(rewards.tolist())
        rows["rollout_versions"].append(t.versions.tolist()[pl : pl + n] + [-1] * (R - n))
    dtypes = {"rollout_log_probs": np.float32, "token_level_rewards": np.float32, "rollout_versions": np.int32}
    return {
        k: torch.tensor(np.array(v, dtype=dtypes.get(k, np.int64)).reshape(len(trajs), -1))
        for k, v in rows.items()
    }


def padding_cases() -> dict[str, tuple[list[Trajectory], dict]]:
    """Batches whose rows have no, some and maximal padding on either side, with and without a cut."""
    rng = np.random.default_rng(7)

    def ids(n: int) -> list[int]:
        return rng.integers(0, 151_643, n).tolist()

    def rand(prompt_len: int, *turns: tuple[int, int]) -> Trajectory:
        """``turns``: (action tokens, observation tokens); logprobs on every other action."""
        return make(
            ids(prompt_len),
            *(
                (ids(a), -rng.random(a).astype(np.float32) if k % 2 == 0 else None, 0.25 * (k + 1), ids(o))
                for k, (a, o) in enumerate(turns)
            ),
        )

    longest_prompt = rand(9, (3, 2))
    longest_response = rand(2, (4, 5), (6, 0))
    both = rand(9, (4, 5), (6, 0))  # the longest prompt and the longest response: no padding at all
    prompt_only = make(ids(1))  # one prompt token, no response: maximal padding
    mixed = [longest_prompt, prompt_only, longest_response, rand(1, (1, 0)), rand(5, (2, 3), (1, 1), (2, 0))]
    # Rewards of empty actions land on the token before them; NaN logprobs read as 0.0, infinities stay.
    odd = [
        make(ids(2), ([], None, 1.0, ids(2)), (ids(3), np.array([np.nan, -np.inf, -0.5], np.float32), 0.5, None)),
        make(ids(1), (ids(1), [-0.25], 1.0, ids(1)), ([], None, 0.5, None)),
        make(ids(3), (ids(2), np.array([np.nan, np.nan], np.float32), -1.0, ids(4)), ([], None, 2.0, ids(1))),
    ]
    return {
        "minimal widths": (mixed, {}),
        "no padding in one row": ([both, prompt_only, rand(3, (2, 1))], {}),
        "no padding at all": ([both], {}),
        "one padded row": ([prompt_only], {}),
        "wider than every row": (mixed, {"prompt_length": 12, "response_length": 20}),
        "responses cut": (mixed + [both], {"response_length": 6, "overlong": "truncate"}),
        "response width 0": ([prompt_only], {"response_length": 0}),
        "empty actions, non-finite logprobs": (odd + mixed, {}),
        "empty actions, responses cut": (odd, {"response_length": 3, "overlong": "truncate"}),
    }


def test_verl_padding_equals_reference_for_every_pad_id(qwen3):
    """Every tensor (keys, dtypes, values) equals the plain reference, whatever the pad id.

    Non-zero pad ids leave the id buffers uninitialised and write only the padding, so a
    missed padding region would show whatever the memory held: the pad ids alternate, so
    that memory a previous batch freed holds a different id.
    """
    assert qwen3.pad_token_id not in (None, 0)
    pads = [qwen3.pad_token_id, 2**62 + 3, 0, -7, qwen3.pad_token_id, np.iinfo(np.int64).max, np.int64(5)]
    for name, (batch, kwargs) in padding_cases().items():
        P = kwargs.get("prompt_length", max(t.prompt_len for t in batch))
        R = kwargs.get("response_length", max(len(t) - t.prompt_len for t in batch))
        for pad in pads:
            got = to_verl(batch, pad_token_id=pad, **kwargs).tensors
            want = reference_verl(batch, P, R, int(pad))
            assert list(got) == list(want), name
            for k in VERL_KEYS:
                assert got[k].dtype == want[k].dtype, (name, pad, k)
                assert torch.equal(got[k], want[k]), (name, pad, k)


def test_verl_real_trajectories_equal_reference_with_the_real_pad_id(trajs, qwen3):
    P = max(x.prompt_len for x in trajs)
    R = max(len(x) - x.prompt_len for x in trajs)
    for pad in (0, qwen3.pad_token_id, 0):
        got = to_verl(trajs, pad_token_id=pad).tensors
        want = reference_verl(trajs, P, R, pad)
        for k in VERL_KEYS:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (pad, k)


def test_verl_pad_id_must_be_an_int64_id():
    with pytest.raises(TypeError, match="must be an integer token id, not None: pass tokenizer.pad_token_id"):
        to_verl(HAND, pad_token_id=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not 1.5"):
        to_verl(HAND, pad_token_id=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not True"):
        to_verl(HAND, pad_token_id=True)
    # Refused even when no row has padding to write it on.
    with pytest.raises(ValueError, match=r"pad_token_id=9223372036854775808 does not fit the int64 id tensors"):
        to_verl([HAND[0]], pad_token_id=2**63)
    with pytest.raises(ValueError, match="does not fit"):
        to_verl(HAND, pad_token_id=-(2**63) - 1)


def test_verl_overlong_error_names_the_row():
    with pytest.raises(ValueError, match=r"trajectory 1: response has 10 tokens, response_length is 8"):
        to_verl(HAND, response_length=8)
    with pytest.raises(ValueError, match=r"trajectory 1: prompt has 5 tokens, prompt_length is 4"):
        to_verl(HAND, prompt_length=4)
    # The prompt is never cut, even when truncating responses.
    with pytest.raises(ValueError, match="prompt has 5 tokens"):
        to_verl(HAND, prompt_length=4, overlong="truncate")
    with pytest.raises(ValueError, match="overlong"):
        to_verl(HAND, overlong="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no trajectories"):
        to_verl([])


def test_verl_truncate_cuts_the_response_end(trajs):
    R = 5
    b = to_verl(trajs, response_length=R, overlong="truncate")
    t, nt = b.tensors, b.non_tensors
    assert t["responses"].shape[1] == R
    cut = [len(x) - x.prompt_len > R for x in trajs]
    assert nt["truncated_to_fit"].tolist() == cut and any(cut) and not all(cut)
    lengths = [x.prompt_len + min(len(x) - x.prompt_len, R) for x in trajs]
    assert_same_tokens(from_verl(b), trajs, lengths)
    # The row still sums to the return: rewards of cut turns move to the last kept action token.
    for i, x in enumerate(trajs):
        assert t["token_level_rewards"][i].sum().item() == pytest.approx(x.reward)
    # HAND[1]: response [11 | 12 13 | 14 15 | 16 | 17 ...] cut to 5: turn 1's action ends at column 4.
    row = trajs.index(HAND[1])
    assert t["response_mask"][row].tolist() == [1, 0, 0, 1, 1]
    assert t["token_level_rewards"][row].tolist() == [0.25, 0, 0, 0, -1.0 + 2.0]


def test_verl_truncate_moves_rewards_of_cut_turns():
    x = make([1], ([2, 3], [-0.1, -0.2], 1.0, [4]), ([5], [-0.3], 0.5, None))
    b = to_verl([x], response_length=3, overlong="truncate")
    assert b.tensors["token_level_rewards"][0].tolist() == [0.0, 1.5, 0.0]
    # An empty first action: no action token survives, so the reward lands on the last kept token.
    y = make([1], ([], None, 0.0, [3, 4, 5]), ([6], None, 1.0, None))
    z = make([1, 2], ([3], None, 0.0, [4]), ([5], None, 0.0, None))  # no reward to move
    b = to_verl([y, z], response_length=2, overlong="truncate")
    assert b.tensors["response_mask"].tolist() == [[0, 0], [1, 0]]
    assert b.tensors["token_level_rewards"].tolist() == [[0.0, 1.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="no token to carry"):
        to_verl([x], response_length=0, overlong="truncate")


def test_missing_logprobs_are_zero_not_nan_and_said():
    """0.0 stands in for logprobs that were not recorded (NaN would poison the masked product),
    which reads as probability 1: each layout warns and marks the rows that have them all."""
    from tokengym.recorder import MissingLogprobsWarning
    from tokengym.recorder.batches import logprobs_present

    rows = [HAND[0], HAND[1]]
    present = logprobs_present(rows).tolist()
    assert present == [all(a.logprobs is not None for a in t.actions) for t in rows] and present[1] is False
    with pytest.warns(MissingLogprobsWarning, match=r"1 of 2 trajectories in this verl batch .* without logprobs"):
        b = to_verl(rows)
    lp = b.tensors["rollout_log_probs"][1]
    assert lp.tolist()[3:5] == [0.0, 0.0] and not torch.isnan(lp).any()  # turn 1 had no logprobs
    assert b.non_tensors["logprobs_present"].tolist() == present
    with pytest.warns(MissingLogprobsWarning, match="packed batch"):
        packed = to_packed(rows)
    assert not torch.isnan(packed.logprobs).any() and packed.logprobs_present.tolist() == present
    with pytest.warns(MissingLogprobsWarning, match="TRL batch"):
        to_trl(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingLogprobsWarning)
        whole = [t for t in rows if all(a.logprobs is not None for a in t.actions)]
        assert to_verl(whole).non_tensors["logprobs_present"].tolist() == [True] * len(whole)  # no warning


# ----------------------------------------------------------------------- TRL
def test_trl_layout_and_round_trip(trajs):
    d = to_trl(trajs)
    assert set(d) == {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
    for i, x in enumerate(trajs):
        pl = x.prompt_len
        assert d["prompt_ids"][i] == x.token_ids[:pl].tolist()
        assert d["completion_ids"][i] == x.token_ids[pl:].tolist()
        assert len(d["logprobs"][i]) == len(d["env_mask"][i]) == len(d["completion_ids"][i])
        assert d["env_mask"][i] == x.mask[pl:].tolist()
        assert all(type(v) is int for v in d["completion_ids"][i] + d["env_mask"][i])
        assert all(type(v) is float for v in d["logprobs"][i])
    assert d["env_mask"][3] == [1, 0, 0, 1, 1, 0, 1, 1, 1, 1]
    assert d["logprobs"][3][:5] == pytest.approx([-0.5, 0.0, 0.0, 0.0, 0.0])
    assert_same_tokens(from_trl(d), trajs)


# -------------------------------------------------------------------- packed
def test_packed_layout(trajs):
    p = to_packed(trajs)
    assert isinstance(p, PackedBatch) and len(p) == len(trajs)
    lens = [len(x) for x in trajs]
    T = sum(lens)
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == np.cumsum([0, *lens]).tolist()
    assert p.max_seqlen == max(lens)
    for k in ("input_ids", "position_ids", "loss_mask", "seq_index"):
        assert getattr(p, k).dtype == torch.int64 and getattr(p, k).shape == (T,), k
    assert p.logprobs.dtype == p.token_rewards.dtype == torch.float32
    assert p.position_ids.tolist() == [j for n in lens for j in range(n)]
    assert p.seq_index.tolist() == [i for i, n in enumerate(lens) for _ in range(n)]
    assert p.advantages is None
    for i, x in enumerate(trajs):
        assert p.token_rewards[p.seq_index == i].sum().item() == pytest.approx(x.reward)
    assert_same_tokens(from_packed(p), trajs)


def test_packed_equals_padded(trajs):
    """Same tokens, masks, logprobs and rewards, with or without padding."""
    b, p = to_verl(trajs).tensors, to_packed(trajs)
    P = b["prompts"].shape[1]
    for i, (a, z) in enumerate(zip(p.cu_seqlens[:-1].tolist(), p.cu_seqlens[1:].tolist())):
        real = b["attention_mask"][i] == 1
        real_resp = real[P:]
        pl = int(real[:P].sum())
        assert torch.equal(p.input_ids[a:z], b["input_ids"][i][real])
        assert torch.equal(p.position_ids[a:z], b["position_ids"][i][real])
        assert torch.equal(p.loss_mask[a + pl : z], b["response_mask"][i][real_resp])
        assert not p.loss_mask[a : a + pl].any()
        assert torch.equal(p.logprobs[a + pl : z], b["rollout_log_probs"][i][real_resp])
        assert torch.equal(p.token_rewards[a + pl : z], b["token_level_rewards"][i][real_resp])
        assert torch.equal(p.versions[a:z], torch.from_numpy(trajs[i].versions))
        assert torch.equal(p.versions[a + pl : z], b["rollout_versions"][i][real_resp])
    assert (p.versions >= 1).any(), "the hand-made rows carry versions: the comparison is not of -1s alone"


# ---------------------------------------------------------------------- GRPO
def rewarded(task, reward):
    return make([1], ([2, 3], [-0.1, -0.2], reward, None), task_id=task)


GROUPED = [
    rewarded("A", 1.0),
    rewarded("B", 2.0),
    rewarded("A", 0.0),
    rewarded("C", 3.0),
    rewarded("A", 0.5),
    rewarded("B", 2.0),
]


def test_group_by_task():
    assert group_by_task(GROUPED) == {"A": [0, 2, 4], "B": [1, 5], "C": [3]}
    assert list(group_by_task(GROUPED)) == ["A", "B", "C"]
    assert group_by_task(GROUPED, key=lambda t: t.reward > 1) == {False: [0, 2, 4], True: [1, 3, 5]}
    with pytest.raises(ValueError, match="trajectory 1 has no group key"):
        group_by_task([GROUPED[0], Trajectory(HAND[0].segments)])


def test_grpo_advantages_by_hand():
    # A: rewards 1, 0, 0.5 -> mean 0.5, sample std sqrt((0.25 + 0.25 + 0) / 2) = 0.5.
    # B: 2, 2 -> std 0, advantage 0.  C: a group of one has no baseline -> 0.
    eps = 1e-6
    adv = grpo_advantages(GROUPED, eps=eps)
    s = 0.5 / (0.5 + eps)
    assert adv.advantages.dtype == np.float32 and adv.advantages.shape == (6,) and len(adv) == 6
    np.testing.assert_allclose(adv, [s, 0.0, -s, 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(grpo_advantages(GROUPED, normalize_std=False), [0.5, 0, -0.5, 0, 0, 0])
    # Population std (ddof=0) for A: sqrt(1/6).
    population = grpo_advantages(GROUPED, eps=0.0, ddof=0)
    np.testing.assert_allclose(population[[0, 2, 4]], np.array([0.5, -0.5, 0.0]) * 6**0.5, rtol=1e-6)
    one_group = grpo_advantages(GROUPED, key=lambda t: "all", normalize_std=False)
    np.testing.assert_allclose(one_group[3], 3.0 - 8.5 / 6, rtol=1e-6)


def test_advantages_broadcast_on_action_tokens(trajs):
    adv = np.arange(len(trajs), dtype=np.float32) + 1.0
    b, p = to_verl(trajs, advantages=adv).tensors, to_packed(trajs, advantages=adv)
    assert b["advantages"].dtype == p.advantages.dtype == torch.float32
    assert b["advantages"].shape == b["response_mask"].shape
    assert torch.equal(b["advantages"], b["response_mask"].float() * torch.from_numpy(adv)[:, None])
    assert torch.equal(p.advantages, p.loss_mask.float() * torch.from_numpy(adv)[p.seq_index])
    with pytest.raises(ValueError, match="one value per trajectory"):
        to_verl(trajs, advantages=adv[:2])
    with pytest.raises(ValueError, match="one value per trajectory"):
        to_packed(trajs, advantages=adv[:2])
    g = grpo_advantages(GROUPED)
    assert to_verl(GROUPED, advantages=g).tensors["advantages"][0].tolist() == pytest.approx([g[0], g[0]])


def sampled(group, reward, task="T"):
    """One of G samples of a task, as rollout(..., group_size=G) labels them."""
    return make([1], ([2, 3], [-0.1, -0.2], reward, None), task_id=task, group=group)


def no_warning(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def test_recorded_groups_are_the_default_key():
    """Samples of one task in two rollout groups: the groups are compared within, not the task."""
    trajs = [sampled(0, 1.0), sampled(1, 5.0), sampled(0, 3.0), sampled(1, 5.0), sampled(1, 8.0)]
    assert group_by_task(trajs) == {0: [0, 2], 1: [1, 3, 4]}
    adv = no_warning(grpo_advantages, trajs, eps=0.0)
    g0, g1 = np.array([1.0, 3.0]), np.array([5.0, 5.0, 8.0])
    expected = np.empty(5)
    expected[[0, 2]] = (g0 - g0.mean()) / g0.std(ddof=1)
    expected[[1, 3, 4]] = (g1 - g1.mean()) / g1.std(ddof=1)
    np.testing.assert_allclose(adv.advantages, expected, rtol=1e-6)
    assert adv.with_signal == (0, 1) and adv.singletons == adv.equal_reward == ()
    assert adv.summary() == "groups with signal: 2 of 2 (0 of one member, 0 with equal rewards)"
    # verl groups by uid: it is the same group.
    assert to_verl(trajs).non_tensors["uid"].tolist() == [0, 1, 0, 1, 1]
    # Without group labels the task is the group.
    assert group_by_task([make([1], ([2], None, 0.0, None), task_id="T")] * 2) == {"T": [0, 1]}
    # An explicit key still wins.
    assert group_by_task(trajs, key=lambda t: t.metadata["task_id"]) == {"T": [0, 1, 2, 3, 4]}


def test_groups_that_cannot_be_trusted_are_refused():
    with pytest.raises(ValueError, match=r"1 of 3 trajectories \(e.g. 1\) have no metadata\['group'\]"):
        group_by_task([sampled(0, 1.0), rewarded("A", 0.0), sampled(0, 2.0)])
    with pytest.raises(ValueError, match="group 0 mixes tasks .*'A'.*'B'.*group ids restart"):
        grpo_advantages([sampled(0, 1.0, task="A"), sampled(0, 2.0, task="B")])
    with pytest.raises(ValueError, match=r"trajectory 0 has no group key .*rollout\(\.\.\., group_size=G\)"):
        group_by_task([Trajectory(HAND[0].segments)])
    with pytest.raises(ValueError, match="no trajectories"):
        grpo_advantages([])
    assert group_signal([]) == GroupSignal(0, 0, 0, 0)


def test_groups_of_one_warn_with_the_fix():
    """rollout(...) without groups: each episode its own group, every advantage 0."""
    trajs = [sampled(i, float(i)) for i in range(4)]
    with pytest.warns(NoGroupSignalWarning) as caught:
        adv = grpo_advantages(trajs)
    message = str(caught[0].message)
    assert "groups with signal: 0 of 4 (4 of one member, 0 with equal rewards)" in message
    assert "run G samples per task: rollout(..., group_size=G)" in message
    assert "same reward" not in message
    assert caught[0].filename == __file__  # points at the caller, not at the library
    assert adv.singletons == (0, 1, 2, 3) and adv.with_signal == () and not adv.advantages.any()
    assert group_signal(trajs) == adv.signal == GroupSignal(groups=4, with_signal=0, singletons=4, equal_reward=0)


def test_equal_rewards_everywhere_warn_and_give_exact_zeros():
    # 0.1 three times: its float mean is not 0.1, yet the advantages must be exactly 0.
    trajs = [sampled(0, 0.1), sampled(0, 0.1), sampled(0, 0.1), sampled(1, 1.0), sampled(1, 1.0)]
    for normalize_std in (True, False):
        with pytest.warns(NoGroupSignalWarning, match="same reward has nothing to prefer") as caught:
            adv = grpo_advantages(trajs, normalize_std=normalize_std, eps=0.0)
        assert "0 of 2 (0 of one member, 2 with equal rewards)" in str(caught[0].message)
        assert "rollout(..., group_size=G) with a larger G" in str(caught[0].message)
        assert adv.equal_reward == (0, 1) and np.array_equal(adv.advantages, np.zeros(5, dtype=np.float32))
    # Both causes at once name both fixes.
    with pytest.warns(NoGroupSignalWarning) as caught:
        grpo_advantages(trajs + [sampled(2, 3.0)])
    message = str(caught[0].message)
    assert "0 of 3 (1 of one member, 2 with equal rewards)" in message
    assert "no baseline" in message and "nothing to prefer" in message


def test_degenerate_groups_are_reported_beside_the_others():
    """GROUPED: A has signal, B has equal rewards, C one member; no warning, the batch still teaches."""
    adv = no_warning(grpo_advantages, GROUPED)
    assert isinstance(adv, GRPOAdvantages)
    assert adv.groups == {"A": [0, 2, 4], "B": [1, 5], "C": [3]}
    assert (adv.with_signal, adv.equal_reward, adv.singletons) == (("A",), ("B",), ("C",))
    assert adv.summary() == "groups with signal: 1 of 3 (1 of one member, 1 with equal rewards)"
    assert group_signal(GROUPED) == adv.signal == GroupSignal(3, 1, 1, 1)
    assert group_signal(GROUPED).summary() == adv.summary()
    # It reads as the array of advantages wherever one was used.
    assert np.asarray(adv).dtype == np.float32 and np.array_equal(np.asarray(adv), adv.advantages)
    assert [float(a) for a in adv] == adv.advantages.tolist() and adv[0] == adv.advantages[0]
    assert np.asarray(adv, dtype=np.float64).dtype == np.float64
    assert torch.equal(
        to_verl(GROUPED, advantages=adv).tensors["advantages"],
        to_verl(GROUPED, advantages=adv.advantages).tensors["advantages"],
    )


def test_an_episode_of_several_rows_is_one_group_member():
    """history="deploy" writes one row per context: GRPO compares episodes, not rows."""

    def row(episode, sequence, sequences, reward):
        segs = [Segment(SegmentKind.PROMPT, np.array([1, 2]), sequence),
                Segment(SegmentKind.ACTION, np.array([3]), sequence, reward=reward)]
        return Trajectory(segs, metadata={"group": 0, "episode": episode, "sequence": sequence, "sequences": sequences})

    # episode 0: two rows (return 1 + 1 = 2); episode 1: three rows (return 0); episode 2: one row (return 1)
    rows = [row(0, 0, 2, 1.0), row(0, 1, 2, 1.0), row(1, 0, 3, 0.0), row(1, 1, 3, 0.0), row(1, 2, 3, 0.0),
            make([1], ([2], None, 1.0, None), group=0, episode=2)]
    adv = grpo_advantages(rows)
    returns = np.array([2.0, 0.0, 1.0])
    want = (returns - returns.mean()) / (returns.std(ddof=1) + 1e-6)
    assert np.allclose(adv.advantages, [want[0], want[0], want[1], want[1], want[1], want[2]], atol=1e-6)
    assert group_signal(rows) == GroupSignal(groups=1, with_signal=1, singletons=0, equal_reward=0)
    # Two rows of one episode alone are a group of one member, not two.
    with pytest.warns(NoGroupSignalWarning):
        assert grpo_advantages(rows[:2]).singletons == (0,)


def random_batch(n: int, seed: int, *, shortest_action: int = 1, top_reward: int = 1) -> list:
    """``n`` random trajectories of 1-3 turns; some actions without logprobs (on purpose)."""
    r = np.random.default_rng(seed)

    def ids(lo, hi):
        return r.integers(5, 100, r.integers(lo, hi)).tolist()

    def turn():
        action = ids(shortest_action, 5)
        lp = r.normal(size=len(action)).astype(np.float32) if r.random() < 0.7 else None
        return action, lp, float(r.integers(0, top_reward + 1)), ids(1, 4)

    return [make(ids(1, 6), *[turn() for _ in range(r.integers(1, 4))]) for _ in range(n)]


def test_to_verl_into_reused_buffers_gives_the_fresh_batchs_tensors_in_the_same_memory():
    from tokengym.recorder import BatchBuffers

    batch = random_batch

    buffers = BatchBuffers()
    first = batch(8, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some actions have no logprobs, on purpose
        a = to_verl(first, pad_token_id=151643, out=buffers).tensors
        pointers = {k: v.data_ptr() for k, v in a.items()}
        fresh = to_verl(first, pad_token_id=151643).tensors
        assert all(torch.equal(a[k], fresh[k]) and a[k].is_contiguous() for k in fresh)
        # The next step's batch (no bigger): the same memory, every stale value written over.
        second = batch(6, 2)
        b = to_verl(second, pad_token_id=151643, out=buffers).tensors
        again = to_verl(second, pad_token_id=151643).tensors
        assert all(torch.equal(b[k], again[k]) for k in again)
        assert all(b[k].data_ptr() == pointers[k] for k in b)  # warm memory: no new pages to fault in
        # A bigger batch grows the buffers (that call is a fresh one) and is still exact.
        third = batch(20, 3)
        c = to_verl(third, pad_token_id=0, out=buffers).tensors
        assert all(torch.equal(c[k], to_verl(third, pad_token_id=0).tensors[k]) for k in c)
    assert buffers.nbytes >= sum(v.numel() * v.element_size() for v in c.values())


def test_to_packed_into_reused_buffers_gives_the_fresh_batchs_tensors_in_the_same_memory():
    from tokengym.recorder import BatchBuffers

    def batch(n, seed):  # empty actions too: their reward goes on the token before
        return random_batch(n, seed, shortest_action=0, top_reward=2)

    def tensors(b):
        return {k: v for k, v in vars(b).items() if isinstance(v, torch.Tensor)}

    buffers = BatchBuffers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some actions have no logprobs, on purpose
        first = batch(8, 1)
        adv = np.linspace(-1, 1, 8)
        a = to_packed(first, advantages=adv, out=buffers)
        fresh = to_packed(first, advantages=adv)
        pointers = {k: v.data_ptr() for k, v in tensors(a).items() if k not in ("cu_seqlens", "logprobs_present")}
        assert tensors(a).keys() == tensors(fresh).keys()
        assert all(torch.equal(v, tensors(fresh)[k]) for k, v in tensors(a).items())
        assert a.max_seqlen == fresh.max_seqlen
        # The next step's batch (no bigger): the same memory, every stale value written over.
        second = batch(6, 2)
        b = to_packed(second, advantages=np.ones(6), out=buffers)
        again = to_packed(second, advantages=np.ones(6))
        assert all(torch.equal(v, tensors(again)[k]) for k, v in tensors(b).items())
        assert all(tensors(b)[k].data_ptr() == p for k, p in pointers.items())
        # Both layouts can share one BatchBuffers: their buffers have names of their own.
        verl = to_verl(second, pad_token_id=0, out=buffers).tensors
        assert all(torch.equal(v, tensors(to_packed(second, advantages=np.ones(6)))[k]) for k, v in tensors(b).items())
        assert torch.equal(verl["responses"], to_verl(second, pad_token_id=0).tensors["responses"])
