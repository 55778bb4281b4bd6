"""The committed benchmark results: ``docs/bench/results.md`` is ``docs/bench/report.json`` rendered
(README links it, never repeats it), and the report names no path of the machine it ran on."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvshrink.benchmarks.suite import render_readme

DOCS = Path(__file__).resolve().parents[2] / "docs" / "bench"


def test_the_results_page_is_the_committed_report_rendered() -> None:
    page = (DOCS / "results.md").read_text()
    assert page == render_readme(DOCS), "regenerate it: kvshrink bench --readme-from docs/bench > docs/bench/results.md"
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", page):
        assert (DOCS / image).is_file(), f"results.md shows {image}, which is not in docs/bench/"


def test_the_committed_report_names_no_path_of_its_machine() -> None:
    text = (DOCS / "report.json").read_text()
    report = json.loads(text)
    absolute = sorted(set(re.findall(r'"(/(?!dev/shm)[^"]*)"', text)))
    assert absolute == [], f"absolute paths in report.json: {absolute[:5]}"
    assert all(s.get("store_config") is None or s["store_config"]["path"] == "configs/store-default.yaml"
               for s in report["sections"].values())
