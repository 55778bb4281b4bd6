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


class OutputMismatchError(KVShrinkError, ValueError):
    """``decode(out=...)`` was given a buffer whose size or dtype does not match the frame."""
