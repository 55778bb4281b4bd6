"""Which codec each tier uses (method and level from its config), and moving frames between tiers.

Every tier stores codec frames, compressed or not, so every read is checksum-verified: an
uncompressed tier uses the codec's ``raw`` method (header + checksum + bytes). This module is the
one place that knows how a tier's config maps to codec arguments.
"""

from __future__ import annotations

from typing import Any

from kvshrink.store.tier_base import Tier

RAW_METHOD = "raw"


def method_of(tier: Tier) -> tuple[str, int]:
    """(codec method, level) for frames written to ``tier``."""
    if not tier.compressed:
        return RAW_METHOD, 0
    return tier.config.method, tier.config.level


def frame_method(frame: Any) -> str:
    from kvshrink.codec import read_header

    return read_header(frame).method


def convert(frame: Any, tier: Tier) -> Any:
    """``frame`` re-encoded for ``tier`` if its method differs; the same frame otherwise."""
    return FrameSet(frame=frame).frame_for(tier)


class FrameSet:
    """The frames of one chunk, at most one per codec method, each made once, on first need:
    from the chunk itself (a put) or by decoding a frame we already have (a copy between tiers).
    A frame of the right method is reused whatever level it was made with."""

    def __init__(self, *, chunk: Any = None, frame: Any = None) -> None:
        if (chunk is None) == (frame is None):
            raise ValueError("FrameSet needs a chunk or a frame")
        self._chunk = chunk
        self._frames: dict[str, Any] = {} if frame is None else {frame_method(frame): frame}

    def frame_for(self, tier: Tier) -> Any:
        method, level = method_of(tier)
        if method not in self._frames:
            from kvshrink.codec import encode

            self._frames[method] = encode(self._source(), method=method, level=level)
        return self._frames[method]

    def _source(self) -> Any:
        if self._chunk is None:
            from kvshrink.codec import decode

            self._chunk = decode(next(iter(self._frames.values())))
        return self._chunk
