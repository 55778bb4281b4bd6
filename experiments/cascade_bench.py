"""``python experiments/cascade_bench.py``: answers and prompt tokens, full documents vs
documents condensed by the KV Cascade condenser, on a small RAG QA set made here.

The set: documents of at least ``--min-doc-tokens`` tokens of real prose (the Python reference
shipped with every interpreter, ``kvshrink.testing.fixtures.real_kv.corpus_text``), each with
``--facts-per-doc`` made-up facts put between its paragraphs (codes, years, pressures, people's
names: checkable values the model cannot know). Each question asks for one fact; every question is
asked after all the documents, in one seeded order, so the answer sits in one of several
documents and the shared prompt prefix is prefilled once per setting (its KV cache copied for each
question, so only the question and the answer are computed per question). Nothing is downloaded.

The main model is SmolLM2-135M-Instruct run with transformers ``generate`` (greedy) in this
process, the same model as the condenser (the only one the project ships); vLLM is not involved,
so the figures are about what condensation keeps, not about serving. An answer *matches* when the
expected value appears, as whole words, in the generation (numbers compared without thousands
separators); *exact* when the generation's first line is the value and nothing else. *In context*
counts the questions whose answer is still in the (condensed) documents shown: what the condenser
kept, whatever the main model then makes of it.

Documents are condensed question-independently (the proxy's default: one condensation per document,
shared by every question), each document scored once for all ratios; ``--aware-ratios`` adds the
question-conditioned condensation per (document, question) at those ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

FIRST = ("Margaret", "Tomas", "Ingrid", "Kwame", "Priya", "Henrik", "Lucia", "Dmitri", "Amara", "Soren", "Yuki", "Elena")
LAST = ("Okonkwo", "Lindqvist", "Ferreira", "Haddad", "Nakamura", "Brandt", "Castellano", "Mbeki", "Novak", "Quinlan")
PLACES = ("Orion", "Vesper", "Kestrel", "Halcyon", "Meridian", "Tamarisk", "Sable", "Corvid", "Juniper", "Altair")
# (fact, question, answer): fields {p} {q} person, {a} place, {year}, {n3}, {n4} numbers
TEMPLATES = (
    ("The access code of the {a} vault is {n4}.", "What is the access code of the {a} vault?", "{n4}"),
    ("{p} {q} joined the {a} expedition in {year}.", "In which year did {p} {q} join the {a} expedition?", "{year}"),
    ("The {a} reactor runs at a pressure of {n3} kilopascals.",
     "At what pressure, in kilopascals, does the {a} reactor run?", "{n3}"),
    ("The head of the {a} laboratory is {p} {q}.", "Who is the head of the {a} laboratory?", "{p} {q}"),
)
SYSTEM = "Answer the question with the exact value from the documents and nothing else."


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    document: int  # index of the document holding the fact


def build_set(tokenizer: Any, documents: int, facts_per_doc: int, min_doc_tokens: int,
              seed: int = 17) -> tuple[list[str], list[Question]]:
    """Documents (in the order they are shown) with facts put in, and one question per fact."""
    from kvshrink.testing.fixtures.real_kv import corpus_text

    rng = random.Random(seed)
    blocks = [b.strip() for b in corpus_text("prose").split("\n\n") if len(b.strip()) > 200]
    docs: list[str] = []
    questions: list[Question] = []
    places = rng.sample(PLACES, len(PLACES))
    cursor = 30 + 997 * (seed - 17)  # each seed reads another part of the reference (17: the first set)
    for d in range(documents):
        paragraphs: list[str] = []
        tokens = 0
        while tokens < min_doc_tokens:  # paragraph by paragraph, + 1 for each separator
            paragraphs.append(blocks[cursor % len(blocks)])
            tokens += len(tokenizer(paragraphs[-1]).input_ids) + 1
            cursor += 1
        cursor += 25  # documents from different parts of the reference
        for f in range(facts_per_doc):
            n = d * facts_per_doc + f
            fact, question, answer = TEMPLATES[n % len(TEMPLATES)]
            values = {"p": rng.choice(FIRST), "q": rng.choice(LAST), "a": places[n % len(places)],
                      "year": str(rng.randint(1890, 2019)), "n3": str(rng.randint(120, 980)),
                      "n4": str(rng.randint(1000, 9999))}
            paragraphs.insert(rng.randint(1, len(paragraphs) - 1), fact.format(**values))
            questions.append(Question(question.format(**values), answer.format(**values), d))
        docs.append("\n\n".join(paragraphs))
    rng.shuffle(questions)
    return docs, questions


def _normalize(text: str) -> list[str]:
    return re.sub(r"(?<=\d),(?=\d{3})", "", text).lower().replace(".", " ").replace(",", " ").split()


def judge(generation: str, answer: str) -> tuple[bool, bool]:
    """(exact, match) for one generation."""
    got, want = _normalize(generation), _normalize(answer)
    lines = generation.strip().splitlines()
    match = any(got[i:i + len(want)] == want for i in range(len(got) - len(want) + 1))
    return bool(lines) and _normalize(lines[0]) == want, match


def rag_messages(documents: Sequence[str], question: str,
                 markers: tuple[str, str] | None = None) -> list[dict[str, str]]:
    """The set's chat: the SYSTEM line, then "Document i:" blocks and the question; each document
    between ``markers`` when given (the cascade proxy's, e.g. ``<doc>``), else bare."""
    begin, end = markers or ("", "")
    body = "\n\n".join(f"Document {i + 1}:\n{begin}{doc}{end}" for i, doc in enumerate(documents))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{body}\n\nQuestion: {question}"}]


def prompt_ids(tokenizer: Any, documents: list[str], question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(rag_messages(documents, question), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def answer_all(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[str], float]:
    """Greedy answers; the prompts' common prefix is prefilled once and its KV cache copied."""
    import copy

    import torch

    shared = min(len(p) for p in prompts) - 1
    while any(p[:shared] != prompts[0][:shared] for p in prompts):
        shared -= 1
    out, started = [], time.perf_counter()
    with torch.inference_mode():
        cache = model(torch.tensor([prompts[0][:shared]]), use_cache=True).past_key_values if shared > 0 else None
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       past_key_values=copy.deepcopy(cache), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=tokenizer.eos_token_id)
            out.append(tokenizer.decode(generated[0, len(ids):], skip_special_tokens=True))
    return out, time.perf_counter() - started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=3, help="documents in the set, all shown (default 3)")
    parser.add_argument("--facts-per-doc", type=int, default=2)
    parser.add_argument("--min-doc-tokens", type=int, default=1024)
    parser.add_argument("--sets", type=int, default=1,
                        help="independent sets (other documents, facts and order), seeds --seed, --seed + 1, ...")
    parser.add_argument("--seed", type=int, default=17, help="seed of the first set (default 17)")
    parser.add_argument("--ratios", default="0.7,0.5,0.3")
    parser.add_argument("--granularity", choices=("word", "sentence"), default="word")
    parser.add_argument("--aware-ratios", default="",
                        help="also condense per question at these ratios (e.g. 0.5; costs a pass per question)")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 documents, 2 facts each, ratio 0.5 only")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")


ACCURACY_TARGET = 0.9  # condensed accuracy / full-document accuracy at TARGET_RATIO (issue 17)
TARGET_RATIO = 0.5


def run_set(model: Any, tokenizer: Any, condenser: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One seeded set: its documents condensed at every ratio, every question answered under every
    setting. Per setting: counts, prompt tokens and each question's answer and verdicts."""
    ratios = [float(r) for r in args.ratios.split(",")]
    docs, questions = build_set(tokenizer, args.documents, args.facts_per_doc, args.min_doc_tokens, seed=seed)
    started = time.perf_counter()
    condensed = condenser.condense_many([(doc, None, r) for r in ratios for doc in docs])
    condense_s = time.perf_counter() - started
    print(f"set {seed}: condensed {len(docs)} documents at {len(ratios)} ratios in {condense_s:.1f} s", flush=True)
    variants: dict[str, list[list[str]]] = {"full": [docs] * len(questions)}
    for k, ratio in enumerate(ratios):
        variants[f"condensed {ratio}"] = [[c.text for c in condensed[k * len(docs):(k + 1) * len(docs)]]] * len(questions)
    aware_s = 0.0
    aware_ratios = [float(r) for r in args.aware_ratios.split(",")] if args.aware_ratios else []
    if aware_ratios:  # one call: each (document, question) scored once for every ratio
        started = time.perf_counter()
        items = [(doc, q.text, ratio) for ratio in aware_ratios for q in questions for doc in docs]
        texts = iter(c.text for c in condenser.condense_many(items))
        for ratio in aware_ratios:
            variants[f"question-aware {ratio}"] = [[next(texts) for _ in docs] for _ in questions]
        aware_s = time.perf_counter() - started
        print(f"set {seed}: condensed per question in {aware_s:.1f} s", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for name, contexts in variants.items():
        prompts = [prompt_ids(tokenizer, context, q.text) for q, context in zip(questions, contexts)]
        generations, seconds = answer_all(model, tokenizer, prompts, args.max_new_tokens)
        verdicts = [judge(g, q.answer) for g, q in zip(generations, questions)]
        shown = [q.answer in "\n".join(context) for q, context in zip(questions, contexts)]
        rows[name] = {"prompt_tokens": sum(len(p) for p in prompts), "answer_seconds": seconds,
                      "answers": [{"question": q.text, "expected": q.answer, "got": g, "exact": e, "match": m,
                                   "in_context": k}
                                  for q, g, (e, m), k in zip(questions, generations, verdicts, shown)]}
        print(f"set {seed} {name:>22}: answer in context {sum(shown)}/{len(questions)}, "
              f"match {sum(m for _, m in verdicts)}/{len(questions)}, "
              f"prompt tokens {rows[name]['prompt_tokens']}, {seconds:.1f} s", flush=True)
    return {"seed": seed, "document_tokens": [len(tokenizer(d).input_ids) for d in docs], "questions": len(questions),
            "question_independent_seconds": condense_s, "question_aware_seconds": aware_s, "settings": rows}


def summarize(sets: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting over all sets: counts, accuracy and its ratio to the full documents' (paired by
    question, 95 % bootstrap), prompt tokens and their ratio to full. At :data:`TARGET_RATIO` the
    row carries the target's verdict (only where the interval clears it)."""
    from kvshrink.benchmarks.paired_stats import ratio_of_sums, verdict

    def column(name: str, field: str) -> list[float]:
        return [float(a[field]) for s in sets for a in s["settings"][name]["answers"]]

    full_match = column("full", "match")
    full_tokens = sum(s["settings"]["full"]["prompt_tokens"] for s in sets)
    rows = []
    for name in sets[0]["settings"]:
        match, exact = column(name, "match"), column(name, "exact")
        tokens = sum(s["settings"][name]["prompt_tokens"] for s in sets)
        row: dict[str, Any] = {"setting": name, "questions": len(match),
                               "answers_in_context": int(sum(column(name, "in_context"))), "match": int(sum(match)),
                               "exact": int(sum(exact)), "accuracy": sum(match) / max(1, len(match)),
                               "prompt_tokens": tokens, "prompt_tokens_vs_full": tokens / max(1, full_tokens),
                               "answer_seconds": sum(s["settings"][name]["answer_seconds"] for s in sets)}
        if name != "full" and sum(full_match):
            row["accuracy_vs_full"] = ratio_of_sums(match, full_match)
            if name.endswith(f" {TARGET_RATIO}"):
                row["target"] = ACCURACY_TARGET
                row["verdict"] = verdict(row["accuracy_vs_full"], ACCURACY_TARGET, higher_is_better=True)
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvshrink.cascade.condenser import Condenser, CondenserConfig
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    if args.quick:
        args.documents, args.facts_per_doc, args.ratios, args.sets = 2, 2, "0.5", 1
    load_before = os.getloadavg()
    path = str(ensure_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    condenser = Condenser(CondenserConfig(model_path=path, granularity=args.granularity))
    sets = [run_set(model, tokenizer, condenser, args, args.seed + i) for i in range(args.sets)]
    rows = summarize(sets)
    for row in rows:
        vs = row.get("accuracy_vs_full")
        against = (f", vs full {vs['value']:.2f} (95 % {vs['low']:.2f}-{vs['high']:.2f})" if vs else "")
        print(f"{row['setting']:>22}: answer in context {row['answers_in_context']}/{row['questions']}, "
              f"match {row['match']}/{row['questions']} ({row['accuracy']:.1%}){against}"
              f"{', ' + row['verdict'] if 'verdict' in row else ''}; prompt tokens {row['prompt_tokens_vs_full']:.2f}x",
              flush=True)
    report = {"machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "main_model": "SmolLM2-135M-Instruct, transformers generate (greedy), float32 CPU",
              "condenser": {"granularity": args.granularity, "window_tokens": condenser.config.window_tokens},
              "set": {"sets": args.sets, "first_seed": args.seed, "documents": args.documents,
                      "facts_per_doc": args.facts_per_doc, "min_doc_tokens": args.min_doc_tokens,
                      "questions": sum(s["questions"] for s in sets)},
              "summary": rows, "sets": sets}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
