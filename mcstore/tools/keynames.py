"""What a store key of ours names, read from the key alone (:mod:`mcstore.keys` writes them)."""

from __future__ import annotations

import re

from mcstore.keys import META_SUFFIX

_PART = re.compile(r"^(pp\d+)?tp\d+$")  # mcstore.keys.KeySpace.key: tp{r}, or pp{s}tp{r} with stages
_LINK = re.compile(r"^[0-9a-f]{64}(-b\d+)?$")  # a whole chunk's link, or a part object's (-b{blocks})
DIR = "dir"


def parse_key(key: str) -> tuple[str, str, str] | None:
    """``(prefix, fp16, link|'meta'|'dir')`` for a key of ours (a chunk's or part object's, a
    key space's metadata, a directory entry), None otherwise."""
    parts = key.split("/")
    if len(parts) == 4 and len(parts[1]) == 16 and _LINK.match(parts[2]) and _PART.match(parts[3]):
        return parts[0], parts[1], parts[2]
    if len(parts) == 4 and len(parts[1]) == 16 and parts[2] == "d" and len(parts[3]) == 64:
        return parts[0], parts[1], DIR
    if len(parts) == 3 and len(parts[1]) == 16 and parts[2] == META_SUFFIX:
        return parts[0], parts[1], META_SUFFIX
    return None
