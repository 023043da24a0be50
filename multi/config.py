"""``TieredConnector`` configuration (``kv_connector_extra_config``)::

    {"store": {...StoreConnector keys...} | null,   # null/absent: no store tier
     "p2p": {...P2PConnector keys...} | null,       # null/absent: no P2P tier
     "policy": {...multi.policy.PolicyConfig...},
     "default_source": "auto" | "store" | "p2p" | "recompute",
     "write_back": false}                           # decode instances also save to the store
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcore.config import load
from kvcore.errors import ConfigError
from multi.policy import FORCE_VALUES, PolicyConfig


class TieredConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    store: dict[str, Any] | None = None
    p2p: dict[str, Any] | None = None
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    default_source: str = "auto"
    write_back: bool = False

    def __post_init__(self):
        if self.store is None and self.p2p is None:
            raise ConfigError("TieredConnector: configure at least one tier ('store' and/or 'p2p')")
        if self.default_source not in FORCE_VALUES:
            raise ConfigError(f"TieredConnector: default_source must be one of {FORCE_VALUES}")

    def store_role(self, role: str) -> str:
        # Prefill (and kv_both) instances load prefixes and save; decode instances only
        # load unless write-back is on.
        if role == "kv_consumer" and not self.write_back:
            return "kv_consumer"
        return "kv_both"


def load_config(extra: dict[str, Any] | None) -> TieredConfig:
    return load(TieredConfig, extra, "TieredConnector kv_connector_extra_config")
