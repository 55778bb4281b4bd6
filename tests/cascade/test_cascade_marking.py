"""The marking convention: which parts of a chat or completions body are documents, which question
each is condensed for, how the condensations go back, and which malformed bodies are refused with
the field named."""

from __future__ import annotations

import pytest

from kvshrink.cascade.errors import MalformedRequestError
from kvshrink.cascade.marking import CHAT, COMPLETIONS, find_documents


def test_chat_tool_messages_marked_spans_and_documents_field() -> None:
    body = {"model": "m", "documents": ["doc four", {"title": "t", "text": "doc five"}],
            "messages": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "Context: <doc>doc one</doc> and <doc>doc two</doc>. Who won?"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "doc three"},
                                                                            {"type": "image_url", "image_url": {}}]}]}
    marked = find_documents(CHAT, body)
    assert marked.documents == ["doc one", "doc two", "doc three", "doc four", "doc five"]
    assert marked.questions == ["Context:  and . Who won?"] * 5
    out = marked.rewrite(["1", "2", "3", "4", "5"])
    assert out["messages"][1]["content"] == "Context: 1 and 2. Who won?"
    assert out["messages"][3]["content"][0] == {"type": "text", "text": "3"}
    assert out["documents"] == ["4", {"title": "t", "text": "5"}]
    assert out["messages"][0] == {"role": "system", "content": "Answer briefly."}


def test_tool_messages_can_be_left_alone_and_unmarked_bodies_have_no_documents() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "result"}]}
    assert find_documents(CHAT, body, tool_messages=False).documents == []
    assert find_documents(CHAT, {"messages": [{"role": "user", "content": "plain"}]}).documents == []


def test_completions_prompts_with_custom_markers() -> None:
    body = {"prompt": ["[[a]] Q1?", "no docs", "x [[b]][[c]] Q3?"]}
    marked = find_documents(COMPLETIONS, body, markers=("[[", "]]"))
    assert (marked.documents, marked.questions) == (["a", "b", "c"], ["Q1?", "x  Q3?", "x  Q3?"])
    assert marked.rewrite(["A", "B", "C"])["prompt"] == ["A Q1?", "no docs", "x BC Q3?"]
    assert find_documents(COMPLETIONS, {"prompt": [1, 2, 3]}).documents == []


@pytest.mark.parametrize(("endpoint", "body", "field", "reason"), [
    (CHAT, [], "body", "JSON object"),
    (CHAT, {"model": "m"}, "messages", "list"),
    (CHAT, {"messages": ["hi"]}, "messages[0]", "message object"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role", "string"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text",
     "string"),
    (CHAT, {"messages": [{"role": "user", "content": "a <doc>b"}]}, "messages[0].content", "has no '</doc>'"),
    (CHAT, {"messages": [{"role": "user", "content": "a </doc> b"}]}, "messages[0].content", "closes no"),
    (CHAT, {"messages": [{"role": "user", "content": "<doc>a<doc>b</doc>"}]}, "messages[0].content", "inside"),
    (CHAT, {"messages": [], "documents": "x"}, "documents", "list"),
    (CHAT, {"messages": [], "documents": [{"title": "no text"}]}, "documents[0]", "text"),
    (COMPLETIONS, {"prompt": {"a": 1}}, "prompt", "string"),
    (COMPLETIONS, {"prompt": "<doc>x</doc>", "documents": ["y"]}, "documents", "only /v1/chat/completions"),
])
def test_malformed_bodies_name_the_field(endpoint: str, body: object, field: str, reason: str) -> None:
    with pytest.raises(MalformedRequestError, match=reason) as info:
        find_documents(endpoint, body)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_the_proxy_errors_are_in_the_family_and_survive_pickling() -> None:
    import pickle

    from kvshrink.cascade.errors import UpstreamUnavailableError
    from kvshrink.errors import KVShrinkError

    err = pickle.loads(pickle.dumps(MalformedRequestError("messages[1].content", "must be a string")))
    assert (err.field, err.reason, err.status, isinstance(err, KVShrinkError)) == ("messages[1].content",
                                                                                     "must be a string", 400, True)
    assert issubclass(UpstreamUnavailableError, KVShrinkError) and UpstreamUnavailableError.status == 502


@pytest.mark.parametrize(("argv", "message"), [
    (["cascade", "serve", "--upstream", "http://127.0.0.1:9"], "--model-path"),
    (["cascade", "serve", "--upstream", "http://127.0.0.1:9", "--model-path", "m", "--markers", "<d>"], "--markers"),
    (["cascade", "serve", "--upstream", "http://127.0.0.1:9", "--model-path", "m", "--ratio", "2"], "cascade.ratio"),
])
def test_the_serve_command_refuses_bad_arguments(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshrink.cli import main

    monkeypatch.delenv("KVSHRINK_CASCADE_MODEL", raising=False)
    with pytest.raises(SystemExit, match=message):
        main(argv)
