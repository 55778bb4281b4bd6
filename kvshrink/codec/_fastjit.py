"""Compiled per-block loops of ``fast`` frames of 2-byte elements (numba): choose a block's
exponent coding, encode it, check a whole frame's payload headers, decode blocks, with no Python
between the steps of a block.

Why here: a block's exponents are coded as 4-bit code pairs (``_nibblejit``'s kernels, the
nibble coding stored) where the sample picks a window of 15 values, the case of real KV, and as
packed bit planes of another width (``_packjit``) otherwise; this module sits above both.

Block checksums are xxh3-64 from the ``xxhash`` package's own library, called by name from the
kernels (``XXH3_64bits_dispatch``, the SIMD variant the package itself calls; its extension exports
it and llvmlite resolves it once the library is loaded), and libc's ``memmove`` moves a block's low
bytes, so a worker decodes and verifies, or encodes, places and hashes, its whole group of blocks
in one call. With a kernel call, a move and a Python hash per block, interleaved runs on the
AVX-512 EPYC were 3-9 % slower to decode and 8-10 % slower to encode on one thread (8-18 % on
two). Where the symbol is missing, ``verify_in_kernel`` is False and callers go block by block.

Threads: every kernel is ``nogil`` and shares no state. Buffers: kernels write only the arrays they
are given. Errors: no bounds checks in the kernels; ``word_block_args`` checks every payload
header against its block before any decode runs, and decode statuses report the first failing
block. Importing this module raises ImportError when numba is missing.
"""

from __future__ import annotations

import numba
import numpy as np

from kvshrink.codec import _nibblejit, _packjit
from kvshrink.codec.frame import PACKED, PAIRS
from kvshrink.codec.nibbles import PAIRS_WIDTH

ERR_CHECKSUM = 3  # the third status code of decode_verify_word_blocks, after _packjit's two


def _load_xxh3() -> bool:
    """Make ``XXH3_64bits_dispatch`` of the ``xxhash`` extension resolvable by compiled code;
    False where that extension or the symbol is not there (another build of the package)."""
    import llvmlite.binding

    try:
        import xxhash._xxhash

        llvmlite.binding.load_library_permanently(xxhash._xxhash.__file__)
    except (ImportError, AttributeError, RuntimeError):
        return False
    return llvmlite.binding.address_of_symbol("XXH3_64bits_dispatch") is not None


verify_in_kernel = _load_xxh3()
_memmove = numba.types.ExternalFunction("memmove", numba.types.voidptr(numba.types.voidptr, numba.types.voidptr,
                                                                      numba.types.uintp))  # libc's
_xxh3 = numba.types.ExternalFunction("XXH3_64bits_dispatch",
                                     numba.types.uint64(numba.types.voidptr, numba.types.uintp))


@numba.njit(nogil=True, cache=True)
def decode_word_blocks(blob, hi_off, hi_len, lo_off, codings, widths, bases, planes_len, block_elems, out, rotate,
                       first, stop):
    """Decode the fused 2-byte blocks ``first..stop-1`` of a fast frame (``blob``: the whole frame as
    uint8) into ``out`` (uint16, every element of the frame): code pairs or packed planes, as
    ``codings`` says. Per-block arrays come from ``word_block_args`` (``planes_len``: bytes of the
    planes or of the pairs), which ``fast_frames.WordBlocks`` validated; it calls this a block at a
    time so that the block's checksum reads it from cache. Returns 0, or ``-(block * 4 + code)``
    with code 1 / 2 for ERR_EXCEPTIONS / ERR_COUNT of the first failing block."""
    n = out.size
    for b in range(first, stop):
        start = b * block_elems
        m = min(block_elems, n - start)
        ho, pl = hi_off[b], planes_len[b]
        exc = blob[ho + 4 + pl:ho + hi_len[b]]
        low, dst = blob[lo_off[b]:lo_off[b] + m], out[start:start + m]
        if codings[b] == PAIRS:
            status = _nibblejit.decode(blob[ho + 4:ho + 4 + pl], bases[b], exc, low, dst, rotate)
        else:
            status = _packjit.decode(blob[ho + 4:ho + 4 + pl].view(np.uint64), widths[b], bases[b], exc, low, dst,
                                     rotate)
        if status:
            return -(b * 4 + (1 if status == _packjit.ERR_EXCEPTIONS else 2))
    return 0


@numba.njit(nogil=True, cache=True)
def decode_verify_word_blocks(blob, hi_off, hi_len, lo_off, codings, widths, bases, planes_len, block_elems, out,
                              rotate, checksums, first, stop):
    """:func:`decode_word_blocks` for blocks ``first..stop-1``, each block's xxh3-64 compared with
    ``checksums`` right after it is decoded (from cache). Only where ``verify_in_kernel``. Returns
    0, a decode status, or ``-(block * 4 + ERR_CHECKSUM)`` for the first block whose bytes do not
    match."""
    n = out.size
    for b in range(first, stop):
        status = decode_word_blocks(blob, hi_off, hi_len, lo_off, codings, widths, bases, planes_len, block_elems,
                                    out, rotate, b, b + 1)
        if status:
            return status
        start = b * block_elems
        block = out[start:start + min(block_elems, n - start)]
        if _xxh3(block.ctypes.data, block.size * 2) != checksums[b]:
            return -(b * 4 + ERR_CHECKSUM)
    return 0


@numba.njit(nogil=True, cache=True)
def encode_word_blocks(words, rotate, block_elems, first, stop, slots, slot_size, escape_cost_bits, header,
                       max_width, max_escapes, sample_runs, sample_run, results):
    """Encode blocks ``first..stop-1`` of ``words`` (uint16, the whole input) as
    ``blocks._encode_fast`` does, each into its slot of ``slots`` (uint8, ``slot_size`` bytes a
    block: the payload from 0, the low bytes from ``slot_size - block_elems``): sampling, choice and
    coding in one call without the GIL. ``results[b - first]`` gets (payload bytes, PAIRS or
    PACKED), or (0, 0) when the coded high bytes would not be smaller than the block: the caller
    encodes that block the general way. ``max_escapes``: the largest share of escapes code pairs
    take (``nibbles.MAX_ESCAPE_SHARE``)."""
    n = words.size
    hist = np.empty(256, np.int64)
    for b in range(first, stop):
        start = b * block_elems
        m = min(block_elems, n - start)
        src = words[start:start + m]
        slot = slots[(b - first) * slot_size:(b - first + 1) * slot_size]
        low = slot[slot_size - block_elems:slot_size - block_elems + m]
        hist[:] = 0
        _packjit.histogram(src, rotate, sample_runs, sample_run, hist)
        w, base, estimate = _packjit.choose(hist, m, escape_cost_bits, header, max_width)
        results[b - first, 0] = 0
        results[b - first, 1] = 0
        if estimate >= m:
            continue
        if w == PAIRS_WIDTH:
            pairs = (m + 1) // 2
            ne = _nibblejit.encode(src, rotate, base, slot[header:header + pairs],
                                   slot[header + pairs:slot_size - block_elems], low)
            size = header + pairs + ne
            if ne <= m * max_escapes and size < m:
                slot[0], slot[1], slot[2], slot[3] = base, 0, 0, 0
                results[b - first, 0] = size
                results[b - first, 1] = PAIRS
                continue
        ne = -1
        while ne < 0:  # width 0 that the sample missed a value for: width 1, as packed._encode
            planes = _packjit.planes_bytes(m, w)
            ne = _packjit.encode(src, rotate, w, base, slot[header:header + planes].view(np.uint64),
                                 slot[header + planes:slot_size - block_elems], low)
            if ne < 0:
                w = 1
        slot[0], slot[1], slot[2], slot[3] = w, base, 0, 0
        size = header + planes + ne
        if size < m:
            results[b - first, 0] = size
            results[b - first, 1] = PACKED


@numba.njit(nogil=True, cache=True)
def encode_word_group(words, rotate, block_elems, first, stop, dest, pos, slot_size, escape_cost_bits, header,
                      max_width, max_escapes, sample_runs, sample_run, checksums, sizes, codings):
    """Encode blocks ``first..stop-1`` of ``words`` into ``dest`` (uint8) from ``pos`` on, each
    block as :func:`encode_word_blocks` codes it into a slot at the current position, its low bytes
    then moved down behind its high payload (from cache) and its raw bytes hashed (xxh3-64); only
    where ``verify_in_kernel``. ``checksums`` / ``sizes`` (high payload bytes) / ``codings`` get
    one entry a block, indexed from ``first``. Stops at the first block whose high bytes are not
    worth coding (the caller encodes that one the general way). Returns (the block it stopped at,
    or ``stop``; the position behind the last block written)."""
    n = words.size
    result = np.empty((1, 2), np.int64)
    for b in range(first, stop):
        encode_word_blocks(words, rotate, block_elems, b, b + 1, dest[pos:pos + slot_size], slot_size,
                           escape_cost_bits, header, max_width, max_escapes, sample_runs, sample_run, result)
        size, coding = result[0, 0], result[0, 1]
        if coding == 0:
            return b, pos
        start = b * block_elems
        m = min(block_elems, n - start)
        low = pos + slot_size - block_elems
        _memmove(dest[pos + size:].ctypes.data, dest[low:].ctypes.data, m)  # ranges may overlap
        block = words[start:start + m]
        checksums[b - first] = _xxh3(block.ctypes.data, m * 2)
        sizes[b - first], codings[b - first] = size, coding
        pos += size + m
    return stop, pos


@numba.njit(nogil=True, cache=True)
def word_block_args(blob, hi_off, hi_len, codings, block_elems, n, header, max_width, widths, bases, planes_len):
    """Read each block's high-stream payload header (at ``hi_off``, ``hi_len`` bytes, coded as
    ``codings`` says) into ``widths``, ``bases`` and ``planes_len`` (bytes of the planes or of the
    code pairs) and check it as ``packed.check_payload`` / ``nibbles.check_pairs_payload`` do;
    False at the first block that fails (its caller then takes the path that reports it)."""
    for b in range(hi_off.size):
        m = min(block_elems, n - b * block_elems)
        size, at = hi_len[b], hi_off[b]
        if size < header:
            return False
        if codings[b] == PAIRS:
            w, planes = PAIRS_WIDTH, (m + 1) // 2
            if blob[at + 1] or blob[at + 2] or blob[at + 3]:
                return False
            base = blob[at]
        else:
            w = np.int64(blob[at])
            if w > max_width or blob[at + 2] or blob[at + 3]:
                return False
            planes = _packjit.planes_bytes(m, w)
            base = blob[at + 1]
        exceptions = size - header - planes
        if exceptions < 0 or exceptions > m or (w == 0 and exceptions):
            return False
        widths[b], bases[b], planes_len[b] = w, base, planes
    return True
