"""Cut a document into the units the condenser keeps or drops, and join the kept ones back.

Why whole words (or whole sentences) and never single tokens: dropping BPE pieces cuts numbers,
names and code identifiers in half (``4719`` -> ``47``, ``get_many`` -> ``get_``), which corrupts
exactly the facts a question asks for. A unit is a run of non-space characters with the white
space before it; punctuation stays glued to its word. Some words are *protected* (kept before any
other word when the budget allows): anything with a digit, and a capital letter that does not
merely start a sentence (names, acronyms, CamelCase). A code identifier is one word (kept or
dropped whole) but not protected: source is full of them.

Pure functions of the text; any thread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

GRANULARITIES = ("word", "sentence")

_WORD = re.compile(r"\s*\S+")
_STRIP = "\"'`([{<>)]}.,;:!?*"
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


@dataclass(frozen=True)
class Unit:
    """``text[start:end]`` with its leading white space; the unit proper starts at ``word_start``."""

    start: int
    word_start: int
    end: int
    protected: bool


def _capitalized(core: str) -> bool:
    return bool(core) and core[0].isupper()


def _protected(core: str, starts_sentence: bool, next_core: str) -> bool:
    if not core:
        return False
    if any(ch.isdigit() for ch in core):
        return True
    if any(ch.isupper() for ch in core[1:]):  # acronyms, CamelCase, McName
        return True
    # a capital that only starts a sentence is no name, unless a capitalized word follows ("Ada Lovelace")
    return _capitalized(core) and (not starts_sentence or _capitalized(next_core))


def words(text: str) -> list[Unit]:
    """Every white-space separated word of ``text`` (leading white space included), in order."""
    found = []  # (start, word start, end, core, starts a sentence)
    starts_sentence = True
    for match in _WORD.finditer(text):
        lead = len(match.group()) - len(match.group().lstrip())
        word = match.group()[lead:]
        starts_sentence = starts_sentence or "\n" in match.group()[:lead]
        found.append((match.start(), match.start() + lead, match.end(), word.strip(_STRIP), starts_sentence))
        starts_sentence = bool(_SENTENCE_END.search(word)) or word.endswith(":")
    return [Unit(start, word_start, end, _protected(core, first, found[i + 1][3] if i + 1 < len(found) else ""))
            for i, (start, word_start, end, core, first) in enumerate(found)]


def sentences(text: str) -> list[Unit]:
    """Sentences of ``text``: words up to one ending in ``.``, ``!`` or ``?``, or up to a line break
    (so source code goes line by line). Never protected: a sentence is kept or dropped whole."""
    units: list[Unit] = []
    group: list[Unit] = []
    for word in words(text):
        if group and "\n" in text[word.start:word.word_start]:
            units.append(Unit(group[0].start, group[0].word_start, group[-1].end, False))
            group = []
        group.append(word)
        if _SENTENCE_END.search(text[word.word_start:word.end]):
            units.append(Unit(group[0].start, group[0].word_start, group[-1].end, False))
            group = []
    if group:
        units.append(Unit(group[0].start, group[0].word_start, group[-1].end, False))
    return units


def split(text: str, granularity: str) -> list[Unit]:
    if granularity == "word":
        return words(text)
    if granularity == "sentence":
        return sentences(text)
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def enclosing(inner: Sequence[Unit], outer: Sequence[Unit]) -> list[int]:
    """For each of ``inner`` (words), the index of the ``outer`` unit (sentence) it starts in."""
    found, o = [], 0
    for unit in inner:
        while o + 1 < len(outer) and outer[o + 1].start <= unit.word_start:
            o += 1
        found.append(o)
    return found


def join(text: str, units: Sequence[Unit], keep: Sequence[bool]) -> str:
    """The kept units in their order, each with its own leading white space, except that a line
    break among dropped units survives (as one newline) so lines and paragraphs stay apart."""
    out: list[str] = []
    broken = False
    for unit, kept in zip(units, keep):
        lead = text[unit.start:unit.word_start]
        if not kept:
            broken = broken or "\n" in lead
            continue
        if not out:
            lead = ""
        elif broken and "\n" not in lead:
            lead = "\n"
        out.append(lead + text[unit.word_start:unit.end])
        broken = False
    return "".join(out)
