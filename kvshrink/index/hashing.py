"""Prefix block hashes computed from token ids, identical in every process and on every machine.

Choice (issue 6): the index never matches on the engines' own block hashes. vLLM hashes blocks with
a per-process ``NONE_HASH`` that is random unless ``PYTHONHASHSEED`` is fixed, with a configurable
algorithm (pickle-based ``sha256`` by default, not stable across Python/vLLM versions); LMCache
chunk hashes inherit the same dependency. A router that trusted them would silently never hit when
one pod runs with another seed. Like llm-d, we recompute our own chained hash from the token ids
that every ``BlockStored`` event (and every LMCache ``store`` entry) carries:

    root(model, block_size) = xxh3_64(b"kvshrink-index/1\\0" + model + b"\\0" + decimal(block_size))
    h[0] = xxh3_64(le_u32(tokens[0 : bs]),            seed=root)
    h[i] = xxh3_64(le_u32(tokens[i*bs : (i+1)*bs]),  seed=h[i-1])

so ``h[i]`` names the whole prefix ``tokens[0 : (i+1)*bs]`` of that model at that block size.
Engine hashes are kept only as opaque per-stream ids, to find a block's parent and to apply
``BlockRemoved``. Nothing here reads ``PYTHONHASHSEED``; engines may run with different seeds (the
real-vLLM test does). A stream that contradicts itself — an engine hash re-stored with other
tokens — is counted and logged as a hash conflict (see ``block_index``), which is how a seed or
algorithm mix-up *inside* one publisher would show. xxh3-64 is not cryptographic: a crafted prompt
could collide, which costs at worst a wrong routing choice, never wrong KV (engines verify their
own hashes).
"""

from __future__ import annotations

import array
import sys
from functools import lru_cache
from typing import Iterable

import xxhash

from kvshrink.errors import CorruptDataError

HASH_VERSION = b"kvshrink-index/1"
_xxh3 = xxhash.xxh3_64_intdigest


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
    step = block_size * 4
    data = bytes(data)  # slicing bytes is ~2x faster than memoryview slices at these sizes
    out: list[int] = []
    h = parent
    for start in range(0, (len(data) // step) * step, step):
        h = _xxh3(data[start:start + step], h)
        out.append(h)
    return out


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
