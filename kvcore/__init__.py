"""Shared core of the mctier KV tiers: page geometry, plans, config, errors, platform seam."""

from kvcore.errors import ConfigError, MooncakeError, TransferTimeout
from kvcore.geometry import KVGeometry, MemRange
from kvcore.plan import Segment, Source

__all__ = [
    "ConfigError",
    "KVGeometry",
    "MemRange",
    "MooncakeError",
    "Segment",
    "Source",
    "TransferTimeout",
]
