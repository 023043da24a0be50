"""The router's start-up probe: each instance's prefill speed and fixed cost, and each
prefill instance's handoff cost, measured with a few tiny real requests before the first
client request, so that the estimates fit the machine from the start (the priors are
another machine's: 10-40x off on a fast CPU, docs/benchmarks/router.md).

Per instance (when the router starts, and when an instance joins or comes back into
rotation, :meth:`multi.router.app.Router.start` and its health loop):

- ``max_tokens=1`` completions of token-id prompts (no tokenizer needed; random ids, so
  nothing is cached) of two lengths, :data:`SHORT` and :data:`LONG` tokens (at most the
  instance's ``max_model_len`` less 8), one warm-up then :data:`REPEATS` of each, one at a
  time; the median of each length's times goes to :func:`multi.router.fits.probe_compute`,
  whose ``[step, token, attn]`` seed the instance's fit (:meth:`InstanceFit.seed`, worth as
  many samples as were timed) and its cost model;
- for each prefill instance, :data:`HANDOFFS` real handoffs of a :data:`LONG`-token prompt
  through it to the least loaded decode instance (the P2P tier's proxy contract,
  :mod:`p2p.proxy`), the decode request sent once the prefill answered; the fastest one's
  time from the prefill's answer to the decode instance's, less the decode instance's compute
  of the last token, is the handoff's fixed cost: it seeds the prefill instance's ``p2p`` load fit (latency; the bandwidth stays
  the prior's).

Every request has a deadline (what is left of ``timeout``); a failed or late probe leaves
that instance's priors (logged). A probe of an instance that already has requests of the
router in flight is put off to the next health round; a sample during which a routed
request arrived is dropped. Not run when the cost model does not calibrate
(``calibrate: false``) or with ``--probe-timeout 0``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
import uuid

import aiohttp

from multi.router.fits import probe_compute
from multi.router.instances import Instance
from p2p.proxy import ProxyError, decode_body, prefill_body

logger = logging.getLogger("mctier.router")

SHORT, LONG = 32, 1024  # prompt tokens of the two probe lengths
REPEATS = 3  # timed requests per length (after one warm-up)
HANDOFFS = 2  # per prefill instance; the first also sets up the pair's transfer connection
IDS = (100, 1000)  # token ids drawn from this range (within any real vocabulary)


# ``router`` below is the :class:`multi.router.app.Router` (not imported: it imports this module).


class ProbeFailed(Exception):
    pass


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*IDS) for _ in range(n)]


async def _card(router, inst: Instance, deadline: float) -> tuple[str, int | None]:
    """The served model's name and ``max_model_len`` from the instance's ``/v1/models``."""
    t = aiohttp.ClientTimeout(total=max(0.1, deadline - time.monotonic()))
    try:
        async with router.session.get(inst.url + "/v1/models", timeout=t) as r:
            card = (await r.json())["data"][0]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError, TypeError) as e:
        raise ProbeFailed(f"/v1/models: {e!r}") from None
    limit = card.get("max_model_len")
    return str(card["id"]), limit if isinstance(limit, int) and limit > 0 else None


async def _time_one(router, inst: Instance, body: dict, deadline: float) -> float:
    t = aiohttp.ClientTimeout(total=max(0.1, deadline - time.monotonic()))
    t0 = time.monotonic()
    try:
        async with router.session.post(inst.url + "/v1/completions", json=body, timeout=t) as r:
            data = await r.read()
            if r.status != 200:
                raise ProbeFailed(f"HTTP {r.status}: {data[:200].decode(errors='replace')}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ProbeFailed(f"{e!r}") from None
    return time.monotonic() - t0


def _busy(inst: Instance) -> bool:
    return bool(inst.inflight or inst.decoding)


async def probe_compute_of(router, inst: Instance, deadline: float) -> list[float]:
    """Time the two lengths on ``inst`` and seed its fit; returns ``[step, token, attn]``."""
    model, limit = await _card(router, inst, deadline)
    rng = random.Random(f"{inst.url}-{time.time_ns()}")
    long_n = LONG if limit is None else max(SHORT + 1, min(LONG, limit - 8))
    times: dict[int, list[float]] = {SHORT: [], long_n: []}
    plan = [SHORT] + [n for n in (SHORT, long_n) for _ in range(REPEATS)]
    for i, n in enumerate(plan):
        body = {"model": model, "prompt": _prompt(rng, n), "max_tokens": 1, "temperature": 0}
        busy = _busy(inst)
        seconds = await _time_one(router, inst, body, deadline)
        if i > 0 and not busy and not _busy(inst):  # the first is a warm-up; a routed request spoils one
            times[n].append(seconds)
    samples = [(n, statistics.median(ts)) for n, ts in times.items() if ts]
    compute = probe_compute(samples, router.chooser.cfg)
    if compute is None:
        raise ProbeFailed(f"timings give no per-token cost: {samples}")
    router.chooser.seed(inst, compute, weight=sum(len(ts) for ts in times.values()), scale_s=max(s for _, s in samples))
    logger.info("probe %s: %s -> step %.4fs, %.3g s/token", inst.url,
                ", ".join(f"{n} tokens {s * 1e3:.1f} ms" for n, s in samples), compute[0], compute[1])
    return compute


async def probe_handoff(router, p: Instance, deadline: float) -> float | None:
    """Real handoffs through ``p`` (module docstring): the prefill request, then the decode
    request once the prefill answered, so that the decode's time is the handoff's alone.
    Seeds ``p``'s ``p2p`` fit; returns the handoff's fixed cost in seconds (None without a
    healthy decode instance)."""
    decodes = router.pool.role("decode")
    if not decodes:
        return None
    d = min(decodes, key=lambda i: (i.outstanding + i.waiting, i.kv_usage))
    model, limit = await _card(router, d, deadline)
    n = LONG if limit is None else max(SHORT + 1, min(LONG, limit - 8))
    rng = random.Random(f"{p.url}-handoff-{time.time_ns()}")
    path, best = "/v1/completions", None
    for _ in range(HANDOFFS):
        rid = f"probe-{uuid.uuid4()}"
        tid, headers = f"xfer-{rid}", {"X-Request-Id": rid}
        body = {"model": model, "prompt": _prompt(rng, n), "max_tokens": 1, "temperature": 0}
        prefilled = False
        try:
            engine_id = await asyncio.wait_for(router._engine_id(p), max(0.1, deadline - time.monotonic()))
            # Signed as the router's own handoffs are (p2p.proxy): with a secret, unsigned ones are refused.
            pbody = await router._signed(prefill_body(body, tid), None)
            dbody = await router._signed(decode_body(body, {}, p.bootstrap, engine_id, tid), None)
            await asyncio.wait_for(router._prefill(p, path, pbody, headers, rid),
                                   max(0.1, deadline - time.monotonic()))
            prefilled = True
            t1 = time.monotonic()
            resp, data = await asyncio.wait_for(
                router._decode_first(d, path, dbody, headers, False),
                max(0.1, deadline - time.monotonic()))
            resp.release()
            seconds = time.monotonic() - t1
            if resp.status != 200:
                raise ProbeFailed(f"decode {d.url}: HTTP {resp.status}: {data[:200].decode(errors='replace')}")
            prefilled = False  # pulled: nothing held
        except (ProxyError, asyncio.TimeoutError, aiohttp.ClientError) as e:
            raise ProbeFailed(f"handoff {p.url} -> {d.url}: {e!r}") from None
        finally:
            router._prefill_s.pop(rid, None)
            router._alone_after.pop(rid, None)
            if prefilled:  # the prefill holds its blocks for a pull that did not come
                router._release_later(p, p.engine_id or "", tid)
        seconds -= router.chooser.model(d).compute_s(n - 1, n)
        best = seconds if best is None else min(best, seconds)
    best = max(best, 0.0)
    router.chooser.seed_handoff(p, best, n - 1)
    logger.info("probe %s -> %s: handoff %.1f ms after the prefill", p.url, d.url, best * 1e3)
    return best


async def probe(router, instances: list[Instance], timeout: float) -> dict[str, dict]:
    """Probe ``instances`` one after the other within ``timeout`` seconds in all: the
    compute of each, then the handoff of each prefill instance. Returns, per URL, what was
    measured (``step``, ``token``, ``handoff``) or ``error``; never raises."""
    deadline = time.monotonic() + timeout
    out: dict[str, dict] = {}
    for inst in instances:
        try:
            step, token, _ = await probe_compute_of(router, inst, deadline)
            out[inst.url] = {"step": step, "token": token}
        except ProbeFailed as e:
            out[inst.url] = {"error": str(e)}
            logger.warning("probe of %s failed, its estimates start from the priors: %s", inst.url, e)
    for inst in instances:
        if inst.role != "prefill" or "error" in out.get(inst.url, {}):
            continue
        try:
            h = await probe_handoff(router, inst, deadline)
            if h is not None:
                out[inst.url]["handoff"] = h
        except ProbeFailed as e:
            out[inst.url]["handoff_error"] = str(e)
            logger.warning("handoff probe through %s failed, its handoff starts from the prior: %s", inst.url, e)
    return out
