"""Which parts of an OpenAI request are documents to condense: the marking convention.

A document is
* the content of a ``role: "tool"`` message (``/v1/chat/completions``; a string, or each
  ``{"type": "text"}`` part of a content list): what an agent's tools retrieved (a tool message
  that carries markers gives only its marked spans);
* text between the markers (default ``<doc>`` and ``</doc>``) in any message content or in
  ``prompt`` (``/v1/completions``; a string or a list of strings); the markers are removed when
  the document is condensed (they are our convention, not the model's);
* an entry of a top-level ``documents`` list (``/v1/chat/completions`` only, vLLM hands it to the
  chat template): a string, or the string ``"text"`` of an object.

The question a document is condensed for is the text of the last ``user`` message outside its
markers (chat), or the prompt outside its markers (completions). Anything the convention does not
name is left as it was; a request with nothing marked is forwarded byte for byte by the proxy.

Pure functions; any thread. Errors: :class:`~kvshrink.cascade.errors.MalformedRequestError`
naming the field (``messages[2].content[0].text``) for a body of the wrong shape or a marker
without its partner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvshrink.cascade.errors import MalformedRequestError

DEFAULT_MARKERS = ("<doc>", "</doc>")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class _Slot:
    """A place in the body holding documents: ``parent[key]`` whole, or its marked spans."""

    field: str
    parent: Any
    key: Any
    spans: list[tuple[int, int, int, int]] | None  # (open, inner start, inner end, close end); None: whole
    question: str | None


@dataclass
class Marked:
    """The documents of one parsed body, in order, and where each goes back."""

    body: dict
    documents: list[str] = field(default_factory=list)
    questions: list[str | None] = field(default_factory=list)
    _slots: list[_Slot] = field(default_factory=list)

    def rewrite(self, condensed: list[str]) -> dict:
        """``body`` (changed in place) with document ``i`` replaced by ``condensed[i]``."""
        if len(condensed) != len(self.documents):
            raise ValueError(f"{len(self.documents)} documents, {len(condensed)} condensations")
        texts = iter(condensed)
        for slot in self._slots:
            if slot.spans is None:
                slot.parent[slot.key] = next(texts)
                continue
            value, out, last = slot.parent[slot.key], [], 0
            for open_at, _, _, close_end in slot.spans:
                out += [value[last:open_at], next(texts)]
                last = close_end
            slot.parent[slot.key] = "".join(out) + value[last:]
        return self.body


def spans(text: str, where: str, markers: tuple[str, str]) -> list[tuple[int, int, int, int]]:
    """Marked spans of ``text``; MalformedRequestError for an unclosed, stray or nested marker."""
    begin, end = markers
    found, at = [], 0
    while True:
        open_at, close_at = text.find(begin, at), text.find(end, at)
        if open_at < 0:
            if close_at >= 0:
                raise MalformedRequestError(where, f"{end!r} at character {close_at} closes no {begin!r}")
            return found
        if 0 <= close_at < open_at:
            raise MalformedRequestError(where, f"{end!r} at character {close_at} closes no {begin!r}")
        if close_at < 0:
            raise MalformedRequestError(where, f"{begin!r} at character {open_at} has no {end!r}")
        nested = text.find(begin, open_at + len(begin), close_at)
        if nested >= 0:
            raise MalformedRequestError(where, f"{begin!r} at character {nested} is inside another document")
        found.append((open_at, open_at + len(begin), close_at, close_at + len(end)))
        at = close_at + len(end)


def outside(text: str, found: list[tuple[int, int, int, int]]) -> str:
    """``text`` without its marked spans."""
    out, last = [], 0
    for open_at, _, _, close_end in found:
        out.append(text[last:open_at])
        last = close_end
    return ("".join(out) + text[last:]).strip()


def find_documents(endpoint: str, body: Any, markers: tuple[str, str] = DEFAULT_MARKERS,
                   tool_messages: bool = True) -> Marked:
    """The documents of a parsed request body for ``endpoint`` (CHAT or COMPLETIONS)."""
    if not isinstance(body, dict):
        raise MalformedRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    marked = Marked(body)
    if endpoint == CHAT:
        _chat(marked, markers, tool_messages)
    elif endpoint == COMPLETIONS:
        _completions(marked, markers)
    else:
        raise ValueError(f"no marking convention for {endpoint}")
    return marked


def _add(marked: Marked, slot: _Slot) -> None:
    value = slot.parent[slot.key]
    marked._slots.append(slot)
    pieces = [value] if slot.spans is None else [value[s:e] for _, s, e, _ in slot.spans]
    marked.documents += pieces
    marked.questions += [slot.question] * len(pieces)


def _text_parts(content: Any, where: str) -> list[tuple[Any, Any, str]]:
    """(parent, key, field name) of every text in a message content (string or parts list)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(None, None, where)]
    if not isinstance(content, list):
        raise MalformedRequestError(where, f"must be a string, a list of content parts or null, got "
                                           f"{type(content).__name__}")
    found = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise MalformedRequestError(f"{where}[{i}]", "must be a content part object")
        if part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise MalformedRequestError(f"{where}[{i}].text", "must be a string")
            found.append((part, "text", f"{where}[{i}].text"))
    return found


def _chat(marked: Marked, markers: tuple[str, str], tool_messages: bool) -> None:
    messages = marked.body.get("messages")
    if not isinstance(messages, list):
        raise MalformedRequestError("messages", "must be a list of message objects")
    texts = []  # (message, parent, key, field, role)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MalformedRequestError(f"messages[{i}]", "must be a message object")
        role = message.get("role")
        if not isinstance(role, str):
            raise MalformedRequestError(f"messages[{i}].role", "must be a string")
        for parent, key, where in _text_parts(message.get("content"), f"messages[{i}].content"):
            texts.append((message if parent is None else parent, "content" if parent is None else key, where, role))
    found = {where: spans(parent[key], where, markers) for parent, key, where, _ in texts}
    question = next((outside(parent[key], found[where]) for parent, key, where, role in reversed(texts)
                     if role == "user"), None) or None
    for parent, key, where, role in texts:
        if role == "tool" and tool_messages and not found[where]:
            _add(marked, _Slot(where, parent, key, None, question))
        elif found[where]:
            _add(marked, _Slot(where, parent, key, found[where], question))
    documents = marked.body.get("documents")
    if documents is None:
        return
    if not isinstance(documents, list):
        raise MalformedRequestError("documents", "must be a list of strings or objects with a string \"text\"")
    for i, document in enumerate(documents):
        if isinstance(document, str):
            _add(marked, _Slot(f"documents[{i}]", documents, i, None, question))
        elif isinstance(document, dict) and isinstance(document.get("text"), str):
            _add(marked, _Slot(f"documents[{i}].text", document, "text", None, question))
        else:
            raise MalformedRequestError(f"documents[{i}]", "must be a string or an object with a string \"text\"")


def _completions(marked: Marked, markers: tuple[str, str]) -> None:
    if "documents" in marked.body:
        raise MalformedRequestError("documents", f"only {CHAT} takes a documents list (vLLM hands it to the chat "
                                                 f"template); mark documents in the prompt with {markers[0]!r}")
    prompt = marked.body.get("prompt")
    if isinstance(prompt, str):
        places = [(marked.body, "prompt", "prompt")]
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        places = [(prompt, i, f"prompt[{i}]") for i in range(len(prompt))]
    elif isinstance(prompt, list) and all(isinstance(p, int) or isinstance(p, list) for p in prompt):
        return  # token ids: nothing can be marked
    else:
        raise MalformedRequestError("prompt", "must be a string, a list of strings or token ids")
    for parent, key, where in places:
        found = spans(parent[key], where, markers)
        if found:
            _add(marked, _Slot(where, parent, key, found, outside(parent[key], found) or None))
