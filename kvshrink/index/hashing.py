"""Prefix block hashes computed from token ids, identical in every process and on every machine.

Choice: the index never matches on the engines' own block hashes. vLLM hashes blocks with
a per-process ``NONE_HASH`` that is random unless ``PYTHONHASHSEED`` is fixed, with a configurable
algorithm (pickle-based ``sha256`` by default, not stable across Python/vLLM versions); LMCache
chunk hashes inherit the same dependency. A router that trusted them would silently never hit when
one pod runs with another seed. Like llm-d, we recompute our own chained hash from the token ids
that every ``BlockStored`` event (and every LMCache ``store`` entry) carries. All arithmetic is
modulo 2**64 (``M`` and ``K`` are odd 64-bit constants, ``fmix64`` is MurmurHash3's finalizer)::

    root(model, bs) = xxh3_64(b"kvshrink-index/2\\0" + model + b"\\0" + decimal(bs))
    c[i] = fmix64(sum_k (tokens[i*bs + k] + 1) * M[bs][k])       block i's content, k in [0, bs)
    h[i] = h[i-1] * K + c[i],   h[-1] = root

so ``h[i]`` names the whole prefix ``tokens[0 : (i+1)*bs]`` of that model at that block size. The
content hashes need no loop and the chain is a linear recurrence, ``h[i] = K**(i+1) * h[-1] +
sum_j K**(i-j) * c[j]``: a whole prompt is hashed in a dozen numpy operations over its tokens
(32K tokens at block size 16: ~0.1 ms, against ~0.5 ms for 2048 chained xxh3 calls from Python),
which is most of what a lookup costs. A token change in block ``i`` changes ``c[i]`` (``M`` is
odd, a token is < 2**32) and so every later ``h``.
Engine hashes are kept only as opaque per-stream ids, to find a block's parent and to apply
``BlockRemoved``. Nothing here reads ``PYTHONHASHSEED``; engines may run with different seeds (the
real-vLLM test does). A stream that contradicts itself — an engine hash re-stored with other
tokens — is counted and logged as a hash conflict (see ``block_index``), which is how a seed or
algorithm mix-up *inside* one publisher would show. Neither hash is cryptographic: a crafted prompt
could collide, which costs at worst a wrong routing choice, never wrong KV (engines verify their
own hashes).
"""

from __future__ import annotations

import array
import sys
from functools import lru_cache
from typing import Iterable

import numpy as np
import xxhash

from kvshrink.errors import CorruptDataError

HASH_VERSION = b"kvshrink-index/2"
_xxh3 = xxhash.xxh3_64_intdigest
_MASK = (1 << 64) - 1
_K = 0x9E3779B97F4A7C15  # odd: invertible modulo 2**64
_K_INV = pow(_K, -1, 1 << 64)
# 0-d arrays, not numpy scalars: an operation with a numpy scalar costs ~0.3 us more
_FMIX = tuple(np.array(v, dtype=np.uint64) for v in (33, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53))
_powers_cache: tuple[np.ndarray, np.ndarray] = (np.ones(1, np.uint64), np.ones(1, np.uint64))


def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, in place: spreads a multilinear sum over all 64 bits."""
    shift, m1, m2 = _FMIX
    h ^= h >> shift
    h *= m1
    h ^= h >> shift
    h *= m2
    h ^= h >> shift
    return h


@lru_cache(maxsize=64)
def _multipliers(block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``M[bs]`` — one odd 64-bit multiplier per token position of a block, fixed by the version —
    and ``sum(M[bs])``, the ``+ 1`` of every token folded into one addition."""
    seed = _xxh3(HASH_VERSION + b"\0multipliers")
    multipliers = [_xxh3(k.to_bytes(4, "little"), seed) | 1 for k in range(block_size)]
    return np.array(multipliers, dtype=np.uint64), np.array(sum(multipliers) & _MASK, dtype=np.uint64)


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``K**i`` and ``K**-i`` for ``i`` in [0, n) (wrapping uint64), grown by doubling and kept."""
    global _powers_cache
    if len(_powers_cache[0]) < n:
        size = max(n, 2 * len(_powers_cache[0]), 4096)
        _powers_cache = (_geometric(_K, size), _geometric(_K_INV, size))
    k_pow, k_inv_pow = _powers_cache
    return k_pow[:n], k_inv_pow[:n]


def _geometric(ratio: int, size: int) -> np.ndarray:
    """``ratio**i`` for ``i`` in [0, size), modulo 2**64."""
    terms = np.full(size, ratio, dtype=np.uint64)
    terms[0] = 1
    return np.cumprod(terms)


def token_bytes(token_ids: Iterable[int]) -> bytes:
    """Little-endian uint32 bytes of ``token_ids``; ids outside [0, 2**32) are corrupt input."""
    try:
        arr = array.array("I", token_ids)
    except (OverflowError, TypeError, ValueError) as exc:
        raise CorruptDataError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if sys.byteorder == "big":  # pragma: no cover - no big-endian machine here
        arr.byteswap()
    return arr.tobytes()


@lru_cache(maxsize=4096)
def root_hash(model: str, block_size: int) -> int:
    """Seed of the chain for one (model, block size): different models never share blocks."""
    return _xxh3(HASH_VERSION + b"\0" + model.encode() + b"\0" + str(block_size).encode())


def chain_hashes(data: bytes | memoryview, block_size: int, parent: int) -> list[int]:
    """Hashes of the full blocks in ``data`` (uint32 token bytes), chained from ``parent``."""
    tokens = np.frombuffer(data, dtype="<u4")
    n = len(tokens) // block_size
    if n == 0:
        return []
    multipliers, offset = _multipliers(block_size)
    blocks = tokens[:n * block_size].reshape(n, block_size).astype(np.uint64)
    # sum_k (t_k + 1) * M_k  =  sum_k t_k * M_k  +  sum_k M_k
    # same sums either way: einsum is faster on a prompt, dot costs less per call on an event's few blocks
    content = np.einsum("ij,j->i", blocks, multipliers) if n >= 64 else np.dot(blocks, multipliers)
    content += offset
    content = fmix64(content)
    k_pow, k_inv_pow = _powers(n)
    content *= k_inv_pow  # h[i] = K**i * (K * parent + sum_{j<=i} c[j] * K**-j)
    chain = np.add.accumulate(content)
    chain += np.array(parent * _K & _MASK, dtype=np.uint64)
    chain *= k_pow
    return chain.tolist()


def prefix_hashes(token_ids: Iterable[int], model: str, block_size: int) -> list[int]:
    """Chained hashes of every full block of a prompt: what a lookup walks."""
    return chain_hashes(token_bytes(token_ids), block_size, root_hash(model, block_size))


def position_key(block: bytes | memoryview, offset: int, root: int) -> int:
    """Content-and-position key of one block, for chunks reported without their parent.

    LMCache ``store`` entries carry a chunk's tokens and its token offset but not its prefix; this
    key lets the index find the chain hash that a lookup of the same prompt computed (see
    ``state.PositionMap``).
    """
    return _xxh3(offset.to_bytes(8, "little") + bytes(block), root)
