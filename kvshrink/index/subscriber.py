"""ZMQ subscriber for vLLM KV events, with sequence-gap repair.

One SUB socket on its own thread. It binds the configured endpoints (vLLM instances whose
``--kv-events-config`` ``endpoint`` is ``tcp://<index host>:<port>`` connect to it) and connects to
instances that bind their own PUB (``events_endpoint`` in the registry). Each message is
``(topic = kv@<instance>@<model>, seq, payload)``; the topic names the instance.

Sequence handling per (instance, data-parallel rank), see ``sequence``: on a gap the subscriber
asks the instance's replay endpoint (vLLM's ROUTER socket, ``replay_endpoint`` in the kv-events
config, registered with the instance) for the missing batches; if there is no replay endpoint or
the replay does not cover the gap, that stream's blocks are dropped (full resync: later events
rebuild them) so the index never keeps blocks whose removal it may have missed. A sequence that
restarts means a restarted engine: its blocks are dropped. The first message of a stream triggers a
replay from 0 when possible, so an index (re)started after the engines learns their current cache.

Malformed messages are counted and dropped; nothing that arrives on the wire stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading

import zmq

from kvshrink.errors import KVShrinkError
from kvshrink.index import vllm_ingest
from kvshrink.index.events import DecodedBatch, decode_batch, parse_topic
from kvshrink.index.sequence import Verdict
from kvshrink.index.state import IndexState

logger = logging.getLogger(__name__)
SOURCE = "vllm"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_DP_RANKS = 256


class KVEventSubscriber:
    def __init__(self, state: IndexState, bind: list[str], connect: list[str] | None = None,
                 replay_timeout_s: float = 2.0, rcvhwm: int = 100_000) -> None:
        self.state = state
        self.bind_endpoints = list(bind)
        self.replay_timeout_s = replay_timeout_s
        self.rcvhwm = rcvhwm
        self.bound: list[str] = []
        self.messages = 0  # messages handled (any outcome); lets tests and benchmarks wait for quiescence
        self._ctx = zmq.Context()
        self._pending_connects: queue.SimpleQueue[str] = queue.SimpleQueue()
        for endpoint in connect or ():
            self._pending_connects.put(endpoint)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> "KVEventSubscriber":
        self._thread = threading.Thread(target=self._run, name="kvshrink-index-zmq", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._start_error is not None:
            raise self._start_error
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._ctx.term()

    def connect(self, endpoint: str) -> None:
        """Also subscribe to a PUB socket that an instance binds (thread-safe)."""
        self._pending_connects.put(endpoint)

    # -- thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            for endpoint in self.bind_endpoints:
                sub.bind(endpoint)
                self.bound.append(sub.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError as exc:
            self._start_error = KVShrinkError(f"cannot bind KV event endpoint {self.bind_endpoints}: {exc}")
            sub.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                self._drain_connects(sub)
                if not poller.poll(100):
                    continue
                for _ in range(10_000):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(frames)
        finally:
            sub.close(linger=0)

    def _drain_connects(self, sub: zmq.Socket) -> None:
        while True:
            try:
                endpoint = self._pending_connects.get_nowait()
            except queue.Empty:
                return
            try:
                sub.connect(endpoint)
                logger.info("subscribed to KV events at %s", endpoint)
            except zmq.ZMQError as exc:
                logger.warning("cannot connect to KV event endpoint %s: %s", endpoint, exc)
                self.state.metrics.drop(SOURCE, "bad_connect_endpoint")

    # -- messages -----------------------------------------------------------------------------

    def handle(self, frames: list[bytes]) -> None:
        """Apply one ``(topic, seq, payload)`` message; never raises for bad input."""
        try:
            self._handle(frames)
        except KVShrinkError as exc:
            logger.warning("dropped KV event message: %s", exc)
            self.state.metrics.drop(SOURCE, "malformed_message")
        except Exception:  # noqa: BLE001 - the subscriber thread must survive anything on the wire
            logger.exception("internal error on a KV event message (counted, dropped)")
            self.state.metrics.drop(SOURCE, "internal_error")
        finally:
            self.messages += 1

    def _handle(self, frames: list[bytes]) -> None:
        metrics = self.state.metrics
        if len(frames) != 3 or len(frames[1]) != 8:
            return metrics.drop(SOURCE, "bad_frames")
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        instance_id, model = parse_topic(topic)
        batch = decode_batch(payload)
        dp_rank = batch.data_parallel_rank or 0
        if dp_rank >= MAX_DP_RANKS:  # each rank is a stream and a feed: keep their number bounded
            return metrics.drop(SOURCE, "bad_dp_rank")
        stream = (instance_id, dp_rank)
        state = self.state
        with state.lock:
            inst = state.resolve_instance(instance_id, model, SOURCE)
            if inst is None:
                return None
            tracker = state.vllm_seq
            obs = tracker.observe(stream, seq)
            if obs.verdict is Verdict.APPLY:
                self._apply(inst, model, batch)
                tracker.applied(stream, seq)
                return None
            if obs.verdict is Verdict.DUPLICATE:
                return metrics.drop(SOURCE, "duplicate_batch")
            if obs.verdict is Verdict.RESTART:
                metrics.seq_gaps.labels(SOURCE, "restart").inc()
                state.reset_feed(inst, vllm_ingest.feed_name(dp_rank), "restart")
                tracker.forget(stream)
            missing_from = obs.missing_from if obs.verdict is Verdict.GAP else 0
            replay_endpoint = _rank_endpoint(inst.replay_endpoint, dp_rank)
        fetched = None
        if seq > missing_from and replay_endpoint:
            fetched = self._replay(replay_endpoint, missing_from, seq - 1)
        with state.lock:
            inst = state.resolve_instance(instance_id, model, SOURCE)
            if inst is None:
                return None
            complete = fetched is not None and [s for s, _ in fetched] == list(range(missing_from, seq))
            if obs.verdict is Verdict.GAP:
                action = "replayed" if complete else "resync"
                metrics.seq_gaps.labels(SOURCE, action).inc()
                if not complete:
                    state.reset_feed(inst, vllm_ingest.feed_name(dp_rank), "sequence_gap")
            for replayed_seq, replayed_payload in fetched or ():
                try:
                    self._apply(inst, model, decode_batch(replayed_payload))
                except KVShrinkError:
                    metrics.drop(SOURCE, "malformed_replay")
            if fetched:
                tracker.replayed(stream, fetched[0][0], fetched[-1][0])
            self._apply(inst, model, batch)
            tracker.applied(stream, seq)
        return None

    def _apply(self, inst, model: str, batch: DecodedBatch) -> None:
        vllm_ingest.apply_batch(self.state, inst, model, batch)

    def _replay(self, endpoint: str, first: int, last: int) -> list[tuple[int, bytes]] | None:
        """Ask a vLLM replay ROUTER for batches ``first..last``; ``None`` if it does not answer."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        fetched: list[tuple[int, bytes]] = []
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            timeout_ms = int(self.replay_timeout_s * 1000)
            while sock.poll(timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.state.metrics.drop(SOURCE, "bad_replay_frames")
                    continue
                if frames[2] == END_SEQ:
                    return fetched
                seq = int.from_bytes(frames[2], "big")
                if first <= seq <= last:
                    fetched.append((seq, frames[3]))
            logger.warning("replay from %s timed out after %d batches", endpoint, len(fetched))
            return fetched or None
        except zmq.ZMQError as exc:
            logger.warning("replay from %s failed: %s", endpoint, exc)
            return None
        finally:
            sock.close()


def _rank_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """vLLM offsets a data-parallel rank's tcp port by its rank; mirror that."""
    if not endpoint or not dp_rank:
        return endpoint
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, port = endpoint.rsplit(":", 1)
        if port.isdigit() and int(port):
            return f"{base}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}" if "inproc" in endpoint else endpoint
