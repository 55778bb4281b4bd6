"""Global KV index: which serving instance holds which prompt prefix, on which tier (``kvshrink index serve``).

Data flow: vLLM KV events (ZMQ, ``subscriber`` → ``events`` → ``vllm_ingest``) and LMCache tier
events (HTTP ``POST /events``, ``tier_events``) update ``state.IndexState`` (``registry`` of
instances, ``block_index`` of prefix blocks hashed by ``hashing``); ``POST /lookup`` (``app``) ranks
instances for a prompt (``scoring``). Configuration: ``config`` / ``configs/index.yaml``.

Needs the ``index`` extra: without it, importing this package raises
:class:`~kvshrink.errors.MissingExtraError` with the ``pip install`` line (:func:`kvshrink.extras.check`,
which imports nothing). Text and chat lookups also need ``transformers`` (in the extra; loaded lazily).
"""

from kvshrink.extras import check

check("index")
