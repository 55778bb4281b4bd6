"""KV Fuse (issue 15): reuse the KV of token runs that are not a prefix of the prompt.

Prefix caching misses whenever shared context moves: turn 1 retrieves documents A, B; turn 2
retrieves B, C. B's KV exists, but at other positions and computed after other text. KV Fuse
builds the new prompt's KV from such pieces, CacheBlend's way:

1. :mod:`kvshrink.fuse.index` — :class:`~kvshrink.fuse.index.ContentIndex` finds the stored token
   runs (fixed chunks, or documents cut at a separator) that occur in the new prompt at any offset;
   every match is verified token by token, so a run is only ever answered with the KV of the same
   tokens.
2. :mod:`kvshrink.fuse.rope` — keys are stored after RoPE; :func:`~kvshrink.fuse.rope.rerotate`
   turns keys computed at ``p..p+n`` into keys at ``q..q+n`` (one rotation by ``q - p``).
3. :mod:`kvshrink.fuse.engine` — :class:`~kvshrink.fuse.engine.FuseEngine` runs the model layer by
   layer over the prompt's KV buffer: the tokens no run covers (gaps: separators, the question) are
   computed in full; at the check layer the reused tokens whose keys deviate most from a fresh
   computation (the top ``ratio``) are selected and recomputed in every later layer, attending over
   the whole fused buffer. ``ratio = 0`` is re-rotation only, ``ratio = 1`` a full prefill. The
   result is an ordinary full-prompt KV ``[2, layers, tokens, kv_heads * head_dim]`` that a later
   request loads as a prefix.
4. :mod:`kvshrink.fuse.keys` — fused KV is an approximation; it lives under its own cache salt
   (:func:`~kvshrink.fuse.keys.fused_salt`), never under the keys exact KV is looked up with.

``benchmarks/fuse_quality.py`` measures what this costs in quality against a full prefill.

How it plugs into serving (the next step; nothing below exists yet)
--------------------------------------------------------------------
vLLM's scheduler only takes a *prefix* count of externally computed tokens, so the fused KV must
reach vLLM as an ordinary LMCache prefix hit. The plan needs no patch of vLLM or LMCache:

* A server module, ``lmcache server --server-module '{"module_path":
  "kvshrink.storage_backends.fuse_module", "config": {"ratio": 0.15, "check_layer": 1,
  "model_path": ...}}'``, registers RPC handlers after the built-ins (same-named ones replace
  them). It wraps ``commit_store`` (the engine-driven store path vLLM CPU uses): after the stock
  handler, the committed prompt's full chunks are added to a :class:`ContentIndex` under their
  object keys, with their start positions (and, with a configured separator, the documents cut
  from the prompt). Evictions (the store's delete notifications) remove them.
* It wraps ``lookup``. A request opts into fusion by its ``cache_salt``: vLLM passes the
  OpenAI request's ``cache_salt`` into every ``ObjectKey``, and a client (or our proxy) that
  wants fusion sends ``fused_salt(settings, own_salt)``. For such a key the module: (1) if every
  full chunk is already stored under the fused salt, delegates (a repeat of a fused prompt is a
  plain hit); (2) otherwise reads the exact prefix chunks and the matched runs by their original
  (unsalted) keys, (3) runs :meth:`FuseEngine.fuse` on a thread of its own (fusion takes seconds
  on CPU; LMCache's lookup gives up after 300 s), (4) writes the full chunks of the result under
  the prompt's own chunk hashes *with the fused salt* (``reserve_write`` / ``finish_write``), and
  (5) calls the built-in lookup, which now finds a prefix hit; vLLM loads it and computes the tail.
  Any missing, evicted or unreadable piece makes the module delegate without fusing (an ordinary
  prefill, the right answer).
* Requests without a fused salt never see fused chunks; fusion off = no handler wrapped = stock.
  Fused chunks are ordinary chunks of our store (compressed, tiered, evictable); their keys end
  with a salt :func:`is_fused_salt` recognizes, so they can be counted and evicted on their own.

Dependencies: torch and transformers (the ``cpu`` / ``gpu`` extras). Imports nothing of ours but
``kvshrink.errors``.
"""
