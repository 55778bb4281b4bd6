"""Every error KVShrink raises on purpose is a KVShrinkError, and the ones that were RuntimeErrors
before they joined the family still are (callers with ``except RuntimeError`` keep working).
Each is raised for real where that is cheap: a closed task runner, a server that answers 500 or
streams nothing, a child that exits before it is ready, the qat path with libqatzip switched off."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kvshrink.codec.qat import QatUnavailable
from kvshrink.errors import KVShrinkError
from kvshrink.testing.launch import LOOPBACK, ManagedProcess, ServerStartError
from kvshrink.plugins.router.router_launcher import RouterShapeError
from kvshrink.storage_backends.task_channels import ChannelClosedError, L2TaskRunner, TaskChannelError
from kvshrink.testing.streaming_client import StreamedCompletionError, stream_completion


@pytest.mark.parametrize("cls", [ServerStartError, RouterShapeError, TaskChannelError, ChannelClosedError,
                                 QatUnavailable, StreamedCompletionError])
def test_in_the_family_and_still_a_runtime_error(cls: type[Exception]) -> None:
    assert issubclass(cls, KVShrinkError)
    assert issubclass(cls, RuntimeError)


def test_config_error_has_key_and_reason_and_survives_pickling() -> None:
    import pickle

    from kvshrink.errors import ConfigError

    err = ConfigError("tiers[1].capacity", "must be greater than zero")
    assert isinstance(err, KVShrinkError) and isinstance(err, ValueError)
    assert (err.key, err.reason, str(err)) == ("tiers[1].capacity", "must be greater than zero",
                                               "config key 'tiers[1].capacity': must be greater than zero")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is ConfigError and (copy.key, copy.reason, str(copy)) == (err.key, err.reason, str(err))
    whole_file = ConfigError(None, "/etc/x.yaml is not valid YAML at line 3, column 1: ...")
    assert whole_file.key is None and str(whole_file) == whole_file.reason


def test_submit_after_close_is_channel_closed_error() -> None:
    runner = L2TaskRunner("family", workers=1)
    runner.close()
    with pytest.raises(ChannelClosedError, match="family: submit after close"):
        runner.submit(runner.store, lambda: 1, on_error=lambda exc: None)


def test_child_that_exits_before_ready_is_server_start_error(tmp_path) -> None:
    proc = ManagedProcess([sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                          log_path=tmp_path / "child.log").start()
    try:
        with pytest.raises(KVShrinkError, match=r"exited with 3 before ready:\nboom") as info:
            proc.wait_until(lambda: False, timeout=10, what="ready")
        assert isinstance(info.value, ServerStartError)
    finally:
        proc.stop()


class _Answer(http.server.BaseHTTPRequestHandler):
    """POST /v1/completions: 500 when the path says so, else a stream with no token in it."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path.startswith("/fail"):
            body, status, kind = b"engine is down", 500, "text/plain"
        else:
            body, status, kind = b"data: [DONE]\n\n", 200, "text/event-stream"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_error_status_is_streamed_completion_error(answering_server: str) -> None:
    with pytest.raises(StreamedCompletionError, match="answered 500: engine is down"):
        stream_completion(f"{answering_server}/fail", "m", "hi", timeout=10)


def test_stream_without_token_is_streamed_completion_error(answering_server: str) -> None:
    with pytest.raises(StreamedCompletionError, match="streamed no token"):
        stream_completion(answering_server, "m", "hi", timeout=10)


def test_qat_without_library_is_qat_unavailable() -> None:
    code = ("import numpy as np\n"
            "from kvshrink.codec import qat\n"
            "from kvshrink.errors import KVShrinkError\n"
            "try:\n"
            "    qat.compress(np.zeros(16, np.uint8))\n"
            "except KVShrinkError as exc:\n"
            "    print(type(exc).__name__, exc)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "KVSHRINK_QATZIP_LIB": "off"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "QatUnavailable libqatzip not loaded"


def test_a_closed_store_says_so_with_its_own_error(tmp_path) -> None:
    import numpy as np

    from kvshrink.errors import StoreClosedError
    from kvshrink.store.tiered import TieredStore

    store = TieredStore.from_config({"tiers": [{"kind": "ssd", "path": str(tmp_path / "ssd"), "capacity": 1 << 20}]})
    store.close()
    with pytest.raises(StoreClosedError, match="closed") as info:
        store.put(b"k", np.zeros(16, dtype=np.uint16))
    assert isinstance(info.value, KVShrinkError) and isinstance(info.value, RuntimeError)


def test_codec_arguments_are_their_own_error_and_survive_pickling() -> None:
    import pickle

    from kvshrink.codec import Codec, CodecArgumentError
    from kvshrink.errors import ConfigError

    with pytest.raises(CodecArgumentError) as info:
        Codec(level=99)
    err = pickle.loads(pickle.dumps(info.value))
    assert (err.argument, isinstance(err, KVShrinkError), isinstance(err, ConfigError)) == ("level", True, False)
