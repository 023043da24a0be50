"""Configuration loading: ``kv_connector_extra_config`` dicts into typed msgspec structs.

Unknown keys and ill-typed values are errors that name the key, never silently
ignored: a typo in a deployment's JSON must not turn a feature off.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from kvcore.errors import ConfigError

T = TypeVar("T", bound=msgspec.Struct)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like ``"512MB"``, ``"4 GiB"``, ``"1g"`` (binary units)."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"negative size: {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"not a size: {value!r} (use e.g. 536870912, '512MB', '4GB')")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def load(cls: type[T], data: dict[str, Any] | None, where: str) -> T:
    """Convert ``data`` into ``cls``; any problem raises :class:`ConfigError` naming ``where``."""
    try:
        return msgspec.convert(data or {}, cls, strict=False)
    except msgspec.ValidationError as e:
        fields = ", ".join(sorted(f for f in cls.__struct_fields__ if not f.startswith("_")))
        raise ConfigError(f"{where}: {e} (known keys: {fields})") from None


def dump(obj: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(obj)
