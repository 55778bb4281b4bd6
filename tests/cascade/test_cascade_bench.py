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
