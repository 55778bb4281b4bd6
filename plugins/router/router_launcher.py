"""``kvshrink router serve``: run production-stack's router (``vllm_router``) with the KVShrink routing logic.

production-stack has no plugin point for routing logics (its ``--routing-logic`` choices, the
factory and the dispatch in ``request.py`` are hard-coded), so the launcher injects ours without
forking: it wraps ``vllm_router.app.initialize_all`` so that, after the router set itself up with a
stock logic, ``app.state.router`` becomes a ``SessionRouter`` subclass delegating to
:class:`KVShrinkRoutingLogic` (being a ``SessionRouter`` is what makes the router await the
five-argument call), then runs ``vllm_router.app.main()`` with the remaining arguments.
Dynamic-config reloads would swap in a stock logic again, so ``--dynamic-config-*`` is refused.

Install (production-stack is not on PyPI and needs Python ≥ 3.12)::

    python3.12 -m venv ~/router-venv && . ~/router-venv/bin/activate
    git clone https://github.com/vllm-project/production-stack && \\
        SETUPTOOLS_SCM_PRETEND_VERSION=0.0.0 pip install -e production-stack
    pip install -e '<kvshrink checkout>[router]'

Run (all options after ``--`` go to vllm-router)::

    python -m kvshrink.plugins.router.router_launcher --index-url http://127.0.0.1:8200 -- \\
        --host 127.0.0.1 --port 8001 --service-discovery static \\
        --static-backends http://127.0.0.1:8000,http://127.0.0.1:8100 --static-models M,M

(``kvshrink router serve ...`` is the same command through the console script.)
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

# kvshrink.errors imports nothing but the standard library, so it is safe in the router's own
# environment (this module already runs as kvshrink.plugins.router.router_launcher there).
from kvshrink.errors import KVShrinkError

INSTALL_HINT = """production-stack's router (the Python package `vllm_router`) is not installed in this environment.
It is not on PyPI and needs Python >= 3.12:
  python3.12 -m venv ~/router-venv && . ~/router-venv/bin/activate
  git clone https://github.com/vllm-project/production-stack
  SETUPTOOLS_SCM_PRETEND_VERSION=0.0.0 pip install -e production-stack
  pip install -e '<kvshrink checkout>[router]'
then run this command from that environment (python -m kvshrink.plugins.router.router_launcher ...)."""


class RouterShapeError(KVShrinkError, RuntimeError):
    """The installed vllm_router does not route the way this launcher relies on (also a
    RuntimeError, as it was before it joined the family)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index-url", default="http://127.0.0.1:8200", help="the KVShrink index service")
    parser.add_argument("--index-timeout-ms", type=float, default=50.0,
                        help="deadline for one index lookup; past it the request falls back")
    parser.add_argument("--index-token-env", default="KVSHRINK_INDEX_TOKEN",
                        help="environment variable holding the index's bearer token, if any")
    parser.add_argument("--index-backoff-s", type=float, default=1.0,
                        help="after an index failure, skip it this long")
    parser.add_argument("--hint-targets", default=None,
                        help='JSON object backend URL -> its cache server\'s hint URL, e.g. '
                             '\'{"http://vllm-a:8000": "http://cache-a:8210"}\': send prefetch hints there '
                             '(fire and forget) for requests whose prompt is token ids; default: no hints')
    parser.add_argument("--hint-token-env", default="KVSHRINK_HINT_TOKEN",
                        help="environment variable holding the hint endpoints' bearer token, if any")
    parser.add_argument("--hint-timeout-ms", type=float, default=1000.0, help="deadline of one hint")
    parser.add_argument("--hint-max-in-flight", type=int, default=32,
                        help="hints in flight at most; beyond, hints are dropped and counted")
    parser.add_argument("router_args", nargs=argparse.REMAINDER,
                        help="arguments for vllm-router (after --), e.g. --service-discovery static ...")


def check_router_shape() -> None:
    """Verify, on the installed source, the call shape the launcher relies on."""
    from vllm_router import app as app_module
    from vllm_router.routers import routing_logic
    from vllm_router.services.request_service import request as request_module

    problems = []
    if not callable(getattr(app_module, "initialize_all", None)) or not callable(getattr(app_module, "main", None)):
        problems.append("vllm_router.app has no initialize_all()/main()")
    if not inspect.iscoroutinefunction(getattr(routing_logic.SessionRouter, "route_request", None)):
        problems.append("SessionRouter.route_request is not async")
    source = inspect.getsource(request_module.route_general_request)
    if "SessionRouter" not in source or "request_json" not in source:
        problems.append("route_general_request no longer awaits SessionRouter with request_json")
    if problems:
        raise RouterShapeError("; ".join(problems) + " — this vllm_router version is not supported (verified: "
                               "production-stack a6c01db)")


def make_router(logic):
    """Wrap ``logic`` in a ``SessionRouter`` subclass so vllm_router awaits it with request_json."""
    from vllm_router.routers.routing_logic import SessionRouter

    class KVShrinkSessionRouter(SessionRouter):
        def __init__(self, inner) -> None:  # deliberately not SessionRouter.__init__ (no hash ring needed)
            self._logic = inner
            self.session_key = inner.session_key
            self.max_instance_failover_reroute_attempts = inner.max_instance_failover_reroute_attempts

        def extract_session_id(self, request, request_json):
            return self._logic.extract_session_id(request, request_json)

        async def route_request(self, endpoints, engine_stats, request_stats, request, request_json=None):
            return await self._logic.route_request(endpoints, engine_stats, request_stats, request, request_json)

    return KVShrinkSessionRouter(logic)


def run(args: argparse.Namespace) -> int:
    router_argv = list(args.router_args)
    if router_argv[:1] == ["--"]:
        router_argv = router_argv[1:]
    try:
        from vllm_router import app as app_module
    except ImportError as exc:
        print(f"kvshrink router serve: cannot import vllm_router ({exc}).\n{INSTALL_HINT}", file=sys.stderr)
        return 2
    try:
        check_router_shape()
    except RouterShapeError as exc:
        print(f"kvshrink router serve: {exc}", file=sys.stderr)
        return 2
    if any(a.startswith("--dynamic-config") for a in router_argv):
        print("kvshrink router serve: --dynamic-config-* would replace the KVShrink routing logic on reload; "
              "not supported", file=sys.stderr)
        return 2
    if not any(a == "--routing-logic" or a.startswith("--routing-logic=") for a in router_argv):
        router_argv += ["--routing-logic", "roundrobin"]  # a stock logic to initialise; replaced below

    from kvshrink.plugins.router.router_logic import KVShrinkRoutingLogic

    hints = None
    if args.hint_targets:
        import json

        from kvshrink.plugins.router.hints import HintSender

        try:
            targets = json.loads(args.hint_targets)
            if not isinstance(targets, dict) or not all(isinstance(v, str) for v in targets.values()):
                raise ValueError("expected a JSON object of URL strings")
            hints = HintSender(targets, token=os.environ.get(args.hint_token_env) or None,
                               timeout_s=args.hint_timeout_ms / 1000.0, max_in_flight=args.hint_max_in_flight)
        except ValueError as exc:
            print(f"kvshrink router serve: --hint-targets: {exc}", file=sys.stderr)
            return 2
    logic = KVShrinkRoutingLogic(args.index_url, timeout_s=args.index_timeout_ms / 1000.0,
                                 token=os.environ.get(args.index_token_env) or None, backoff_s=args.index_backoff_s,
                                 hints=hints)
    original = app_module.initialize_all

    def initialize_all(app, router_args):
        original(app, router_args)
        logic.session_key = router_args.session_key
        logic.max_instance_failover_reroute_attempts = router_args.max_instance_failover_reroute_attempts
        app.state.router = make_router(logic)
        print(f"kvshrink router serve: KVShrink routing logic installed (index {args.index_url}, "
              f"deadline {args.index_timeout_ms:g} ms)", file=sys.stderr, flush=True)

    app_module.initialize_all = initialize_all
    sys.argv = ["vllm-router", *router_argv]
    app_module.main()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshrink.plugins.router.router_launcher",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
