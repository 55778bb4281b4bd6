"""``python experiments/fuse_quality.py``: how close KV Fuse's prompt KV is to a full
prefill's, on a RAG set made here (SmolLM2-135M-Instruct, transformers weights, CPU; no vLLM).

The set (:func:`build_set`): ``--documents`` documents of real prose (the Python reference shipped
with every interpreter, ``kvshrink.testing.fixtures.real_kv.corpus_text``), 200-800 tokens each
(``--doc-tokens`` is the target a document's paragraphs must reach; the last paragraph overshoots),
each with two made-up checkable facts put between its paragraphs ("The access code of the Orion
vault is 4719."); no answer occurs anywhere else in the set. Each of ``--questions`` questions
shows ``--per-question`` (3-6 by default, the issue allows 3-8) documents of the pool in a seeded
random order and asks for one fact of one of them, so documents recur across questions at varying
positions. A prompt is ``system header | SEP | doc | SEP | doc ... | SEP | question + assistant
header`` as token ids (documents tokenized once, so a document has the same tokens everywhere);
SEP is a fixed separator (``--separator``) on which a server can split prompts into documents.

Settings, per question, all over the same token ids:
* ``full``: the ordinary prefill (the reference);
* ``fuse r=R``: the header's KV is an exact prefix; every document's KV comes from a separate earlier
  computation (the document right after the header, as a first request would have cached it),
  found by :class:`kvshrink.fuse.index.ContentIndex` and re-rotated to its new position; separators
  and the question are gaps; R of the reused tokens recomputed after the check layer (CacheBlend).
  ``r=0`` is re-rotation only;
* ``oracle r=R`` (``--oracle``): the same fusion, but the R of reused tokens recomputed are those
  whose re-rotated KV deviates most from the full prefill's (summed over K and V of every layer,
  each layer scaled by its mean): a selection no server can make, since it needs the full prefill.
  It bounds what any choice of which R to recompute can reach with this model;
* ``history-docs`` / ``history-windows`` (``--history``, at ``--history-ratio``): what a server
  that only has the KV of the earlier questions' prompts would reuse: documents cut from those
  prompts at the separators, or LMCache's fixed 256-token chunks of them found at any offset.

Figures: next-token top-1 agreement with ``full`` and mean KL(full || setting) over every position
of full's greedy answer (teacher-forced: the answer's tokens are fed on top of each setting's KV);
answer agreement (the setting's own greedy answer equals full's) and match (the planted value is
in the answer, as whole words); tokens computed (token-layers / layers: a FLOP proxy, attention
aside) and wall seconds of building the prompt KV, against full. A 95 % Wilson interval is given
for agreements: a setting "matches full within noise" when its interval contains 100 %.

Compute: float32 math on the bf16 checkpoint's weights, KV rounded to bf16 (what vLLM stores), one
torch thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cascade_bench import FIRST, LAST, TEMPLATES, judge

PLACES = ("Orion", "Vesper", "Kestrel", "Halcyon", "Meridian", "Tamarisk", "Sable", "Corvid", "Juniper", "Altair",
          "Borealis", "Cinder", "Dunmore", "Elmstead", "Foxglove", "Greywater", "Harrow", "Islay", "Jarrah",
          "Kilnsey", "Larkspur", "Marlow", "Northgate", "Oxbow", "Pellam", "Quarry", "Rowan", "Saltmarsh",
          "Thornbury", "Umber", "Valmont", "Wexford")
SYSTEM = "Answer the question with the exact value from the documents."
SEPARATOR = "\n\n#####\n\n"
RATIOS = (0.0, 0.05, 0.15, 0.30)


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    documents: tuple[int, ...]  # indices into the pool, in the order shown
    target: int  # the pool document holding the fact


@dataclass
class RagSet:
    header: list[int]  # chat template up to the user's content
    separator: list[int]
    documents: list[list[int]]
    document_texts: list[str]
    questions: list[Question]
    question_ids: list[list[int]]  # "Question: ..." + end of turn + assistant header

    def prompt(self, q: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of question ``q``'s prompt and ``(start, pool index)`` of each document."""
        ids = list(self.header)
        placed = []
        for d in self.questions[q].documents:
            ids += self.separator
            placed.append((len(ids), d))
            ids += self.documents[d]
        ids += self.separator + self.question_ids[q]
        return ids, placed


def build_set(tokenizer: Any, documents: int = 20, questions: int = 56, per_question: tuple[int, int] = (3, 6),
              doc_tokens: tuple[int, int] = (200, 480), seed: int = 15) -> RagSet:
    from kvshrink.testing.fixtures.real_kv import corpus_text

    if documents * 2 > len(PLACES) * len(TEMPLATES):
        raise ValueError("not enough distinct facts for that many documents")
    rng = random.Random(seed)
    blocks = [b.strip() for b in corpus_text("prose").split("\n\n") if 200 < len(b.strip()) < 1000]
    facts: list[tuple[str, str, int]] = []  # (question, answer, document)
    names = rng.sample(PLACES, len(PLACES))
    cursor = 40
    bodies: list[list[str]] = []
    for d in range(documents):  # real paragraphs first, then the facts put into them
        target = rng.randint(*doc_tokens)
        paragraphs: list[str] = []
        tokens = 0
        while tokens < target:
            paragraphs.append(blocks[cursor % len(blocks)])
            tokens += len(tokenizer(paragraphs[-1]).input_ids) + 1
            cursor += 1
        cursor += 17
        bodies.append(paragraphs)
    base = "\n".join(p for body in bodies for p in body)
    used: set[str] = set()  # answers so far
    sentences: list[str] = []  # facts so far
    for d, paragraphs in enumerate(bodies):
        for f in range(2):
            n = 2 * d + f
            fact, question, answer = TEMPLATES[n % len(TEMPLATES)]
            while True:  # an answer found nowhere else: not in the prose, not another fact's
                values = {"p": rng.choice(FIRST), "q": rng.choice(LAST), "a": names[(n // len(TEMPLATES)) % len(names)],
                          "year": str(rng.randint(1890, 2019)), "n3": str(rng.randint(120, 980)),
                          "n4": str(rng.randint(1000, 9999))}
                value, sentence = answer.format(**values), fact.format(**values)
                if (value not in base and not any(value in other for other in sentences)
                        and not any(u in sentence for u in used)):
                    break
            used.add(value)
            sentences.append(sentence)
            paragraphs.insert(rng.randint(0, len(paragraphs)), sentence)
            facts.append((question.format(**values), value, d))
    texts = ["\n\n".join(body) for body in bodies]
    docs = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    for d, ids in enumerate(docs):
        if len(ids) > 800:
            raise ValueError(f"document {d} has {len(ids)} tokens (> 800)")
    header, tail = _template(tokenizer)
    qs, q_ids = [], []
    for i in range(questions):
        question, answer, target = facts[rng.randrange(len(facts))] if i >= len(facts) else facts[(i * 7) % len(facts)]
        others = [d for d in range(documents) if d != target]
        k = rng.randint(*per_question)
        shown = rng.sample(others, k - 1) + [target]
        rng.shuffle(shown)
        qs.append(Question(question, answer, tuple(shown), target))
        q_ids.append(tokenizer(f"Question: {question}", add_special_tokens=False).input_ids + tail)
    sep = tokenizer(SEPARATOR, add_special_tokens=False).input_ids
    return RagSet(header, sep, docs, texts, qs, q_ids)


def _template(tokenizer: Any) -> tuple[list[int], list[int]]:
    marker = "\u2063CONTENT\u2063"
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": marker}],
                                         add_generation_prompt=True, tokenize=False)
    before, after = text.split(marker)
    return (tokenizer(before, add_special_tokens=False).input_ids, tokenizer(after, add_special_tokens=False).input_ids)


# --------------------------------------------------------------------------- model runs
def greedy(engine: Any, kv: Any, first_logits: Any, prompt: list[int], max_new: int, stop: set[int]) -> list[int]:
    """Greedy tokens after ``prompt`` whose KV is ``kv``; the first from ``first_logits``."""
    import torch

    buf = torch.cat([kv, engine.empty_kv(max_new)], dim=2)
    ids, out = list(prompt), []
    token = int(first_logits.argmax())
    while True:
        out.append(token)
        if token in stop or len(out) >= max_new:
            return out
        ids.append(token)
        pos = len(ids) - 1
        token = int(engine.run(ids, buf, [pos], logits_at=[pos]).logits[0].argmax())


def follow(engine: Any, kv: Any, first_logits: Any, prompt: list[int], reference: list[int], max_new: int,
           stop: set[int]) -> tuple[Any, list[int]]:
    """Logits at every position of ``reference`` teacher-forced over ``kv`` (``[len(reference), V]``),
    and the setting's own greedy answer. The own answer equals ``reference`` up to the first position
    whose argmax differs, so it is decoded freely only from there (same result as decoding it from
    scratch, at a fraction of the cost)."""
    import torch

    buf = torch.cat([kv, engine.empty_kv(max_new)], dim=2)
    n = len(prompt)
    logits = first_logits[None]
    if len(reference) > 1:
        positions = list(range(n, n + len(reference) - 1))
        rest = engine.run(prompt + reference[:-1], buf, positions, logits_at=positions).logits
        logits = torch.cat([logits, rest])
    picks = logits.argmax(-1).tolist()
    differ = next((i for i, (a, b) in enumerate(zip(picks, reference)) if a != b), None)
    if differ is None:
        return logits, list(reference)
    own = reference[:differ] + [picks[differ]]
    ids = prompt + own
    while own[-1] not in stop and len(own) < max_new:
        pos = len(ids) - 1
        token = int(engine.run(ids, buf, [pos], logits_at=[pos]).logits[0].argmax())
        own.append(token)
        ids.append(token)
    return logits, own


def oracle_priority(reused_kv: Any, full_kv: Any) -> Any:
    """Per position: how far ``reused_kv`` (``[2, L, T, W]``, the prompt's KV as fusion starts from
    it) is from ``full_kv`` (the full prefill's), as squared error summed over K and V of every
    layer, each (K or V, layer) scaled by its mean over the positions so no layer dominates."""
    err = ((reused_kv.float() - full_kv.float()) ** 2).sum(-1)  # [2, L, T]
    return (err / err.mean(dim=-1, keepdim=True).clamp_min(1e-12)).sum(dim=(0, 1))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, mid - half), min(1.0, mid + half))


class Tally:
    def __init__(self) -> None:
        self.top1 = self.positions = self.agree = self.match = self.questions = 0
        self.kl = 0.0
        self.token_layers = self.seconds = 0.0
        self.reused = self.recomputed = 0

    def row(self, name: str, layers: int, full: "Tally") -> dict:
        lo, hi = wilson(self.top1, self.positions)
        alo, ahi = wilson(self.agree, self.questions)
        return {"setting": name, "questions": self.questions, "positions": self.positions,
                "top1_agreement": self.top1 / max(1, self.positions), "top1_ci95": [lo, hi],
                "mean_kl": self.kl / max(1, self.positions),
                "answer_agreement": self.agree / max(1, self.questions), "answer_agreement_ci95": [alo, ahi],
                "answer_match": self.match / max(1, self.questions),
                "tokens_computed": self.token_layers / layers,
                "tokens_computed_vs_full": self.token_layers / max(1.0, full.token_layers),
                "reused_tokens": self.reused, "recomputed_tokens": self.recomputed,
                "seconds": self.seconds, "seconds_vs_full": self.seconds / max(1e-9, full.seconds),
                "within_noise": hi >= 1.0 and ahi >= 1.0}


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from kvshrink.fuse.engine import FuseEngine, ReusedSegment
    from kvshrink.fuse.index import ContentIndex, coverage, fixed_windows, split_at_separator
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    torch.set_num_threads(args.threads)
    if args.quick:
        args.documents, args.questions, args.max_new_tokens = 6, 4, 20
        args.per_question, args.doc_tokens = "3,4", "200,260"
        args.history = args.history_quality = True
    started_all = time.perf_counter()
    load_before = os.getloadavg()
    path = str(ensure_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = FuseEngine.from_pretrained(path)
    layers = engine.num_layers
    per_q = tuple(int(x) for x in args.per_question.split(","))
    doc_tok = tuple(int(x) for x in args.doc_tokens.split(","))
    rag = build_set(tokenizer, args.documents, args.questions, per_q, doc_tok, seed=args.seed)
    ratios = [float(r) for r in args.ratios.split(",")]
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    header_kv = engine.prefill(rag.header).kv

    # every document computed once, right after the header (what a first request caches)
    t0 = time.perf_counter()
    store = ContentIndex(anchor=args.anchor)
    doc_kv = {}
    for d, ids in enumerate(rag.documents):
        kv = engine.extend(header_kv, rag.separator + ids, logits_at=[-1]).kv
        start = len(rag.header) + len(rag.separator)
        doc_kv[("doc", d)] = kv[:, :, start:].clone()
        store.add(("doc", d), ids, start)
    docs_s = time.perf_counter() - t0
    print(f"{len(rag.documents)} documents ({min(map(len, rag.documents))}-{max(map(len, rag.documents))} tokens) "
          f"computed once in {docs_s:.1f} s; {len(rag.questions)} questions", flush=True)

    names = ["full"] + [f"fuse r={r:g}" for r in ratios]
    oracle_ratios = [r for r in ratios if 0 < r < 1] if args.oracle else []  # 0 and 1 pick no one
    names += [f"oracle r={r:g}" for r in oracle_ratios]
    if args.history and args.history_quality:
        names += [f"history-docs r={args.history_ratio:g}", f"history-windows r={args.history_ratio:g}"]
    tallies = {n: Tally() for n in names}
    history: list[tuple[list[int], Any]] = []  # (prompt ids, full KV) of earlier questions
    reuse = {"stock_prefix": 0, "history-docs": 0, "history-windows": 0, "document_tokens": 0}
    samples = []
    for qi, question in enumerate(rag.questions):
        prompt, placed = rag.prompt(qi)
        t = time.perf_counter()
        full = engine.prefill(prompt)
        tallies["full"].seconds += time.perf_counter() - t
        tallies["full"].token_layers += full.token_layers
        ref_answer = greedy(engine, full.kv, full.logits[0], prompt, args.max_new_tokens, stop)
        ref_logp = torch.log_softmax(follow(engine, full.kv, full.logits[0], prompt, ref_answer,
                                            args.max_new_tokens, stop)[0], -1)
        ref_text = tokenizer.decode(ref_answer, skip_special_tokens=True).strip()
        runs: dict[str, tuple[Any, float]] = {}
        matches = store.match(prompt, start=len(rag.header))
        segs = [ReusedSegment(m.start, m.source_start, doc_kv[m.key]) for m in matches]
        for r in ratios:
            t = time.perf_counter()
            runs[f"fuse r={r:g}"] = (engine.fuse(prompt, segs, r, check_layer=args.check_layer, prefix_kv=header_kv),
                                     time.perf_counter() - t)
        if oracle_ratios:
            # reused KV as a server has it: the r=0 fusion, already run when 0 is among the ratios
            rerotated = runs["fuse r=0"][0] if "fuse r=0" in runs else engine.fuse(prompt, segs, 0.0, prefix_kv=header_kv)
            priority = oracle_priority(rerotated.kv, full.kv)
            for r in oracle_ratios:
                t = time.perf_counter()
                runs[f"oracle r={r:g}"] = (engine.fuse(prompt, segs, r, check_layer=args.check_layer,
                                                       prefix_kv=header_kv, priority=priority),
                                           time.perf_counter() - t)
        if args.history:
            doc_tokens = sum(len(rag.documents[d]) for _, d in placed)
            reuse["document_tokens"] += doc_tokens
            reuse["stock_prefix"] += _stock_prefix(prompt, [h for h, _ in history], 256, len(rag.header))
            for mode in ("history-docs", "history-windows"):
                index, kvs = ContentIndex(anchor=args.anchor), {}
                for j, (ids, kv) in enumerate(history[-args.history_depth:]):
                    cuts = (split_at_separator(ids, rag.separator) if mode == "history-docs" else fixed_windows(ids, 256))
                    for c, (s, e) in enumerate(cuts):
                        if index.add((j, c), ids[s:e], s):
                            kvs[(j, c)] = (kv, s, e)
                found = index.match(prompt, start=len(rag.header))
                reuse[mode] += coverage(found)
                if not args.history_quality:
                    continue
                hsegs = [ReusedSegment(m.start, m.source_start, kvs[m.key][0][:, :, kvs[m.key][1]:kvs[m.key][2]])
                         for m in found]
                t = time.perf_counter()
                runs[f"{mode} r={args.history_ratio:g}"] = (
                    engine.fuse(prompt, hsegs, args.history_ratio, check_layer=args.check_layer, prefix_kv=header_kv),
                    time.perf_counter() - t)
            history.append((prompt, full.kv if args.history_quality else None))
            history = history[-args.history_depth:]
        ft = tallies["full"]
        ft.questions += 1
        ft.positions += len(ref_answer)
        ft.top1 += len(ref_answer)
        ft.agree += 1
        ft.match += judge(ref_text, question.answer)[1]
        sample = {"question": question.text, "expected": question.answer, "documents": len(placed),
                  "prompt_tokens": len(prompt), "full": ref_text}
        for name, (res, seconds) in runs.items():
            tl = tallies[name]
            logits, own = follow(engine, res.kv, res.logits[0], prompt, ref_answer, args.max_new_tokens, stop)
            logp = torch.log_softmax(logits, -1)
            tl.positions += len(ref_answer)
            tl.top1 += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
            tl.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            text = tokenizer.decode(own, skip_special_tokens=True).strip()
            tl.questions += 1
            tl.agree += int(own == ref_answer)
            tl.match += judge(text, question.answer)[1]
            tl.token_layers += res.token_layers
            tl.seconds += seconds
            tl.reused += res.reused_tokens
            tl.recomputed += res.recomputed_tokens
            sample[name] = text
        samples.append(sample)
        if args.json:  # after every question, so that a run cut short still leaves its figures
            _write(args.json, {"partial": True, "questions_done": qi + 1,
                               "rows": [tallies[n].row(n, layers, tallies["full"]) for n in names], "samples": samples})
        print(f"q{qi} ({len(prompt)} tokens, {len(placed)} docs): full {ref_text[:40]!r} | "
              + " | ".join(f"{n.split()[-1] if n.startswith('fuse') else n}: {'=' if sample[n] == ref_text else sample[n][:30]!r}"
                           for n in runs), flush=True)

    rows = [tallies[n].row(n, layers, tallies["full"]) for n in names]
    print(f"\n{'setting':>24} {'top-1':>7} {'(95% CI)':>15} {'KL':>8} {'agree':>6} {'match':>6} "
          f"{'tokens':>7} {'seconds':>8}")
    for r in rows:
        print(f"{r['setting']:>24} {r['top1_agreement']:7.1%} ({r['top1_ci95'][0]:.3f}-{r['top1_ci95'][1]:.3f}) "
              f"{r['mean_kl']:8.4f} {r['answer_agreement']:6.1%} {r['answer_match']:6.1%} "
              f"{r['tokens_computed_vs_full']:7.1%} {r['seconds_vs_full']:8.1%}")
    positions = rows[0]["positions"]
    total_s = time.perf_counter() - started_all
    report = {"machine": {"cpus": os.cpu_count(), "threads": args.threads, "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg()},
              "model": "SmolLM2-135M-Instruct (bf16 checkpoint), float32 math, bf16 KV, FuseEngine",
              "set": {"documents": len(rag.documents), "document_tokens": [len(d) for d in rag.documents],
                      "questions": len(rag.questions), "positions": positions,
                      "mean_prompt_tokens": sum(s["prompt_tokens"] for s in samples) / max(1, len(samples))},
              "settings": {"check_layer": args.check_layer, "anchor": args.anchor, "ratios": ratios,
                           "oracle": args.oracle,
                           "history_depth": args.history_depth if args.history else 0},
              "rows": rows, "seconds": {"documents": docs_s, "total": total_s}, "samples": samples}
    if args.history and reuse["document_tokens"]:
        report["reuse_from_history"] = {k: v / reuse["document_tokens"] for k, v in reuse.items() if k != "document_tokens"}
        print("document tokens reusable from the earlier prompts' KV: "
              + ", ".join(f"{k} {v:.1%}" for k, v in report["reuse_from_history"].items()))
    print(f"{positions} positions, total {total_s:.0f} s")
    if args.json:
        _write(args.json, report)
        print(f"wrote {args.json}")
    return 0


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def _stock_prefix(prompt: list[int], earlier: list[list[int]], chunk: int, header: int) -> int:
    """Document tokens stock LMCache reuses: the longest common prefix with an earlier prompt, in
    whole chunks, less the header every prompt shares."""
    best = header
    for ids in earlier:
        n = 0
        limit = min(len(ids), len(prompt))
        while n < limit and ids[n] == prompt[n]:
            n += 1
        best = max(best, n // chunk * chunk)
    return best - header


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=20, help="documents in the pool (default 20)")
    parser.add_argument("--questions", type=int, default=56)
    parser.add_argument("--per-question", default="3,6", help="documents shown per question, min,max")
    parser.add_argument("--doc-tokens", default="200,480", help="document length target, min,max (<= 800)")
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS))
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--anchor", type=int, default=16)
    parser.add_argument("--oracle", action="store_true",
                        help="also recompute the tokens that deviate most from the full prefill's KV (a bound, "
                             "not a server's selection): rows 'oracle r=R'")
    parser.add_argument("--history", action="store_true",
                        help="also reuse from the earlier questions' prompts: documents split at the separator "
                             "vs fixed 256-token windows")
    parser.add_argument("--history-quality", action="store_true",
                        help="with --history, also fuse from those segments and measure quality (two more fusions a question)")
    parser.add_argument("--history-ratio", type=float, default=0.15)
    parser.add_argument("--history-depth", type=int, default=12, help="earlier prompts whose KV is kept")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="6 documents, 4 questions: a few minutes")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
