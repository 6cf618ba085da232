"""The prefix table the router keeps: block keys, longest matches, recency, bounds, forgetting replicas."""

from __future__ import annotations

import pytest

from servelm.ray.prefix_table import PrefixTable, block_keys

pytestmark = pytest.mark.ray


def test_a_key_stands_for_everything_before_it() -> None:
    a = block_keys(list(range(40)), 8)
    b = block_keys([99, *range(1, 40)], 8)
    assert len(a) == 5  # whole blocks only
    assert a[0] != b[0] and all(x != y for x, y in zip(a, b))  # one token differs early: every later key differs
    assert block_keys(list(range(7)), 8) == []


def test_the_deepest_match_comes_first() -> None:
    t = PrefixTable(block_tokens=4)
    conversation = list(range(24))
    t.insert(t.keys(conversation[:8]), "shared")  # saw the system prompt only
    t.insert(t.keys(conversation[:20]), "deep")  # saw the earlier turns too
    assert t.match(t.keys(conversation)) == [("deep", 20), ("shared", 8)]


def test_at_equal_depth_the_latest_holder_wins() -> None:
    t = PrefixTable(block_tokens=4)
    prompt = list(range(12))
    t.insert(t.keys(prompt), "a")
    t.insert(t.keys(prompt), "b")
    assert [r for r, _ in t.match(t.keys(prompt))] == ["b", "a"]
    t.insert(t.keys(prompt), "a")
    assert [r for r, _ in t.match(t.keys(prompt))] == ["a", "b"]


def test_a_replica_must_hold_every_block_before_the_ones_it_matches() -> None:
    t = PrefixTable(block_tokens=2)
    keys = t.keys(list(range(8)))
    t.insert(keys[:1], "a")
    t.insert(keys[1:], "b")  # cannot happen through insert of a whole prompt; a later block alone is no match
    assert t.match(keys) == [("a", 2)]


def test_no_match_for_a_new_prompt() -> None:
    t = PrefixTable(block_tokens=4)
    t.insert(t.keys(list(range(16))), "a")
    assert t.match(t.keys([7] * 16)) == []
    assert t.match([]) == []


def test_bounded_least_recently_used_first() -> None:
    t = PrefixTable(block_tokens=1, max_blocks=4)
    t.insert(t.keys([1, 2, 3]), "a")
    t.insert(t.keys([9, 8]), "b")
    assert len(t) == 4
    assert t.match(t.keys([9, 8])) == [("b", 2)]
    assert t.match(t.keys([1, 2, 3])) == []  # its first block went first


def test_forget_drops_a_replica_everywhere() -> None:
    t = PrefixTable(block_tokens=4)
    prompt = list(range(16))
    t.insert(t.keys(prompt), "a")
    t.insert(t.keys(prompt), "b")
    t.forget(["b"])
    assert t.match(t.keys(prompt)) == [("a", 16)]
    t.forget(["a"])
    assert len(t) == 0


def test_holders_per_block_are_bounded() -> None:
    t = PrefixTable(block_tokens=4)
    prompt = list(range(4))
    for r in "abcdef":
        t.insert(t.keys(prompt), r)
    assert [r for r, _ in t.match(t.keys(prompt))] == ["f", "e", "d", "c"]


def test_the_same_prompt_under_two_scopes_shares_no_block():
    from servelm.ray.prefix_table import block_keys

    tokens = list(range(64))
    a, b = block_keys(tokens, 16, "scope-a"), block_keys(tokens, 16, "scope-b")
    assert len(a) == len(b) == 4 and not set(a) & set(b)
    assert block_keys(tokens, 16, "scope-a") == a and block_keys(tokens, 16) != a
