"""KV Fuse: reuse the KV of token runs that are not a prefix of the prompt.

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

``experiments/fuse_quality.py`` measured what this costs in quality against a full prefill.

How it plugs into serving: :mod:`kvshrink.storage_backends.kv_fuse`, an ``lmcache server
--server-module`` beside the other LMCache backends (``kvshrink cache serve`` loads it from the
``fuse`` section of its YAML). This package imports nothing of LMCache.

Dependencies: torch and transformers (the ``cpu`` / ``gpu`` extras). Imports nothing of ours but the
foundation (``kvshrink.errors``, ``kvshrink.config_checks``).
"""
