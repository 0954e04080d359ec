"""The compact records an episode in flight keeps: its token stream, packed messages, deferred results."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tokengym.envs import CalculatorEnv
from tokengym.envs.conformance import Conformance, deferred_conformance, deferred_next, deferred_result
from tokengym.envs.packed import PackedList, PackedMessages
from tokengym.envs.stream import TokenStream

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def test_a_stream_holds_its_pieces_as_int32_and_gives_them_back_as_new_int64_arrays(qwen3):
    decoded: list[list[int]] = []

    def decode(ids):
        decoded.append(list(ids))
        return qwen3.decode(ids)

    s = TokenStream(decode)
    first, second = qwen3.encode("one two"), qwen3.encode(" three")
    s.append("prompt", 0, np.array([1, 2, 3]), "abc", has_user=True)
    s.append("action", 0, first, qwen3.decode(first))
    s.append("observation", 0, [7, 8], "é\n", n_messages=2)
    s.append("action", 1, second, qwen3.decode(second))
    assert decoded == [[1, 2, 3], [7, 8]]  # a prompt's or observation's ids are decoded once, to see whether its text must be kept
    decoded.clear()
    assert len(s) == 5 + len(first) + len(second) and s.num_pieces == 4
    assert s.tolist() == [1, 2, 3, *first, 7, 8, *second] and s._ids.itemsize == 4
    ids = s.piece_ids(2)
    assert ids.dtype == np.int64 and ids.tolist() == [7, 8] and not ids.flags.writeable
    assert s.piece_equals(2, np.array([7, 8])) and not s.piece_equals(2, np.array([7, 9]))
    assert not s.piece_equals(2, np.array([7]))
    assert s.text(3) == " three" and decoded == []  # the latest action's text is the one it was given
    assert s.text(1) == "one two" and decoded == [first]  # an earlier one's is decoded again
    assert s.text(2) == "é\n" and s.text(0) == "abc"
    p = s.piece(2)
    assert (p.kind, p.turn, p.has_user, p.n_messages) == ("observation", 0, False, 2)
    assert [q.kind for q in s.last_pieces(2)] == ["observation", "action"] and s.all_text() == "abcone twoé\n three"


def test_a_stream_refuses_ids_that_do_not_fit_int32():
    s = TokenStream(str)
    with pytest.raises(ValueError, match="int32"):
        s.append("prompt", 0, np.array([1, 2**31]), "")
    with pytest.raises(ValueError, match="int32"):
        s.append("prompt", 0, np.array([-1]), "")
    assert len(s) == 0 and s.num_pieces == 0  # nothing half-appended


def test_an_env_keeps_one_stream_that_grows_and_a_new_one_each_episode(qwen3):
    env = CalculatorEnv(qwen3, max_turns=4)
    obs, _ = env.reset(seed=0)
    first = env.token_stream
    action = env.renderer.encode_action_text(CALL) + list(env.renderer.turn_end_ids)
    obs2, *_ = env.step(action)
    assert env.token_stream is first and first.tolist() == [*obs.tolist(), *action, *obs2.tolist()]
    assert first.kinds() == ["prompt", "action", "observation"] and "42" in first.text(2)
    env.reset(seed=1)
    assert env.token_stream is not first and first.num_pieces == 3  # the old episode's stream is left as it was


def test_packed_messages_give_back_copies_and_keep_what_marshal_cannot_encode():
    class Note:
        def __eq__(self, other):
            return isinstance(other, Note)

    packed = PackedMessages()
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"x": (1, 2.5)}}}]}
    packed[3] = call
    packed[5] = {"role": "assistant", "content": Note()}
    got = packed[3]
    assert got == call and got is not call
    got["tool_calls"].clear()
    assert packed[3] == call  # a reader cannot change what is kept
    call["content"] = "changed"
    assert packed[3]["content"] is None  # nor the writer, after the fact
    assert packed[5] == {"role": "assistant", "content": Note()} and packed[5]["content"] is not packed[5]["content"]
    assert list(packed) == [3, 5] and len(packed) == 2 and packed.get(4, "none") == "none"
    assert packed.pop(3)["role"] == "assistant" and packed.pop(3, "gone") == "gone" and list(packed) == [5]


def test_a_deferred_result_that_says_nothing_else_is_two_ints(qwen3):
    env = CalculatorEnv(qwen3)
    env.reset(seed=0)
    action = env.renderer.encode_action_text(CALL) + list(env.renderer.turn_end_ids)
    env.step(action)
    plain = deferred_conformance(env.renderer, env.token_stream.last_pieces(2), turn=4, next_check=7)
    assert deferred_next(plain) == 7 and deferred_result(4, 7) == plain
    with_notes = Conformance(turn=4, status="deferred", detail=plain.detail, notes=("a note",))
    assert deferred_next(with_notes) is None
    assert deferred_next(Conformance(turn=4, status="ok")) is None
    assert deferred_next(Conformance(turn=4, status="deferred", detail="another text")) is None


def test_a_packed_list_gives_back_what_it_was_given_and_a_reference_reads_as_its_piece():
    class Note:
        def __eq__(self, other):
            return isinstance(other, Note)

    odd = [
        {"role": "tool", "content": "84", "tool_call_id": "call_0_0", "name": "calculate"},
        {"a": (1, (2, [3, {"b": ()}])), 7: "int key", "c": [None, True, 2.5, b"x", {"d": -1}]},
        {"role": "user", "content": Note()},  # marshal cannot encode it: kept as a copy
        {"role": "assistant", "content": "x" * 300, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
    ]
    calls = []

    def resolve(pieces):
        calls.append(list(pieces))
        return [{"role": "assistant", "content": f"piece {k}"} for k in pieces]

    packed = PackedList(odd[:2], resolve=resolve)
    packed.append(odd[2])
    packed.append_ref(5)
    packed.extend(odd[3:])
    assert packed.holds_refs and len(packed) == 5 and calls == []
    assert packed[3] == {"role": "assistant", "content": "piece 5"} and calls == [[5]]
    assert packed[:3] == odd[:3] and packed[4] == odd[3] and packed[-1] == odd[3]
    assert type(packed[1]["a"]) is tuple and type(packed[1]["a"][1][1]) is list
    got = packed[0]
    got["content"] = "changed"
    assert packed[0] == odd[0] and packed[2]["content"] is not packed[2]["content"]
    snapshot = packed.snapshot()
    packed.append({"role": "user", "content": "later"})
    assert len(snapshot) == 5 and list(snapshot)[:3] == odd[:3] and len(packed) == 6
    with pytest.raises(IndexError):
        packed[6]
    packed.append_ref(7)
    del calls[:]
    assert [m.get("content") for m in packed][3:] == ["piece 5", odd[3]["content"], "later", "piece 7"]
    assert calls == [[5, 7]]  # a whole read resolves its references in one call
    # a pickle (another process) gets the messages themselves: references and key numbers stay here
    plain = PackedList(odd[:2], resolve=resolve)
    plain.append_ref(1)
    again = pickle.loads(pickle.dumps(plain))
    assert list(again) == [*odd[:2], {"role": "assistant", "content": "piece 1"}] and not again.holds_refs
    with pytest.raises(ValueError, match="resolve="):
        PackedList().append_ref(0)


def test_packed_messages_keep_their_keys_in_order_whatever_the_order_of_writes():
    packed = PackedMessages()
    packed[4] = {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}
    packed[9] = {"role": "assistant", "content": None}
    packed[2] = {"role": "assistant", "content": "early"}  # written out of order: still found
    assert list(packed) == [2, 4, 9] and 4 in packed and 5 not in packed and packed[2]["content"] == "early"
    assert packed.pop(4)["tool_calls"] == [{"id": "a"}] and list(packed) == [2, 9] and packed[9]["content"] is None
    packed[9] = {"role": "assistant", "content": "replaced"}
    assert packed[9]["content"] == "replaced" and len(packed) == 2
    assert dict(pickle.loads(pickle.dumps(packed))) == dict(packed)
    with pytest.raises(KeyError):
        packed[3]


def test_an_env_reads_its_assistant_messages_back_from_the_stream_except_under_a_deploy_history(qwen3):
    action_text = CALL
    for history in ("keep", "deploy"):
        env = CalculatorEnv(qwen3, max_turns=4, history=history)
        env.reset(seed=0)
        action = env.renderer.encode_action_text(action_text) + list(env.renderer.turn_end_ids)
        env.step(action)
        env.step(action)
        assistants = [m for m in env.messages if m["role"] == "assistant"]
        assert assistants == [{"role": "assistant", "content": action_text}] * 2
        assert env._messages.holds_refs is (history == "keep")


def test_a_stream_decodes_the_texts_a_whole_check_asks_for_in_one_call(qwen3):
    env = CalculatorEnv(qwen3, max_turns=8)
    env.reset(seed=0)
    r = env.renderer
    action = np.array(r.encode_action_text(CALL) + list(r.turn_end_ids))
    for _ in range(4):
        env.step(action)
    stream = env.token_stream
    calls: list[int] = []
    one = TokenStream(r.decode)
    many = TokenStream(r.decode, lambda seqs: calls.append(len(seqs)) or r.decode_many(seqs))
    for k in range(stream.num_pieces):
        for s in (one, many):
            s.append(stream.kind(k), stream.turn(k), stream.piece_ids(k), stream.text(k))
    calls.clear()
    assert many.texts() == one.texts() == stream.texts()
    assert calls == [stream.num_pieces - 2]  # every piece but the last two (whose texts are kept) in one call
    assert r.decode_many([stream.piece_ids(k).tolist() for k in range(3)]) == [stream.text(k) for k in range(3)]
    env.close()
