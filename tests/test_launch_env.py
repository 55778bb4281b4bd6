"""Child processes the harness starts must not share a Prometheus multiprocess folder by accident."""

import os
import sys

from kvshrink.testing.launch import ManagedProcess

PRINT_ENV = "import os; print('dir=' + os.environ.get('PROMETHEUS_MULTIPROC_DIR', '<unset>'))"


def _child_sees(tmp_path, **kwargs) -> str:
    log = tmp_path / "child.log"
    proc = ManagedProcess([sys.executable, "-c", PRINT_ENV], log_path=log, **kwargs).start()
    assert proc.proc is not None and proc.proc.wait(timeout=60) == 0
    proc.stop()
    return log.read_text().strip().splitlines()[-1]


def test_an_inherited_multiproc_dir_is_dropped(tmp_path, monkeypatch):
    """LMCache's in-process engine sets it in os.environ; two vLLMs inheriting it summed their metrics."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "shared"))
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"]
    assert _child_sees(tmp_path) == "dir=<unset>"


def test_a_multiproc_dir_asked_for_by_name_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "shared"))
    mine = str(tmp_path / "mine")
    assert _child_sees(tmp_path, env={"PROMETHEUS_MULTIPROC_DIR": mine}) == f"dir={mine}"
