"""The content index: which stored token runs appear, at any offset, in a new prompt.

A *segment* is a run of tokens whose KV is stored somewhere: a fixed window (LMCache's 256-token
chunks of an earlier prompt) or a document cut out of an earlier prompt at separators
(:func:`split_at_separator`). Each is registered with the key its KV is stored under, the tokens
themselves and the position its keys were rotated for (``source_start``).

Matching (:meth:`ContentIndex.match`) looks every offset of the prompt up by the bytes of its next
``anchor`` tokens (a dict of exact byte strings, so no hash collision can confuse two anchors), then
**compares the candidate's whole token run with the prompt** before accepting it: two segments
that share an anchor, or two copies of one document stored at different positions, can never be
answered with the other's KV; a candidate that differs anywhere is skipped. Among verified
candidates at one offset the longest wins (ties: the one registered first); matches never overlap;
the scan then continues after the match. Segments shorter than ``anchor`` tokens are not indexed
(their tokens become recomputed gaps).

This is the job of LMCache's ``BlendTokenRangeMatcher`` (a rolling hash over fixed windows, no
verification); here windows of any length are indexed and every match is verified.

Threads: not thread-safe; the owner serializes ``add`` / ``remove`` / ``match``. Memory: one
int32 copy of every indexed run plus one anchor entry per segment.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import numpy as np

from kvshrink.errors import ConfigError


@dataclass(frozen=True)
class Match:
    """Segment ``key`` (its KV rotated for ``source_start``) found at ``start`` of the prompt."""

    key: Hashable
    start: int
    length: int
    source_start: int

    @property
    def end(self) -> int:
        return self.start + self.length


class ContentIndex:
    def __init__(self, anchor: int = 16) -> None:
        if anchor < 1:
            raise ConfigError("anchor", "must be at least 1")
        self.anchor = anchor
        self._segments: OrderedDict[Hashable, tuple[np.ndarray, int]] = OrderedDict()
        self._by_anchor: dict[bytes, list[Hashable]] = {}

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._segments

    def add(self, key: Hashable, token_ids: Sequence[int], source_start: int) -> bool:
        """Index a segment; False (and nothing indexed) when it is shorter than the anchor.
        Re-adding a key replaces its entry."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        if key in self._segments:
            self.remove(key)
        if len(tokens) < self.anchor:
            return False
        self._segments[key] = (tokens, int(source_start))
        self._by_anchor.setdefault(tokens[: self.anchor].tobytes(), []).append(key)
        return True

    def remove(self, key: Hashable) -> None:
        """Forget a segment (its KV was evicted); unknown keys are ignored."""
        entry = self._segments.pop(key, None)
        if entry is None:
            return
        anchor = entry[0][: self.anchor].tobytes()
        keys = self._by_anchor[anchor]
        keys.remove(key)
        if not keys:
            del self._by_anchor[anchor]

    def match(self, token_ids: Sequence[int], start: int = 0) -> list[Match]:
        """Non-overlapping verified matches in ``token_ids[start:]``, in prompt order."""
        prompt = np.asarray(token_ids, dtype=np.int32)
        raw = prompt.tobytes()
        width = self.anchor * 4
        found: list[Match] = []
        i, last = start, len(prompt) - self.anchor
        while i <= last:
            keys = self._by_anchor.get(raw[i * 4 : i * 4 + width])
            best = None
            for key in keys or ():
                tokens, source = self._segments[key]
                n = len(tokens)
                if (best is None or n > best.length) and i + n <= len(prompt) and np.array_equal(prompt[i : i + n], tokens):
                    best = Match(key, i, n, source)
            if best is None:
                i += 1
            else:
                found.append(best)
                i = best.end
        return found


def fixed_windows(token_ids: Sequence[int], size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the full ``size``-token windows of a prompt (LMCache's chunks)."""
    return [(s, s + size) for s in range(0, len(token_ids) - size + 1, size)]


def split_at_separator(token_ids: Sequence[int], separator: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of the runs between occurrences of ``separator`` (a token sequence, e.g.
    CacheBlend's ``" # # "``); the separators themselves belong to no run. Empty runs are dropped."""
    sep = list(separator)
    if not sep:
        raise ConfigError("separator", "must not be empty")
    ids = list(token_ids)
    runs, begin, i = [], 0, 0
    while i <= len(ids) - len(sep):
        if ids[i : i + len(sep)] == sep:
            if i > begin:
                runs.append((begin, i))
            i += len(sep)
            begin = i
        else:
            i += 1
    if begin < len(ids):
        runs.append((begin, len(ids)))
    return runs


def coverage(matches: Iterable[Match]) -> int:
    """Tokens covered by ``matches`` (non-overlapping, as :meth:`ContentIndex.match` returns)."""
    return sum(m.length for m in matches)
