"""KV Fuse served through vLLM: LMCache's side of non-prefix KV reuse.

vLLM's scheduler only takes a *prefix* of externally computed tokens, so a fused KV must reach vLLM
as an ordinary LMCache prefix hit. An ``lmcache server --server-module`` makes it one, with no patch
of vLLM or LMCache. The fusion itself (content index, re-rotation, the engine, the fused salt) is
:mod:`kvshrink.fuse`, which knows nothing of LMCache; this package is the glue, one job a module:

* :mod:`.server_module` — the module LMCache loads: its RPC handlers and factory;
* :mod:`.settings` — the ``fuse`` section of the serve-cache YAML (no LMCache import);
* :mod:`.stored_chunks` — which stored chunks are fusion sources, per model and tenant;
* :mod:`.job_queue` — fusion jobs, one at a time on the module's thread;
* :mod:`.fusion` — one request's fusion: read, check, fuse, write;
* :mod:`.chunk_io` — reads and writes through LMCache's storage manager;
* :mod:`.chunk_layouts`, :mod:`.chunk_codec`, :mod:`.key_check` — what a stored chunk's bytes are,
  and the layer-0 key check that refuses a misread or damaged one;
* :mod:`.outcomes` — counters and the fallback exception.

Nothing is imported here, so ``cache serve --check`` can read the settings without LMCache.
"""
