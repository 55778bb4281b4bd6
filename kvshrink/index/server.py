"""Run the index service: in the foreground (``kvshrink index serve``) or on a background thread.

The background form is what tests and benchmarks use to drive a real service over real HTTP and
ZMQ inside one process; ``stop()`` shuts uvicorn down and joins the thread.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from kvshrink.errors import KVShrinkError
from kvshrink.index.app import create_app
from kvshrink.index.config import IndexConfig


class IndexServer:
    def __init__(self, config: IndexConfig, log_level: str = "warning") -> None:
        self.config = config
        self.app = create_app(config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=config.port,
                                                     log_level=log_level, access_log=False, lifespan="on"))
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

    def run(self) -> None:
        """Serve until interrupted (foreground)."""
        self._server.run()

    def start(self, timeout: float = 20.0) -> "IndexServer":
        self._thread = threading.Thread(target=self._server.run, name="kvshrink-index-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise KVShrinkError(f"index service failed to start on {self.url} (see log)")
            if time.monotonic() > deadline:
                raise KVShrinkError(f"index service not up on {self.url} after {timeout:.0f} s")
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
