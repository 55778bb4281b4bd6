"""The condenser with the real SmolLM2-135M: ratio hit within a tolerance, facts kept whole,
deterministic alone or batched, long documents in windows, settings checked."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from cascade_texts import FACTS, KEPT_WORDS, prose, with_facts

from kvshrink.cascade.condenser import Condenser, CondenserConfig
from kvshrink.errors import ConfigError

RATIO_TOLERANCE = 0.05


def _is_subsequence(short: list[str], long: list[str]) -> bool:
    words = iter(long)
    return all(any(w == v for v in words) for w in short)


def test_ratio_is_hit_and_facts_survive_whole(condenser: Condenser) -> None:
    doc = with_facts(prose(3))
    results = condenser.condense_many([(doc, None, r) for r in (0.7, 0.5, 0.3)])
    for ratio, result in zip((0.7, 0.5, 0.3), results):
        assert result.tokens_in == condenser.count_tokens(doc) and result.tokens_out == condenser.count_tokens(result.text)
        assert abs(result.tokens_out / result.tokens_in - ratio) <= RATIO_TOLERANCE, (ratio, result.tokens_out)
        kept = result.text.split()
        assert _is_subsequence(kept, doc.split()), "a word was cut or changed"
        assert [w for w in KEPT_WORDS if w not in kept] == [], ratio


def test_deterministic_alone_and_batched(condenser: Condenser) -> None:
    doc, other = f"{prose(1)}\n\n{FACTS[0]}", prose(1, start=3)
    alone = condenser.condense(doc, ratio=0.5)
    assert condenser.condense_many([(other, None, 0.5), (doc, None, 0.5)])[1] == alone


def test_a_long_document_is_scored_in_windows(condenser: Condenser) -> None:
    doc = prose(3, start=90)
    result = condenser.condense(doc, ratio=0.5)
    window, overlap = condenser.config.window_tokens, condenser.config.overlap_tokens
    assert result.tokens_in > window
    assert result.windows == 1 + math.ceil((result.tokens_in - window) / (window - overlap))
    assert abs(result.tokens_out / result.tokens_in - 0.5) <= RATIO_TOLERANCE


def test_the_question_changes_what_is_kept_and_facts_stay(condenser: Condenser) -> None:
    doc = f"{prose(1)}\n\n{FACTS[0]}\n\n{prose(1, start=41)}"
    question = "Which access code opens the vault of the Orion project?"
    aware, blind = condenser.condense_many([(doc, question, 0.5), (doc, None, 0.5)])
    assert aware.question_aware and not blind.question_aware and aware.text != blind.text
    assert abs(aware.tokens_out / aware.tokens_in - 0.5) <= RATIO_TOLERANCE
    assert {"Orion", "4719."} <= set(aware.text.split())


def test_short_documents_and_ratio_one_come_back_unchanged(condenser: Condenser) -> None:
    short = "Too short to condense."
    assert condenser.condense(short, ratio=0.3).text == short
    doc = prose(1)
    same = condenser.condense(doc, ratio=1.0)
    assert (same.text, same.windows, same.tokens_out) == (doc, 0, same.tokens_in)


@pytest.mark.parametrize(("settings", "key"), [({"ratio": 0.0}, "cascade.ratio"), ({"ratio": 1.5}, "cascade.ratio"),
                                               ({"granularity": "token"}, "cascade.granularity"),
                                               ({"window_tokens": 64, "overlap_tokens": 40}, "cascade.overlap_tokens"),
                                               ({"max_batch_tokens": 100}, "cascade.max_batch_tokens")])
def test_bad_settings_are_config_errors_naming_the_key(settings: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CondenserConfig(model_path="unused", **settings)
    assert info.value.key == key


def test_a_folder_without_a_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Condenser(CondenserConfig(model_path=str(tmp_path)))
    assert info.value.key == "cascade.model_path"
