"""Run the index service: in the foreground (``kvshrink index serve``) or on a background thread.

The background form is what tests and benchmarks use to drive a real service over real HTTP and
ZMQ inside one process; ``stop()`` shuts uvicorn down and joins the thread.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time

import uvicorn

from kvshrink.errors import KVShrinkError
from kvshrink.index.app import create_app
from kvshrink.index.config import IndexConfig

logger = logging.getLogger(__name__)


def missing_fast_http() -> list[str]:
    """Which of uvloop / httptools cannot be imported. uvicorn's "auto" settings then fall back to
    asyncio's event loop / h11's pure-Python parser: +0.25 ms of service CPU and +0.3 ms latency per
    32K-token ``POST /lookup`` (paired A/B on a 2-core VM, ~2.8 ms per request with both)."""
    return [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]


class IndexServer:
    def __init__(self, config: IndexConfig, log_level: str = "warning") -> None:
        self.config = config
        self.app = create_app(config)
        # loop / http "auto": uvloop and httptools when installed (see missing_fast_http)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=config.port,
                                                     log_level=log_level, access_log=False, lifespan="on"))
        missing = missing_fast_http()
        if missing:
            logger.warning("%s not installed: the index's HTTP API runs on the slower pure-Python fallback "
                           "(pip install %s)", " and ".join(missing), " ".join(missing))
        self._thread: threading.Thread | None = None

    @property
    def state(self):
        return self.app.state.index

    @property
    def subscriber(self):
        return self.app.state.subscriber

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def thread_cpu_s(self) -> float:
        """CPU seconds used so far by the background serving thread (event loop, HTTP, lookups):
        benchmarks divide its growth by the requests they sent. Only after :meth:`start`."""
        if self._thread is None or self._thread.ident is None:
            raise KVShrinkError("the index service runs no background thread (call start())")
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    def run(self) -> None:
        """Serve until interrupted (foreground)."""
        self._server.run()

    def start(self, timeout: float = 20.0) -> "IndexServer":
        self._thread = threading.Thread(target=self._server.run, name="kvshrink-index-http", daemon=True)
        self._thread.start()
        # uvicorn sets ``started`` and offers nothing to wait on; a thread that ends first failed
        # (port taken, app start-up raised).
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise KVShrinkError(f"index service failed to start on {self.url} (see log)")
            if time.monotonic() >= deadline:
                raise KVShrinkError(f"timed out waiting for the index service on {self.url} after {timeout:.0f} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15.0)

    def __enter__(self) -> "IndexServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
