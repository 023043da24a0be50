"""vLLM's ``reset_cache`` on the store tier's scheduler side (:class:`CacheReset`, mixed into
:class:`mcstore.scheduler.StoreScheduler`, whose request table, lookups, client and events it uses)."""

from __future__ import annotations

from kvcore.log import get_logger

logger = get_logger("mcstore.scheduler")


class CacheReset:
    def reset_cache(self) -> bool:
        """vLLM's reset_cache: forget every answered lookup of a request that has not planned a
        load (asked again, it is looked up anew) and every lookup still out; with
        ``reset_removes_objects``, remove every object of this engine's key space from the store
        too (the published metadata stays). False when that removal failed."""
        for st in self._reqs.values():
            if st.pending is not None:
                st.pending.cancel()
                st.pending = None
                self._waiting -= 1
            if not st.load_tried and st.request.request_id not in self._async_loads:
                st.hit, st.present, st.partial = None, 0, None
        self.stats.inc("resets")
        if not self.cfg.reset_removes_objects:
            return True
        if self.client is None:
            logger.warning("mcstore: reset_removes_objects on an engine that does not look up: nothing removed")
            return False
        try:
            n = self.client.remove_key_space(self.keys)
        except Exception as e:  # noqa: BLE001 - Unavailable, Mooncake errors: the reset failed
            logger.warning("mcstore: reset could not remove the key space's objects: %s", e)
            return False
        logger.info("mcstore: reset removed %d object(s) of key space %s", n, self.keys.fp[:16])
        if self.events is not None:
            self.events.removed_all()
        return True
