"""Which codec each tier uses (method and level from its config), and moving frames between tiers.

Every tier stores codec frames, compressed or not, so every read is checksum-verified: an
uncompressed tier uses the codec's ``raw`` method (header + checksum + bytes). This module is the
one place that knows how a tier's config maps to codec arguments, and which thread budget a
store's encodes and decodes run on (:class:`StoreCodecs`).
"""

from __future__ import annotations

from typing import Any

from kvshrink.store.tier_base import Tier

RAW_METHOD = "raw"


class StoreCodecs:
    """The codecs one store encodes and decodes with, both on the store's thread budget: a
    block-parallel one, and a serial one for a read lane that decodes beside other lanes (same
    frames, same errors). Read-only after construction; any thread."""

    def __init__(self, budget: Any = None) -> None:
        from kvshrink.codec import Codec
        from kvshrink.codec.cpu_budget import budget as process_budget

        self.budget = process_budget() if budget is None else budget
        self.parallel = Codec(budget=self.budget)
        self.serial = Codec(threads=1, budget=self.budget)

    def decoder(self, serial: bool) -> Any:
        return self.serial if serial else self.parallel


_process_codecs: StoreCodecs | None = None


def codecs_of(tier: Tier) -> StoreCodecs:
    """The codecs ``tier`` runs: its store's (set when the store opens it), else ones on the
    process-wide budget (a tier used on its own)."""
    global _process_codecs
    if tier.codecs is not None:
        return tier.codecs
    if _process_codecs is None:
        _process_codecs = StoreCodecs()
    return _process_codecs


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
    from the chunk itself (a put), or from a frame we already have (a copy between tiers:
    :meth:`Codec.transcode`, which re-codes a fast frame as a dense one without decoding the
    chunk). A frame of the right method is reused whatever level it was made with."""

    def __init__(self, *, chunk: Any = None, frame: Any = None) -> None:
        if (chunk is None) == (frame is None):
            raise ValueError("FrameSet needs a chunk or a frame")
        self._chunk = chunk
        self._frames: dict[str, Any] = {} if frame is None else {frame_method(frame): frame}

    def frame_for(self, tier: Tier) -> Any:
        method, level = method_of(tier)
        if method not in self._frames:
            codec = codecs_of(tier).parallel
            made = None
            if self._chunk is None:
                made = codec.transcode_direct(next(iter(self._frames.values())), method=method, level=level)
            if made is None:
                made = codec.encode(self._source(codec), method=method, level=level)
            self._frames[method] = made
        return self._frames[method]

    def _source(self, codec: Any) -> Any:
        """The chunk, decoded from a frame we have at most once for all targets that need it."""
        if self._chunk is None:
            self._chunk = codec.decode(next(iter(self._frames.values())))
        return self._chunk
