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

A prompt's lookup needs the engine's key space: the one the engine published when it
started, found from its URL or its model name (a :class:`~mcstore.tools.published.KeySpaceQuery`,
resolved on first use: :meth:`Inspector.engine_meta`) or from a fingerprint; or derived from
the engine's settings (:mod:`mcstore.tools.engine`). Text and chat prompts are tokenized with
the tokenizer of the model that key space's engine loaded, unless one is given.
``hit_tokens`` is the store's hit depth: leading tokens covered by chunks whose every TP
part is present; an engine loads at most ``prompt_tokens - 1`` of them (``loadable_tokens``).
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
from mcstore.lookup import Probe
from mcstore.tools.engine import Renderer, meta_from_args, query_from_args, read_kv_config, store_config
from mcstore.tools.keynames import DIR, parse_key
from mcstore.tools.published import KeySpaceQuery, ServerModel, find_all, find_meta, tokenizer_path
from mcstore.tools.results import (
    ChunkInfo,
    FingerprintSummary,
    KeyInfo,
    KeyList,
    Lookup,
    NotFound,
    PartialInfo,
    RemoveResult,
    Replicas,
    SegmentInfo,
    Stats,
    Summary,
)

__all__ = ["Inspector", "NotFound", "Unavailable", "parse_key"]

_HEX16 = re.compile(r"^[0-9a-f]{16}([0-9a-f]{48})?$")
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
    """Read-mostly view of a store. The default engine key space for lookups is ``meta``, else
    the one ``query`` describes (with the engine at ``engine_url``), read from the store on
    first use; prompts are tokenized by ``renderer``, else with ``tokenizer``, else with the
    tokenizer of the model the key space's engine loaded."""

    def __init__(self, master: str, admin: str | None = None, meta: EngineMeta | None = None,
                 renderer: Renderer | None = None, engine_url: str | None = None, key_prefix: str = "mct", *,
                 query: KeySpaceQuery | None = None, tokenizer: str | None = None):
        host, sep, port = master.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--master must be HOST:PORT, got {master!r}")
        self.master = master
        self.admin_url = admin.rstrip("/") if admin else None
        self.meta = meta
        self.query = query if meta is None else None
        self.renderer = renderer
        self.tokenizer = tokenizer
        self.engine_url = engine_url.rstrip("/") if engine_url else None
        self.key_prefix = meta.key_prefix if meta is not None else key_prefix
        self._client: StoreClient | None = None
        self._admin: MasterAdmin | None = None
        self._lock = threading.Lock()
        self._resolve_lock = threading.Lock()  # taken before _lock, never inside it
        self._renderers: dict[str, Renderer] = {}

    @classmethod
    def from_args(cls, a) -> Inspector:
        """From ``mctier inspect`` flags: ``--master`` (else ``--kv-config``'s, else
        127.0.0.1:50051), ``--admin``, ``--key-prefix``, ``--engine``, the engine flags
        (:func:`mcstore.tools.engine.add_engine_args`): with ``--kv-config`` the key space is
        derived now; otherwise ``--model`` or ``--engine`` name the engine whose published key
        space is read when first needed."""
        meta = meta_from_args(a)
        master = a.master or (store_config(read_kv_config(a.kv_config)).master if getattr(a, "kv_config", None)
                              else "127.0.0.1:50051")
        engine = getattr(a, "engine", None)
        op = getattr(a, "cmd_inspect", None)
        named = meta is None and (getattr(a, "model", None) or engine) and op != "stats"
        query = query_from_args(a, fingerprint=False) if named else None
        tokenizer = getattr(a, "tokenizer", None) or (a.model if meta is not None else None)
        renderer = Renderer(tokenizer) if tokenizer and op in ("lookup", "serve") else None
        return cls(master, a.admin, meta, renderer, engine, a.key_prefix or "mct", query=query, tokenizer=tokenizer)

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

    def _server(self) -> ServerModel | None:
        return ServerModel(self.engine_url) if self.engine_url else None

    def engine_meta(self) -> EngineMeta | None:
        """The engine's key space: ``meta``, else the published one ``query`` describes (read once;
        :class:`~kvcore.errors.ConfigError` or its :class:`~mcstore.tools.published.AmbiguousKeySpace`
        when none or several fit, tried again on the next call). None when the engine was not named."""
        if self.meta is None and self.query is not None:
            with self._resolve_lock:
                if self.meta is None:
                    meta = find_meta(self.client, self.admin, self.query, self._server())
                    self.key_prefix, self.meta = meta.key_prefix, meta
        return self.meta

    def published(self) -> list[EngineMeta]:
        """Every key space published for the named engine's model that the given settings admit."""
        if self.query is None:
            return [self.meta] if self.meta is not None else []
        return find_all(self.client, self.admin, self.query, self._server())

    def _meta_of(self, fingerprint: str | None) -> EngineMeta:
        if fingerprint is None:
            meta = self.engine_meta()
            if meta is None:
                raise ValueError("no engine key space: name the engine (--engine URL or --model), pass a "
                                 "fingerprint, or give its settings (--model with --kv-config)")
            return meta
        fp = fingerprint.lower()
        if not _HEX16.match(fp):
            raise ValueError(f"fingerprint must be 16 or 64 hex digits, got {fingerprint!r}")
        if self.meta is not None and self.meta.fingerprint.startswith(fp):
            return self.meta
        meta = self.read_meta(fp[:16])
        if meta is None or not meta.fingerprint.startswith(fp):
            raise NotFound(f"no metadata for fingerprint {fp[:16]} (engines publish it when they start; "
                           f"`mctier inspect summary` lists them); pass the engine settings (--model/--kv-config)")
        if meta.foreign():  # its chunks would all read as missing: say why instead
            raise ValueError(f"fingerprint {fp[:16]} was published by mctier key version {meta.key_version}; this "
                             f"one computes {KEY_VERSION} keys: look it up with the mctier that engine runs")
        return meta

    def key_space(self, fingerprint: str | None = None) -> KeySpace:
        """The key space published under ``fingerprint``, else the engine's (:meth:`engine_meta`)."""
        return self._meta_of(fingerprint).key_space()

    def _renderer(self, fingerprint: str | None) -> Renderer:
        if self.renderer is not None:
            return self.renderer
        path = self.tokenizer
        if path is None:
            if fingerprint is None and self.meta is None and self.query is None:
                raise ValueError("no tokenizer: name the engine (--engine URL or --model), pass --tokenizer or a "
                                 "fingerprint, or send tokens")
            path = tokenizer_path(self._meta_of(fingerprint))
        with self._resolve_lock:
            if path not in self._renderers:
                if len(self._renderers) >= 4:  # one per model looked up: a few, bounded
                    self._renderers.pop(next(iter(self._renderers)))
                self._renderers[path] = Renderer(path)
            return self._renderers[path]

    def _replicas(self, keys: Sequence[str]) -> dict[str, Replicas]:
        return {k: Replicas.from_admin(v) for k, v in self.admin.query(list(keys)).items()}

    # -- operations ---------------------------------------------------------------------------------

    def summary(self, fingerprints: set[str] | None = None) -> Summary:
        """Every key space's objects (only those of ``fingerprints``' 16-digit prefixes, if
        given), the totals and the segments."""
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
            kind = fs.directories if parsed[2] == DIR else fs.parts if "-" in parsed[2] else None
            if kind is None:  # a whole chunk's object
                links.setdefault(parsed[1], set()).add(parsed[2])
            else:
                kind.objects += 1
                kind.bytes += r.bytes
            for tier in r.tiers:
                usage = getattr(fs, tier)
                usage.objects += 1
                usage.bytes += r.bytes
        if self.meta is not None and self.meta.fingerprint[:16] in fps:
            fs = fps[self.meta.fingerprint[:16]]
            fs.model, fs.chunk_tokens = fs.model or self.meta.model, fs.chunk_tokens or self.meta.chunk_tokens
        for fp, fs in fps.items():
            fs.chunks = len(links.get(fp, ()))
        if fingerprints is not None:
            fps = {fp: fs for fp, fs in fps.items() if fp in fingerprints}
        segments = [SegmentInfo(s.get("segment_name", "?"),
                                int(s.get("allocator_capacity_bytes") or s.get("size_bytes") or 0),
                                int(s.get("allocator_used_bytes") or 0)) for s in self.admin.segments()]
        return Summary(keys=len(keys), bytes=total, fingerprints=sorted(fps.values(), key=lambda f: -f.bytes),
                       other_keys=other_keys, other_bytes=other_bytes, segments=segments)

    def tokens_of(self, *, prompt: str | None = None, tokens: Sequence[int] | None = None,
                  messages: list[dict] | None = None, add_generation_prompt: bool = True,
                  fingerprint: str | None = None) -> list[int]:
        """Token ids of a prompt; text and messages with the tokenizer of ``fingerprint``'s (else
        the engine's) model unless one was given."""
        given = [x is not None for x in (prompt, tokens, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, tokens, messages")
        if tokens is not None:
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in tokens):
                raise ValueError("tokens must be non-negative integers")
            return list(tokens)
        renderer = self._renderer(fingerprint)
        if prompt is not None:
            return renderer.text(prompt)
        return renderer.messages(messages, add_generation_prompt)

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
        probe = Probe(ks, ks.hashes(tokens, cache_salt=cache_salt, lora=lora), len(tokens))
        links, rank_keys = probe.links, probe.chunk_keys
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
        partial = self._partial(probe, hit // ks.chunk_tokens)
        if partial is not None and partial.present:
            hit = partial.end
        return Lookup(fingerprint=ks.fp[:16], chunk_tokens=ks.chunk_tokens, prompt_tokens=len(tokens),
                      hit_tokens=hit, loadable_tokens=max(0, min(hit, len(tokens) - 1)), chunks=chunks, note=note,
                      partial=partial)

    def _partial(self, probe: Probe, present: int) -> PartialInfo | None:
        """The object past ``present`` whole chunks that the engine's lookup would use (its
        directory entry, then its parts; :mod:`mcstore.lookup`)."""
        ks = probe.ks
        key = probe.directory_key(present, None, probe.num_tokens)
        p = probe.match(present, self.client.fetch(key, 64 + ks.chunk_blocks * 40)) if key else None
        if p is None:
            return None
        keys = probe.part_keys(p)
        reps, _ = self._presence(keys)
        rs = [reps[k] for k in keys]
        tiers = {"+".join(r.tiers) for r in rs if r.ok}
        present_all = all(r.ok for r in rs)
        start = present * ks.chunk_tokens
        return PartialInfo(index=p.index, start=start, end=start + p.matched * ks.block_tokens, blocks=p.blocks,
                           matched=p.matched, present=present_all,
                           tier="missing" if not present_all else (tiers.pop() if len(tiers) == 1 else "mixed"),
                           bytes=sum(r.bytes for r in rs), keys=keys)

    def fingerprint_prefix(self, fingerprint: str) -> str:
        """``{key_prefix}/{fp16}/``: every key of that fingerprint (its metadata object included)."""
        fp = fingerprint.lower()
        if not _HEX16.match(fp):
            raise ValueError(f"fingerprint must be 16 or 64 hex digits, got {fingerprint!r}")
        return f"{self.key_prefix}/{fp[:16]}/"

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
        prefix = self.fingerprint_prefix(fingerprint)
        fp = fingerprint.lower()
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
