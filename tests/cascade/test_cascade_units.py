"""Words and sentences the condenser keeps or drops: numbers, names and identifiers are protected
and never split; joining the kept units keeps each whole and lines apart."""

from __future__ import annotations

from kvshrink.cascade import units


def _words(text: str) -> list[tuple[str, bool]]:
    return [(text[u.word_start:u.end], u.protected) for u in units.words(text)]


def test_numbers_and_names_are_protected_and_identifiers_stay_whole() -> None:
    text = ("The vault opens with code 4719. Margaret Okonkwo ran kv-node-17 at 38.25 ms; "
            "call get_many(batch_id=9) or os.path.join, ask NASA or McDonald about KVShrink.")
    found = dict(_words(text))
    for word in ("4719.", "Margaret", "Okonkwo", "kv-node-17", "38.25", "get_many(batch_id=9)", "NASA", "McDonald",
                 "KVShrink."):
        assert found[word], word
    for word in ("The", "vault", "opens", "with", "code", "ran", "call", "os.path.join,", "or", "ask", "about"):
        assert not found[word], word


def test_a_capital_that_only_starts_a_sentence_is_not_a_name() -> None:
    text = "Values are kept. Some are not.\nLines start sentences too. Alan Turing did."
    protected = {w for w, p in _words(text) if p}
    assert protected == {"Alan", "Turing"}


def test_join_keeps_kept_words_whole_and_lines_apart() -> None:
    text = "alpha beta gamma\ndelta epsilon\n\nzeta eta"
    found = units.words(text)
    assert [text[u.word_start:u.end] for u in found] == ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"]
    keep = [True, False, False, False, True, True, False]
    assert units.join(text, found, keep) == "alpha\nepsilon\n\nzeta"
    assert units.join(text, found, [True] * len(found)) == text


def test_sentences_end_at_stops_and_line_breaks() -> None:
    text = "First one. Second (really)! Third?\ndef f(x):\n    return x"
    found = units.sentences(text)
    assert [text[u.word_start:u.end] for u in found] == ["First one.", "Second (really)!", "Third?", "def f(x):",
                                                          "return x"]
    assert units.join(text, found, [True, False, True, False, True]) == "First one. Third?\n    return x"
