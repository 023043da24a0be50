"""The store's lookup timed alone against a master, before any engine starts (not a test):
:func:`lookup_times`, the lookup lines of ``bench.store_divergence``'s table."""

from __future__ import annotations

import random
import time

from bench.client import ids
from bench.store_hit import CHUNK, SUFFIX

BLOCK = 32


def lookup_times(cluster, n: int, tokens: int = 32768, gap_s: float = 0.005) -> dict:
    """The lookup alone (:func:`mcstore.lookup.reach`, the engine's), against this run's master
    before any engine starts: a ``tokens``-token prompt whose whole chunks are stored (one round
    trip), one that diverges inside its last chunk from a stored prompt (three: the entry's get
    and the object's parts), and one that shares nothing (one). Tiny stand-in objects under the
    real keys (existence is all a lookup asks); each lookup after a ``gap_s`` pause, as between
    requests. Milliseconds, p50 and p99 of ``n`` each, and the round trips."""
    from mcstore.client import StoreClient
    from mcstore.keys import Directory, KeySpace, VllmBlockHashes, fingerprint
    from mcstore.lookup import Probe, reach

    scheme = VllmBlockHashes(algo="sha256", seed="vllm-none-hash", block_size=BLOCK)
    ks = KeySpace(fingerprint({"bench": "lookup"}), CHUNK, block_hashes=scheme)
    client = StoreClient.for_tool(cluster.master_addr, "bench-lookup")
    rng = random.Random(1)
    try:
        p = ids(tokens, rng)
        hs = ks.hashes(p)
        links = ks.links_from_block_hashes(hs, tokens)
        keys = ks.all_rank_keys(links) + [ks.dir_key(hs[i]) for i in range(0, len(hs), ks.chunk_blocks)]
        values = [b"x"] * len(links) + [Directory.of(hs[i:i + ks.chunk_blocks]).encode()
                                         for i in range(0, len(hs), ks.chunk_blocks)]
        for i in range(0, len(keys), 64):
            assert client.upsert_small(keys[i:i + 64], values[i:i + 64]) == 0
        d = tokens - CHUNK + 5 * BLOCK + 7
        cases = {"whole chunks": p + ids(SUFFIX, rng), "inside the last chunk": p[:d] + ids(SUFFIX, rng),
                 "nothing shared": ids(tokens + SUFFIX, rng)}
        out = {}
        for name, q in cases.items():
            probe_hashes, xs = ks.hashes(q), []
            r = None
            for _ in range(n):
                time.sleep(gap_s)
                t0 = time.perf_counter()
                r = reach(client, Probe(ks, probe_hashes, len(q)), len(q) - 1)
                xs.append(time.perf_counter() - t0)
            xs.sort()
            out[name] = {"p50_ms": xs[len(xs) // 2] * 1e3, "p99_ms": xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3,
                         "round_trips": r.round_trips, "tokens": r.tokens, "prompt_tokens": len(q)}
            print(f"[store_divergence] lookup of a {len(q)}-token prompt, {name}: p50 {out[name]['p50_ms']:.2f} ms, "
                  f"p99 {out[name]['p99_ms']:.2f} ms, {r.round_trips} round trip(s), reach {r.tokens}", flush=True)
        client.remove(keys, force=True)
        return out
    finally:
        client.close()
