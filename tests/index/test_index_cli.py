"""``kvshrink index lookup | stats`` against an index that is not there: one line naming the URL
and what to do, a non-zero exit, never a traceback."""

from __future__ import annotations

import pytest

from kvshrink.cli import main as kvshrink_main
from kvshrink.testing.processes import free_port


@pytest.mark.parametrize("argv", [["stats"], ["lookup", "--model", "smollm2", "--token-ids", "1,2,3"]])
def test_a_down_index_is_one_clear_line_and_exit_1(capsys, argv):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert kvshrink_main(["index", *argv, "--url", url]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and f"no index answers at {url}" in err and "kvshrink index serve" in err


def test_bad_token_ids_exit_2_naming_the_option(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert kvshrink_main(["index", "lookup", "--url", url, "--model", "m", "--token-ids", "1,x"]) == 2
    assert "--token-ids must be comma-separated integers" in capsys.readouterr().err
