"""What an engine publishes in the store for the tools: its key space
(:class:`mcstore.keys.EngineMeta`), read back by :mod:`mcstore.tools.published`. Best
effort, in the background: publishing never blocks nor fails the engine."""

from __future__ import annotations

import threading
import time

import msgspec

from kvcore.log import get_logger
from mcstore.client import StoreClient, replicate_config
from mcstore.config import StoreConfig
from mcstore.keys import KeySpace, engine_meta, meta_key

logger = get_logger("mcstore.client")

_PUBLISH_WINDOW_S = 60.0


def publish(cfg: StoreConfig, key: str, value: bytes, client: StoreClient | None = None,
            window_s: float = _PUBLISH_WINDOW_S) -> threading.Thread:
    """Upsert ``key`` (hard-pinned: a few hundred bytes that eviction must not take) in a
    daemon thread, through ``client`` or a short-lived pure client of its own. Retries for
    ``window_s`` while the master does not answer, then logs and gives up: never blocks
    nor fails the caller."""

    def run() -> None:
        own, deadline, why = None, time.monotonic() + window_s, ""
        try:
            while True:
                try:
                    c = client
                    if c is None:
                        own = own or StoreClient(msgspec.structs.replace(cfg, local_buffer_size=4 << 20),
                                                 "publish", segment=False)
                        c = own
                    rc = c.upsert(key, value, replicate_config(hard_pin=True))
                    if rc == 0:
                        logger.info("mcstore: published %s", key)
                        return
                    why = f"upsert returned {rc}"
                except Exception as e:  # noqa: BLE001 - publishing is best effort by design
                    why = str(e)
                if time.monotonic() > deadline:
                    logger.warning("mcstore: could not publish %s within %.0fs (%s); `mctier inspect` will "
                                   "not name this engine's model", key, window_s, why)
                    return
                time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
        finally:
            if own is not None:
                own.close()

    t = threading.Thread(target=run, name=f"mcstore-publish-{key}", daemon=True)
    t.start()
    return t


def publish_engine_meta(cfg: StoreConfig, keys: KeySpace, vllm_config, kv_cache_config,
                        client: StoreClient | None = None) -> threading.Thread | None:
    """Publish this engine's key space (:class:`mcstore.keys.EngineMeta`) for the tools, in
    the background (see :func:`publish`); never raises."""
    try:
        from kvcore.vllm_glue import kv_fingerprint_fields

        meta = engine_meta(keys, cfg.key_prefix, cfg.model_id or vllm_config.model_config.model,
                           kv_fingerprint_fields(vllm_config, kv_cache_config),
                           cfg.partial_hits and not keys.groups)  # no part objects with KV cache groups
        return publish(cfg, meta_key(keys), msgspec.json.encode(meta), client)
    except Exception as e:  # noqa: BLE001
        logger.warning("mcstore: engine metadata not published: %s", e)
        return None
