"""Can a compiled SIMD entropy coder decode the dense frames' code pairs faster than zstd?

Why asked: a dense (SSD-tier) decode spends 60-90 % of its time in zstd's Huffman stage over the
code pairs (~1 GB/s of pairs here), and issue 27's dense targets (decode 3.5 GB/s on one core, the
SSD-in-page-cache L2 rows) need that stage about twice as fast at the same ratio. numba could not
reach zstd (a 4-stream Huffman coder ran at half its speed: docs/bench/notes.md, stop 37). This
builds ``experiments/rans_pairs.c`` with the machine's gcc (``-O3 -march=native``): an order-0
static rANS coder, 32 interleaved 32-bit states, 12-bit probabilities, 16-bit renormalisation,
encoded by scalar code and by AVX2, decoded by AVX2 gathers (one word stream, or one per 8-lane
vector so their reads do not chain), where the CPU has AVX-512 VBMI2 by 16-lane gathers and
expand-loads, and fused with the rebuild of the bf16 words. Every decoder must round-trip every
block bit-exactly and the AVX2 encoder must write the scalar one's bytes; then each runs on the
same blocks as zstandard (level 1, the dense codec's) in interleaved rounds in one process.

Run: ``python experiments/rans_pairs.py [--out docs/bench/rans-pairs.json]`` (about a minute).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from kvshrink.codec import nibbles
from kvshrink.testing.fixtures.real_kv import real_kv_chunks

HERE = Path(__file__).resolve().parent
BLOCK = 512 << 10  # the codec's default block: 256 Ki bf16 values, 128 KiB of code pairs
ROUNDS = 9
VARIANTS = {"avx2, 1 word stream": ("rans_decode1_avx2", 32), "avx2, 4 word streams": ("rans_decode4_avx2", 8),
            "avx512, 2 word streams": ("rans_decode2_avx512", 16)}


def cpu() -> tuple[str, list[str]]:
    """(model name, the SIMD flags that matter here) from /proc/cpuinfo."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = next(line for line in lines if line.startswith("flags")).split(":", 1)[1].split()
    return model, sorted(f for f in flags if f.startswith(("avx", "amx", "bmi")))


@dataclass
class Block:
    """One block of real KV as a dense frame codes it: the words, their code-pair payload, the
    pairs alone, and the stored low bytes."""
    words: np.ndarray  # uint16[n], the original bf16 bits
    payload: np.ndarray  # the code-pair stream: base, 3 reserved bytes, the pairs, the exceptions
    low: np.ndarray  # uint8[n]

    @property
    def pairs(self) -> np.ndarray:
        return self.payload[nibbles.PAIRS_HEADER:nibbles.PAIRS_HEADER + self.words.size // 2]

    @property
    def exceptions(self) -> np.ndarray:
        return self.payload[nibbles.PAIRS_HEADER + self.words.size // 2:]


def kv_blocks() -> list[Block]:
    """Every block of 8 real KV chunks that the dense frame nibble-codes."""
    blocks = []
    for chunk in real_kv_chunks(8):
        words = chunk.view(np.uint16).ravel()
        for start in range(0, words.size - BLOCK // 2 + 1, BLOCK // 2):
            block = np.ascontiguousarray(words[start:start + BLOCK // 2])
            high = (((block << 1) | (block >> 15)) >> 8).astype(np.uint8)
            base, _ = nibbles.choose_base(np.bincount(high, minlength=256))
            coded = nibbles.encode_pair_words(block, True, base, lambda n: np.empty(n, np.uint8))
            if coded is not None:
                blocks.append(Block(block, np.ascontiguousarray(coded[0]), np.ascontiguousarray(coded[1])))
    return blocks


def build(folder: Path) -> ctypes.CDLL:
    lib = folder / "librans_pairs.so"
    subprocess.run(["gcc", "-O3", "-march=native", "-Wall", "-shared", "-fPIC", "-o", str(lib),
                    str(HERE / "rans_pairs.c")], check=True)
    dll = ctypes.CDLL(str(lib))
    p = ctypes.c_void_p
    dll.rans_normalise.argtypes = [p, ctypes.c_uint32, p]
    dll.rans_encode4.argtypes = [p, ctypes.c_uint32, p, p, ctypes.c_uint64, p, ctypes.c_int]
    dll.rans_encode4.restype = ctypes.c_int64
    dll.rans_encode4_avx2.argtypes = [p, ctypes.c_uint32, p, p, ctypes.c_uint64, p]
    dll.rans_encode4_avx2.restype = ctypes.c_int64
    dll.rans_count.argtypes = [p, ctypes.c_uint32, p]
    for name, _ in VARIANTS.values():
        if hasattr(dll, name):
            getattr(dll, name).argtypes = [p, ctypes.c_uint64, p, p, ctypes.c_uint32]
    dll.rans_decode_words_avx2.argtypes = [p, ctypes.c_uint64, p, ctypes.c_uint32, ctypes.c_uint8, p,
                                           ctypes.c_uint32, p, p]
    return dll


def rans_encode(dll: ctypes.CDLL, pairs: np.ndarray, group: int,
                out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> tuple[np.ndarray, int, np.ndarray]:
    """(stream buffer, its size, the frequencies); ``out`` / ``scratch`` reused when given."""
    counts = np.bincount(pairs, minlength=256).astype(np.uint32)
    freq = np.zeros(256, np.uint16)
    if dll.rans_normalise(counts.ctypes.data, pairs.size, freq.ctypes.data) != 0:
        raise RuntimeError("a block with fewer than two symbols")
    cap = 2 * pairs.size + 256
    out = np.empty(cap + 32, np.uint8) if out is None else out  # the decoders read up to 16 bytes past a stream
    scratch = np.empty(4 * (pairs.size + 8), np.uint16) if scratch is None else scratch
    size = dll.rans_encode4(pairs.ctypes.data, pairs.size, freq.ctypes.data, out.ctypes.data, cap,
                            scratch.ctypes.data, group)
    if size <= 0:
        raise RuntimeError("rANS output does not fit")
    return out, size, freq


def timed(fn, rounds: list[float]) -> None:
    start = time.perf_counter()
    fn()
    rounds.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    kv = kv_blocks()
    blocks = [b.pairs.copy() for b in kv]
    total = sum(b.nbytes for b in blocks)
    outs = [np.empty_like(b) for b in blocks]
    params = zstandard.ZstdCompressionParameters.from_level(1, write_content_size=False, write_checksum=False,
                                                            write_dict_id=False)
    cctx, dctx = zstandard.ZstdCompressor(compression_params=params), zstandard.ZstdDecompressor()
    frames = [cctx.compress(b) for b in blocks]

    def zstd_decode() -> None:
        for frame, out in zip(frames, outs):
            dctx.stream_reader(frame, read_across_frames=False).readinto(out)

    with tempfile.TemporaryDirectory() as folder:
        dll = build(Path(folder))
        decoders = {"zstd (zstandard, level 1)": zstd_decode}
        for label, (name, group) in VARIANTS.items():
            if not hasattr(dll, name):
                continue  # compiled only where the CPU has what it needs
            coded = [rans_encode(dll, b, group) for b in blocks]
            fn = getattr(dll, name)
            for (stream, size, freq), block, out in zip(coded, blocks, outs):
                out[:] = 0
                if fn(stream.ctypes.data, size, freq.ctypes.data, out.ctypes.data, block.size) != 0 or \
                        not np.array_equal(out, block):
                    raise SystemExit(f"{label}: a block did not round-trip")

            def decode(fn=fn, coded=coded) -> None:
                for (stream, size, freq), out in zip(coded, outs):
                    fn(stream.ctypes.data, size, freq.ctypes.data, out.ctypes.data, out.size)
            decoders[f"rANS {label}"] = decode

        enc_out = np.empty(2 * max(b.size for b in blocks) + 288, np.uint8)
        enc_scratch = np.empty(4 * (max(b.size for b in blocks) + 8), np.uint16)

        nibble_payloads = [np.frombuffer(nibbles.dense_from_pairs(memoryview(b.payload), b.words.size, 1), np.uint8)
                           for b in kv]
        words = [np.empty_like(b.words) for b in kv]
        scratch_pairs = np.empty(BLOCK // 4 + 1, np.uint8)
        coded8 = [rans_encode(dll, b.pairs, 8) for b in kv]  # every variant writes these sizes and tables
        rans_size = sum(size for _, size, _ in coded8)
        tables = sum(2 * int((freq > 0).sum()) for _, _, freq in coded8)  # a symbol and a 12-bit count each
        for (stream, size, freq), b, out, payload in zip(coded8, kv, words, nibble_payloads):
            out[:] = 0
            exc = b.exceptions
            if dll.rans_decode_words_avx2(stream.ctypes.data, size, freq.ctypes.data, b.pairs.size, int(b.payload[0]),
                                          exc.ctypes.data, exc.size, b.low.ctypes.data, out.ctypes.data) != 0 or \
                    not np.array_equal(out, b.words):
                raise SystemExit("fused rANS + rebuild: a block did not round-trip")
            out[:] = 0
            nibbles.decode_words(memoryview(payload), b.low, out, True, scratch_pairs)
            if not np.array_equal(out, b.words):
                raise SystemExit("the dense path's nibble decode: a block did not round-trip")

        def nibble_words() -> None:  # the dense frame's high stream today: zstd, then the numba rebuild
            for payload, b, out in zip(nibble_payloads, kv, words):
                nibbles.decode_words(memoryview(payload), b.low, out, True, scratch_pairs)

        def fused_words() -> None:
            for (stream, size, freq), b, out in zip(coded8, kv, words):
                exc = b.exceptions
                dll.rans_decode_words_avx2(stream.ctypes.data, size, freq.ctypes.data, b.pairs.size, int(b.payload[0]),
                                           exc.ctypes.data, exc.size, b.low.ctypes.data, out.ctypes.data)
        word_bytes = sum(b.words.nbytes for b in kv)
        word_work = {"words: zstd pairs + numba rebuild (dense today)": nibble_words,
                     "words: rANS avx2 fused with the rebuild (C)": fused_words}

        def rans_encode_all() -> None:  # the histogram included, as zstd counts its own
            for b in blocks:
                rans_encode(dll, b, 8, enc_out, enc_scratch)

        freqs8 = [freq for _, _, freq in coded8]

        def rans_coder_alone() -> None:  # the frequencies given: what a histogram in C would leave
            for b, freq in zip(blocks, freqs8):
                dll.rans_encode4(b.ctypes.data, b.size, freq.ctypes.data, enc_out.ctypes.data, enc_out.size - 32,
                                 enc_scratch.ctypes.data, 8)

        def rans_avx2_coder_alone() -> None:
            for b, freq in zip(blocks, freqs8):
                dll.rans_encode4_avx2(b.ctypes.data, b.size, freq.ctypes.data, enc_out.ctypes.data,
                                      enc_out.size - 32, enc_scratch.ctypes.data)
        counts, freq = np.empty(256, np.uint32), np.empty(256, np.uint16)

        def rans_avx2_whole() -> None:  # counting and normalising in C too: what zstd's time holds
            for b in blocks:
                dll.rans_count(b.ctypes.data, b.size, counts.ctypes.data)
                dll.rans_normalise(counts.ctypes.data, b.size, freq.ctypes.data)
                dll.rans_encode4_avx2(b.ctypes.data, b.size, freq.ctypes.data, enc_out.ctypes.data,
                                      enc_out.size - 32, enc_scratch.ctypes.data)
        for b, (stream, size, freq) in zip(blocks, coded8):  # the vector encoder writes the same bytes
            if dll.rans_encode4_avx2(b.ctypes.data, b.size, freq.ctypes.data, enc_out.ctypes.data, enc_out.size - 32,
                                     enc_scratch.ctypes.data) != size or not np.array_equal(enc_out[:size], stream[:size]):
                raise SystemExit("the AVX2 encoder's stream differs from the scalar encoder's")

        def zstd_encode_all() -> None:
            for b in blocks:
                cctx.compress(b)
        work = {**decoders, "encode: rANS (scalar, numpy histogram)": rans_encode_all,
                "encode: rANS (scalar, the coder alone)": rans_coder_alone,
                "encode: rANS (AVX2, the coder alone)": rans_avx2_coder_alone,
                "encode: rANS (AVX2, histogram in C)": rans_avx2_whole, "encode: zstd": zstd_encode_all, **word_work}
        rounds: dict[str, list[float]] = {k: [] for k in work}
        for _ in range(ROUNDS):
            for label, fn in work.items():
                timed(fn, rounds[label])
    result = {
        "question": __doc__.split("\n")[0], "cpu": cpu()[0], "cores": os.cpu_count(), "flags": cpu()[1],
        "blocks": len(blocks), "pair_bytes": total,
        "ratio_of_pairs": {"zstd": total / sum(len(f) for f in frames), "rANS, streams only": total / rans_size,
                           "rANS, with ~2 B per present symbol": total / (rans_size + tables)},
        "gb_per_s_of_pairs": {label: {"best": total / min(t) / 1e9, "median": total / float(np.median(t)) / 1e9}
                              for label, t in rounds.items() if label not in word_work},
        "gb_per_s_of_bf16_data": {label: {"best": word_bytes / min(t) / 1e9,
                                          "median": word_bytes / float(np.median(t)) / 1e9}
                                  for label, t in rounds.items() if label in word_work},
        "rounds": ROUNDS,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
