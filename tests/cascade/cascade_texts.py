"""Real text with checkable facts put into it, for the cascade tests."""

from __future__ import annotations

# Facts put into real prose: what a question asks for must survive condensation intact.
FACTS = ("The vault of the Orion project opens with access code 4719.",
         "Margaret Okonkwo measured a latency of 38.25 ms on server kv-node-17.",
         "The call get_many_chunks(batch_id=982) returns 1,024 entries.")
KEPT_WORDS = ("4719.", "Okonkwo", "38.25", "kv-node-17.", "get_many_chunks(batch_id=982)", "1,024")


def prose(paragraphs: int = 4, start: int = 40) -> str:
    """Real documentation prose (the Python reference shipped with every interpreter)."""
    from kvshrink.testing.fixtures.real_kv import corpus_text

    blocks = [b.strip() for b in corpus_text("prose").split("\n\n") if len(b.strip()) > 200]
    return "\n\n".join(blocks[start:start + paragraphs])


def with_facts(text: str) -> str:
    """``text`` with FACTS put after its first, second and third paragraph."""
    parts = text.split("\n\n")
    for i, fact in enumerate(FACTS):
        parts.insert(2 * i + 1, fact)
    return "\n\n".join(parts)
