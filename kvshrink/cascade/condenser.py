"""The condenser: a small causal LM scores a document and the least informative words are dropped.

Method (the LLMLingua / LongLLMLingua family, extractive): every token of the document gets its
self-information ``-log p(token | preceding text)`` under the small model; with a question, the
contrast of LongLLMLingua is added, ``w * (log p(token | question, preceding) - log p(token |
preceding))``, so the words the question makes expected count more (per word, and per sentence
added to each of its words). Scores are averaged per unit (:mod:`kvshrink.cascade.units`: whole
words or sentences, never parts of a token run), and units are kept by score density (mean score
per token, the fractional-knapsack order) until the kept units cost ``ratio`` of the document's
tokens; the joined text is re-tokenized and the budget corrected a few times, so the ratio holds
for the text itself. Protected words (numbers, names) go first.

A document longer than one window is scored in windows of ``window_tokens`` that overlap by
``overlap_tokens``: each window's first ``overlap_tokens`` only give context, every token is
scored once. The windows of all documents of one call run as batched forward passes (rows padded
on the right, at most ``max_batch_tokens`` tokens a pass); the vocabulary projection runs in slices
of positions, so memory stays ``O(slice x vocabulary)`` instead of ``O(tokens x vocabulary)``.

Ratios count tokens of the condenser's tokenizer (the main model's when both are one family, as
SmolLM2 is for our stack). Deterministic: scores are rounded to 1/1024 nat before ranking and ties
go to the earlier unit, so a document condenses the same alone or batched with others, for a given
model, settings and torch build (tests/cascade check it).

Threads: ``condense_many`` may be called from any thread; calls run one at a time (a lock: two
forward passes at once only compete for the same cores). Errors: a bad setting is a ConfigError
naming it; a model folder that cannot be loaded is a ConfigError on ``model_path``.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvshrink.cascade import units as unit_split
from kvshrink.errors import ConfigError

CONDENSER_VERSION = 1  # bump whenever the output for the same model and settings changes
_SCORE_QUANTUM = 1024.0  # scores are rounded to 1/1024 nat before ranking (see module docstring)
_HEAD_SLICE = 256  # positions projected onto the vocabulary at once
_BUDGET_ROUNDS = 4  # selections tried to land on the ratio (each re-tokenizes the result)


@dataclass(frozen=True)
class CondenserConfig:
    """Settings of one condenser. All but ``model_path``, ``threads``, ``dtype`` and
    ``max_batch_tokens`` enter the condensation cache key (through :attr:`Condenser.fingerprint`)."""

    model_path: str
    ratio: float = 0.5  # kept tokens / document tokens, when a call gives none
    granularity: str = "word"
    window_tokens: int = 1024
    overlap_tokens: int = 64
    question_tokens: int = 128  # a question is cut to its last this many tokens
    question_weight: float = 1.0
    min_document_tokens: int = 64  # shorter documents are returned unchanged
    max_batch_tokens: int = 8192
    dtype: str = "float32"  # bfloat16 matmuls are slow on CPUs without AMX / AVX512-BF16
    threads: int | None = None  # torch intra-op threads; None leaves torch's setting alone

    def __post_init__(self) -> None:
        checks = [("ratio", 0 < self.ratio <= 1, "must be in (0, 1]"),
                  ("granularity", self.granularity in unit_split.GRANULARITIES,
                   f"must be one of {unit_split.GRANULARITIES}"),
                  ("window_tokens", self.window_tokens >= 16, "must be at least 16"),
                  ("overlap_tokens", 0 <= self.overlap_tokens <= self.window_tokens // 2,
                   "must be between 0 and half of window_tokens"),
                  ("question_tokens", self.question_tokens >= 0, "must not be negative"),
                  ("min_document_tokens", self.min_document_tokens >= 0, "must not be negative"),
                  ("max_batch_tokens", self.max_batch_tokens >= self.window_tokens + self.question_tokens + 8,
                   "must hold at least one window with its question"),
                  ("dtype", self.dtype in ("float32", "bfloat16"), "must be float32 or bfloat16"),
                  ("threads", self.threads is None or self.threads >= 1, "must be at least 1")]
        for key, ok, reason in checks:
            if not ok:
                raise ConfigError(f"cascade.{key}", f"{reason}, got {getattr(self, key)!r}")

    def output_settings(self) -> dict[str, Any]:
        """The settings that change what a document condenses to."""
        ignored = {"model_path", "threads", "dtype", "max_batch_tokens", "ratio"}
        return {k: v for k, v in asdict(self).items() if k not in ignored}


@dataclass(frozen=True)
class Condensation:
    """What a document became. ``windows`` is the number of windows it was scored in (0: returned
    unchanged, too short or ratio 1); token counts are the condenser tokenizer's."""

    text: str
    tokens_in: int
    tokens_out: int
    ratio: float
    question_aware: bool
    windows: int


@dataclass
class _Doc:
    """One distinct (text, question) of a call, scored once for every ratio asked of it."""

    text: str
    question: str | None
    wanted: bool = False  # some ratio below 1 was asked
    ids: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)
    base: np.ndarray | None = None  # per-token -log p without the question
    cond: np.ndarray | None = None  # per-token -log p after the question
    windows: int = 0


@dataclass
class _Row:
    """One forward-pass row: ``prefix + ids[start:stop]``, scoring document tokens ``first..stop``."""

    doc: _Doc
    conditioned: bool
    ids: list[int]
    first: int  # first document token scored by this row
    start: int
    stop: int


def model_fingerprint(model_path: str | Path) -> str:
    """A digest of the model folder's config, tokenizer and weights (their names, sizes and first
    and last MiB): a cache entry written by another model is never reused."""
    folder = Path(model_path)
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.suffix in (".json", ".jinja", ".txt", ".model"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".gguf"):
            size = path.stat().st_size
            with open(path, "rb") as handle:
                head = handle.read(1 << 20)
                handle.seek(max(size - (1 << 20), 0))
                tail = handle.read(1 << 20)
            digest.update(f"{path.name}\0{size}\0".encode() + head + tail)
    return digest.hexdigest()


class Condenser:
    """SmolLM2-class causal LM on the CPU, loaded once, condensing documents in batches."""

    def __init__(self, config: CondenserConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(config.model_path)
            self._model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=getattr(torch, config.dtype))
        except (OSError, ValueError) as exc:
            raise ConfigError("cascade.model_path", f"cannot load a causal LM from {config.model_path!r}: {exc}") \
                from exc
        if not self._tokenizer.is_fast:
            raise ConfigError("cascade.model_path", "the condenser needs a fast tokenizer (character offsets)")
        self._model.eval()
        self._torch = torch
        limit = getattr(self._model.config, "max_position_embeddings", None) or 2048
        if config.window_tokens + config.question_tokens + 8 > limit:
            raise ConfigError("cascade.window_tokens", f"window_tokens + question_tokens must fit the model's "
                                                       f"{limit}-token context")
        bos = self._tokenizer.bos_token_id
        self._prefix = [bos if bos is not None else self._tokenizer.eos_token_id]
        self._separator = self._tokenizer("\n\n", add_special_tokens=False).input_ids
        self._pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else self._prefix[0]
        self._lock = threading.RLock()  # also around the tokenizer: a fast tokenizer is not re-entrant
        settings = json.dumps({"version": CONDENSER_VERSION, "model": model_fingerprint(config.model_path),
                               **config.output_settings()}, sort_keys=True)
        self.fingerprint = hashlib.sha256(settings.encode()).hexdigest()[:32]

    def count_tokens(self, text: str) -> int:
        with self._lock:
            return len(self._tokenizer(text, add_special_tokens=False).input_ids)

    def condense(self, document: str, question: str | None = None, ratio: float | None = None) -> Condensation:
        return self.condense_many([(document, question, ratio)])[0]

    def condense_many(self, items: Sequence[tuple[str, str | None, float | None]]) -> list[Condensation]:
        """Condense ``(document, question or None, ratio or None)`` items, all windows batched; a
        document asked at several ratios is scored once."""
        asked = [(text, question or None, self.config.ratio if ratio is None else float(ratio))
                 for text, question, ratio in items]
        docs: dict[tuple[str, str | None], _Doc] = {}
        for text, question, ratio in asked:
            if not 0 < ratio <= 1:
                raise ConfigError("cascade.ratio", f"must be in (0, 1], got {ratio!r}")
            doc = docs.setdefault((text, question), _Doc(text, question))
            doc.wanted = doc.wanted or ratio < 1
        with self._lock:
            for doc in docs.values():
                encoded = self._tokenizer(doc.text, add_special_tokens=False, return_offsets_mapping=True)
                doc.ids, doc.offsets = list(encoded.input_ids), list(encoded.offset_mapping)
            self._score([d for d in docs.values()
                         if d.wanted and len(d.ids) >= max(self.config.min_document_tokens, 1)])
            return [self._select(docs[text, question], ratio) for text, question, ratio in asked]

    # -- scoring ----------------------------------------------------------------------------------
    def _rows(self, doc: _Doc) -> list[_Row]:
        window, overlap = self.config.window_tokens, self.config.overlap_tokens
        question: list[int] = []
        if doc.question:
            question = self._tokenizer(doc.question, add_special_tokens=False).input_ids
            question = question[-self.config.question_tokens:] if self.config.question_tokens else []
        rows = []
        start, first = 0, 0
        while first < len(doc.ids):
            stop = min(start + window, len(doc.ids))
            for conditioned, prefix in ((False, self._prefix), (True, self._prefix + question + self._separator)):
                if conditioned and not question:
                    continue
                rows.append(_Row(doc, conditioned, prefix + doc.ids[start:stop], first, start, stop))
            doc.windows += 1
            first, start = stop, stop - overlap
        doc.base = np.zeros(len(doc.ids), np.float64)
        doc.cond = np.zeros(len(doc.ids), np.float64) if question else None
        return rows

    def _score(self, docs: list[_Doc]) -> None:
        rows = sorted((row for doc in docs for row in self._rows(doc)), key=lambda r: -len(r.ids))
        batch: list[_Row] = []
        for row in rows:
            if batch and (len(batch) + 1) * len(batch[0].ids) > self.config.max_batch_tokens:
                self._forward(batch)
                batch = []
            batch.append(row)
        if batch:
            self._forward(batch)

    def _forward(self, rows: list[_Row]) -> None:
        torch = self._torch
        width = len(rows[0].ids)
        ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row.ids)] = torch.tensor(row.ids)
            mask[i, : len(row.ids)] = 1
        head = self._model.get_output_embeddings()
        with torch.inference_mode():
            hidden = self._model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            for i, row in enumerate(rows):
                prefix = len(row.ids) - (row.stop - row.start)
                begin = prefix + row.first - row.start  # row position of the first scored token
                targets = ids[i, begin: len(row.ids)]
                nll = []
                for s in range(0, len(targets), _HEAD_SLICE):
                    logits = head(hidden[i, begin - 1 + s: begin - 1 + s + _HEAD_SLICE][: len(targets) - s]).float()
                    picked = logits.gather(1, targets[s: s + _HEAD_SLICE, None])[:, 0]
                    nll.append(torch.logsumexp(logits, dim=1) - picked)
                scores = torch.cat(nll).double().numpy()
                (row.doc.cond if row.conditioned else row.doc.base)[row.first: row.stop] = scores

    # -- selection --------------------------------------------------------------------------------
    def _select(self, doc: _Doc, ratio: float) -> Condensation:
        if doc.base is None or ratio >= 1:  # too short, or nothing to drop
            return Condensation(doc.text, len(doc.ids), len(doc.ids), ratio, False, 0)
        units = unit_split.split(doc.text, self.config.granularity)
        cost, value = _unit_costs(units, doc.offsets, doc.base)
        if doc.cond is not None:
            value = self._relevance(doc, units, value)
        target = ratio * len(doc.ids)
        budget, best = math.floor(target), None
        for _ in range(_BUDGET_ROUNDS):  # unit costs only estimate the tokens of the joined text
            text = unit_split.join(doc.text, units, _choose(units, cost, value, budget))
            tokens = self.count_tokens(text)
            if best is None or abs(tokens - target) < abs(best[1] - target):
                best = (text, tokens)
            if abs(tokens - target) <= max(1.0, 0.01 * len(doc.ids)):
                break
            budget -= round(tokens - target)
        text, tokens = best
        return Condensation(text, len(doc.ids), tokens, ratio, doc.cond is not None, doc.windows)

    def _relevance(self, doc: _Doc, units: Sequence[unit_split.Unit], value: list[float]) -> list[float]:
        """Values with the question's contrast added, per unit and (for words) per sentence, so
        the words around what the question asks for survive with it."""
        weight = self.config.question_weight
        contrast = doc.base - doc.cond
        _, own = _unit_costs(units, doc.offsets, contrast)
        value = [v + weight * c for v, c in zip(value, own)]
        if self.config.granularity == "word":
            sentences = unit_split.sentences(doc.text)
            _, around = _unit_costs(sentences, doc.offsets, contrast)
            value = [v + weight * around[s] for v, s in zip(value, unit_split.enclosing(units, sentences))]
        return value


def _unit_costs(units: Sequence[unit_split.Unit], offsets: Sequence[tuple[int, int]],
                scores: np.ndarray) -> tuple[list[int], list[float]]:
    """Per unit: how many tokens overlap its characters (leading white space included), and
    their mean score."""
    cost, value = [], []
    t = 0
    for unit in units:
        while t < len(offsets) and offsets[t][1] <= unit.start:
            t += 1
        u = t
        while u < len(offsets) and offsets[u][0] < unit.end:
            u += 1
        mine = scores[t:u]
        cost.append(len(mine))
        value.append(float(mine.mean()) if len(mine) else 0.0)
        t = max(u - 1, t)  # a token may straddle two units: count it for both
    return cost, value


def _choose(units: Sequence[unit_split.Unit], cost: Sequence[int], value: Sequence[float],
            budget: int) -> list[bool]:
    """Protected units first, then the rest, each by mean score (rounded; ties: earlier first),
    while they fit ``budget`` tokens."""
    rounded = [round(v * _SCORE_QUANTUM) for v in value]
    order = sorted(range(len(units)), key=lambda i: (not units[i].protected, -rounded[i], i))
    keep = [False] * len(units)
    spent = 0
    for i in order:
        if spent + cost[i] <= budget:
            keep[i] = True
            spent += cost[i]
    return keep
