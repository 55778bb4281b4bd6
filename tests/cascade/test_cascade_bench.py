"""The cascade benchmark's QA set and answer check (the model runs are the benchmark's, not CI's)."""

from __future__ import annotations

from pathlib import Path

from kvshrink.benchmarks.cascade_bench import build_set, judge


def test_every_fact_sits_in_its_document_of_real_text(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    docs, questions = build_set(tokenizer, documents=3, facts_per_doc=2, min_doc_tokens=1024)
    assert len(questions) == 6 and all(len(tokenizer(d).input_ids) >= 1024 for d in docs)
    for q in questions:
        assert q.answer in docs[q.document] and all(q.answer not in d for i, d in enumerate(docs) if i != q.document)
    assert build_set(tokenizer, 3, 2, 1024) == (docs, questions)  # seeded


def test_an_answer_matches_as_whole_words() -> None:
    assert judge("4719\n", "4719") == (True, True)
    assert judge("The code is 4,719.", "4719") == (False, True)
    assert judge("It is 47190.", "4719") == (False, False)
    assert judge("Elena Lindqvist heads it.", "Elena Lindqvist") == (False, True)
    assert judge("", "4719") == (False, False)


def test_each_seed_is_another_set_and_the_first_is_unchanged(checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    first, other = build_set(tokenizer, 2, 2, 256, seed=17), build_set(tokenizer, 2, 2, 256, seed=18)
    assert set(first[0]).isdisjoint(other[0]) and first[1] != other[1]


def _set(seed: int, full: list[int], condensed: list[int], tokens: tuple[int, int], dropped: int = 0) -> dict:
    """``dropped``: questions (the first ones) whose answer the condensed documents no longer hold."""
    def setting(matches: list[int], prompt_tokens: int, dropped: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "answer_seconds": 1.0,
                "answers": [{"question": "q", "expected": "1", "got": "1" if m else "2", "exact": m, "match": m,
                             "in_context": i >= dropped} for i, m in enumerate(matches)]}
    return {"seed": seed, "questions": len(full), "settings": {"full": setting(full, tokens[0], 0),
                                                               "condensed 0.5": setting(condensed, tokens[1], dropped)}}


def test_the_summary_pools_the_sets_and_decides_only_where_the_interval_clears() -> None:
    from kvshrink.benchmarks.cascade_bench import summarize

    even = summarize([_set(17, [1, 0, 1, 1], [1, 0, 1, 1], (400, 200), dropped=1),
                      _set(18, [1, 1, 0, 0], [1, 1, 0, 0], (400, 220))])
    full, half = even
    assert (full["questions"], full["match"], full["accuracy"]) == (8, 5, 5 / 8)
    assert (full["answers_in_context"], half["answers_in_context"]) == (8, 7)
    assert half["prompt_tokens_vs_full"] == 420 / 800 and half["accuracy_vs_full"]["value"] == 1.0
    assert half["verdict"] == "met"  # the same answers in every resample
    worse = summarize([_set(17, [1] * 6, [1, 0, 1, 0, 1, 0], (600, 300))])[1]
    assert worse["accuracy_vs_full"]["value"] == 0.5 and worse["verdict"] == "not met"
    few = summarize([_set(17, [1, 1, 0], [1, 0, 1], (3, 3))])[1]
    assert few["verdict"] == "inconclusive"
