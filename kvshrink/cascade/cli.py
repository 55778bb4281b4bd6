"""``kvshrink cascade serve``: the cascade proxy in front of an OpenAI-compatible server (vLLM).

Light at import (argparse only); torch, transformers and FastAPI are imported when it runs.
"""

from __future__ import annotations

import argparse
import os

MODEL_ENV = "KVSHRINK_CASCADE_MODEL"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cascade_command", required=True, metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="condense marked documents with a small model, then forward to --upstream")
    serve.add_argument("--upstream", required=True, help="base URL of the OpenAI-compatible server (vLLM)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8300, help="HTTP port (default 8300)")
    serve.add_argument("--model-path", default=os.environ.get(MODEL_ENV),
                       help=f"Hugging Face folder of the small causal LM (default ${MODEL_ENV}; "
                            "`kvshrink fixture` builds SmolLM2-135M-Instruct)")
    serve.add_argument("--ratio", type=float, default=0.5, help="kept tokens / document tokens (default 0.5)")
    serve.add_argument("--granularity", choices=("word", "sentence"), default="word",
                       help="unit the condenser keeps or drops (default word)")
    serve.add_argument("--question-aware", action="store_true",
                       help="condition on the request's question (a shared document is then condensed per question)")
    serve.add_argument("--window-tokens", type=int, default=1024, help="condenser window (longer documents: windows)")
    serve.add_argument("--min-document-tokens", type=int, default=64, help="shorter documents are left as they are")
    serve.add_argument("--markers", default="<doc>,</doc>", help="open,close marker pair (default <doc>,</doc>)")
    serve.add_argument("--no-tool-messages", action="store_true", help="do not treat role \"tool\" contents as documents")
    serve.add_argument("--cache-mib", type=int, default=64, help="in-memory condensation cache (MiB)")
    serve.add_argument("--store-config", help="TieredStore YAML that also keeps condensations (survives restarts)")
    serve.add_argument("--threads", type=int, help="torch threads for the small model")
    serve.add_argument("--log-level", default="info", help="log level (default info)")


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvshrink.cascade.cache import CondensationCache
    from kvshrink.cascade.condenser import Condenser, CondenserConfig
    from kvshrink.cascade.proxy import ProxyConfig, create_app
    from kvshrink.cascade.service import CondenseService
    from kvshrink.errors import KVShrinkError

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.model_path:
        raise SystemExit(f"kvshrink cascade serve: --model-path (or ${MODEL_ENV}) is required")
    markers = tuple(args.markers.split(","))
    if len(markers) != 2 or not all(markers) or markers[0] == markers[1]:
        raise SystemExit(f"kvshrink cascade serve: --markers must be two different non-empty strings, got "
                         f"{args.markers!r}")
    store = None
    try:
        config = CondenserConfig(model_path=args.model_path, ratio=args.ratio, granularity=args.granularity,
                                 window_tokens=args.window_tokens, min_document_tokens=args.min_document_tokens,
                                 threads=args.threads)
        if args.store_config:
            from kvshrink.store.tiered import TieredStore

            store = TieredStore.from_config(args.store_config)
        service = CondenseService(Condenser(config), CondensationCache(args.cache_mib << 20, store))
    except KVShrinkError as exc:
        if store is not None:
            store.close()
        raise SystemExit(f"kvshrink cascade serve: {exc}") from exc
    app = create_app(ProxyConfig(args.upstream, markers, not args.no_tool_messages, args.question_aware), service)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        service.close()
        if store is not None:
            store.close()
    return 0
