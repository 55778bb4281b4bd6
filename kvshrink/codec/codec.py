"""``Codec``: settings and the encode / decode / read_header entry points.

Thread safety: a ``Codec`` may be used from many threads at once. Its settings are immutable; the
zstd contexts live per thread (``backends``). Block parallelism comes from a thread budget
(:mod:`kvshrink.codec.cpu_budget`): the one given to the constructor (a store passes its own),
else the process-wide one; however many Codecs and callers share a budget, at most its limit of
threads run block work at once; a Codec owns no threads.
Buffer ownership: ``encode`` only reads its input and returns new ``bytes``; ``decode`` writes only
into the array it returns (``out`` when given, whose content is unspecified if decode raises),
straight from the frame's memory (no intermediate copy of the frame or of the decoded chunk).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvshrink.codec import backends, byteplanes, dtypes, fast_frames, frame_writer, in_place, transcode
from kvshrink.codec.blocks import EncodePlan, decode_block, encode_block, encode_fast_words, fast_words_apply
from kvshrink.codec.cpu_budget import CpuBudget
from kvshrink.codec.cpu_budget import budget as _process_budget
from kvshrink.codec.errors import CodecArgumentError, CodecError, UnsupportedArrayError
from kvshrink.codec.frame import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_BLOCKS,
    METHODS,
    FrameHeader,
    block_count,
    pack_header,
    parse_header,
)

DEFAULT_BLOCK_SIZE = 512 << 10
DEFAULT_HASH_LOG = 6
DEFAULT_MIN_SAVING = 0.02
MAX_BLOCK_SIZE = 1 << 30  # stream sizes are stored as 32-bit integers
PARALLEL_MIN_BYTES = 256 << 10  # below this, handing blocks to other threads costs more than it saves
TRANSFORM_CHOICES = ("auto", "none", "rotl1")


def default_threads() -> int:
    """The process-wide budget's limit: ``KVSHRINK_CODEC_THREADS``, else the CPUs this process may
    use (ConfigError if malformed); a store with ``engine.codec_threads`` runs on a budget of its own."""
    return _process_budget().limit()


class Codec:
    """Codec settings plus the machinery to apply them.

    * ``method``: "zstd" (default), "qat" (gzip/deflate; QAT hardware when libqatzip is present),
      "fast" (exponent bytes as fixed-width codes, 4-bit code pairs where they fit, the rest
      stored: ~1.33x on bf16 KV at several GB/s per core; :mod:`kvshrink.codec.nibbles`,
      :mod:`kvshrink.codec.packed`) or "raw" (framed and checksummed, not
      compressed);
    * ``level``: zstd 1..22 or deflate 1..9 (1 is best on split KV: higher zstd levels are slower
      *and* larger there); ignored by "raw" and "fast";
    * ``block_size``: bytes of input per independent block (parallelism and checksum granularity);
    * ``threads``: most busy threads per call, the caller included (None: the process budget's
      limit, looked up per call); a call gets fewer when the budget is taken by other calls;
    * ``hash_log``: zstd match-finder table size for plain zstd streams (None: zstd's default;
      nibble-coded exponent streams always use zstd's default: matches there are worth their bits);
    * ``min_saving``: a stream whose sampled order-0 entropy promises a smaller saving is stored;
    * ``transform``: "auto" (rotl1 when a sample says it helps), "none" or "rotl1";
    * ``max_frame_bytes``: decode refuses frames claiming more decoded bytes than this;
    * ``budget``: the :class:`~kvshrink.codec.cpu_budget.CpuBudget` whose threads run block work
      (None: the process-wide one).
    """

    def __init__(self, method: str = "zstd", level: int = 1, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 threads: int | None = None, hash_log: int | None = DEFAULT_HASH_LOG,
                 min_saving: float = DEFAULT_MIN_SAVING, transform: str = "auto",
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, budget: CpuBudget | None = None) -> None:
        self.budget = _process_budget() if budget is None else budget
        self.method = _check_method(method)
        self.level = _check_level(method, level)
        self.block_size = _check_int("block_size", block_size, 1, MAX_BLOCK_SIZE)
        if threads is None:
            self.budget.limit()  # a malformed KVSHRINK_CODEC_THREADS fails here, not in the first call
        self._threads = None if threads is None else _check_int("threads", threads, 1)
        if hash_log is not None:
            _check_int("hash_log", hash_log, 6, 30)
        self.hash_log = hash_log
        if not 0.0 <= min_saving < 1.0:
            raise CodecArgumentError("min_saving", f"must be in [0, 1), got {min_saving!r}")
        self.min_saving = float(min_saving)
        if transform not in TRANSFORM_CHOICES:
            raise CodecArgumentError("transform", f"must be one of {TRANSFORM_CHOICES}, got {transform!r}")
        self.transform = transform
        self.max_frame_bytes = _check_int("max_frame_bytes", max_frame_bytes, 0)

    @property
    def threads(self) -> int:
        """Most threads one call may use: the ``threads`` given, else the budget's limit now."""
        return self.budget.limit() if self._threads is None else self._threads

    def __repr__(self) -> str:
        return (f"Codec(method={self.method!r}, level={self.level}, block_size={self.block_size}, "
                f"threads={self.threads}, hash_log={self.hash_log}, min_saving={self.min_saving}, "
                f"transform={self.transform!r})")

    # -- public entry points ----------------------------------------------------------------------
    def encode(self, x: Any, *, method: str | None = None, level: int | None = None,
               into: Callable[[int], Any] | None = None) -> Any:
        """A frame holding ``x`` (numpy array or torch tensor) as new ``bytes``; ``x`` is never
        modified. With ``into``, the frame is written into ``into(frame_size)`` instead (a writable
        contiguous buffer of exactly that size, which the caller owns; called once, after the
        blocks are encoded, from the calling thread) and that buffer is returned."""
        method = self.method if method is None else _check_method(method)
        level = self.level if level is None else _check_level(method, level)
        kind, rows = dtypes.as_byte_rows(x)
        if kind.nbytes > self.max_frame_bytes:
            raise UnsupportedArrayError(
                f"array of {kind.nbytes} bytes is above max_frame_bytes={self.max_frame_bytes}; raise that limit "
                "on the writing and the reading Codec, or send smaller chunks")
        nstreams = 1 if method == "raw" or kind.itemsize == 1 else kind.itemsize
        rotate, bits = byteplanes.analyze(rows, self.transform if nstreams > 1 else "none")
        attempt = tuple(b <= 8.0 * (1.0 - self.min_saving) for b in bits) if nstreams == kind.itemsize else (False,)
        block_elems = max(1, self.block_size // kind.itemsize, -(-kind.size // MAX_BLOCKS))
        plan = EncodePlan(method, level, self.hash_log, attempt, rotate, nstreams, block_elems)
        nblocks = block_count(kind.size, block_elems)
        threads, parallel = self.threads, _parallel(nblocks, kind.nbytes)
        groups = _groups(nblocks, threads if parallel else 1)
        if fast_words_apply(plan):  # one kernel call per group of blocks
            if into is None and in_place.available():  # straight into the frame: no copy of the payloads
                return in_place.encode_fast_frame(rows, plan, kind, "rotl1" if rotate else "none", groups,
                                                  lambda count, work: self.budget.run(count, work, threads, parallel))
            blocks = [blk for group in self.budget.run(len(groups), lambda g: encode_fast_words(rows, plan, *groups[g]),
                                                    threads, parallel) for blk in group]
        else:
            blocks = self.budget.run(nblocks, lambda b: encode_block(rows[b * block_elems:(b + 1) * block_elems], plan),
                                  threads, parallel)
        return self._write_frame(kind, method, "rotl1" if rotate else "none", nstreams, block_elems, blocks, into,
                                 len(groups), threads, parallel)

    def transcode(self, blob: Any, *, method: str, level: int | None = None) -> Any:
        """``blob``'s array as a frame of ``method`` (``blob`` itself if it is one already). A
        ``fast`` frame of 2-byte elements becomes a ``zstd`` frame without decoding the chunk
        (:mod:`kvshrink.codec.transcode`: a demotion from a fast tier to a dense one); any other
        pair is decoded and encoded. CodecError if ``blob`` is corrupt where it is read."""
        made = self.transcode_direct(blob, method=method, level=level)
        if made is None:
            made = self.encode(self.decode(blob), method=method, level=level)
        return made

    def transcode_direct(self, blob: Any, *, method: str, level: int | None = None) -> Any | None:
        """:meth:`transcode` where it needs no decode of the chunk (the same frame, or fast to
        zstd), else None: a caller holding several targets decodes once itself."""
        method = _check_method(method)
        level = self.level if level is None else _check_level(method, level)
        view = _as_bytes_view(blob)
        header, table = parse_header(view, self.max_frame_bytes)
        if header.method == method:
            return blob
        if not transcode.fast_to_dense_applies(header, table, method):
            return None
        threads, parallel = self.threads, _parallel(header.nblocks, header.raw_size)
        blocks = self.budget.run(header.nblocks,
                                 lambda b: transcode.dense_block(view, header, table, b, level, self.hash_log),
                                 threads, parallel)
        return self._write_frame(header.kind, method, header.transform, 2, header.block_elems, blocks, None,
                                 len(_groups(header.nblocks, threads if parallel else 1)), threads, parallel)

    def _write_frame(self, kind: dtypes.ArrayKind, method: str, transform: str, nstreams: int, block_elems: int,
                     blocks: list, into: Callable[[int], Any] | None, groups: int, threads: int, parallel: bool) -> Any:
        """The frame of encoded ``blocks`` (header, then payloads, copied in ``groups`` on the budget)
        as new ``bytes``, or into ``into(size)``; the blocks' pooled buffers are released."""
        sizes = [[memoryview(p).nbytes for p in blk.payloads] for blk in blocks]
        header = pack_header(kind, method, transform, nstreams, block_elems,
                             [blk.checksum for blk in blocks], [blk.codings for blk in blocks], sizes)
        try:
            size = len(header) + sum(map(sum, sizes))
            if into is not None:
                frame = into(size)
                dest = frame_writer.writable_view(frame, size)
            elif (made := frame_writer.fresh_bytes(size)) is not None:
                frame, dest = made
            else:
                return b"".join([header, *(p for blk in blocks for p in blk.payloads)])
            frame_writer.write(dest, header, [blk.payloads for blk in blocks], groups,
                               lambda count, work: self.budget.run(count, work, threads, parallel))
            return frame
        finally:
            for blk in blocks:
                blk.release()

    def decode(self, blob: Any, out: Any = None, *, as_numpy: bool = False) -> Any:
        """The array held by ``blob``, bit-exact, as the container it was encoded from.

        With ``out`` (numpy array or torch tensor of the frame's dtype, or its raw uint view, with
        the same number of bytes) the result is written there and ``out`` is returned; a
        C-contiguous CPU ``out`` is filled in place without an intermediate full-size copy.
        ``as_numpy`` returns numpy even for torch frames (bf16/fp8 as their raw uint dtype).
        """
        view = _as_bytes_view(blob)
        header, table = parse_header(view, self.max_frame_bytes)
        kind = header.kind
        if out is not None:
            rows = dtypes.output_rows(out, kind)
            result, copy_needed = out, rows is None
            if copy_needed:
                rows = np.empty((kind.size, kind.itemsize), dtype=np.uint8)
        else:
            copy_needed = False
            result, rows = _numpy_output(kind) if as_numpy else dtypes.new_output(kind)
        threads, parallel = self.threads, _parallel(header.nblocks, kind.nbytes)
        kernels = fast_frames.kernels()
        words = None if kernels is None else fast_frames.word_blocks(view, header, table, kernels)
        if words is not None:  # one kernel call per group of blocks
            out_words = rows.reshape(-1).view("<u2")
            groups = _groups(header.nblocks, threads if parallel else 1)
            self.budget.run(len(groups), lambda g: words.decode(kernels, out_words, *groups[g]), threads, parallel)
        else:
            self.budget.run(header.nblocks,
                            lambda b: decode_block(view, header, table, b, rows[_block_slice(header, b)]),
                            threads, parallel)
        if copy_needed and kind.nbytes:
            dtypes.copy_into(out, rows.reshape(-1))
        return result

    def read_header(self, blob: Any) -> FrameHeader:
        """The validated header of ``blob`` (dtype, shape, method, sizes); nothing is decompressed."""
        return parse_header(_as_bytes_view(blob), self.max_frame_bytes)[0]

    def close(self) -> None:
        """Nothing to release: helper threads belong to the process budget (kept for callers
        that use a Codec as a context manager)."""

    def __enter__(self) -> "Codec":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parallel(nblocks: int, nbytes: int) -> bool:
    """Whether helpers may join a call: several blocks, and enough bytes to pay for the hand-off."""
    return nblocks > 1 and nbytes >= PARALLEL_MIN_BYTES


def _groups(nblocks: int, threads: int) -> list[tuple[int, int]]:
    """Contiguous [first, stop) block ranges: one for a serial call, else two per thread, so a
    helper that starts late leaves the caller whole groups to take instead of idling."""
    count = min(nblocks, 1 if threads <= 1 else 2 * threads)
    if not count:
        return []
    edges = [nblocks * g // count for g in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _block_slice(header: FrameHeader, block: int) -> slice:
    return slice(block * header.block_elems, (block + 1) * header.block_elems)


def _numpy_output(kind: dtypes.ArrayKind) -> tuple[np.ndarray, np.ndarray]:
    if kind.container == dtypes.NUMPY:
        dtype = np.dtype(kind.dtype)
    elif kind.dtype in ("bool", "float16", "float32", "float64", "complex64", "complex128") or \
            kind.dtype.startswith(("int", "uint")):
        dtype = np.dtype(kind.dtype)
    else:  # bfloat16, fp8, complex32...: numpy has no such type; hand back the raw bits
        dtype = np.dtype(f"u{kind.itemsize}")
    array = np.empty(kind.shape, dtype=dtype)
    return array, array.reshape(-1).view(np.uint8).reshape(kind.size, kind.itemsize)


def _as_bytes_view(blob: Any) -> memoryview:
    """A read-only flat byte view of ``blob`` (bytes, bytearray, memoryview or uint8 array)."""
    try:
        view = memoryview(blob)
    except TypeError:
        raise CodecError(f"a frame must be bytes-like, not {type(blob).__name__}") from None
    if not view.c_contiguous:
        raise CodecError("a frame must be a contiguous buffer")
    return view.cast("B").toreadonly() if view.format != "B" or view.ndim != 1 else view.toreadonly()


def _check_method(method: str) -> str:
    if method not in METHODS:
        raise CodecArgumentError("method", f"unknown codec method {method!r}; choose one of {METHODS}")
    return method


def _check_level(method: str, level: int) -> int:
    try:
        return backends.validate_level(method, level)
    except ValueError as exc:
        raise CodecArgumentError("level", str(exc)) from None


def _check_int(key: str, value: int, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise CodecArgumentError(key, f"must be an integer {bound}, got {value!r}")
    return value
