"""The ``kvshrink`` command line reads like one product: every option of every command (the whole
argparse tree) has help, the top-level help says what KVShrink is and lists the product commands
before the development ones (labelled), old spellings still run with a one-line notice, and a
client whose service is down says so in one line and a non-zero exit, never a traceback.
(tests/index/test_index_cli.py has the in-process down-index checks; these add the console
script's view and a port that answers but is no index.)"""

from __future__ import annotations

import argparse
import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kvshrink.cli import COMMANDS, DEVELOPMENT, build_parser, main, resolve_deprecated
from kvshrink.testing.processes import free_port

PRODUCT = ["cache", "index", "router", "cascade"]
DEVELOPMENT_COMMANDS = ["fixture", "bench", "codec-bench", "store-bench"]


def walk(parser: argparse.ArgumentParser, words: tuple[str, ...] = ("kvshrink",)
         ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the tree with the words that reach it."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*words, name))


def test_every_option_and_subcommand_has_help():
    missing = []
    for words, parser in walk(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue  # hidden on purpose (a command whose extra is missing hides its arguments)
            if isinstance(action, argparse._SubParsersAction):
                listed = {choice.dest: choice.help for choice in action._choices_actions}
                missing += [f"{' '.join(words)} {name}" for name in action.choices if not (listed.get(name) or "").strip()]
                continue
            if not (action.help or "").strip():
                missing.append(f"{' '.join(words)} {'/'.join(action.option_strings) or action.dest}")
    assert missing == [], f"options without help: {missing}"


def test_the_walk_reaches_every_command():
    reached = {words[1:] for words, _ in walk(build_parser())}
    assert {("cache", "serve"), ("index", "serve"), ("index", "lookup"), ("index", "stats"), ("router", "serve"),
            ("cascade", "serve"), ("bench",), ("fixture",)} <= reached


def test_top_level_help_says_what_it_is_and_lists_product_commands_first(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description.startswith("KVShrink: ") and "console script" not in out
    assert list(COMMANDS) == PRODUCT + DEVELOPMENT_COMMANDS
    starts = {name: out.index(f"\n    {name}") for name in COMMANDS}
    assert sorted(starts, key=starts.get) == PRODUCT + DEVELOPMENT_COMMANDS
    ends = sorted(starts.values())[1:] + [out.index("\noptions:")]
    entry = {name: out[start:end] for (name, start), end in zip(sorted(starts.items(), key=lambda kv: kv[1]), ends)}
    assert all(DEVELOPMENT.strip() in entry[name] for name in DEVELOPMENT_COMMANDS)
    assert not any(DEVELOPMENT.strip() in entry[name] for name in PRODUCT)
    assert "serve-cache" not in out  # the old spelling still runs, hidden


@pytest.mark.parametrize("old, new", [
    (["serve-cache", "--check"], ["cache", "serve", "--check"]),
    (["serve-cache"], ["cache", "serve"]),
    (["router", "--index-url", "http://i:8200", "--", "--port", "8001"],
     ["router", "serve", "--index-url", "http://i:8200", "--", "--port", "8001"]),
])
def test_old_spellings_become_the_new_ones_with_a_one_line_notice(old, new):
    argv, notice = resolve_deprecated(old)
    assert argv == new
    assert "\n" not in notice and "deprecated" in notice and f"use `kvshrink {new[0]} {new[1]}`" in notice


@pytest.mark.parametrize("argv", [["cache", "serve", "--check"], ["router", "serve", "--index-url", "u"],
                                  ["router", "--help"], ["router"], ["index", "serve"], []])
def test_current_spellings_pass_unchanged(argv):
    assert resolve_deprecated(argv) == (argv, None)


def test_the_old_serve_cache_spelling_runs_cache_serve(tmp_path, capsys):
    assert main(["serve-cache", "--config", str(tmp_path / "missing.yaml"), "--check"]) == 2
    notice, error = capsys.readouterr().err.splitlines()
    assert notice == ("kvshrink: `kvshrink serve-cache` is deprecated and will be removed; "
                      "use `kvshrink cache serve`")
    assert error.startswith("kvshrink cache serve: ") and "cannot read" in error


def test_a_bad_shutdown_timeout_is_refused_naming_the_option(tmp_path, capsys):
    assert main(["cache", "serve", "--check", "--shutdown-timeout", "0"]) == 2
    assert "'--shutdown-timeout'" in capsys.readouterr().err
    # before the configuration is read: a file that fails its own checks (here: none there; on a small
    # disk: the shipped default's SSD capacity) must not hide the bad flag
    assert main(["cache", "serve", "--check", "--config", str(tmp_path / "missing.yaml"),
                 "--shutdown-timeout", "-1"]) == 2
    error = capsys.readouterr().err
    assert "'--shutdown-timeout'" in error and "cannot read" not in error


# -- a down service: one line, non-zero, no traceback -------------------------------------------------
@pytest.mark.parametrize("argv", [["stats"], ["lookup", "--model", "m", "--prompt", "hello"]])
def test_the_console_script_against_a_down_index_prints_one_line(argv):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "kvshrink.cli", "index", *argv, "--url", url],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"no index answers at {url}" in done.stderr


class NotAnIndex(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b"<html>a web server, not a KVShrink index</html>"
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("argv", [["stats"], ["lookup", "--model", "m", "--token-ids", "1,2"]])
def test_a_port_that_is_no_index_is_one_line_too(argv, capsys):
    server = http.server.HTTPServer(("127.0.0.1", 0), NotAnIndex)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["index", *argv, "--url", url]) == 1
    finally:
        server.shutdown()
        server.server_close()
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "is it a KVShrink index?" in err and "HTTP 404" in err
