"""What the store holds: one implementation (:class:`Inspector`) behind three faces.

* Python: :class:`Inspector` methods return the structs of :mod:`mcstore.tools.results`.
* CLI: ``mctier inspect summary | lookup | keys | remove | stats [--json]``
  (:mod:`mcstore.tools.inspect_cli`).
* HTTP: ``mctier inspect serve`` (:mod:`mcstore.tools.inspect_http`), which serves an Inspector.

Sources of truth, all real, all through :class:`mcstore.client.StoreClient` (and its breaker):

* the master's HTTP admin API (:class:`mcstore.client.MasterAdmin`): ``--admin``, else the
  address the store server published in the store, else ``http://MASTER_HOST:9003``.
  ``/get_all_keys`` (complete objects only), ``/batch_query_keys`` (replica descriptors per
  key: size, memory replicas, disk replicas) and ``/metrics``. A query grants the key a read
  lease (``default_kv_lease_ttl``), as any read does;
* the master's RPC port for the metadata objects engines publish under
  ``{prefix}/{fp16}/meta``, for presence when the admin API does not answer (a lookup then
  still answers the hit depth, with tier ``unknown``) and for removal;
* an engine's ``/metrics`` (``--engine URL``) for the connector counters (``vllm:mctier_*``).

A prompt's lookup needs the engine's key space: derived from the engine's settings
(:mod:`mcstore.tools.engine`) or, with a fingerprint, read from the metadata object the
engine published. ``hit_tokens`` is the store's hit depth: leading tokens covered by chunks
whose every TP part is present; an engine loads at most ``prompt_tokens - 1`` of them
(``loadable_tokens``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

import requests

from kvcore.errors import ConfigError, is_leased, is_not_found, is_rpc_down
from kvcore.procs import port_open
from mcstore.admin import MasterAdmin, Unavailable
from mcstore.client import StoreClient
from mcstore.keys import KEY_VERSION, META_SUFFIX, EngineMeta, KeySpace
from mcstore.tools.engine import Renderer, meta_from_args, read_kv_config, store_config
from mcstore.tools.results import (
    ChunkInfo,
    FingerprintSummary,
    KeyInfo,
    KeyList,
    Lookup,
    NotFound,
    RemoveResult,
    Replicas,
    SegmentInfo,
    Stats,
    Summary,
)

__all__ = ["Inspector", "NotFound", "Unavailable", "parse_key"]

_HEX16 = re.compile(r"^[0-9a-f]{16}([0-9a-f]{48})?$")
_PART = re.compile(r"^(pp\d+)?tp\d+$")  # mcstore.keys.KeySpace.key: tp{r}, or pp{s}tp{r} with stages


def parse_key(key: str) -> tuple[str, str, str] | None:
    """``(prefix, fp16, link|'meta')`` for a key of ours, None otherwise."""
    parts = key.split("/")
    if len(parts) == 4 and len(parts[1]) == 16 and len(parts[2]) == 64 and _PART.match(parts[3]):
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


class Inspector:
    """Read-mostly view of a store; ``meta`` is the default engine key space for lookups."""

    def __init__(self, master: str, admin: str | None = None, meta: EngineMeta | None = None,
                 renderer: Renderer | None = None, engine_url: str | None = None, key_prefix: str = "mct"):
        host, sep, port = master.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--master must be HOST:PORT, got {master!r}")
        self.master = master
        self.admin_url = admin.rstrip("/") if admin else None
        self.meta = meta
        self.renderer = renderer
        self.engine_url = engine_url.rstrip("/") if engine_url else None
        self.key_prefix = meta.key_prefix if meta is not None else key_prefix
        self._client: StoreClient | None = None
        self._admin: MasterAdmin | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_args(cls, a) -> Inspector:
        """From ``mctier inspect`` flags: ``--master`` (else ``--kv-config``'s, else
        127.0.0.1:50051), ``--admin``, ``--key-prefix``, ``--engine``, the engine settings."""
        meta = meta_from_args(a)
        master = a.master or (store_config(read_kv_config(a.kv_config)).master if getattr(a, "kv_config", None)
                              else "127.0.0.1:50051")
        model = getattr(a, "model", None)
        renderer = Renderer(model) if model and getattr(a, "cmd_inspect", None) in ("lookup", "serve") else None
        return cls(master, a.admin, meta, renderer, getattr(a, "engine", None), a.key_prefix)

    @property
    def client(self) -> StoreClient:
        with self._lock:
            if self._client is None:
                self._client = StoreClient.for_tool(self.master, "inspect")
            return self._client

    @property
    def admin(self) -> MasterAdmin:
        """The master's admin API: the given URL, else the published one (asks the master)."""
        if self._admin is None:
            admin = MasterAdmin(self.admin_url) if self.admin_url else self.client.admin()
            with self._lock:
                self._admin = self._admin or admin
        return self._admin

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def health(self) -> dict:
        host, _, port = self.master.rpartition(":")
        try:
            admin = self.admin
            admin_ok = admin.healthy()
        except (ConfigError, Unavailable):
            admin, admin_ok = None, False
        return {"master": port_open(int(port), host, 2.0), "admin": admin_ok,
                "admin_url": admin.url if admin else self.admin_url}

    # -- metadata objects ---------------------------------------------------------------------

    def read_meta(self, fp16: str) -> EngineMeta | None:
        return self.client.read(f"{self.key_prefix}/{fp16}/{META_SUFFIX}", EngineMeta)

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
            raise NotFound(f"no metadata for fingerprint {fp[:16]} (engines publish it when they start; "
                           f"`mctier inspect summary` lists them); pass the engine settings (--model/--kv-config)")
        if meta.foreign():  # its chunks would all read as missing: say why instead
            raise ValueError(f"fingerprint {fp[:16]} was published by mctier key version {meta.key_version}; this "
                             f"one computes {KEY_VERSION} keys: look it up with the mctier that engine runs")
        return meta.key_space()

    def _replicas(self, keys: Sequence[str]) -> dict[str, Replicas]:
        return {k: Replicas.from_admin(v) for k, v in self.admin.query(list(keys)).items()}

    # -- operations ---------------------------------------------------------------------------------

    def summary(self) -> Summary:
        keys = self.admin.all_keys()
        reps = self._replicas(keys)
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
                    fs.model, fs.chunk_tokens, fs.key_version = meta.model, meta.chunk_tokens, meta.key_version
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
        segments = [SegmentInfo(s.get("segment_name", "?"),
                                int(s.get("allocator_capacity_bytes") or s.get("size_bytes") or 0),
                                int(s.get("allocator_used_bytes") or 0)) for s in self.admin.segments()]
        return Summary(keys=len(keys), bytes=total, fingerprints=sorted(fps.values(), key=lambda f: -f.bytes),
                       other_keys=other_keys, other_bytes=other_bytes, segments=segments)

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

    def _presence(self, keys: list[str]) -> tuple[dict[str, Replicas], str | None]:
        """Replicas per key from the admin API; from the store alone (tier unknown) without it."""
        try:
            return self._replicas(keys), None
        except Unavailable as e:
            rcs = self.client.exists(keys)
            if any(is_rpc_down(rc) for rc in rcs):
                raise Unavailable(f"master {self.master} does not answer (and {e})") from None
            note = f"tiers and sizes unknown: {e}"
            return {k: Replicas(rc == 1, 0, ["unknown"] if rc == 1 else [], int(rc == 1))
                    for k, rc in zip(keys, rcs)}, note

    def lookup(self, tokens: Sequence[int], *, fingerprint: str | None = None, cache_salt: str | None = None,
               lora: str | None = None) -> Lookup:
        ks = self.key_space(fingerprint)
        links = ks.links(tokens, cache_salt=cache_salt, lora=lora)
        rank_keys = ks.all_rank_keys(links)
        reps, note = self._presence(rank_keys)
        chunks, hit, leading = [], 0, True
        for i in range(len(links)):
            keys = rank_keys[i * ks.parts:(i + 1) * ks.parts]
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
                      hit_tokens=hit, loadable_tokens=max(0, min(hit, len(tokens) - 1)), chunks=chunks, note=note)

    def keys(self, prefix: str | None = None, limit: int = 1000) -> KeyList:
        if limit < 0:
            raise ValueError("limit must be >= 0")
        prefix = f"{self.key_prefix}/" if prefix is None else prefix
        matched = sorted(k for k in self.admin.all_keys() if k.startswith(prefix))
        shown = matched[:limit]
        reps = self._replicas(shown)
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
            busy = []
            for k, rc in zip(todo, self.client.remove(todo, force)):
                if rc == 0 or is_not_found(rc):  # not found: already gone (evicted or removed meanwhile)
                    removed += rc == 0
                elif is_leased(rc):
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
