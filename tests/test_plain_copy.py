"""plain_copy: a deep copy of message trees, whatever they hold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tokengym.envs.plain_copy import plain_copy


@dataclass
class Box:
    items: list


def test_a_copy_shares_nothing_mutable_with_the_original():
    calls = [{"id": "c1", "function": {"name": "f", "arguments": {"xs": [1, 2.5, None, True], "t": (1, [2])}}}]
    message = {"role": "assistant", "content": "hi", "tool_calls": calls, "extra": Box([1]), "arr": np.arange(3)}
    copied = plain_copy(message)
    assert copied == {**message, "arr": copied["arr"]} and np.array_equal(copied["arr"], message["arr"])
    copied["tool_calls"][0]["function"]["arguments"]["xs"].append(3)
    copied["tool_calls"][0]["function"]["arguments"]["t"][1].append(3)
    copied["extra"].items.append(2)
    copied["arr"][0] = 9
    assert message["tool_calls"][0]["function"]["arguments"] == {"xs": [1, 2.5, None, True], "t": (1, [2])}
    assert message["extra"].items == [1] and message["arr"][0] == 0
    assert type(copied["tool_calls"][0]["function"]["arguments"]["t"]) is tuple


def test_a_tree_that_holds_itself_is_still_copied():
    loop: dict = {"role": "user"}
    loop["self"] = loop
    copied = plain_copy(loop)
    assert copied is not loop and copied["self"] is copied  # copy.deepcopy's answer for a cycle


def test_plain_data_copies_exact_plain_trees_and_refuses_the_rest():
    from tokengym.envs.plain_copy import NotPlainData, plain_data

    tree = {"a": [1, 2.5, True, None, ("x", {"y": []})], "b": {"c": "d"}}
    copied = plain_data(tree)
    assert copied == tree and copied is not tree and copied["a"] is not tree["a"]
    assert copied["a"][4] is not tree["a"][4] and copied["a"][4][1] is not tree["a"][4][1]

    class Text(str):
        pass

    deep: list = []
    for _ in range(120):
        deep = [deep]
    for refused, _why in [({"k": Text("v")}, "Text"), ({1: "one"}, "int key"), ({"k": b"raw"}, "bytes"),
                         ({"k": object()}, "object"), (deep, "too deep")]:
        with pytest.raises(NotPlainData):
            plain_data(refused)
