"""A child process the harness owns: its own session and process group, a log file, a readiness
probe, and a stop that ends the whole group.

Every server that tests and benchmarks start (:mod:`kvshrink.testing.launch`) is one of these, and
so is any other child they must not leak. Ports are loopback-only and taken free at the moment of
asking (:func:`free_port`). One :class:`ManagedProcess` belongs to the thread that started it; its
errors are :class:`ServerStartError` (a child that exited or never became ready), with the tail of
its log in the message.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

from kvshrink.errors import KVShrinkError
from kvshrink.testing.polling import poll_until

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class ServerStartError(KVShrinkError, RuntimeError):
    """A server exited or did not become ready; the message carries the tail of its log. Also a
    RuntimeError, so that callers which catch that keep catching it."""


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, for an error message; "(no log)" when it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ManagedProcess:
    """A child process in its own session, logging to a file, stopped as a group."""

    name = "process"

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, log_path: Path | None = None,
                 cwd: Path | None = None) -> None:
        self.argv = list(argv)
        # LMCache's in-process engine sets PROMETHEUS_MULTIPROC_DIR in os.environ (a fixed
        # /tmp/lmcache_prometheus); children that inherit it share one metrics folder and every
        # vLLM's /metrics then sums all of them. A child gets it only when asked for by name.
        inherited = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        self.env = {**inherited, **(env or {})}
        self.log_path = log_path or Path(tempfile.mkstemp(prefix=f"kvshrink-{self.name}-", suffix=".log")[1])
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> "ManagedProcess":
        self._log = open(self.log_path, "ab")
        logger.info("starting %s: %s (log %s)", self.name, " ".join(self.argv), self.log_path)
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        def ready_while_running() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.proc.returncode} before {what}:\n"
                                       f"{log_tail(self.log_path)}")
            return ready()

        poll_until(ready_while_running, timeout, what=f"{self.name} to be {what}",
                   error=lambda message: ServerStartError(f"{message}:\n{log_tail(self.log_path)}"))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down gracefully: SIGTERM to the leader only, so that it stops its own children and
        they release what they hold (vLLM's shared-memory queues are unlinked on a clean shutdown).
        The leader gets ``timeout`` seconds; what is left of the group is then ended stage by stage."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing its process group", self.name, timeout)
        self._end_group()
        self._close_log()

    def kill(self) -> None:
        """``kill -9`` the whole group at once: a crash, not a shutdown."""
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close_log()

    def _end_group(self, grace: float = 5.0) -> None:
        """Children that outlive the leader get ``grace`` seconds to exit, then SIGTERM, then SIGKILL."""
        assert self.proc is not None
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                _signal_group(self.proc.pid, sig)
            deadline = time.monotonic() + grace
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _group_alive(self.proc.pid):
                break
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process of the group remains; reads /proc, since a container's
    init may never reap the zombies that ``killpg(pgid, 0)`` would still count."""
    return bool(group_pids(pgid))


def group_pids(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group ``pgid``, from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after "comm)": state, ppid, pgrp
            out.append(int(stat.parent.name))
    return out


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False

