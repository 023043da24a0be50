"""What the inspection API answers: msgspec structs, the same for Python, CLI ``--json`` and HTTP."""

from __future__ import annotations

import msgspec


class NotFound(LookupError):
    """No such fingerprint (nothing published under it)."""


class TierUsage(msgspec.Struct):
    objects: int = 0
    bytes: int = 0


class FingerprintSummary(msgspec.Struct, kw_only=True):
    fingerprint: str
    model: str | None = None
    chunk_tokens: int | None = None
    key_version: str | None = None  # EngineMeta.key_version (None: not published, or before the field)
    objects: int = 0  # every object of the key space (its metadata aside)
    chunks: int = 0  # whole chunks stored (all their parts or some)
    bytes: int = 0
    memory: TierUsage = msgspec.field(default_factory=TierUsage)
    disk: TierUsage = msgspec.field(default_factory=TierUsage)
    parts: TierUsage = msgspec.field(default_factory=TierUsage)  # of those objects: part objects (saved tails)
    directories: TierUsage = msgspec.field(default_factory=TierUsage)  # of those objects: directory entries


class SegmentInfo(msgspec.Struct):
    """One mounted Mooncake segment (not :class:`kvcore.plan.Segment`, a plan's token range)."""

    name: str
    capacity_bytes: int
    used_bytes: int


class Summary(msgspec.Struct, kw_only=True):
    keys: int
    bytes: int
    fingerprints: list[FingerprintSummary]
    other_keys: int
    other_bytes: int
    segments: list[SegmentInfo]


class ChunkInfo(msgspec.Struct, kw_only=True):
    index: int
    start: int
    end: int
    present: bool
    tier: str  # memory | disk | memory+disk | mixed | missing | unknown (admin API unreachable)
    bytes: int
    keys: list[str]


class PartialInfo(msgspec.Struct, kw_only=True):
    """Past the leading whole chunks: the stored object (another prompt's chunk, or a saved
    prompt's tail) whose leading ``matched`` of ``blocks`` blocks are this prompt's
    (:mod:`mcstore.lookup`); ``present`` when all its parts exist."""

    index: int
    start: int
    end: int  # start + matched blocks
    blocks: int
    matched: int
    present: bool
    tier: str
    bytes: int
    keys: list[str]


class Lookup(msgspec.Struct, kw_only=True):
    fingerprint: str
    chunk_tokens: int
    prompt_tokens: int
    hit_tokens: int  # whole chunks, then partial's blocks when present (the engine's reach)
    loadable_tokens: int
    chunks: list[ChunkInfo]
    note: str | None = None  # set when part of the answer is unknown
    partial: PartialInfo | None = None


class KeyInfo(msgspec.Struct):
    key: str
    bytes: int
    tiers: list[str]
    replicas: int


class KeyList(msgspec.Struct, kw_only=True):
    prefix: str
    total: int
    truncated: bool
    keys: list[KeyInfo]


class RemoveResult(msgspec.Struct, kw_only=True):
    fingerprint: str
    matched: int
    removed: int
    busy: int  # still leased (being read) at the deadline; retry or --force
    failed: dict[str, int]


class Stats(msgspec.Struct, kw_only=True):
    master: dict[str, float]
    engine_url: str | None = None
    engine: dict[str, float] | None = None


class Replicas(msgspec.Struct):
    """One key's replicas as the master's admin API describes them."""

    ok: bool
    bytes: int
    tiers: list[str]
    copies: int = 0  # replicas over all tiers

    @classmethod
    def from_admin(cls, entry: dict | None) -> Replicas:
        if not entry or not entry.get("ok"):
            return cls(False, 0, [])
        tiers, size, copies = [], 0, 0
        for field, tier in (("values", "memory"), ("disk_values", "disk"), ("local_disk_values", "disk"),
                            ("nof_values", "disk")):
            reps = entry.get(field) or []
            if reps and tier not in tiers:
                tiers.append(tier)
            copies += len(reps)
            for rep in reps:
                size = size or int(rep.get("size_") or rep.get("size") or 0)
        return cls(bool(tiers), size, tiers, copies)
