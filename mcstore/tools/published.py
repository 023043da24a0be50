"""The key spaces engines published in the store, and which one an operator means.

Every engine's store connector writes its key space to ``{prefix}/{fp16}/meta`` when it
starts (:class:`mcstore.keys.EngineMeta`, :func:`mcstore.publish.publish_engine_meta`):
fingerprint, chunk size, TP and PP sizes, key prefix and version, how its links are hashed,
and the layout fields (the model path the engine loaded, which also names its tokenizer,
dtype, KV cache dtype, block size). So an operator names the engine by what they know and
the tools read the rest:

* its URL (:class:`ServerModel`: ``/v1/models`` names the model, ``/metrics`` the block size);
* or its model: the path the engine was given (``--model``) or the connector's ``model_id``;
* or a fingerprint (``mctier inspect summary`` lists them).

:class:`KeySpaceQuery` holds that, plus any engine setting given to narrow the choice.
:func:`find_meta` picks the one key space it describes:

1. key spaces of another key version are never picked (this mctier computes other keys);
2. those the given settings exclude are dropped;
3. of several left, those of this key version win (the others ran before an upgrade), then
   those whose model identity is the name (an engine with another ``model_id`` that loaded
   the same path stores elsewhere), then, given an engine URL but no block size, those of
   the server's block size;
4. several still left is :class:`AmbiguousKeySpace`, listing them with what tells them apart
   and the flag that picks one; none is a :class:`~kvcore.errors.ConfigError` naming what
   was published.

:func:`offline_settings` goes the other way: the settings of an engine that stores under a
published key space (warmup's offline engine; :func:`mcstore.tools.engine.rebuild_engine`
checks them against the fingerprint).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import requests

from kvcore.errors import ConfigError
from mcstore.admin import MasterAdmin, Unavailable
from mcstore.client import StoreClient
from mcstore.keys import KEY_VERSION, META_SUFFIX, EngineMeta

__all__ = ["AmbiguousKeySpace", "KeySpaceQuery", "ServerModel", "describe", "find_all", "find_meta",
           "meta_for_server", "offline_settings", "published_metas", "tokenizer_path"]


class AmbiguousKeySpace(ConfigError):
    """Several published key spaces fit what the operator gave."""


class KeySpaceQuery(msgspec.Struct, kw_only=True):
    """What the operator said about the engine; None: not said."""

    model: str | None = None  # the engine's --model path, or the connector's model_id
    fingerprint: str | None = None  # 16 or 64 hex digits: that key space, whatever the rest says
    tp_size: int | None = None
    pp_size: int | None = None
    block_size: int | None = None
    chunk_tokens: int | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    hash_algo: str | None = None  # the engine's --prefix-caching-hash-algo
    key_prefix: str = "mct"  # where a fingerprint's metadata object is read


# -- what a published key space says -----------------------------------------------------------


def _block_size(m: EngineMeta) -> int | tuple[int, ...] | None:
    sizes = sorted({g["block_size"] for g in m.fields.get("groups", []) if isinstance(g, dict) and g.get("block_size")})
    return sizes[0] if len(sizes) == 1 else tuple(sizes) or None


def _dtype(value) -> str | None:
    return None if value is None else str(value).removeprefix("torch.")


def _hash(algo: str | None) -> str | None:
    """Links from vLLM's sha256 block hashes, or mctier's own chain (every other algorithm)."""
    return None if algo is None else "sha256" if algo == "sha256" else "non-sha256"


# What tells key spaces of one model apart: (label, KeySpaceQuery field, the flag that sets it,
# the value a published key space has). A trait without a flag is told apart by --fingerprint.
_TRAITS: tuple[tuple[str, str | None, str | None, Callable[[EngineMeta], object]], ...] = (
    ("tp", "tp_size", "--tensor-parallel-size", lambda m: m.tp_size),
    ("pp", "pp_size", "--pipeline-parallel-size", lambda m: m.pp_size),
    ("block", "block_size", "--block-size", _block_size),
    ("chunk", "chunk_tokens", "--chunk-tokens", lambda m: m.chunk_tokens),
    ("dtype", "dtype", "--dtype", lambda m: _dtype(m.fields.get("dtype"))),
    ("kv cache dtype", "kv_cache_dtype", "--kv-cache-dtype", lambda m: _dtype(m.fields.get("cache_dtype"))),
    ("hash", "hash_algo", "--prefix-caching-hash-algo", lambda m: "sha256" if m.block_hashes else "non-sha256"),
    ("key version", None, None, lambda m: "?" if m.key_version is None else
     "this" if m.key_version == KEY_VERSION else m.key_version),
    ("model", None, None, lambda m: m.model),
    ("key prefix", None, None, lambda m: m.key_prefix),
)
_NORMALIZE = {"dtype": _dtype, "kv_cache_dtype": _dtype, "hash_algo": _hash}


def describe(m: EngineMeta) -> str:
    """One line: the fingerprint and every trait of the key space."""
    return f"{m.fingerprint[:16]}  " + ", ".join(f"{label} {'?' if get(m) is None else get(m)}"
                                                 for label, _, _, get in _TRAITS)


def _admits(q: KeySpaceQuery, m: EngineMeta) -> bool:
    for _, field, _, get in _TRAITS:
        want = getattr(q, field) if field else None
        if want is not None and _NORMALIZE.get(field, lambda v: v)(want) != get(m):
            return False
    return True


def _given(q: KeySpaceQuery) -> str:
    return ", ".join(f"{flag} {getattr(q, field)}" for _, field, flag, _ in _TRAITS
                     if field and getattr(q, field) is not None)


def same_model(name: str, published: str) -> bool:
    """``name`` (as the operator wrote it) names the published model: equal, or the same path."""
    a, b = name.rstrip("/"), published.rstrip("/")
    return a == b or (os.path.isabs(b) and os.path.realpath(a) == os.path.realpath(b))


def tokenizer_path(m: EngineMeta) -> str | None:
    """The model the engine loaded (its ``--model``; vLLM's tokenizer defaults to it)."""
    return m.fields.get("model") or m.model


# -- reading the published key spaces ------------------------------------------------------------


def published_metas(client: StoreClient, admin: MasterAdmin) -> list[EngineMeta]:
    """Every engine key space published in the store (lists keys: needs the admin API)."""
    out = []
    for k in admin.all_keys():
        parts = k.split("/")
        if len(parts) == 3 and len(parts[1]) == 16 and parts[2] == META_SUFFIX:
            meta = client.read(k, EngineMeta)
            if meta is not None:
                out.append(meta)
    return out


class ServerModel:
    """What a live vLLM OpenAI server says about itself: its served name, the model it
    loaded (``root`` in ``/v1/models``) and its block size (``vllm:cache_config_info``)."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        try:
            r = requests.get(self.url + "/v1/models", timeout=timeout)
            r.raise_for_status()
            card = r.json()["data"][0]
        except (requests.RequestException, KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"engine {self.url} does not answer /v1/models: {e}") from None
        self.name: str = card["id"]
        self.root: str = card.get("root") or card["id"]
        self.block_size: int | None = None
        try:
            from prometheus_client.parser import text_string_to_metric_families

            text = requests.get(self.url + "/metrics", timeout=timeout).text
            for fam in text_string_to_metric_families(text):
                if fam.name == "vllm:cache_config_info":
                    self.block_size = int(fam.samples[0].labels["block_size"])
        except (requests.RequestException, KeyError, IndexError, ValueError):
            pass


def _foreign_error(metas: list[EngineMeta]) -> str:
    return ("key space " + ", ".join(f"{m.fingerprint[:16]} (key version {m.key_version})" for m in metas)
            + f" was published by another mctier; this one computes {KEY_VERSION} keys, which that engine "
            "would not find: use the mctier the engine runs")


def _by_fingerprint(client: StoreClient, fingerprint: str, key_prefix: str) -> EngineMeta:
    fp = fingerprint.lower()
    meta = client.read(f"{key_prefix}/{fp[:16]}/{META_SUFFIX}", EngineMeta)
    if meta is None or not meta.fingerprint.startswith(fp):
        raise ConfigError(f"no key space published under fingerprint {fp[:16]} (key prefix {key_prefix!r}); "
                          f"`mctier inspect summary` lists them")
    if meta.foreign():
        raise ConfigError(_foreign_error([meta]))
    return meta


def _named(client: StoreClient, admin: MasterAdmin, q: KeySpaceQuery,
           server: ServerModel | None) -> tuple[str, list[str], list[EngineMeta]]:
    """(how the engine was named, the names, the published key spaces of its model)."""
    if q.model is None and server is None:
        raise ConfigError("no engine named: give its URL (--engine) or its model (--model), or a --fingerprint")
    if q.model is not None and server is not None and not any(same_model(q.model, n)
                                                              for n in (server.name, server.root)):
        raise ConfigError(f"--model {q.model} is not the model of engine {server.url} (it serves {server.root!r} "
                          f"as {server.name!r}); give one of the two")
    try:
        metas = published_metas(client, admin)
    except Unavailable as e:
        raise ConfigError(f"cannot list the engines' published metadata ({e}); pass --admin, --fingerprint, "
                          f"or the engine's settings (--model, --kv-config)") from None
    names = [q.model] if q.model is not None else [server.name, server.root]
    what = (f"model {q.model!r}" if server is None else
            f"model {server.root!r} (served as {server.name!r} by {server.url})")
    mine = [m for m in metas if any(same_model(n, p) for n in names for p in (m.model, m.fields.get("model")) if p)]
    if not mine:
        seen = sorted({m.model or m.fields.get("model") or "?" for m in metas})
        shown = ", ".join(seen[:30]) + (f" and {len(seen) - 30} more" if len(seen) > 30 else "") if seen else "none"
        raise ConfigError(f"no published key space for {what} in the store; published for: {shown}. Is the engine's "
                          f"store tier on this master (--master)? Otherwise pass the engine's settings "
                          f"(--model, --kv-config)")
    return what, names, mine


def find_all(client: StoreClient, admin: MasterAdmin, q: KeySpaceQuery,
             server: ServerModel | None = None) -> list[EngineMeta]:
    """Every key space published for the engine's model that the given settings admit, of any
    key version (what ``inspect summary`` shows for it). None of its model is an error."""
    if q.fingerprint:
        return [_by_fingerprint(client, q.fingerprint, q.key_prefix)]
    _, _, mine = _named(client, admin, q, server)
    return [m for m in mine if _admits(q, m)]


def find_meta(client: StoreClient, admin: MasterAdmin, q: KeySpaceQuery,
              server: ServerModel | None = None) -> EngineMeta:
    """The one key space the query (and the engine at ``server``) describes; see the module
    docstring for the rules. :class:`~kvcore.errors.ConfigError` when none fits,
    :class:`AmbiguousKeySpace` when several do."""
    if q.fingerprint:
        return _by_fingerprint(client, q.fingerprint, q.key_prefix)
    what, names, mine = _named(client, admin, q, server)
    usable = [m for m in mine if not m.foreign()]
    if not usable:
        raise ConfigError(_foreign_error(mine))
    found = [m for m in usable if _admits(q, m)]
    if not found:
        raise ConfigError(f"none of the key spaces published for {what} has {_given(q)}:\n  "
                          + "\n  ".join(map(describe, usable)))
    if len(found) > 1:  # published before and after an upgrade: the current version's
        found = [m for m in found if m.key_version == KEY_VERSION] or found
    if len(found) > 1:  # the model identity (model_id, else the path) over the path the engine loaded
        found = [m for m in found if m.model and any(same_model(n, m.model) for n in names)] or found
    if len(found) > 1 and server is not None and server.block_size is not None and q.block_size is None:
        found = [m for m in found if _block_size(m) == server.block_size] or found  # e.g. an older engine
    if len(found) == 1:
        return found[0]
    differ = [(label, flag) for label, _, flag, get in _TRAITS if len({repr(get(m)) for m in found}) > 1]
    flags = [flag for _, flag in differ if flag]
    raise AmbiguousKeySpace(
        f"{what} matches {len(found)} published key spaces:\n  " + "\n  ".join(map(describe, found))
        + f"\nthey differ in {', '.join(label for label, _ in differ) or 'nothing shown here'}; pick one with "
        + "--fingerprint FP16" + (f", or narrow the choice with {' / '.join(flags)}" if flags else ""))


def meta_for_server(server: ServerModel, client: StoreClient, admin: MasterAdmin,
                    fingerprint: str | None = None, key_prefix: str = "mct") -> EngineMeta:
    """The key space the engine behind ``server`` published when it started (or the one
    published under ``fingerprint``): :func:`find_meta` given only the engine's URL."""
    return find_meta(client, admin, KeySpaceQuery(fingerprint=fingerprint, key_prefix=key_prefix), server)


# -- an engine that stores under a published key space -------------------------------------------


def offline_settings(meta: EngineMeta, master: str) -> tuple[str, dict, dict]:
    """``(model, kv-transfer-config, settings)`` of an engine that stores under ``meta``'s key
    space at ``master``, ``settings`` being :func:`mcstore.tools.engine.derive_meta`'s keywords.
    What the metadata does not say (the connector's ``verify_checksums``, ``PYTHONHASHSEED``,
    which non-sha256 hash algorithm) is the default: check the result's fingerprint."""
    model = tokenizer_path(meta)
    block_size = _block_size(meta)
    if not model or not isinstance(block_size, int):
        raise ConfigError(f"key space {meta.fingerprint[:16]} does not say its model and block size (published by "
                          f"an older mctier?): pass the engine's settings (--model, --kv-config)")
    extra = {"master": master, "chunk_tokens": meta.chunk_tokens, "key_prefix": meta.key_prefix}
    if meta.model and meta.model != model:
        extra["model_id"] = meta.model
    kv = {"kv_connector": "StoreConnector", "kv_connector_module_path": "mcstore", "kv_role": "kv_both",
          "kv_connector_extra_config": extra}
    # Links from vLLM's sha256 block hashes, else mctier's chain, the same for every other algorithm.
    settings = dict(block_size=block_size, dtype=_dtype(meta.fields.get("dtype")) or "auto",
                    kv_cache_dtype=_dtype(meta.fields.get("cache_dtype")) or "auto",
                    tensor_parallel_size=meta.tp_size, pipeline_parallel_size=meta.pp_size,
                    prefix_caching_hash_algo="sha256" if meta.block_hashes else "sha256_cbor")
    return model, kv, settings
