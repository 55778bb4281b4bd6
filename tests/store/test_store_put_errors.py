"""``put`` argument errors on a real TieredStore (DRAM arena + SSD directory).

The rule: a caller bug (a key that is not 1..1024 bytes, a chunk the codec cannot store) raises
from ``put`` itself, synchronously, as a KVShrinkError that is also a TypeError (chunks; keys are
both TypeError and ValueError), with a message naming what is wrong; it never fails the Future,
leaves nothing staged, and the store goes on working. Odd but valid chunks (zero-size,
non-contiguous, broadcast, conjugated, requiring grad) are copied and round-trip bit-exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshrink.codec import UnsupportedArrayError
from kvshrink.errors import InvalidKeyError, KVShrinkError
from kvshrink.store.tiered import TieredStore


@pytest.fixture
def store(tmp_path, shm_name):
    config = {"tiers": [{"kind": "dram", "capacity": "32MiB", "shm_name": shm_name},
                        {"kind": "ssd", "capacity": "256MiB", "path": str(tmp_path / "ssd"), "write_back": True,
                         "fsync": False}]}
    with TieredStore.from_config(config) as s:
        yield s


def reopen_ssd_only(tmp_path) -> TieredStore:
    return TieredStore.from_config({"tiers": [{"kind": "ssd", "capacity": "256MiB", "path": str(tmp_path / "ssd")}]})


def same(got, want) -> bool:
    """Same container, dtype, shape and bits (bf16 -0.0 is not 0.0 here)."""
    if isinstance(want, torch.Tensor):
        def bits(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous().view(torch.uint8) if t.numel() else t

        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(bits(got), bits(want)))
    return (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
            and np.array_equal(got, want))


def assert_store_works(store) -> None:
    good = np.arange(1024, dtype=np.uint16).reshape(4, 256)
    assert store.put(b"still-works", good).result(timeout=30) is True
    assert same(store.get(b"still-works"), good)
    assert store.engine.staging.in_use() == 0


ZERO_SIZE = {
    "torch bf16 [2,0,16,8]": lambda: torch.empty(2, 0, 16, 8, dtype=torch.bfloat16),
    "torch float32 [0]": lambda: torch.empty(0),
    "numpy uint16 [2,0,3]": lambda: np.empty((2, 0, 3), dtype=np.uint16),
    "numpy float32 []": lambda: np.empty(0, dtype=np.float32),
}


@pytest.mark.parametrize("name", list(ZERO_SIZE))
def test_zero_size_chunks_round_trip(store, tmp_path, name):
    chunk = ZERO_SIZE[name]()
    assert store.put(b"empty", chunk).result(timeout=30) is True
    assert same(store.get(b"empty"), chunk)
    store.flush(timeout=30)
    store.close()
    with reopen_ssd_only(tmp_path) as again:  # from the SSD file, decoded afresh
        assert same(again.get(b"empty"), chunk)


def _noncontiguous_bf16() -> torch.Tensor:
    return torch.randn(2, 16, 8, 30).to(torch.bfloat16).permute(0, 3, 1, 2)


VALID_ODD = {
    "torch bf16 permuted": _noncontiguous_bf16,
    "torch float32 transposed": lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    "torch sliced with a step": lambda: torch.arange(100, dtype=torch.int16)[::3],
    "torch broadcast (stride 0)": lambda: torch.arange(8, dtype=torch.float16).expand(4, 8),
    "torch requires grad": lambda: torch.randn(3, 5, requires_grad=True),
    "torch conjugated view": lambda: torch.randn(6, dtype=torch.complex64).conj(),
    "numpy Fortran order": lambda: np.asfortranarray(np.arange(60, dtype=np.float32).reshape(3, 4, 5)),
    "numpy sliced with a step": lambda: np.arange(300, dtype=np.uint16).reshape(30, 10)[::4, ::3],
    "numpy big-endian": lambda: np.arange(10, dtype=">f4"),
    "numpy read-only": lambda: np.frombuffer(bytes(range(64)), dtype=np.uint8),
}


@pytest.mark.parametrize("name", list(VALID_ODD))
def test_odd_but_valid_chunks_are_copied_and_round_trip(store, name):
    chunk = VALID_ODD[name]()
    want = chunk.detach().resolve_conj().clone() if isinstance(chunk, torch.Tensor) else chunk.copy()
    assert store.put(b"odd", chunk).result(timeout=30) is True
    assert same(store.get(b"odd"), want)


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])


BAD_CHUNKS = {
    "meta tensor": (lambda: torch.empty(4, device="meta"), "meta device"),
    "quantized tensor": (lambda: torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8), "torch.quint8"),
    "sparse COO tensor": (lambda: torch.eye(3).to_sparse(), "torch.sparse_coo"),
    "sparse CSR tensor": (lambda: torch.eye(3).to_sparse_csr(), "torch.sparse_csr"),
    "nested tensor": (_nested, "nested"),
    "numpy object array": (lambda: np.array([object(), 1], dtype=object), "numpy dtype object"),
    "numpy string array": (lambda: np.array(["kv", "cache"]), "numpy dtype <U5"),
    "numpy structured array": (lambda: np.zeros(3, dtype=[("a", "<i4"), ("b", "<f4")]), "numpy dtype"),
    "numpy datetime array": (lambda: np.zeros(3, dtype="datetime64[s]"), "numpy dtype datetime64"),
    "python list": (lambda: [1, 2, 3], "got list"),
    "python bytes": (lambda: b"\x00" * 16, "got bytes"),
    "None": (lambda: None, "got NoneType"),
}


@pytest.mark.filterwarnings("ignore:.*(quantized tensor creation|Sparse CSR|nested tensors).*:UserWarning")
@pytest.mark.parametrize("name", list(BAD_CHUNKS))
def test_unstorable_chunks_raise_from_put_itself(store, name):
    make, message = BAD_CHUNKS[name]
    with pytest.raises(UnsupportedArrayError, match=message) as info:
        store.put(b"bad", make())
    assert isinstance(info.value, KVShrinkError) and isinstance(info.value, TypeError)
    assert not store.in_flight(b"bad") and not store.contains(b"bad")
    assert store.stats()["engine"]["puts"] == 0  # refused before anything was queued
    assert_store_works(store)


BAD_KEYS = {
    "empty bytes": (b"", "1..1024 bytes, got 0"),
    "empty bytearray": (bytearray(), "1..1024 bytes, got 0"),
    "2000 bytes": (b"k" * 2000, "1..1024 bytes, got 2000"),
    "str": ("chunk-1", "keys are bytes, got str"),
    "int": (7, "keys are bytes, got int"),
    "None": (None, "keys are bytes, got NoneType"),
}


@pytest.mark.parametrize("name", list(BAD_KEYS))
def test_bad_keys_raise_from_put_itself(store, name):
    key, message = BAD_KEYS[name]
    with pytest.raises(InvalidKeyError, match=message) as info:
        store.put(key, np.zeros(8, dtype=np.uint16))
    assert isinstance(info.value, KVShrinkError)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert store.stats()["engine"]["puts"] == 0
    assert_store_works(store)


def test_a_1024_byte_key_is_fine(store):
    chunk = np.arange(32, dtype=np.uint16)
    assert store.put(b"k" * 1024, chunk).result(timeout=30) is True
    assert same(store.get(b"k" * 1024), chunk)
