"""The codec's exceptions.

``CodecError`` is the one exception for bytes that cannot be trusted (corrupt, truncated, foreign,
hostile): a store catches it and treats the chunk as lost. Mistakes by the *caller* (an array we
cannot encode, an output buffer of the wrong size) are separate types, so a store never mistakes its
own bug for corruption on disk.
"""

from __future__ import annotations

from kvshrink.errors import CorruptDataError, KVShrinkError


class CodecError(CorruptDataError):
    """A blob is not a valid, intact KV Shrink frame; the message says what is wrong with it."""


class UnsupportedArrayError(KVShrinkError, TypeError):
    """``encode`` was given something that is not a fixed-width numpy array or torch tensor."""


class CodecArgumentError(KVShrinkError, ValueError):
    """A codec setting passed by the caller (``Codec(...)``, ``encode(level=...)``) is invalid.

    ``argument`` names the parameter and ``reason`` says what is wrong. A config file's key is a
    :class:`~kvshrink.errors.ConfigError` instead: the store's config parser checks its own keys."""

    def __init__(self, argument: str, reason: str) -> None:
        super().__init__(f"codec argument {argument!r}: {reason}")
        self.argument, self.reason = argument, reason

    def __reduce__(self):  # keep both fields across processes (an error raised in a worker)
        return (type(self), (self.argument, self.reason))


class OutputMismatchError(KVShrinkError, ValueError):
    """``decode(out=...)`` was given a buffer whose size or dtype does not match the frame."""
