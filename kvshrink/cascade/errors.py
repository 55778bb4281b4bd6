"""The cascade's exceptions, members of the project's ``KVShrinkError`` family.

A request the proxy cannot read is the client's mistake and becomes a 4xx naming the field to fix;
an upstream that cannot be reached becomes a 502. Anything else that goes wrong in the proxy is a
bug and a 500 (logged), never a silently unchanged request.
"""

from __future__ import annotations

from kvshrink.errors import KVShrinkError


class MalformedRequestError(KVShrinkError, ValueError):
    """A request body the proxy cannot read. ``field`` is where, as an OpenAI client spells it
    (``messages[2].content``, ``documents[0]``, ``body``); ``reason`` says what is wrong."""

    status = 400

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason

    def __reduce__(self) -> tuple:  # survive pickling with both fields
        return (type(self), (self.field, self.reason))


class UpstreamUnavailableError(KVShrinkError, ConnectionError):
    """The upstream server (vLLM) could not be reached or hung up before answering."""

    status = 502
