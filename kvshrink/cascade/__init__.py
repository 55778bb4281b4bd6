"""KV Cascade: a small model condenses retrieved documents before the main model sees them.

Fewer prompt tokens mean less prefill and less KV cache to keep, move and offload. The pieces, one
idea each: ``units`` (words / sentences, what may be dropped), ``condenser`` (small-model scoring
and selection), ``cache`` (condensations keyed by what determines them), ``service`` (cache, single
flight and batching in front of the condenser), ``marking`` (which parts of an OpenAI request are
documents), ``proxy`` (the OpenAI-compatible front of vLLM), ``metrics`` and ``cli``
(``kvshrink cascade serve``). Importing the package imports none of them.

Needs the ``cascade`` extra: without it, importing this package raises
:class:`~kvshrink.errors.MissingExtraError` with the ``pip install`` line (:func:`kvshrink.extras.check`,
which imports nothing: torch and transformers still load only when the condenser starts).
"""

from kvshrink.extras import check

check("cascade")
