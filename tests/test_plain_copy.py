"""plain_copy: a deep copy of message trees, whatever they hold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
