"""The content index: stored token runs found at any offset, verified token by token."""

from __future__ import annotations

import pytest

from kvshrink.errors import ConfigError
from kvshrink.fuse.index import ContentIndex, Match, coverage, fixed_windows, split_at_separator


def _doc(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 49152 for i in range(n)]


def test_documents_are_found_at_any_offset_in_any_order() -> None:
    a, b, c = _doc(1, 300), _doc(2, 120), _doc(3, 40)
    index = ContentIndex(anchor=16)
    assert index.add("a", a, 20) and index.add("b", b, 20) and index.add("c", c, 340)
    prompt = [5] * 7 + b + [9, 9] + c + a + [1, 2, 3]
    assert index.match(prompt) == [Match("b", 7, 120, 20), Match("c", 129, 40, 340), Match("a", 169, 300, 20)]
    assert coverage(index.match(prompt)) == 460
    assert index.match(prompt, start=130) == [Match("a", 169, 300, 20)]  # c starts before 130


def test_a_document_sharing_an_anchor_never_answers_for_another() -> None:
    """Same first 40 tokens, then different: each prompt gets the document it really contains."""
    shared = _doc(4, 40)
    a, b = shared + _doc(5, 60), shared + _doc(6, 60)
    index = ContentIndex(anchor=16)
    index.add("a", a, 100)
    index.add("b", b, 200)
    assert index.match([0] * 3 + b) == [Match("b", 3, 100, 200)]
    assert index.match([0] * 3 + a) == [Match("a", 3, 100, 100)]
    assert index.match(shared + _doc(7, 60)) == []  # neither: differs after the anchor
    assert index.match(a[:-1]) == []  # a cut short is not a


def test_the_same_tokens_stored_twice_keep_their_own_positions() -> None:
    """One document's KV from two earlier prompts (different positions, different keys): a match
    names one key and that key's own position, never another entry's."""
    doc = _doc(8, 64)
    index = ContentIndex(anchor=16)
    index.add(("prompt1", 0), doc, 30)
    index.add(("prompt2", 3), doc, 700)
    (m,) = index.match([1] * 10 + doc)
    assert (m.key, m.source_start) == (("prompt1", 0), 30)
    index.remove(("prompt1", 0))  # evicted: the other copy answers, with its position
    (m,) = index.match([1] * 10 + doc)
    assert (m.key, m.source_start) == (("prompt2", 3), 700)
    index.remove(("prompt2", 3))
    assert index.match(doc) == [] and len(index) == 0
    index.remove("unknown")  # ignored


def test_longest_verified_candidate_wins_and_matches_never_overlap() -> None:
    doc = _doc(9, 80)
    index = ContentIndex(anchor=8)
    index.add("short", doc[:30], 0)
    index.add("long", doc, 0)
    index.add("inner", doc[40:60], 40)
    assert index.match(doc) == [Match("long", 0, 80, 0)]
    assert index.match(doc[:50]) == [Match("short", 0, 30, 0)]  # long does not fit; inner starts at 40 > 30
    assert not index.add("tiny", doc[:7], 0) and "tiny" not in index
    index.add("long", doc[:20], 5)  # re-adding a key replaces it
    assert index.match(doc[:25]) == [Match("long", 0, 20, 5)]


def test_splitting_fixed_windows_and_separators() -> None:
    ids = list(range(10)) + [7, 7] + list(range(20, 25)) + [7, 7] + [7, 7] + [1]
    assert split_at_separator(ids, [7, 7]) == [(0, 10), (12, 17), (21, 22)]
    assert fixed_windows(list(range(600)), 256) == [(0, 256), (256, 512)]
    with pytest.raises(ConfigError):
        split_at_separator(ids, [])
    with pytest.raises(ConfigError):
        ContentIndex(anchor=0)
