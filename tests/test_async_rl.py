"""Asynchronous RL: weight versions on every token, updates while turns are in flight, streamed batches.

The policy side runs a real tiny Qwen3 (random weights, the real Qwen3 tokenizer) through HFPolicy's
continuous decoder; the run side (AsyncRollout) is checked with a ScriptedPolicy where only the
bookkeeping is under test, and with the tiny Qwen3 for the law per version.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from tiny_qwen3 import tiny_qwen3
from tokengym.envs import ReplayEnv
from tokengym.policies import HFPolicy, SamplingParams, ScriptedPolicy
from tokengym.policies.versions import PolicyClosed, VersionWentBackwards, WeightsMismatch
from tokengym.recorder import AsyncRollout, StalenessStall, TrajectoryWriter, policy_logprobs, read_trajectories, to_packed, to_verl


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of ``model`` whose every weight moved a little: "the trainer's next weights"."""
    out = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn_like(p) * scale)
    return out


def wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.0005)


@pytest.fixture()
def hf(qwen3):
    model = tiny_qwen3(len(qwen3))
    policy = HFPolicy(copy.deepcopy(model), qwen3)
    yield policy, model
    policy.close()


LONG = SamplingParams(max_tokens=48, seed=3)
CONTEXT = list(range(100, 130))


def hold_for_update(policy, after: int) -> None:
    """Make the decode loop wait, once ``after`` more decode steps have run, until an update is
    queued: the update then falls inside the turns in flight however loaded the machine is."""
    from tokengym.policies.continuous import ContinuousDecoder

    if policy._decoder is None:
        policy._decoder = ContinuousDecoder(policy)
    decoder, seen, base = policy._decoder, [0], policy._decoder.updates_asked

    def listener(_n: int) -> None:
        seen[0] += 1
        if seen[0] == after:  # unless the update is in already
            end = time.monotonic() + 30
            while decoder.updates_asked == base and time.monotonic() < end:
                time.sleep(0.0005)
            remove()

    remove = policy.add_token_listener(listener)


def in_flight(policy, context=CONTEXT, params=LONG, *, hold: bool = True):
    """Submit one request to the decode loop; returns its future once it is decoding (with ``hold``,
    it waits at its third step for the next update to be queued)."""
    from tokengym.policies.continuous import ContinuousDecoder

    if policy._decoder is None:
        policy._decoder = ContinuousDecoder(policy)
    if hold:
        hold_for_update(policy, 3)
    steps = policy._decoder.steps
    future = policy._decoder.submit(context, params)
    wait_for(lambda: policy._decoder.steps >= steps + 1)
    return future


def recomputed(model, context, gen) -> np.ndarray:
    """Teacher-forced raw logprobs of ``gen``'s tokens after ``context`` under ``model``."""
    ids = torch.tensor([list(context) + gen.token_ids.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0].float().log_softmax(-1)
    n = len(context)
    return np.array([logits[n - 1 + i, t].item() for i, t in enumerate(gen.token_ids.tolist())])


# ---------------------------------------------------------------------- the policy's side
def test_continue_rebuilds_the_cache_and_later_tokens_are_the_new_weights(hf):
    """An update mid-turn under "continue": the turn holds two versions, and each token's logprob is
    what its own version's weights give over the whole prefix (the KV cache was computed again)."""
    policy, model = hf
    new = perturbed(model, 1)
    future = in_flight(policy)
    assert policy.update_weights(new.state_dict(), on_update="continue") == 1
    gen = future.result()
    v = gen.versions.tolist()
    assert len(v) == 48 and v[0] == 0 and v[-1] == 1 and v == sorted(v), v
    assert policy._decoder.rebuilds == 1
    for version, weights in ((0, model), (1, new)):
        on = gen.versions == version
        diff = np.abs(recomputed(weights, CONTEXT, gen)[on] - gen.logprobs[on]).max()
        assert diff < 1e-4, (version, diff)
    later = gen.versions == 1  # the old weights do not give the new version's tokens back
    assert np.abs(recomputed(model, CONTEXT, gen)[later] - gen.logprobs[later]).max() > 1e-3


def test_restart_drops_the_turn_and_samples_it_again_on_the_new_weights(hf):
    policy, model = hf
    new = perturbed(model, 2)
    future = in_flight(policy)
    policy.update_weights(new.state_dict(), on_update="restart")
    gen = future.result()
    assert gen.versions.tolist() == [1] * 48 and gen.info["restarts"] == 1
    fresh = policy.generate([CONTEXT], LONG)[0]  # the same seed on the new weights from the start
    assert gen.token_ids.tolist() == fresh.token_ids.tolist()
    np.testing.assert_allclose(gen.logprobs, fresh.logprobs, atol=1e-5)


def test_finish_lets_turns_in_flight_end_on_the_old_weights_and_holds_new_ones(hf):
    policy, model = hf
    new = perturbed(model, 3)
    alone = policy.generate([CONTEXT], LONG)[0]
    future = in_flight(policy)
    done = threading.Event()

    def update() -> None:
        policy.update_weights(new.state_dict(), on_update="finish")
        done.set()

    asked = policy._decoder.updates_asked
    updater = threading.Thread(target=update)
    updater.start()
    wait_for(lambda: policy._decoder.updates_asked > asked)  # the update is queued before the new turn comes
    late = policy._decoder.submit([5, 6, 7], SamplingParams(max_tokens=4, seed=1))  # a new turn: it waits
    gen = future.result()
    updater.join(30)
    assert done.is_set() and gen.versions.tolist() == [0] * 48
    assert gen.token_ids.tolist() == alone.token_ids.tolist()  # untouched by the update
    assert late.result().versions.tolist() == [1] * 4


def test_refused_updates_change_nothing_and_name_the_cause(hf, tmp_path):
    policy, model = hf
    state = model.state_dict()
    future = in_flight(policy, hold=False)
    with pytest.raises(WeightsMismatch, match="names the model does not have"):
        policy.update_weights({**state, "model.nope.weight": torch.zeros(3)})
    with pytest.raises(WeightsMismatch, match="missing"):
        policy.update_weights({k: v for k, v in state.items() if "layers.0" not in k})
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(WeightsMismatch, match=r"other shapes \(model.norm.weight: \(7,\)"):
        policy.update_weights(bad)
    with pytest.raises(ValueError, match="on_update='later'"):
        policy.update_weights(state, on_update="later")
    with pytest.raises(TypeError, match="state dict"):
        policy.update_weights([1, 2])
    gen = future.result()
    assert policy.version == 0 and gen.versions.tolist() == [0] * 48
    assert policy.generate([CONTEXT], LONG)[0].token_ids.tolist() == gen.token_ids.tolist()

    new = perturbed(model, 4)
    new.save_pretrained(tmp_path / "step-7")  # a folder, as a trainer saves one (the tied head left out)
    assert policy.update_weights(tmp_path / "step-7", version=7) == 7
    with pytest.raises(VersionWentBackwards, match="version 7 is not newer than the policy's version 7"):
        policy.update_weights(state, version=7)
    with pytest.raises(VersionWentBackwards, match="version 3"):
        policy.update_weights(state, version=3)
    with pytest.raises(FileNotFoundError, match="no weights at"):
        policy.update_weights(tmp_path / "absent")
    gen = policy.generate([CONTEXT], LONG)[0]
    assert gen.versions.tolist() == [7] * 48
    np.testing.assert_allclose(recomputed(new, CONTEXT, gen), gen.logprobs, atol=1e-4)
    policy.close()
    with pytest.raises(PolicyClosed, match="closed"):
        policy.update_weights(state)
    assert policy.version == 7


def test_the_scripted_policy_bumps_its_version_and_stamps_every_reply(qwen3):
    policy = ScriptedPolicy(lambda ctx: [1, 2, 3])
    assert policy.generate([[9]], SamplingParams())[0].versions.tolist() == [0, 0, 0]
    assert policy.update_weights() == 1 and policy.update_weights(None, 5) == 5
    assert policy.generate([[9]], SamplingParams())[0].versions.tolist() == [5, 5, 5]
    with pytest.raises(VersionWentBackwards):
        policy.update_weights(None, 5)
    policy.close()
    with pytest.raises(PolicyClosed):
        policy.update_weights()


# ---------------------------------------------------------------------- the run's side
def scripted(qwen3):
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    return ScriptedPolicy(lambda ctx: "ok", qwen3, end_ids=[end])


def test_every_episode_is_handed_out_once_and_none_starts_past_the_bound(qwen3):
    policy = scripted(qwen3)
    B, K, N = 4, 1, 24
    with AsyncRollout(lambda: ReplayEnv(qwen3, max_turns=2), policy, batch_size=B, max_staleness=K, episodes=N,
                      concurrency=6) as run:
        seen = []
        for batch in run.batches():
            seen += batch
            run.update_weights(None)
    episodes = [t.metadata["episode"] for t in seen]
    assert sorted(episodes) == list(range(N))  # none lost, none twice
    assert run.stats.episodes == N and run.stats.failed == 0 and run.stats.updates >= N // B
    starts = Counter(t.metadata["start_version"] for t in seen)
    for v in starts:  # the staleness bound at every version: started by then <= (K + 1 + v) * B
        assert sum(n for u, n in starts.items() if u <= v) <= (K + 1 + v) * B, starts
    assert sum(run.stats.staleness.values()) == N and all(t.has_versions for t in seen)
    for t in seen:  # an update may fall between an episode's start and its first turn
        assert t.metadata["start_version"] <= t.version_span[0] <= t.version_span[1] <= run.version
        assert 0 <= t.metadata["staleness"] <= run.stats.updates


def test_max_staleness_zero_is_the_synchronous_bound(qwen3):
    policy = scripted(qwen3)
    with AsyncRollout(lambda: ReplayEnv(qwen3, max_turns=2), policy, batch_size=3, max_staleness=0, episodes=9,
                      concurrency=8) as run:
        versions = []
        for batch in run.batches():
            versions.append({t.metadata["start_version"] for t in batch})
            run.update_weights(None)
    assert versions == [{0}, {1}, {2}] and run.stats.staleness == Counter({0: 9}) and run.stats.waits > 0


def test_groups_are_handed_out_whole_and_failures_are_counted(qwen3):
    calls = Counter()

    class Flaky(ReplayEnv):
        def reset(self, *, seed=None, options=None):
            calls["reset"] += 1
            if calls["reset"] == 3:
                raise RuntimeError("a broken task")
            return super().reset(seed=seed, options=options)

    with AsyncRollout(lambda: Flaky(qwen3, max_turns=1), scripted(qwen3), batch_size=4, group_size=2, episodes=8,
                      concurrency=3) as run:
        batches = list(run.batches())
    rows = [t for b in batches for t in b]
    groups = Counter(t.metadata["group"] for t in rows)
    assert sum(groups.values()) == 7 and run.stats.failed == 1 and "a broken task" in str(run.stats.errors[0])
    assert sorted(groups.values()) == [1, 2, 2, 2]  # the failed episode's group has its other member
    for b in batches:  # a group never straddles two batches
        assert all(groups[g] == sum(1 for t in b if t.metadata["group"] == g) for g in {t.metadata["group"] for t in b})


def test_closing_drops_only_what_is_in_flight_and_says_so(qwen3):
    release = threading.Event()

    def slow(ctx):
        release.wait(10)
        return "ok"

    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    run = AsyncRollout(lambda: ReplayEnv(qwen3, max_turns=1), ScriptedPolicy(slow, qwen3, end_ids=[end]),
                       batch_size=2, concurrency=2)
    with pytest.raises(TimeoutError, match="no batch of 2 within 0.2 s"):
        run.next_batch(timeout=0.2)
    threading.Timer(0.3, release.set).start()  # the policy's call under way returns; its episodes are dropped
    run.close()
    assert run.stats.dropped == 2 and run.stats.episodes == 0 and run.next_batch() == []

    run = AsyncRollout(lambda: ReplayEnv(qwen3, max_turns=1), scripted(qwen3), batch_size=2, concurrency=2)
    first = run.next_batch()
    run.close(wait=True)  # the episodes in flight end and are still handed out
    rest = list(run.batches())
    ids = [t.metadata["episode"] for t in first + [t for b in rest for t in b]]
    assert len(ids) == len(set(ids)) == run.stats.episodes and run.stats.dropped == 0


def test_a_trainer_that_never_updates_is_told_instead_of_waiting_forever(qwen3):
    """The bound counts updates: with none, K + 1 batches start, and the next pull names the fix."""
    with AsyncRollout(lambda: ReplayEnv(qwen3, max_turns=1), scripted(qwen3), batch_size=2, max_staleness=1,
                      episodes=10, concurrency=4) as run:
        taken = run.next_batch() + run.next_batch(timeout=30)
        with pytest.raises(StalenessStall, match="call update_weights between batches"):
            run.next_batch(timeout=30)
        run.update_weights(None)  # a version bump lets the next batch start
        taken += run.next_batch(timeout=30)
    assert len({t.metadata["episode"] for t in taken}) == 6


def test_bad_arguments_are_refused_by_name(qwen3):
    from tokengym.policies import OpenAIServerPolicy

    env = lambda: ReplayEnv(qwen3)  # noqa: E731
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        AsyncRollout(env, scripted(qwen3), batch_size=6, group_size=4)
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncRollout(env, scripted(qwen3), batch_size=2, max_staleness=-1)
    with pytest.raises(ValueError, match="on_update='soon'"):
        AsyncRollout(env, scripted(qwen3), batch_size=2, on_update="soon")
    fixed = OpenAIServerPolicy.__new__(OpenAIServerPolicy)  # a policy without weight updates
    with pytest.raises(TypeError, match="no weight versions"):
        AsyncRollout(env, fixed, batch_size=2)


# ---------------------------------------------------------------------- the law per version
def test_the_law_holds_per_version_across_updates_in_flight(hf, qwen3, tmp_path):
    """An asynchronous run on the tiny Qwen3 whose trainer puts new weights in while turns are in
    flight ("continue"): recomputing with version v's weights gives back the recorded logprobs on
    version v's tokens (< 1e-4, float32), and some trajectory spans two versions. The versions
    survive the store and every layout."""
    policy, model = hf
    weights = {0: model}
    writer = TrajectoryWriter(tmp_path / "store", tokenizer=qwen3)
    run = AsyncRollout(lambda: ReplayEnv(qwen3, max_turns=2), policy, batch_size=4, max_staleness=1, episodes=8,
                       concurrency=4, sampling=SamplingParams(max_tokens=24), on_update="continue",
                       on_episode=writer.write)
    rows = []
    with run:
        for step in range(1, 3):
            weights[step] = perturbed(model, 10 + step)
            wait_for(lambda: policy._decoder is not None)
            hold_for_update(policy, 6)  # the decode loop waits there for the update: turns are in flight
            run.update_weights(weights[step].state_dict())
            rows += run.next_batch()
        rows += [t for b in run.batches() for t in b]
    writer.close()
    assert sorted(t.metadata["episode"] for t in rows) == list(range(8))
    spanning = [t for t in rows if len({int(v) for v in t.versions[t.mask == 1]}) > 1]
    assert spanning, [t.version_span for t in rows]
    assert spanning[0].version_changes()
    batch = to_verl(rows)
    for v, m in weights.items():
        on = batch.tensors["rollout_versions"] == v
        if not on.any():
            continue
        got = policy_logprobs(m, batch)[on]
        diff = (got - batch.tensors["rollout_log_probs"][on]).abs().max().item()
        assert diff < 1e-4, (v, diff)
    stored = {t.metadata["episode"]: t for t in read_trajectories(tmp_path / "store", tokenizer=qwen3)}
    for t in rows:
        assert np.array_equal(stored[t.metadata["episode"]].versions, t.versions)
    packed = to_packed(rows)
    assert torch.equal(packed.versions, torch.from_numpy(np.concatenate([t.versions for t in rows])))


def test_inspect_shows_where_the_version_changes(hf, qwen3, tmp_path, capsys):
    from tokengym.recorder.cli.inspect_store import main

    policy, model = hf
    new = perturbed(model, 5).state_dict()
    future = in_flight(policy)
    policy.update_weights(new)
    gen = future.result()
    env = ReplayEnv(qwen3, max_turns=1)
    from tokengym.recorder import RecordEpisodes

    rec = RecordEpisodes(env)
    obs, _ = rec.reset(seed=0)
    rec.step(gen.token_ids, logprobs=gen.logprobs, finish_reason=gen.finish_reason, versions=gen.versions)
    traj = rec.trajectories[0]
    (offset, old, new), = traj.version_changes()
    assert (old, new) == (0, 1) and traj.versions[offset - 1] == 0 and traj.versions[offset] == 1
    with TrajectoryWriter(tmp_path, tokenizer=qwen3) as writer:
        writer.write(traj)
    assert main([str(tmp_path), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert f"weights v0 -> v1 at token {offset} (turn 0)" in out
    n0 = int((traj.versions == 0).sum())
    assert f"weight versions  2: v0 {n0:,} · v1 {48 - n0:,} policy tokens (0 of unknown version) · 1 rows span more than one" in out
    with pytest.raises(ValueError, match="one value per action token"):
        rec.reset(seed=0)
        rec.step(gen.token_ids, versions=gen.versions[:3])


def test_a_servers_weight_version_spans_are_stamped_or_refused_by_name():
    from tokengym.policies.openai_server import ServerError, weight_versions

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert weight_versions(spans, 5).tolist() == [3, 3, 4, 4, 4]
    assert weight_versions(None, 5) is None and weight_versions([], 5) is None
    with pytest.raises(ServerError, match="leave some of the 6 output tokens out"):
        weight_versions(spans, 6)
    with pytest.raises(ServerError, match="labels its weights 'step-3'"):
        weight_versions([{"version": "step-3", "start": 0, "end": 1}], 1)
    with pytest.raises(ServerError, match="is not"):
        weight_versions([{"start": 0}], 1)
