"""Plan types: which range of a prompt's tokens comes from where.

A source is a string: :data:`Source.LOCAL` (vLLM's prefix cache),
:data:`Source.RECOMPUTE`, or the name of a tier (``kvcore.tier.Tier.name``).
"""

from __future__ import annotations

import msgspec


class Source:
    """The two sources that are not tiers."""

    LOCAL = "local"
    RECOMPUTE = "recompute"


class Segment(msgspec.Struct, frozen=True):
    """Tokens ``[start, end)`` of a prompt, supplied by ``source``."""

    start: int
    end: int
    source: str

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def blocks(self, block_size: int) -> range:
        """Block indices (within the request) fully covered by this segment."""
        return range(self.start // block_size, self.end // block_size)


def normalize(segments: list[Segment]) -> list[Segment]:
    """Drop empty segments and merge neighbours with the same source."""
    out: list[Segment] = []
    for seg in segments:
        if seg.end <= seg.start:
            continue
        if out and out[-1].source == seg.source and out[-1].end == seg.start:
            out[-1] = Segment(out[-1].start, seg.end, seg.source)
        else:
            out.append(seg)
    return out
