"""``kvshrink index serve | lookup | stats``: run the global KV index, or ask a running one."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_URL = "http://127.0.0.1:8200"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="index_command", required=True, metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run the index service (HTTP + ZMQ KV-event subscriber)")
    serve.add_argument("--config", metavar="FILE", help="index YAML (configs/index.yaml documents every key); "
                                                        "default: every key's default")
    serve.add_argument("--host", help="HTTP bind address (default 127.0.0.1; overrides the file's host)")
    serve.add_argument("--port", type=int, help="HTTP port (default 8200; overrides the file's port)")
    serve.add_argument("--zmq-bind", action="append", metavar="ENDPOINT",
                       help="ZMQ SUB endpoint to bind for vLLM KV events (repeatable; replaces the file's zmq.bind)")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                       help="log level of the service (default info)")
    lookup = sub.add_parser("lookup", help="ask a running index which instance holds a prompt's prefix")
    lookup.add_argument("--url", default=DEFAULT_URL, help=f"the index service (default {DEFAULT_URL})")
    lookup.add_argument("--model", required=True, help="model name, as the engines serve it")
    group = lookup.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="prompt text (the index tokenizes it with the model's tokenizer)")
    group.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    stats = sub.add_parser("stats", help="print what a running index holds")
    stats.add_argument("--url", default=DEFAULT_URL, help=f"the index service (default {DEFAULT_URL})")
    for p in (lookup, stats):
        p.add_argument("--token-env", default="KVSHRINK_INDEX_TOKEN", metavar="VAR",
                       help="environment variable holding the index's bearer token (default KVSHRINK_INDEX_TOKEN)")


def run(args: argparse.Namespace) -> int:
    if args.index_command == "serve":
        return _serve(args)
    import httpx

    headers = {}
    token = os.environ.get(args.token_env)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        if args.index_command == "stats":
            resp = httpx.get(f"{args.url}/stats", headers=headers, timeout=10.0)
        else:
            body = {"model": args.model}
            if args.prompt is not None:
                body["prompt"] = args.prompt
            else:
                body["token_ids"] = [int(t) for t in args.token_ids.split(",") if t.strip()]
            resp = httpx.post(f"{args.url}/lookup", json=body, headers=headers, timeout=10.0)
    except ValueError:
        print(f"kvshrink index {args.index_command}: --token-ids must be comma-separated integers", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:  # down, refused, timed out: one line, not a traceback
        print(f"kvshrink index {args.index_command}: no index answers at {args.url} ({type(exc).__name__}: {exc}); "
              "start one with `kvshrink index serve` or pass --url", file=sys.stderr)
        return 1
    try:
        print(json.dumps(resp.json(), indent=2))
    except ValueError:
        print(f"kvshrink index {args.index_command}: {args.url} answered HTTP {resp.status_code} with a body that "
              "is not JSON: is it a KVShrink index?", file=sys.stderr)
        return 1
    return 0 if resp.status_code == 200 else 1


def _serve(args: argparse.Namespace) -> int:
    import logging

    from kvshrink.errors import KVShrinkError
    from kvshrink.index.config import load_config
    from kvshrink.index.server import IndexServer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        config = load_config(args.config, overrides)
        if args.zmq_bind:
            config.zmq.bind = list(args.zmq_bind)
        server = IndexServer(config, log_level=args.log_level)
    except KVShrinkError as exc:
        print(f"kvshrink index serve: {exc}", file=sys.stderr)
        return 2
    server.run()
    return 0
