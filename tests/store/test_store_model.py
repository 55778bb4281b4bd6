"""Model-based test of the store: random sequences of puts, overwrites, reads, deletes, evictions,
demotions, promotions, prefetches, pins and reopens on a real DRAM + SSD store, against a plain
dict of what each key's current value is.

Every read must return the current value bit for bit, or miss where the store said the key left
(a drop notice since its last put); a deleted or never written key always misses. After every
step the store is at rest (flushed) and the invariants of docs/store-consistency.md must hold:
every copy in every tier is the current value (no older copy survives an overwrite), an exclusive
tier never shares a chunk with another tier, the store holds no key the model does not, and the
copy ledger has nothing in flight. Two machines: the shipped shape (SSD exclusive) and an SSD
that takes write-back copies.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
import zlib
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvshrink.store import TieredStore
from kvshrink.store.dram import SHM_DIR

SHAPE = (2, 4, 16, 32)  # 8 KiB of uint16 (bf16 bits): small, so a step costs milliseconds
CHUNK_BYTES = int(np.prod(SHAPE)) * 2
KEYS = [b"key-%d" % i for i in range(5)]  # few keys: overwrites are frequent
FILLERS = [b"fill-%02d" % i for i in range(12)]
WAIT_S = 60
# CI budget: 2 machines x MAX_EXAMPLES x STEPS >= 2,000 random steps, in well under 2 minutes
MAX_EXAMPLES = 40
STEPS = 50

key_names = st.sampled_from(KEYS)


def chunk_for(key: bytes, version: int) -> np.ndarray:
    """A KV-like chunk unique to (key, version): small values around a per-version level, so the
    codec compresses it and two versions never collide."""
    rng = np.random.default_rng(zlib.crc32(key) * 100_003 + version)
    return (rng.integers(0, 64, SHAPE) + 0x3F00 + (version % 128)).astype(np.uint16)


class StoreModel(RuleBasedStateMachine):
    """A DRAM tier of ~4 chunks in front of an SSD of ~10 (compressed: a few more fit)."""

    write_back = False

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvshrink-model-"))
        self.shm_name = f"kvshrink-model-{uuid.uuid4().hex[:12]}"
        self.config = {
            "promote_on_hit": True, "persist_on_close": True,
            "engine": {"put_workers": 2, "background_workers": 1, "staging_bytes": "16MiB"},
            "tiers": [{"kind": "dram", "name": "dram", "capacity": 4 * CHUNK_BYTES, "compressed": True,
                       "put": True, "shm_name": self.shm_name},
                      {"kind": "ssd", "name": "ssd", "capacity": 10 * CHUNK_BYTES, "compressed": True,
                       "path": str(self.root / "ssd"), "write_back": self.write_back, "fsync": False}]}
        self.current: dict[bytes, np.ndarray] = {}  # the model: each live key's current value
        self.dropped: set[bytes] = set()  # keys the store reported gone since their last put
        self.versions = 0
        self.pinned: list[bytes] = []
        self.persisted: set[bytes] = set()  # in DRAM and on the SSD since a close persisted them
        self._drop_lock = threading.Lock()
        self.store = self._open()

    # -- plumbing ---------------------------------------------------------------------------------
    def _open(self) -> TieredStore:
        store = TieredStore.from_config(self.config)
        store.add_drop_listener(self._on_drop)
        return store

    def _on_drop(self, keys: list[bytes]) -> None:
        with self._drop_lock:
            self.dropped.update(keys)

    def _put(self, key: bytes) -> None:
        self.versions += 1
        value = chunk_for(key, self.versions)
        assert self.store.put(key, value).result(timeout=WAIT_S) is True
        with self._drop_lock:
            self.dropped.discard(key)  # notices for the older value are history now
        self.current[key] = value
        self.persisted.discard(key)
        self.store.flush(timeout=WAIT_S)

    def _check_read(self, key: bytes, got: object, how: str) -> None:
        want = self.current.get(key)
        if got is None:
            assert want is None or key in self.dropped, f"{how}({key!r}) missed a chunk the store never dropped"
            return
        assert want is not None, f"{how}({key!r}) served a deleted or never written key"
        assert np.array_equal(got, want), f"{how}({key!r}) served an older value"

    def teardown(self) -> None:
        try:
            self.store.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            for path in SHM_DIR.glob(f"{self.shm_name}*"):
                path.unlink(missing_ok=True)

    # -- rules ------------------------------------------------------------------------------------
    @initialize(key=key_names)
    def first_put(self, key: bytes) -> None:
        self._put(key)

    @rule(key=key_names)
    def put(self, key: bytes) -> None:
        """A put, or an overwrite when the key holds a value already."""
        self._put(key)

    @rule(count=st.integers(3, 8), start=st.integers(0, len(FILLERS) - 1))
    def evict(self, count: int, start: int) -> None:
        """Fill past the DRAM tier's capacity: its oldest chunks are demoted, the SSD's dropped."""
        for i in range(count):
            self._put(FILLERS[(start + i) % len(FILLERS)])

    @rule(key=key_names)
    def get(self, key: bytes) -> None:
        self._check_read(key, self.store.get(key), "get")
        self.store.flush(timeout=WAIT_S)  # a hit below is promoted in the background

    @rule(keys=st.lists(st.sampled_from(KEYS + FILLERS), min_size=1, max_size=6, unique=True))
    def get_many(self, keys: list[bytes]) -> None:
        outs = [np.empty(SHAPE, np.uint16) for _ in keys]
        for key, got, out in zip(keys, self.store.get_many(keys, outs), outs):
            assert got is None or got is out
            self._check_read(key, got, "get_many")
        self.store.flush(timeout=WAIT_S)

    @rule(key=key_names)
    def get_into(self, key: bytes) -> None:
        out = np.empty(SHAPE, np.uint16)
        self._check_read(key, out if self.store.get_into(key, out) else None, "get_into")
        self.store.flush(timeout=WAIT_S)

    @rule(key=key_names)
    def delete(self, key: bytes) -> None:
        held = self.store.delete(key)
        assert held or key not in self.current or key in self.dropped, "delete did not find a live key"
        self.current.pop(key, None)
        if key in self.pinned:
            self.store.unlock([k for k in self.pinned if k == key])
            self.pinned = [k for k in self.pinned if k != key]

    @rule(key=key_names)
    def demote(self, key: bytes) -> None:
        """Idle demotion of one chunk out of DRAM (what the idle scanner does)."""
        outcome = self.store._jobs.demote_idle(key)
        assert outcome in ("demoted", "pinned", "gone", "failed")
        if outcome == "demoted":
            assert not self.store.tiers[0].contains(key)
        self.store.flush(timeout=WAIT_S)

    @rule(key=key_names)
    def promote(self, key: bytes) -> None:
        """A read hit below DRAM moves (exclusive SSD) or copies (write-back SSD) the chunk up."""
        got = self.store.get(key)
        self._check_read(key, got, "get")
        self.store.flush(timeout=WAIT_S)
        if got is not None and not self.pinned:  # pinned chunks could leave DRAM no room for it
            assert self.store.tiers[0].contains(key), "a hit below was not promoted to DRAM"

    @rule(keys=st.lists(st.sampled_from(KEYS + FILLERS), min_size=1, max_size=4, unique=True))
    def prefetch(self, keys: list[bytes]) -> None:
        self.store.prefetch(keys).wait(timeout=WAIT_S)
        self.store.flush(timeout=WAIT_S)

    @rule(key=key_names)
    def lock(self, key: bytes) -> None:
        if self.store.lock([key])[0]:
            self.pinned.append(key)

    @precondition(lambda self: self.pinned)
    @rule()
    def unlock(self) -> None:
        self.store.unlock([self.pinned.pop(0)])

    @rule()
    def reopen(self) -> None:
        """Close (DRAM-only chunks are persisted to the SSD) and open again: pins are gone."""
        self.store.close()
        self.pinned = []
        self.store = self._open()
        self.persisted = set(self.store.tiers[0].keys()) & set(self.store.tiers[1].keys())

    # -- invariants (docs/store-consistency.md) ---------------------------------------------------
    @invariant()
    def every_copy_is_current(self) -> None:
        """At rest, whatever any tier holds under a key is that key's current value: an overwrite
        left no older copy anywhere, a delete left none at all."""
        for tier in self.store.tiers:
            for key in tier.keys():
                assert key in self.current, f"tier {tier.name} holds {key!r}, deleted or never written"
                got = tier.get(key)
                assert got is None or np.array_equal(got, self.current[key]), \
                    f"tier {tier.name} holds an older value of {key!r}"

    @invariant()
    def exclusive_tier_shares_nothing(self) -> None:
        """An exclusive SSD holds a chunk only instead of DRAM, never beside it (but for the copies a
        close persisted while the DRAM arena stayed: both current, until the next put)."""
        if not self.write_back:
            both = set(self.store.tiers[0].keys()) & set(self.store.tiers[1].keys()) - self.persisted
            assert not both, f"in DRAM and on the exclusive SSD at once: {sorted(both)}"

    @invariant()
    def live_keys_are_held_or_dropped(self) -> None:
        """A live key is in some tier unless the store reported it dropped; the lookups agree."""
        held = set(self.store.keys())
        assert held <= set(self.current), f"the store lists keys it should not hold: {held - set(self.current)}"
        for key in self.current:
            assert key in held or key in self.dropped, f"{key!r} left the store without a drop notice"
            assert self.store.contains(key) == (key in held)

    @invariant()
    def nothing_in_flight_at_rest(self) -> None:
        """After a flush the copy ledger tracks no copy: no move, landing, supersession, parked
        chunk or eviction awaiting its demotion."""
        ledger = self.store._ledger
        assert not ledger._moves and not ledger._landing and not ledger._superseding
        assert not ledger.parked and not ledger._evicting and not ledger._open_victims

    @invariant()
    def pinned_chunks_stay_in_a_local_tier(self) -> None:
        for key in self.pinned:
            if key in self.current and key not in self.dropped:
                assert self.store.tiers[0].contains(key) or self.store.tiers[1].contains(key)


class WriteBackStoreModel(StoreModel):
    """The same with an SSD that takes a write-back copy of every put."""

    write_back = True


MODEL_SETTINGS = settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)

TestExclusiveStoreModel = StoreModel.TestCase
TestExclusiveStoreModel.settings = MODEL_SETTINGS
TestWriteBackStoreModel = WriteBackStoreModel.TestCase
TestWriteBackStoreModel.settings = MODEL_SETTINGS
