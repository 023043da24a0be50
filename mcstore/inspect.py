"""What the store holds: one implementation behind three faces.

* Python: :class:`Inspector` methods return msgspec structs.
* CLI: ``mctier inspect summary | lookup | keys | remove | stats [--json]``
  (:mod:`mcstore.inspect_cli`).
* HTTP: ``mctier inspect serve`` (:mod:`mcstore.inspect_http`).

Sources of truth, all real:

* the master's HTTP admin API on its metrics port (``--admin``, default
  ``http://MASTER_HOST:9003``): ``/get_all_keys`` (complete objects only),
  ``/batch_query_keys`` (replica descriptors per key: size, memory replicas,
  disk replicas) and ``/metrics``. A query grants the key a read lease
  (``default_kv_lease_ttl``), as any read does;
* a pure Mooncake client (no segment) for the metadata objects that warmup
  publishes under ``{prefix}/{fp16}/meta`` and for removal;
* an engine's ``/metrics`` (``--engine URL``) for the connector counters
  (``vllm:mctier_*``).

A prompt's lookup needs the engine's key space: derived from the engine's
settings (:mod:`mcstore.toolkeys`) or, with ``--fingerprint FP16``, read from the
metadata object warmup published for that fingerprint. ``hit_tokens`` is the
store's hit depth: leading tokens covered by chunks whose every TP part is
present; an engine loads at most ``prompt_tokens - 1`` of them
(``loadable_tokens``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

import msgspec
import requests

from kvcore.errors import ConfigError
from mcstore.keys import KeySpace
from mcstore.toolkeys import META_SUFFIX, EngineMeta, Renderer

_HEX16 = re.compile(r"^[0-9a-f]{16}([0-9a-f]{48})?$")
_QUERY_BATCH = 64


class Unavailable(RuntimeError):
    """The master (or an engine) did not answer."""


class NotFound(LookupError):
    pass


# -- results ---------------------------------------------------------------------------


class TierUsage(msgspec.Struct):
    objects: int = 0
    bytes: int = 0


class FingerprintSummary(msgspec.Struct, kw_only=True):
    fingerprint: str
    model: str | None = None
    chunk_tokens: int | None = None
    objects: int = 0
    chunks: int = 0
    bytes: int = 0
    memory: TierUsage = msgspec.field(default_factory=TierUsage)
    disk: TierUsage = msgspec.field(default_factory=TierUsage)


class Segment(msgspec.Struct):
    name: str
    capacity_bytes: int
    used_bytes: int


class Summary(msgspec.Struct, kw_only=True):
    keys: int
    bytes: int
    fingerprints: list[FingerprintSummary]
    other_keys: int
    other_bytes: int
    segments: list[Segment]


class ChunkInfo(msgspec.Struct, kw_only=True):
    index: int
    start: int
    end: int
    present: bool
    tier: str  # memory | disk | memory+disk | mixed | missing
    bytes: int
    keys: list[str]


class Lookup(msgspec.Struct, kw_only=True):
    fingerprint: str
    chunk_tokens: int
    prompt_tokens: int
    hit_tokens: int
    loadable_tokens: int
    chunks: list[ChunkInfo]


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


# -- the master's admin API ----------------------------------------------------------------


class Replicas(msgspec.Struct):
    ok: bool
    bytes: int
    tiers: list[str]
    copies: int = 0  # replicas over all tiers


class MasterAdmin:
    """The master's HTTP admin endpoints (its ``--metrics_port``)."""

    def __init__(self, url: str, timeout: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, **params) -> requests.Response:
        try:
            r = requests.get(self.url + path, params=params or None, timeout=self.timeout)
        except requests.RequestException as e:
            raise Unavailable(f"master admin API {self.url} not reachable: {e}") from None
        if r.status_code >= 500:
            raise Unavailable(f"master admin API {self.url}{path}: HTTP {r.status_code} {r.text[:200]}")
        return r

    def all_keys(self) -> list[str]:
        return self._get("/get_all_keys").text.split()

    def query(self, keys: Sequence[str]) -> dict[str, Replicas]:
        out: dict[str, Replicas] = {}
        for i in range(0, len(keys), _QUERY_BATCH):
            batch = keys[i:i + _QUERY_BATCH]
            if any("," in k for k in batch):
                raise ValueError("keys with ',' cannot be queried through the admin API")
            r = self._get("/batch_query_keys", keys=",".join(batch))
            data = (r.json().get("data") or {}) if r.ok else {}
            for k in batch:
                out[k] = _replicas(data.get(k))
        return out

    def segments(self) -> list[Segment]:
        r = self._get("/get_segments_detail")
        return [Segment(s.get("segment_name", "?"), int(s.get("allocator_capacity_bytes") or s.get("size_bytes") or 0),
                        int(s.get("allocator_used_bytes") or 0)) for s in (r.json().get("segments") or [])]

    def metrics_text(self) -> str:
        return self._get("/metrics").text


def _replicas(entry: dict | None) -> Replicas:
    if not entry or not entry.get("ok"):
        return Replicas(False, 0, [])
    tiers, size, copies = [], 0, 0
    for field, tier in (("values", "memory"), ("disk_values", "disk"), ("local_disk_values", "disk"),
                        ("nof_values", "disk")):
        reps = entry.get(field) or []
        if reps and tier not in tiers:
            tiers.append(tier)
        copies += len(reps)
        for rep in reps:
            size = size or int(rep.get("size_") or rep.get("size") or 0)
    return Replicas(bool(tiers), size, tiers, copies)


def parse_key(key: str) -> tuple[str, str, str] | None:
    """``(prefix, fp16, link|'meta')`` for a key of ours, None otherwise."""
    parts = key.split("/")
    if len(parts) == 4 and len(parts[1]) == 16 and len(parts[2]) == 64 and parts[3].startswith("tp"):
        return parts[0], parts[1], parts[2]
    if len(parts) == 3 and len(parts[1]) == 16 and parts[2] == META_SUFFIX:
        return parts[0], parts[1], META_SUFFIX
    return None


def _prom_samples(text: str, keep) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not keep(s.name) or s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                              if v and k not in ("engine", "model_name"))
            name = f"{s.name}{{{labels}}}" if labels else s.name
            out[name] = out.get(name, 0.0) + s.value
    return out


# -- the inspector -----------------------------------------------------------------------------


class Inspector:
    """Read-mostly view of a store; ``meta`` is the default engine key space for lookups."""

    def __init__(self, master: str, admin: str | None = None, meta: EngineMeta | None = None,
                 renderer: Renderer | None = None, engine_url: str | None = None, key_prefix: str = "mct"):
        host, sep, port = master.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--master must be HOST:PORT, got {master!r}")
        self.master = master
        self.admin = MasterAdmin(admin or f"http://{host}:9003")
        self.meta = meta
        self.renderer = renderer
        self.engine_url = engine_url.rstrip("/") if engine_url else None
        self.key_prefix = meta.key_prefix if meta is not None else key_prefix
        self._client = None
        self._client_lock = threading.Lock()

    @property
    def client(self):
        with self._client_lock:
            return self._make_client()

    def _make_client(self):
        if self._client is None:
            from mcstore.client import StoreClient
            from mcstore.config import StoreConfig

            self._client = StoreClient(StoreConfig(master=self.master, local_buffer_size="4MB"), "inspect",
                                       segment=False)
        return self._client

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # -- metadata objects ---------------------------------------------------------------------

    def read_meta(self, fp16: str) -> EngineMeta | None:
        raw = self.client.store.get(f"{self.key_prefix}/{fp16}/{META_SUFFIX}")
        if not raw:
            return None
        try:
            return msgspec.json.decode(raw, type=EngineMeta)
        except msgspec.DecodeError:
            return None

    def key_space(self, fingerprint: str | None = None) -> KeySpace:
        if fingerprint is None:
            if self.meta is None:
                raise ValueError("no engine key space: start with --model/--kv-config or pass a fingerprint")
            return self.meta.key_space()
        fp = fingerprint.lower()
        if not _HEX16.match(fp):
            raise ValueError(f"fingerprint must be 16 or 64 hex digits, got {fingerprint!r}")
        if self.meta is not None and self.meta.fingerprint.startswith(fp):
            return self.meta.key_space()
        meta = self.read_meta(fp[:16])
        if meta is None or not meta.fingerprint.startswith(fp):
            raise NotFound(f"no metadata for fingerprint {fp[:16]} (published by `mctier warmup`); "
                           f"pass the engine settings (--model/--kv-config) instead")
        return meta.key_space()

    # -- operations ---------------------------------------------------------------------------------

    def summary(self) -> Summary:
        keys = self.admin.all_keys()
        reps = self.admin.query(keys)
        fps: dict[str, FingerprintSummary] = {}
        links: dict[str, set[str]] = {}
        other_keys = other_bytes = total = 0
        for k in keys:
            r = reps[k]
            total += r.bytes
            parsed = parse_key(k)
            if parsed is None or parsed[0] != self.key_prefix:
                other_keys += 1
                other_bytes += r.bytes
                continue
            fs = fps.setdefault(parsed[1], FingerprintSummary(fingerprint=parsed[1]))
            if parsed[2] == META_SUFFIX:
                meta = self.read_meta(parsed[1])
                if meta is not None:
                    fs.model, fs.chunk_tokens = meta.model, meta.chunk_tokens
                continue
            fs.objects += 1
            fs.bytes += r.bytes
            links.setdefault(parsed[1], set()).add(parsed[2])
            for tier in r.tiers:
                usage = getattr(fs, tier)
                usage.objects += 1
                usage.bytes += r.bytes
        if self.meta is not None and self.meta.fingerprint[:16] in fps:
            fs = fps[self.meta.fingerprint[:16]]
            fs.model, fs.chunk_tokens = fs.model or self.meta.model, fs.chunk_tokens or self.meta.chunk_tokens
        for fp, fs in fps.items():
            fs.chunks = len(links.get(fp, ()))
        return Summary(keys=len(keys), bytes=total, fingerprints=sorted(fps.values(), key=lambda f: -f.bytes),
                       other_keys=other_keys, other_bytes=other_bytes, segments=self.admin.segments())

    def tokens_of(self, *, prompt: str | None = None, tokens: Sequence[int] | None = None,
                  messages: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
        given = [x is not None for x in (prompt, tokens, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, tokens, messages")
        if tokens is not None:
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens):
                raise ValueError("tokens must be non-negative integers")
            return list(tokens)
        if self.renderer is None:
            raise ValueError("no tokenizer: start with --model to look up text or messages, or send tokens")
        if prompt is not None:
            return self.renderer.text(prompt)
        return self.renderer.messages(messages, add_generation_prompt)

    def lookup(self, tokens: Sequence[int], *, fingerprint: str | None = None, cache_salt: str | None = None,
               lora: str | None = None) -> Lookup:
        ks = self.key_space(fingerprint)
        links = ks.links(tokens, cache_salt=cache_salt, lora=lora)
        rank_keys = ks.all_rank_keys(links)
        reps = self.admin.query(rank_keys)
        chunks, hit, leading = [], 0, True
        for i, link in enumerate(links):
            keys = rank_keys[i * ks.tp_size:(i + 1) * ks.tp_size]
            rs = [reps[k] for k in keys]
            present = all(r.ok for r in rs)
            tier_sets = {"+".join(r.tiers) for r in rs if r.ok}
            tier = "missing" if not present else (tier_sets.pop() if len(tier_sets) == 1 else "mixed")
            if present and leading:
                hit = (i + 1) * ks.chunk_tokens
            leading = leading and present
            chunks.append(ChunkInfo(index=i, start=i * ks.chunk_tokens, end=(i + 1) * ks.chunk_tokens,
                                    present=present, tier=tier, bytes=sum(r.bytes for r in rs), keys=keys))
        return Lookup(fingerprint=ks.fp[:16], chunk_tokens=ks.chunk_tokens, prompt_tokens=len(tokens),
                      hit_tokens=hit, loadable_tokens=max(0, min(hit, len(tokens) - 1)), chunks=chunks)

    def keys(self, prefix: str | None = None, limit: int = 1000) -> KeyList:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        prefix = f"{self.key_prefix}/" if prefix is None else prefix
        matched = sorted(k for k in self.admin.all_keys() if k.startswith(prefix))
        shown = matched[:limit]
        reps = self.admin.query(shown)
        return KeyList(prefix=prefix, total=len(matched), truncated=len(matched) > len(shown),
                       keys=[KeyInfo(k, reps[k].bytes, reps[k].tiers, reps[k].copies) for k in shown])

    def remove(self, fingerprint: str, *, force: bool = False, timeout: float = 12.0) -> RemoveResult:
        """Remove every object of a fingerprint. Leased objects (being read) are retried until
        ``timeout`` (cover the master's ``default_kv_lease_ttl``) unless ``force``."""
        fp = fingerprint.lower()
        if not _HEX16.match(fp):
            raise ValueError(f"fingerprint must be 16 or 64 hex digits, got {fingerprint!r}")
        prefix = f"{self.key_prefix}/{fp[:16]}/"
        todo = [k for k in self.admin.all_keys() if k.startswith(prefix)]
        matched, removed, failed = len(todo), 0, {}
        deadline = time.monotonic() + timeout
        while todo:
            rcs = list(self.client.store.batch_remove(todo, force))
            busy = []
            for k, rc in zip(todo, rcs):
                if rc == 0 or rc == -704:  # -704: already gone (evicted or removed meanwhile)
                    removed += rc == 0
                elif rc == -706:
                    busy.append(k)
                else:
                    failed[str(rc)] = failed.get(str(rc), 0) + 1
            todo = busy
            if not todo or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return RemoveResult(fingerprint=fp[:16], matched=matched, removed=removed, busy=len(todo), failed=failed)

    def stats(self) -> Stats:
        master = _prom_samples(self.admin.metrics_text(), lambda n: n.startswith(("master_", "segment_")))
        engine = None
        if self.engine_url:
            try:
                r = requests.get(self.engine_url + "/metrics", timeout=5)
                r.raise_for_status()
            except requests.RequestException as e:
                raise Unavailable(f"engine {self.engine_url} /metrics: {e}") from None
            engine = _prom_samples(r.text, lambda n: n.startswith("vllm:mctier_"))
        return Stats(master=master, engine_url=self.engine_url, engine=engine)
