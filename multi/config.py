"""``TieredConnector`` configuration (``kv_connector_extra_config``)::

    {"tiers": [{"name": "store", "config": {...StoreConnector keys...}},
               {"name": "p2p", "config": {...P2PConnector keys...}},
               {"name": "disk", "connector": "mydisk.connector:DiskConnector", "config": {...}}],
     "policy": {...multi.policy.PolicyConfig...},
     "default_source": "auto" | "recompute" | a tier name,
     "write_back": false}               # decode instances also save to the cache tiers

Tiers are listed cheapest first (the order plans fill a prompt in, see
:mod:`multi.policy`). ``connector`` is the tier connector's ``module:Class``; a tier
named in :data:`KNOWN_TIERS` may omit it. The short form ``{"store": {...}, "p2p":
{...}}`` (either may be absent or null) means the tiers ``store`` then ``p2p``, before
any listed under ``tiers``.
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from kvcore.config import load
from kvcore.errors import ConfigError
from kvcore.plan import Source
from kvcore.tier import Tier
from multi.policy import PolicyConfig, force_values

# The tiers the composite knows by name: name -> its connector's "module:Class".
# A tier package adds itself with one line here (or is configured with "connector").
KNOWN_TIERS = {
    "store": "mcstore.connector:StoreConnector",
    "p2p": "p2p.connector:P2PConnector",
}
_RESERVED = ("auto", Source.LOCAL, Source.RECOMPUTE)


class TierSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    connector: str = ""  # "module:Class"; empty: KNOWN_TIERS[name]
    config: dict[str, Any] = msgspec.field(default_factory=dict)  # its kv_connector_extra_config

    def connector_path(self) -> tuple[str, str]:
        """``(module, class name)`` of the tier's connector."""
        path = self.connector or KNOWN_TIERS.get(self.name, "")
        module, _, cls = path.partition(":")
        if not module or not cls:
            raise ConfigError(f"TieredConnector: tier {self.name!r} needs \"connector\": \"module:Class\" "
                              f"(known tiers: {sorted(KNOWN_TIERS)})")
        return module, cls

    def connector_class(self) -> type:
        module, cls = self.connector_path()
        try:
            tier_cls = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"TieredConnector: tier {self.name!r}: cannot load {module}:{cls}: {e}") from None
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, Tier)):
            raise ConfigError(f"TieredConnector: tier {self.name!r}: {module}:{cls} is not a kvcore.tier.Tier")
        return tier_cls


class TieredConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    store: dict[str, Any] | None = None  # short form of {"name": "store", "config": ...}
    p2p: dict[str, Any] | None = None  # short form of {"name": "p2p", "config": ...}
    tiers: list[TierSpec] = msgspec.field(default_factory=list)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    default_source: str = "auto"
    write_back: bool = False

    def __post_init__(self):
        specs = self.tier_specs()
        if not specs:
            raise ConfigError("TieredConnector: configure at least one tier ('store' and/or 'p2p', or 'tiers')")
        names = [s.name for s in specs]
        for spec in specs:
            # Plan names join tier names with "+"; kv_source values share their namespace.
            if not spec.name or spec.name in _RESERVED or "+" in spec.name or names.count(spec.name) > 1:
                raise ConfigError(f"TieredConnector: tier name {spec.name!r} is empty, reserved ({_RESERVED}), "
                                  "contains '+' or is used twice")
            spec.connector_path()  # a missing connector fails here, not at engine start
        if self.default_source not in force_values(names):
            raise ConfigError(f"TieredConnector: default_source must be one of {force_values(names)}")

    def tier_specs(self) -> list[TierSpec]:
        """Every configured tier, cheapest first: the short-form ones, then ``tiers``."""
        short = [TierSpec(name=n, config=c) for n, c in (("store", self.store), ("p2p", self.p2p)) if c is not None]
        return short + list(self.tiers)


def load_config(extra: dict[str, Any] | None) -> TieredConfig:
    return load(TieredConfig, extra, "TieredConnector kv_connector_extra_config")
