"""The Mooncake master's HTTP admin API (its ``--metrics_port``), as the store client
hands it to the tools (:meth:`mcstore.client.StoreClient.admin`). Standard library only."""

from __future__ import annotations

import json
from urllib.error import HTTPError, URLError
from urllib.parse import urlencode
from urllib.request import urlopen

DEFAULT_ADMIN_PORT = 9003  # mooncake_master's default --metrics_port


class Unavailable(RuntimeError):
    """The master (its RPC port or its HTTP admin API) did not answer."""


class MasterAdmin:
    """The master's HTTP admin API (its ``--metrics_port``): key listing, replica
    descriptors, segments, metrics. Every call is bounded by ``timeout``."""

    QUERY_BATCH = 64

    def __init__(self, url: str, timeout: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def get(self, path: str, **params) -> tuple[int, str]:
        """``(HTTP status, body)``; :class:`Unavailable` when it does not answer or answers 5xx."""
        url = self.url + path + (("?" + urlencode(params)) if params else "")
        try:
            with urlopen(url, timeout=self.timeout) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except HTTPError as e:
            body = e.read().decode("utf-8", "replace")
            if e.code >= 500:
                raise Unavailable(f"master admin API {self.url}{path}: HTTP {e.code} {body[:200]}") from None
            return e.code, body
        except (URLError, OSError) as e:
            raise Unavailable(f"master admin API {self.url} not reachable: {getattr(e, 'reason', e)}") from None

    def healthy(self) -> bool:
        try:
            return self.get("/health")[0] == 200
        except Unavailable:
            return False

    def all_keys(self) -> list[str]:
        """Every complete object's key."""
        return self.get("/get_all_keys")[1].split()

    def query(self, keys: list[str]) -> dict[str, dict | None]:
        """Per key the master's replica descriptor entry (None when it has none)."""
        out: dict[str, dict | None] = {}
        for i in range(0, len(keys), self.QUERY_BATCH):
            batch = keys[i:i + self.QUERY_BATCH]
            if any("," in k for k in batch):
                raise ValueError("keys with ',' cannot be queried through the admin API")
            status, body = self.get("/batch_query_keys", keys=",".join(batch))
            data = (json.loads(body).get("data") or {}) if status == 200 else {}
            for k in batch:
                out[k] = data.get(k)
        return out

    def segments(self) -> list[dict]:
        return json.loads(self.get("/get_segments_detail")[1]).get("segments") or []

    def metrics_text(self) -> str:
        return self.get("/metrics")[1]
