"""Global KV index: which serving instance holds which prompt prefix, on which tier (``kvshrink index serve``).

Data flow: vLLM KV events (ZMQ, ``subscriber`` → ``events`` → ``vllm_ingest``) and LMCache tier
events (HTTP ``POST /events``, ``tier_events``) update ``state.IndexState`` (``registry`` of
instances, ``block_index`` of prefix blocks hashed by ``hashing``); ``POST /lookup`` (``app``) ranks
instances for a prompt (``scoring``). Configuration: ``config`` / ``configs/index.yaml``.
"""
