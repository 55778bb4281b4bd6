"""How ``kvshrink bench`` reports: a table only for a complete run, the error otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvshrink.benchmarks import report
from kvshrink.benchmarks.comparison import NO_CACHE, OURS, STOCK, IncomparableError, Metric, SideRun, Workload, compare
from kvshrink.cli import main


def test_a_failing_section_reports_its_error_not_a_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "no-such-store.yaml"
    out = tmp_path / "run"
    code = main(["bench", "--quick", "--sections", "capacity", "--store-config", str(missing), "--out", str(out)])
    assert code == 1
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "--store-config" in printed and str(missing) in printed
    assert "ours/stock" not in printed  # no table header, not even a partial one
    saved = json.loads((out / "report.json").read_text())
    assert saved["status"] == "error"
    assert saved["errors"][0]["section"] == "capacity" and saved["errors"][0]["type"] == "ConfigError"
    assert "comparisons" not in saved["sections"]["capacity"]
    assert not (out / "README-section.md").exists()
    assert "FAILED" in (out / "table.txt").read_text()
    assert main(["bench", "--readme-from", str(out)]) == 1  # a failed run has no README section


def test_timed_sections_run_first_and_the_report_keeps_the_documented_order() -> None:
    from kvshrink.benchmarks.suite import SECTION_NAMES, execution_order

    assert execution_order(SECTION_NAMES) == ["codec", "throughput", "capacity", "e2e", "tiers"]
    assert execution_order(["tiers", "codec"]) == ["codec", "tiers"]
    assert execution_order(["e2e", "codec"]) == ["codec", "e2e"]


def test_unknown_section_is_a_usage_error() -> None:
    with pytest.raises(SystemExit, match="--sections"):
        main(["bench", "--sections", "capacity,speed"])


def _report(rows: list[dict]) -> dict:
    return {"status": "ok", "errors": [], "mode": "quick", "command": "kvshrink bench --quick",
            "started": "2026-01-01 00:00", "machine": {"cpus": 2, "cpu_model": "AMD EPYC", "cpu_flags": ["avx2"], "lmcache": "0.5.6", "vllm": "0.32.0",
                                                       "loadavg_before": [0.1], "loadavg_after": [0.2]},
            "plots": {"hit_rate": "hit_rate_vs_budget.png"},
            "sections": {"capacity": {"status": "ok", "comparisons": rows,
                                      "targets": {"ours >= 80%": {"pass": True, "detail": "0.5 GiB"}},
                                      "notes": ["tiny"]}}}


def _rows(stock_budget: dict, ours_budget: dict) -> list[dict]:
    stock = SideRun(STOCK, Workload("t", "m", stock_budget), {"chunk_hit_rate": 0.6}, policy=NO_CACHE)
    ours = SideRun(OURS, Workload("t", "m", ours_budget), {"chunk_hit_rate": 0.84}, policy=NO_CACHE)
    return [r.to_dict() for r in compare("capacity", "0.5 GiB", stock, ours, [Metric("chunk_hit_rate", "fraction")])]


def test_complete_report_renders_table_and_readme_section() -> None:
    rep = _report(_rows({"gib": 1}, {"gib": 1}))
    table = report.terminal_table(rep)
    assert "capacity" in table and "0.600" in table and "0.840" in table and "1.40x +" in table
    assert "flags: avx2" in table  # the CPU flags vLLM CPU's speed depends on are in every report
    assert "[PASS] capacity: ours >= 80%" in table
    section = report.readme_section(rep, image_prefix="docs/bench/")
    assert section.startswith("## Benchmark") and "kvshrink bench --quick" in section
    assert "| capacity | 0.5 GiB | chunk_hit_rate [fraction] | 0.600 | 0.840 | 1.40x + |" in section
    assert "![Hit rate vs cache budget](docs/bench/hit_rate_vs_budget.png)" in section


def test_rows_from_different_workloads_are_never_rendered() -> None:
    good = _rows({"gib": 1}, {"gib": 1})[0]
    forged = {**good, "ours_fingerprint": "ffffffffffffffff"}
    rep = _report([good, forged])
    with pytest.raises(IncomparableError):
        report.terminal_table(rep)
    with pytest.raises(IncomparableError):
        report.readme_section(rep)


def test_error_report_renders_as_errors() -> None:
    rep = {**_report([]), "status": "error",
           "errors": [{"section": "e2e", "type": "ServerStartError", "message": "vllm exited with 1"}]}
    text = report.terminal_table(rep)
    assert "FAILED" in text and "[e2e] ServerStartError: vllm exited with 1" in text
    with pytest.raises(report.ReportError):
        report.readme_section(rep)


def test_a_report_names_its_store_file_and_says_when_it_is_not_the_shipped_one() -> None:
    shipped = report.shipped_store_sha256()
    rep = _report(_rows({"gib": 1}, {"gib": 1}))
    rep["sections"]["capacity"]["store_config"] = {"path": "configs/store-default.yaml", "sha256": shipped,
                                                   "default": True}
    assert report.store_line(rep) == f"our store config: store-default.yaml (sha256 {shipped[:12]}, the shipped default)"
    rep["sections"]["capacity"]["store_config"]["sha256"] = "0" * 64  # measured on an earlier version of the file
    line = report.store_line(rep)
    assert "sha256 000000000000, NOT the shipped default" in line and shipped[:12] in line
    assert line[1:] in report.readme_section(rep)  # capitalised there


def test_a_written_report_holds_no_path_of_the_machine_it_ran_on(tmp_path: Path) -> None:
    import tempfile

    from kvshrink.benchmarks.suite import portable_paths
    from kvshrink.configs import default_store_path

    checkout = default_store_path().resolve().parents[1]
    scratch = Path(tempfile.gettempdir()).resolve() / "kvshrink-capacity-ours-x" / "kvshrink-ssd"
    got = portable_paths({"store_config": {"path": str(checkout / "configs" / "store-default.yaml")},
                          "tiers": [{"path": str(scratch)}, {"path": "/dev/shm/kvshrink-bench-x"}],
                          "out_dir": checkout / "results" / "run", "url": "/metrics", "n": 3})
    assert got == {"store_config": {"path": "configs/store-default.yaml"},
                   "tiers": [{"path": "$TMPDIR/kvshrink-capacity-ours-x/kvshrink-ssd"},
                             {"path": "/dev/shm/kvshrink-bench-x"}],
                   "out_dir": "results/run", "url": "/metrics", "n": 3}
