"""benchmarks/tier_ttft.py against real vLLM CPU, ``lmcache server``, redis-server across a shaped
link and the blkio throttle (slow; root for the link and the throttle).

Checks the harness, not speed: every row loads its KV from the tier it names (LMCache's own L2
counters, and the cache servers' own device reads from /proc), a throttled row's reads stay under
the cap, node B answers from the shared Redis as node A answered cold, and ours keeps fewer bytes
on disk and in Redis than stock. Its section renders with both tier policies on every row.
"""

from __future__ import annotations

import os
import statistics

import pytest
from kvshrink.benchmarks import tier_ttft as tt
from kvshrink.benchmarks.comparison import OURS, STOCK
from kvshrink.benchmarks.e2e_paired import BYTES_PER_TOKEN
from kvshrink.benchmarks.paired_stats import verdict
from kvshrink.benchmarks.suite_sections import tiers_section

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800),
              pytest.mark.skipif(os.geteuid() != 0, reason="the shaped link and the blkio throttle need root")]

PROMPT = 768  # three whole 256-token chunks


def test_each_row_reads_from_the_tier_it_names(tmp_path) -> None:
    from kvshrink.testing.fixtures.smollm2 import ensure_checkpoint

    settings = tt.TierTTFTSettings(prompt_tokens=PROMPT, pairs=2, l1_mib=128)
    result = tt.TierTTFT(ensure_checkpoint(), settings, log_dir=tmp_path / "logs").run()
    if any("skipped" in note for note in result["notes"]):
        pytest.skip(f"this machine cannot run every row: {result['notes']}")
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"cross-node", "ssd, page cache", "ssd, L1 floor", "ssd, device", "ssd, 500 MB/s device",
                         "remote", "resume, hint", "resume, no hint"}
    raw = PROMPT * BYTES_PER_TOKEN

    # Node B served the whole prompt from the shared tier, with node A's cold answer. How much that
    # saves depends on the CPU's prefill speed (~20 s cold on AVX2, well under a second with AMX),
    # so the 0.35 target is the benchmark's verdict; here: the figures are B's and A's own samples
    # and the verdict is the one their interval gives.
    cross = rows["cross-node"]
    first, cold = cross["ours"][0], cross["stock"][0]
    assert first["hit_tokens"] == first["l2_hit_tokens"] == PROMPT and cold["hit_tokens"] == 0, cross
    assert first["text"] == cold["text"] and cold["ttft_s"] == result["cold_ttft_s"]["ours"]
    assert cross["ratio"]["first_request"] == pytest.approx(first["ttft_s"] / cold["ttft_s"])
    assert cross["verdict"] == verdict(cross["ratio"], tt.CROSS_NODE_TARGET), cross

    for name in ("resume, hint", "resume, no hint"):  # every request loaded the whole prefix from our tiers
        assert all(x["l2_hit_tokens"] == PROMPT for side in ("stock", "ours") for x in rows[name][side]), name
    assert all(x["dram_chunks_after"] == 0 for x in rows["resume, no hint"]["ours"])  # read from SSD, not moved up
    # The hint moved the prefix up and its request read it there: the store's own counters (what
    # DRAM holds after the request depends on the clock: idle demotion empties it 3 s after the read).
    store = result["prefetch_stats"]["store"]
    hinted = 2 * 2 * PROMPT // 256  # hint and DRAM cases, two steps each
    assert store["prefetch_moved"] >= hinted and store["prefetch_useful"] >= hinted, result["prefetch_stats"]

    for name, row in rows.items():
        if name == "cross-node" or name.startswith("resume"):
            continue
        tier = "l1_hit_tokens" if name == "ssd, L1 floor" else "l2_hit_tokens"  # the floor: nothing from L2
        for side in ("stock", "ours"):
            assert len(row[side]) == 2 and all(x[tier] == PROMPT for x in row[side]), (name, side)
        device = {side: statistics.median(x["device_read_bytes"] for x in row[side]) for side in ("stock", "ours")}
        if name.startswith("ssd, ") and name not in ("ssd, page cache", "ssd, L1 floor"):
            assert device["stock"] >= 0.95 * raw, (name, device)  # stock's raw files, from the device
            assert 0.5 * raw <= device["ours"] <= 0.75 * device["stock"], (name, device)  # compressed
            assert "stock at its best: fs_native" in row["label"] and row["stock_variants"], row["label"]
        else:  # page cache / Redis: not the tier's files from the disk (a tier read is >= half of raw
            # on either side); a little may be library pages the kernel dropped beside three vLLMs
            assert device["stock"] < 0.25 * raw and device["ours"] < 0.25 * raw, (name, device, row)
    for side in ("stock", "ours"):  # the cap held for every request (TTFT is longer than the read)
        for x in rows["ssd, 500 MB/s device"][side]:
            assert x["device_read_bytes"] / x["ttft_s"] <= 1.25 * 500e6, (side, x)
    assert any(n.startswith("ssd, 500 MB/s device: reading ") for n in result["notes"]), result["notes"]
    stored, per_token = result["redis_stored"], result["redis_bytes_per_token"]
    assert stored[STOCK]["keys"] == stored[OURS]["keys"] == PROMPT // 256, stored
    assert per_token[OURS] <= 0.72 * per_token[STOCK], per_token

    section = tiers_section(result)
    ours_only = {"cross-node", "resume, hint", "resume, no hint"}  # targets, not stock-vs-ours rows
    assert {c.case.split(":")[0] for c in section.comparisons} == set(rows) - ours_only
    assert all(c.stock_policy and c.ours_policy for c in section.comparisons)
    assert any(name.startswith("cross-node") for name in section.targets)
    assert any(name.startswith("ssd, device") for name in section.targets)
    assert any(name.startswith("resume, hint") for name in section.targets)
