"""Configuration loading: ``kv_connector_extra_config`` dicts into typed msgspec structs.

Unknown keys and ill-typed values are errors that name the key, never silently
ignored: a typo in a deployment's JSON must not turn a feature off.

A config struct defines each key once: its type, its default and its description
(``Annotated[T, msgspec.Meta(description=...)]``); :func:`keys` reads them back, for
docs/configuration.md (``make docs``, :mod:`multi.configdoc`).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, TypeVar

import msgspec
import msgspec.inspect as mi

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
        owner = _struct_at(cls, str(e))
        fields = ", ".join(sorted(f for f in owner.__struct_fields__ if not f.startswith("_")))
        raise ConfigError(f"{where}: {e} (known keys: {fields})") from None


_PATH = re.compile(r" - at `\$((?:\.\w+|\[[^\]]*\])*)`$")


def _struct_at(cls: type[msgspec.Struct], error: str) -> type[msgspec.Struct]:
    """The struct whose keys a validation error concerns: for an unknown field, the object at
    the error's path (``$.tiers[0]``); else the one holding the bad key (``$.policy.x``)."""
    m = _PATH.search(error)
    steps = re.findall(r"\.(\w+)|\[[^\]]*\]", m.group(1)) if m else []  # a name, or "" for [i]
    owner, t = cls, _bare(mi.type_info(cls))
    for name in steps:
        if isinstance(t, mi.StructType) and name:
            owner = t.cls
            t = _bare(next((f.type for f in t.fields if f.encode_name == name), None))
        elif isinstance(t, (mi.ListType, mi.DictType)) and not name:
            t = _bare(t.item_type if isinstance(t, mi.ListType) else t.value_type)
        else:
            return owner
    return t.cls if "unknown field" in error and isinstance(t, mi.StructType) else owner


def _bare(t: mi.Type | None) -> mi.Type | None:
    """``t`` without its Meta, and the struct in an optional struct."""
    while isinstance(t, (mi.Metadata, mi.UnionType)):
        if isinstance(t, mi.Metadata):
            t = t.type
        else:
            structs = [u for u in t.types if isinstance(u, mi.StructType)]
            if not structs:
                return t
            t = structs[0]
    return t


def doc(description: str) -> msgspec.Meta:
    """A config field's description: ``field: Annotated[int, doc("... (seconds)")] = 1``."""
    return msgspec.Meta(description=description)


class Key(NamedTuple):
    """One key of a config struct, as docs/configuration.md shows it."""

    name: str
    type: str  # e.g. "int | str | null", "list[TierSpec]", "float (>= 0)"
    default: str  # JSON of the default ("{}" for a nested struct's), or "required"
    description: str  # the field's msgspec.Meta description ("" when it has none)


def keys(cls: type[msgspec.Struct]) -> list[Key]:
    """The keys of config struct ``cls`` in declaration order (private fields left out)."""
    out = []
    for f in mi.type_info(cls).fields:
        if f.name.startswith("_"):
            continue
        meta = (f.type.extra_json_schema or {}) if isinstance(f.type, mi.Metadata) else {}
        if f.default is not mi.NODEFAULT:
            default = msgspec.json.encode(f.default).decode()
        elif f.default_factory is not mi.NODEFAULT:
            value = f.default_factory()
            default = "{}" if isinstance(value, msgspec.Struct) else msgspec.json.encode(value).decode()
        else:
            default = "required"
        out.append(Key(f.encode_name, _type_name(f.type), default, meta.get("description", "")))
    return out


_SCALARS = {mi.IntType: "int", mi.FloatType: "float", mi.StrType: "str", mi.BoolType: "bool",
            mi.NoneType: "null", mi.AnyType: "any"}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _type_name(t: mi.Type) -> str:
    if isinstance(t, mi.Metadata):
        return _type_name(t.type)
    if isinstance(t, mi.UnionType):
        return " | ".join(_type_name(u) for u in t.types)
    if isinstance(t, mi.ListType):
        return f"list[{_type_name(t.item_type)}]"
    if isinstance(t, mi.DictType):
        return f"dict[{_type_name(t.key_type)}, {_type_name(t.value_type)}]"
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    name = _SCALARS.get(type(t))
    if name is None:
        raise TypeError(f"no documented name for config type {t!r}")
    bounds = [f"{op} {getattr(t, attr)}" for attr, op in _BOUNDS if getattr(t, attr, None) is not None]
    return f"{name} ({', '.join(bounds)})" if bounds else name
