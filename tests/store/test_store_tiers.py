"""Every tier runs the shared contract (tier_contract.py), plus what is special about each."""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvshrink.store.config import TierConfig
from kvshrink.store.dram import DramTier, arena_path
from kvshrink.store.redis_tier import RedisTier, connect
from kvshrink.store.ssd import SsdTier
from kvshrink.testing.polling import poll_until
from tier_contract import TierContract, put

MiB = 2**20


class TierFactory:
    """Builds tiers for one test and closes whatever is still open at teardown."""

    def __init__(self, cls, config: TierConfig) -> None:
        self.cls, self.config, self.open = cls, config, []

    def make(self, capacity: int | None = None, is_pinned=None, **changes) -> object:
        config = replace(self.config, **changes) if capacity is None else replace(self.config, capacity=capacity, **changes)
        if capacity is not None:  # a differently sized tier needs its own storage
            config = self._fresh_storage(config)
        tier = self.cls(config, is_pinned)
        self.open.append(tier)
        return tier

    def reopen(self, tier) -> object:
        tier.close()
        self.open.remove(tier)
        again = self.cls(tier.config, tier.is_pinned)
        self.open.append(again)
        return again

    def _fresh_storage(self, config: TierConfig) -> TierConfig:
        suffix = uuid.uuid4().hex[:8]
        if config.kind == "dram":
            return replace(config, shm_name=f"{config.shm_name}-{suffix}")
        if config.kind == "ssd":
            return replace(config, path=f"{config.path}-{suffix}")
        return replace(config, namespace=f"{config.namespace}-{suffix}")

    def close_all(self) -> None:
        for tier in self.open:
            tier.close()
            if isinstance(tier, DramTier):
                tier.path.unlink(missing_ok=True)


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mapping in this process that are resident (``Rss`` in /proc/self/smaps)."""
    rss, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's first line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
    return rss


def _flip(data: bytearray) -> None:
    middle = len(data) // 2
    for i in range(middle, middle + 64):
        data[i] ^= 0x5A


# -- DRAM -----------------------------------------------------------------------------------------
class TestDramTier(TierContract):
    @pytest.fixture
    def factory(self, shm_name):
        config = TierConfig(kind="dram", name="dram", capacity=64 * MiB, compressed=False, shm_name=shm_name)
        factory = TierFactory(DramTier, config)
        yield factory
        factory.close_all()

    @pytest.fixture
    def make_tier(self, factory):
        return factory.make

    @pytest.fixture
    def reopen(self, factory):
        return factory.reopen

    @pytest.fixture
    def corrupt(self):
        def corrupt(tier: DramTier, key: bytes, how: str) -> None:
            block = tier._blocks[key]
            with open(tier.path, "r+b") as f:  # another writer scribbling over the arena
                f.seek(block.payload_offset)
                data = bytearray(f.read(block.frame_len))
                if how == "flip":
                    _flip(data)
                else:
                    data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)
                f.seek(block.payload_offset)
                f.write(data)

        return corrupt

    def test_second_process_reads_the_arena(self, make_tier, small_chunks, tmp_path):
        import subprocess
        import sys

        tier = make_tier()
        put(tier, b"shared", small_chunks[3])
        np.save(tmp_path / "expected.npy", small_chunks[3])
        script = (
            "import sys, numpy as np\n"
            "from kvshrink.store.config import TierConfig\n"
            "from kvshrink.store.dram import DramTier\n"
            f"cfg = TierConfig(kind='dram', name='dram', capacity=1, compressed=False, shm_name={tier.config.shm_name!r})\n"
            "t = DramTier(cfg, readonly=True)\n"
            "got = t.get(b'shared')\n"
            f"ok = got is not None and np.array_equal(got, np.load({str(tmp_path / 'expected.npy')!r}))\n"
            "sys.exit(0 if ok and t.get(b'other') is None else 1)\n"
        )
        assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 0

    def test_a_second_owner_is_refused(self, make_tier):
        from kvshrink.errors import StoreUnavailableError

        tier = make_tier()
        with pytest.raises(StoreUnavailableError, match="owned by another"):
            DramTier(tier.config)

    def test_writing_block_left_by_a_crash_is_reclaimed(self, make_tier, reopen, small_chunks):
        tier = make_tier()
        put(tier, b"done", small_chunks[0])
        torn = tier._arena.allocate(b"torn", 4096)  # allocated, never committed: a crash mid-copy
        assert torn is not None
        tier = reopen(tier)
        assert tier.keys() == [b"done"]
        assert tier._arena.largest_free() >= tier.capacity_bytes - 2 * MiB

    def test_hugepages_and_mlock_fall_back_with_one_log_line(self, factory, caplog):
        import logging

        from kvshrink.store import arena_pages

        arena_pages._warned.clear()
        with caplog.at_level(logging.WARNING, logger="kvshrink.store.dram"):
            tier = factory.make(hugepages=True, mlock=True)
            tier2 = factory.make(capacity=8 * MiB, hugepages=True)
        assert tier.stats()["kind"] == "dram"
        policy = arena_pages.THP_SHMEM.read_text() if arena_pages.THP_SHMEM.exists() else "[never]"
        if "[never]" in policy or "[deny]" in policy:
            assert tier.hugepages is False and tier2.hugepages is False
            assert sum("huge pages refused" in r.message for r in caplog.records) == 1
        assert isinstance(tier.mlocked, bool)

    def test_prefault_maps_every_page_of_the_arena_at_open(self, factory):
        """With ``prefault`` the whole arena is resident in this process's page tables before the
        first put (a put then copies into mapped pages, not into page faults); without it only the
        pages touched so far are. Measured as the mapping's Rss in /proc/self/smaps."""
        if tuple(int(p) for p in os.uname().release.split(".")[:2] if p.isdigit()) < (5, 14):
            pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14+")
        size = 64 * MiB
        lazy = factory.make(capacity=size, prefault=False)
        eager = factory.make(capacity=size)
        assert eager.prefaulted is True and lazy.prefaulted is False
        assert eager.stats()["prefaulted"] is True
        assert _mapped_rss(eager.path) >= size - MiB
        assert _mapped_rss(lazy.path) < size // 4
        put(eager, b"after", np.arange(1 << 20, dtype=np.uint16).reshape(256, 4096))  # an ordinary tier still
        assert eager.keys() == [b"after"]

    def test_mlock_refused_without_cap_ipc_lock(self, shm_name, tmp_path):
        """Run a tier in a child without CAP_IPC_LOCK and an 8 MiB RLIMIT_MEMLOCK: mlock of a
        64 MiB arena is refused, the tier still works and says so once."""
        import shutil
        import subprocess
        import sys

        if shutil.which("capsh") is None or os.geteuid() != 0:
            pytest.skip("needs root and capsh to drop CAP_IPC_LOCK")
        script = (
            "import logging, resource, numpy as np\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))\n"
            "from kvshrink.store.config import TierConfig\n"
            "from kvshrink.store.dram import DramTier\n"
            f"cfg = TierConfig(kind='dram', name='dram', capacity=64 << 20, compressed=False, shm_name={shm_name!r}, mlock=True)\n"
            "t = DramTier(cfg)\n"
            "assert t.mlocked is False\n"
            "t.destroy()\n"
        )
        done = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c", f"{sys.executable} -c \"$0\"", script],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("mlock of") == 1


# -- SSD ------------------------------------------------------------------------------------------
class TestSsdTier(TierContract):
    @pytest.fixture
    def factory(self, tmp_path):
        config = TierConfig(kind="ssd", name="ssd", capacity=256 * MiB, compressed=True, path=str(tmp_path / "ssd"))
        factory = TierFactory(SsdTier, config)
        yield factory
        factory.close_all()

    @pytest.fixture
    def make_tier(self, factory):
        return factory.make

    @pytest.fixture
    def reopen(self, factory):
        return factory.reopen

    @pytest.fixture
    def corrupt(self):
        def corrupt(tier: SsdTier, key: bytes, how: str) -> None:
            path = tier.path_for(key)
            data = bytearray(path.read_bytes())
            if how == "flip":
                _flip(data)
                path.write_bytes(data)
            else:
                os.truncate(path, len(data) * 2 // 3)

        return corrupt

    def test_corrupt_file_is_moved_to_quarantine(self, make_tier, corrupt, small_chunks):
        tier = make_tier()
        put(tier, b"bad", small_chunks[0])
        corrupt(tier, b"bad", "flip")
        assert tier.get(b"bad") is None
        assert not tier.path_for(b"bad").exists()
        assert len(list(tier.quarantine_dir.iterdir())) == 1

    def test_hostile_keys_never_touch_paths_outside_the_directory(self, make_tier, small_chunks, tmp_path):
        from tier_contract import HOSTILE_KEYS

        tier = make_tier()
        before = {p for p in tmp_path.rglob("*")}
        for key in HOSTILE_KEYS:
            put(tier, key, small_chunks[0])
        created = {p for p in tmp_path.rglob("*")} - before
        assert created and all(p.resolve().is_relative_to(tier.root.resolve()) for p in created)
        assert all(p.parent.parent == tier.chunks_dir for p in created if p.is_file() and p.suffix == ".kvc")

    def test_reopen_uses_the_index_and_drops_a_torn_tail(self, make_tier, reopen, small_chunks):
        tier = make_tier()
        for i in range(3):
            put(tier, b"k%d" % i, small_chunks[i])
        index = tier.root / "index.log"
        tier = reopen(tier)
        with open(index, "ab") as f:
            f.write(b"\x07\x00garbage")  # a record cut short by a crash
        tier = reopen(tier)
        assert sorted(tier.keys()) == [b"k0", b"k1", b"k2"]
        put(tier, b"k3", small_chunks[3])  # appends after the truncated tail still replay
        tier = reopen(tier)
        assert sorted(tier.keys()) == [b"k0", b"k1", b"k2", b"k3"]

    def test_reconcile_adopts_files_the_index_lost(self, make_tier, small_chunks):
        from kvshrink.store.ssd_index import encode_snapshot

        tier = make_tier()
        put(tier, b"a", small_chunks[0])
        put(tier, b"b", small_chunks[1])
        tier.close()
        # a power cut: b's file was renamed into place but its index record never reached the disk,
        # and the tier was not closed cleanly
        (tier.root / "index.log").write_bytes(encode_snapshot([(b"a", tier.path_for(b"a").stat().st_size)]))
        (tier.root / "CLEAN").unlink()
        again = SsdTier(tier.config)
        try:
            assert not again.clean_start
            again._reconciler.join()
            assert sorted(again.keys()) == [b"a", b"b"]
            assert np.array_equal(again.get(b"b"), small_chunks[1])
        finally:
            again.close()

    def test_clean_close_skips_the_scan_and_a_damaged_index_is_rebuilt(self, make_tier, reopen, small_chunks):
        tier = make_tier()
        put(tier, b"a", small_chunks[0])
        tier = reopen(tier)
        assert tier.clean_start and not tier._reconciler.is_alive()
        index = tier.root / "index.log"
        tier.close()
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 0xFF
        index.write_bytes(bytes(data))
        again = SsdTier(tier.config)
        try:
            assert not again.clean_start
            again._reconciler.join()
            assert again.keys() == [b"a"] and np.array_equal(again.get(b"a"), small_chunks[0])
        finally:
            again.close()

    def test_leftover_temp_files_are_removed_at_open(self, make_tier, reopen, small_chunks):
        tier = make_tier()
        (tier.tmp_dir / "deadbeef.1.0.tmp").write_bytes(b"half a chunk")
        tier = reopen(tier)
        assert list(tier.tmp_dir.iterdir()) == []

    def test_compressed_files_are_smaller_than_raw(self, make_tier, small_chunks):
        tier = make_tier()
        put(tier, b"k", small_chunks[0])
        assert tier.path_for(b"k").stat().st_size < small_chunks[0].nbytes / 1.4


# -- Redis ----------------------------------------------------------------------------------------
class RedisTierContract(TierContract):
    """The contract against the Redis a subclass's ``server`` fixture gives (standalone or a
    cluster, as ``cluster`` says); each test uses a namespace of its own."""

    bounded = False
    cluster = False

    @pytest.fixture
    def server(self):
        raise NotImplementedError

    @pytest.fixture
    def factory(self, server):
        config = TierConfig(kind="redis", name="redis", capacity=0, compressed=True, url=server.url,
                            cluster=self.cluster, namespace=f"test-{uuid.uuid4().hex[:8]}")
        factory = TierFactory(RedisTier, config)
        yield factory
        factory.close_all()

    @pytest.fixture
    def make_tier(self, factory):
        return factory.make

    @pytest.fixture
    def reopen(self, factory):
        return factory.reopen

    @pytest.fixture
    def corrupt(self, factory):
        clients = []

        def corrupt(tier: RedisTier, key: bytes, how: str) -> None:
            clients.append(client := connect(tier.config))  # a client of its own, as another process would be
            name = tier._k(key)
            data = bytearray(client.get(name))
            if how == "flip":
                _flip(data)
                client.set(name, bytes(data))
            else:
                client.set(name, bytes(data[: len(data) * 2 // 3]))

        yield corrupt
        for client in clients:
            client.close()


class TestRedisTier(RedisTierContract):
    @pytest.fixture
    def server(self, shared_redis):
        return shared_redis

    def test_ttl_expires_chunks(self, factory, small_chunks):
        import time

        tier = factory.make(ttl_s=0.2)
        put(tier, b"k", small_chunks[0])
        assert tier.contains(b"k")
        time.sleep(0.4)
        assert tier.get(b"k") is None

    def test_outage_is_a_counted_miss_and_recovery_is_automatic(self, redis_server, small_chunks):
        from kvshrink.errors import StoreUnavailableError

        config = TierConfig(kind="redis", name="redis", capacity=0, compressed=True, url=redis_server.url,
                            timeout_s=0.3, namespace="outage")
        tier = RedisTier(config)
        try:
            put(tier, b"before", small_chunks[0])
            redis_server.kill()
            assert tier.get(b"before") is None
            assert tier.fetch_frames([b"before", b"x"]) == [None, None]
            assert tier.contains(b"before") is False
            with pytest.raises(StoreUnavailableError):
                put(tier, b"during", small_chunks[1])
            assert tier.stats()["errors"] >= 4
            redis_server.start()  # same port, append-only file replayed
            assert np.array_equal(tier.get(b"before"), small_chunks[0])
            put(tier, b"after", small_chunks[1])
            assert np.array_equal(tier.get(b"after"), small_chunks[1])
        finally:
            tier.close()

    def test_hung_server_is_a_miss_within_the_timeout(self, redis_server, small_chunks):
        import time

        config = TierConfig(kind="redis", name="redis", capacity=0, compressed=True, url=redis_server.url,
                            timeout_s=0.2, retries=1, namespace="hung")
        tier = RedisTier(config)
        try:
            put(tier, b"k", small_chunks[0])
            redis_server.pause()
            start = time.monotonic()
            assert tier.get(b"k") is None
            elapsed = time.monotonic() - start
            redis_server.resume()
            assert elapsed < 2.0, f"a hung Redis cost {elapsed:.2f} s"
            assert np.array_equal(tier.get(b"k"), small_chunks[0])
        finally:
            redis_server.resume()
            tier.close()


class TestRedisClusterTier(RedisTierContract):
    """``cluster: true`` against a real 3-master Redis Cluster: every key lands on the master of
    its hash slot, so batch reads, lookups and listing span all three."""

    cluster = True

    @pytest.fixture
    def server(self, shared_redis_cluster):
        return shared_redis_cluster

    def test_batch_calls_span_every_master(self, make_tier, server, small_chunks):
        tier = make_tier()
        keys = [b"span-%d" % i for i in range(12)]
        assert {server.node_for(tier._k(k)).port for k in keys} == {n.port for n in server.nodes}
        for i, key in enumerate(keys):
            put(tier, key, small_chunks[i % 4])
        frames = tier.fetch_frames(keys + [b"absent"])
        assert frames[-1] is None
        assert all(np.array_equal(tier.decode_frame(k, f), small_chunks[i % 4])
                   for i, (k, f) in enumerate(zip(keys, frames)))
        assert tier.contains_many([b"absent", *keys]) == [False] + [True] * len(keys)
        assert sorted(tier.keys()) == sorted(keys)

    def test_a_dead_master_costs_only_its_slots_and_rejoins_with_its_data(self, redis_cluster, small_chunks):
        """SIGKILL one of three masters: its keys are counted misses (each under 2 s with timeout_s
        0.3 and 1 retry; a refused connection costs ~0.1 s) and its writes refused, while the
        other two keep serving, also once the survivors flag it FAIL (the nodes run with
        cluster-require-full-coverage no); restarted on its port, nodes.conf and append-only file,
        it serves its slots and the chunks written before the crash again."""
        import time

        from kvshrink.errors import StoreUnavailableError

        config = TierConfig(kind="redis", name="redis", capacity=0, compressed=True, url=redis_cluster.url,
                            cluster=True, timeout_s=0.3, retries=1, namespace="fault")
        tier = RedisTier(config)
        try:
            keys = [b"c%d" % i for i in range(24)]
            chunk = {k: small_chunks[i % len(small_chunks)] for i, k in enumerate(keys)}
            for key in keys:
                put(tier, key, chunk[key])
            victim = redis_cluster.node_for(tier._k(keys[0]))
            lost = [k for k in keys if redis_cluster.node_for(tier._k(k)) is victim]
            kept = [k for k in keys if k not in lost]
            assert lost and len({redis_cluster.node_for(tier._k(k)).port for k in kept}) == 2

            redis_cluster.kill(victim)
            for flagged in (False, True):  # right after the crash, then once the survivors flag it FAIL
                if flagged:
                    redis_cluster.wait_marked_failed(victim, timeout=15)
                for key in keys:
                    start = time.monotonic()
                    got = tier.get(key)
                    elapsed = time.monotonic() - start
                    if key in lost:
                        assert got is None and elapsed < 2.0, (key, elapsed)
                    else:
                        assert np.array_equal(got, chunk[key]), key
                frames = tier.fetch_frames(keys)
                assert [f is not None for f in frames] == [k in kept for k in keys]
                assert tier.contains_many(keys) == [k in kept for k in keys]
            errors = tier.stats()["errors"]
            with pytest.raises(StoreUnavailableError):
                put(tier, lost[0], small_chunks[0])
            assert tier.stats()["errors"] == errors + 1
            put(tier, kept[0], small_chunks[1])  # the other masters still take writes
            chunk[kept[0]] = small_chunks[1]
            with pytest.raises(StoreUnavailableError):
                tier.keys()  # a listing that would leave out a third of the keys is refused, not partial

            redis_cluster.restart(victim)
            poll_until(lambda: tier.get(lost[0]) is not None, 15, what="the restarted master to serve")
            assert all(np.array_equal(tier.get(k), chunk[k]) for k in keys)
            assert tier.contains_many(keys) == [True] * len(keys)
            assert sorted(tier.keys()) == sorted(keys)
            put(tier, lost[0], small_chunks[2])
            assert np.array_equal(tier.get(lost[0]), small_chunks[2])
        finally:
            tier.close()

    def test_a_hung_master_is_a_miss_within_the_timeout(self, redis_cluster, small_chunks):
        """SIGSTOP one master (it accepts connections but never answers): its keys miss within
        timeout_s 0.2 s and 1 retry, alone or inside a batch, and the other masters' keys hit."""
        import time

        config = TierConfig(kind="redis", name="redis", capacity=0, compressed=True, url=redis_cluster.url,
                            cluster=True, timeout_s=0.2, retries=1, namespace="hung")
        tier = RedisTier(config)
        keys = [b"h%d" % i for i in range(12)]
        victim = redis_cluster.node_for(tier._k(keys[0]))
        kept = [redis_cluster.node_for(tier._k(k)) is not victim for k in keys]
        try:
            for i, key in enumerate(keys):
                put(tier, key, small_chunks[i % 4])
            victim.pause()
            start = time.monotonic()
            assert tier.get(keys[0]) is None
            single = time.monotonic() - start
            start = time.monotonic()
            assert [f is not None for f in tier.fetch_frames(keys)] == kept
            batch = time.monotonic() - start
            assert single < 2.0 and batch < 2.0, f"a hung master cost {single:.2f} s, in a batch {batch:.2f} s"
            assert np.array_equal(tier.get(keys[kept.index(True)]), small_chunks[kept.index(True) % 4])
            victim.resume()
            poll_until(lambda: tier.get(keys[0]) is not None, 15, what="the resumed master to serve")
        finally:
            victim.resume()
            tier.close()

    def test_a_cluster_down_is_an_outage_also_when_the_tier_opens(self, redis_cluster, small_chunks):
        """All masters dead: redis-py's cluster client raises RedisClusterException (no RedisError)
        once no node answers, and cannot even be made; reads still miss and writes raise
        StoreUnavailableError, for a tier opened before the outage and one opened during it, and
        both serve again once the cluster is back."""
        from kvshrink.errors import StoreUnavailableError

        config = TierConfig(kind="redis", name="redis", capacity=0, compressed=True, url=redis_cluster.url,
                            cluster=True, timeout_s=0.3, retries=1, namespace="down")
        before = RedisTier(config)
        put(before, b"k", small_chunks[0])
        redis_cluster.kill()
        during = RedisTier(config)
        try:
            for tier in (before, during):
                assert tier.get(b"k") is None and tier.fetch_frames([b"k", b"x"]) == [None, None]
                assert tier.contains(b"k") is False and tier.contains_many([b"k"]) == [False]
                assert tier.delete(b"k") is False
                with pytest.raises(StoreUnavailableError):
                    put(tier, b"new", small_chunks[1])
                with pytest.raises(StoreUnavailableError):
                    tier.keys()
                assert tier.stats()["errors"] >= 7
            redis_cluster.restart(*redis_cluster.nodes)
            for tier in (before, during):
                poll_until(lambda: tier.get(b"k") is not None, 15, what="the cluster to serve again")
                assert np.array_equal(tier.get(b"k"), small_chunks[0])
            put(during, b"new", small_chunks[1])
            assert np.array_equal(before.get(b"new"), small_chunks[1]) and sorted(during.keys()) == [b"k", b"new"]
        finally:
            before.close()
            during.close()


def test_arena_path_stays_in_dev_shm():
    config = TierConfig(kind="dram", name="d", capacity=MiB, compressed=False, shm_name="kvshrink-x")
    assert arena_path(config) == Path("/dev/shm/kvshrink-x")
