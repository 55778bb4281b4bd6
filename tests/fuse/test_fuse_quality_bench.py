"""The KV Fuse quality benchmark: its RAG set, and a tiny run end to end (the figures are the
benchmark's, not CI's)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvshrink.benchmarks.fuse_quality import build_set, main
from kvshrink.fuse.index import split_at_separator


def test_the_set_reuses_documents_of_real_text_in_varying_order(tokenizer: Any) -> None:
    rag = build_set(tokenizer, documents=8, questions=24, per_question=(3, 6), doc_tokens=(200, 480))
    assert len(rag.questions) == 24 and all(200 <= len(d) <= 800 for d in rag.documents)
    for q in rag.questions:
        assert 3 <= len(q.documents) <= 6 and q.target in q.documents and len(set(q.documents)) == len(q.documents)
        holders = [d for d, text in enumerate(rag.document_texts) if q.answer in text]
        assert holders == [q.target], (q, holders)  # the fact sits in its document only
    places = Counter((d, q.documents.index(d)) for q in rag.questions for d in q.documents)
    by_doc = Counter(d for d, _ in places)
    assert max(by_doc.values()) >= 2  # documents recur at different positions
    prompt, placed = rag.prompt(0)
    for start, d in placed:
        assert prompt[start:start + len(rag.documents[d])] == rag.documents[d]
    runs = split_at_separator(prompt, rag.separator)  # a server can cut the prompt into documents
    assert [prompt[s:e] for s, e in runs[1:-1]] == [rag.documents[d] for _, d in placed]
    assert build_set(tokenizer, 8, 24, (3, 6), (200, 480)) == rag  # seeded


def test_a_tiny_run_reports_every_setting(tmp_path: Path) -> None:
    out = tmp_path / "fuse.json"
    assert main(["--documents", "3", "--questions", "1", "--per-question", "3,3", "--doc-tokens", "200,210",
                 "--ratios", "0,1", "--max-new-tokens", "6", "--history", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["setting"]: r for r in report["rows"]}
    assert set(rows) == {"full", "fuse r=0", "fuse r=1"}
    assert rows["full"]["positions"] == rows["fuse r=1"]["positions"] > 0
    assert rows["fuse r=1"]["top1_agreement"] == 1.0 and rows["fuse r=1"]["answer_agreement"] == 1.0
    assert rows["fuse r=1"]["mean_kl"] < 1e-2
    assert rows["fuse r=0"]["tokens_computed_vs_full"] < 0.1  # only the gaps
    assert rows["fuse r=1"]["reused_tokens"] == sum(report["set"]["document_tokens"])
    assert set(report["reuse_from_history"]) == {"stock_prefix", "history-docs", "history-windows"}


def test_an_oracle_row_computes_what_its_ratio_computes(tmp_path: Path) -> None:
    out = tmp_path / "oracle.json"
    assert main(["--documents", "3", "--questions", "1", "--per-question", "3,3", "--doc-tokens", "200,210",
                 "--ratios", "0,0.5", "--oracle", "--max-new-tokens", "6", "--json", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "fuse r=0", "fuse r=0.5", "oracle r=0.5"}  # no oracle at 0: it picks no one
    assert rows["oracle r=0.5"]["tokens_computed"] == rows["fuse r=0.5"]["tokens_computed"]
    assert rows["oracle r=0.5"]["recomputed_tokens"] == rows["fuse r=0.5"]["recomputed_tokens"] > 0


def test_the_oracle_ranks_by_deviation_from_full_prefill_in_every_layer() -> None:
    import torch

    from kvshrink.benchmarks.fuse_quality import oracle_priority

    full = torch.randn(2, 3, 5, 4)
    reused = full.clone()
    reused[1, 2, 1] += 0.5  # a small error at position 1, in V of layer 2
    reused[1, 2, 3] += 3.0  # a larger one at position 3
    reused[0, 1] += 10.0  # every position equally wrong in K of layer 1: it ranks no one
    priority = oracle_priority(reused.to(torch.bfloat16), full.to(torch.bfloat16))
    assert priority.shape == (5,)
    assert priority.argsort(descending=True)[:2].tolist() == [3, 1]
