"""``mctier proxy``: the command line of the KV-aware router (:mod:`multi.router`);
:func:`build_parser` is its argument parser, :func:`build_app` the aiohttp app it serves.

Every flag of the earlier P/D proxy keeps its meaning (``--prefill URL[@BOOTSTRAP_URL]``,
``--decode``, ``--bootstrap``, ``--host``, ``--port``, ``--timeout``,
``--connect-timeout``, ``--log-level``), so existing launch lines still work; they now
get the ``kv`` policy. New:

- ``--plain URL ...``: engines that serve whole requests (data-parallel; no P/D);
- ``--instances FILE``: more instances from a TOML file (:mod:`multi.router.instances`),
  re-read on SIGHUP;
- ``--kv-events URL=ENDPOINT[,REPLAY_ENDPOINT]``: an instance's vLLM KV event publisher,
  the strings of its ``--kv-events-config`` (``"publisher": "zmq"``), for an exact index;
  by default the router reads them from each engine's ``/kv_event_sources``;
- ``--policy kv|least-outstanding|round-robin|direct|handoff``;
- ``--probe-timeout SECONDS``: the start-up probe's deadline (:mod:`multi.router.probe`);
- ``--[no-]direct-to-prefill``: whether the kv policy may serve a request whole on a
  prefill instance (default yes);
- ``--ttft-slo SECONDS``: admission (off by default); per request, the ``X-TTFT-SLO``
  header or ``kv_transfer_params.ttft_slo_s``;
- ``--store MASTER`` (exact store view: the store tier's KV events, confirmed by its lookup;
  ``--store-index-blocks`` bounds the events' view, 0 turns it off) or
  ``--store approx`` (what prefills stored; no Mooncake client in the router);
- ``--kv-bytes-per-token``: KV bytes of one token (default: from the served model's
  ``config.json`` when its path exists here, in the dtype this machine's engines get,
  :func:`kvcore.platform.engine_dtype`; else 0: transfers then cost their latency only);
- ``--[no-]prompt-token-ids``: whether a string completion prompt goes on to the engines as
  the router's token ids where their tokenizers agree (default yes; :mod:`multi.router.prompts`);
- ``--block-size``: the engines' block size (default 32); ``--tokenizer``; the cost
  model's priors with ``--policy-config JSON`` (:class:`multi.policy.PolicyConfig`);
- ``--secret-file``: the deployment's shared secret (else ``MCTIER_SECRET_FILE`` or
  ``MCTIER_SECRET``): transfer parameters are signed with it (:mod:`kvcore.trust`);
  ``--max-body-mb``: the largest request body (16 MiB; 413 above).
"""

from __future__ import annotations

import argparse
import logging

import msgspec
from aiohttp import web

from multi.policy import PolicyConfig
from multi.router.app import Router
from multi.router.choose import POLICIES, Chooser
from multi.router.index import BlockIndex
from multi.router.instances import Instance, Pool, load_file, make
from multi.router.prompts import Prompts
from p2p.config import normalize_url

logger = logging.getLogger("mctier.router")
STORE_INDEX_BLOCKS = 1 << 18  # 8M tokens at 32 a block, ~37 MB


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``mctier proxy`` (``docs/configuration.md`` is generated from it)."""
    ap = argparse.ArgumentParser(prog="mctier proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", nargs="+", default=[], metavar="URL[@BOOTSTRAP_URL]",
                    help="prefill instances (P2P or tiered, kv_producer), each with its bootstrap URL "
                         "(default: the instance's host, port 8998)")
    ap.add_argument("--decode", nargs="+", default=[], metavar="URL",
                    help="decode instances (kv_consumer): they pull a prefill's KV, or serve a request alone")
    ap.add_argument("--plain", nargs="+", default=[], metavar="URL", help="engines serving whole requests")
    ap.add_argument("--bootstrap", nargs="+", metavar="URL", help="bootstrap URLs, one per --prefill")
    ap.add_argument("--instances", metavar="FILE", help="TOML file of instances, re-read on SIGHUP")
    ap.add_argument("--kv-events", nargs="+", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                    help="an instance's vLLM KV event publisher (its --kv-events-config endpoints); "
                         "default: read from the instance's /kv_event_sources")
    ap.add_argument("--policy", default="kv", choices=POLICIES,
                    help="kv: the route with the lowest predicted time to first token (falling back to the better "
                         "fixed policy while its estimates drift); the fixed ones: round-robin, least-outstanding, "
                         "direct (every request whole on a decode or plain instance), handoff (every request "
                         "through a prefill instance)")
    ap.add_argument("--direct-to-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="the kv policy may serve a request whole on a prefill instance when that is predicted "
                         "sooner than a handoff or the decode instance")
    ap.add_argument("--ttft-slo", type=float, help="TTFT target in seconds: 429 when the estimate misses it")
    ap.add_argument("--store", metavar="MASTER|approx", help="the store view: a master HOST:PORT or 'approx'")
    ap.add_argument("--kv-bytes-per-token", type=float,
                    help="KV bytes of one token (default: from the served model's config.json when its path "
                         "exists here, in this machine's engine dtype; else 0: transfers cost their latency only)")
    ap.add_argument("--block-size", type=int, default=32, help="the engines' --block-size (tokens)")
    ap.add_argument("--tokenizer", help="tokenizer path (default: the served model's path when it exists here, "
                                        "else the instances' /tokenize)")
    ap.add_argument("--prompt-token-ids", action=argparse.BooleanOptionalAction, default=True,
                    help="send a string completion prompt on as the router's token ids (the engine then does not "
                         "tokenize it again), where every instance's /tokenize agreed with the router's tokenizer")
    ap.add_argument("--policy-config", help="JSON of multi.policy.PolicyConfig fields (the router's default "
                                            "local_compute_weight is 1: it chooses by time to first token)")
    ap.add_argument("--probe-timeout", type=float,
                    help="deadline in seconds of the start-up probe, which times a few tiny requests on every "
                         "instance (and a handoff through every prefill instance) to seed the cost model "
                         "(default: 60 with the kv policy, 0 = no probe with the fixed ones, whose choices do "
                         "not use the estimates; never with calibrate false)")
    ap.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    ap.add_argument("--index-blocks", type=int, default=4096,
                    help="index capacity per instance until its cache size is known (blocks)")
    ap.add_argument("--store-index-blocks", type=int, default=STORE_INDEX_BLOCKS,
                    help="with --store MASTER: capacity in blocks of the store index, what the store tier's KV "
                         "events say the store holds (the first filter before the store lookup, ~140 bytes a "
                         "block); 0: no filter, every request looked up")
    ap.add_argument("--host", default="127.0.0.1", help="address the router listens on")
    ap.add_argument("--port", type=int, default=8000, help="port the router listens on")
    ap.add_argument("--timeout", type=float, default=600.0, help="deadline of one client request (504 after)")
    ap.add_argument("--connect-timeout", type=float, default=5.0, help="connect / bootstrap query timeout (502 after)")
    ap.add_argument("--secret-file", metavar="FILE",
                    help="the deployment's shared secret (docs/deploy.md, \"Trust model\"): the router signs the "
                         "transfer parameters it sets with it; default: the file MCTIER_SECRET_FILE names, else "
                         "MCTIER_SECRET, else none (nothing signed)")
    ap.add_argument("--max-body-mb", type=float, default=16.0,
                    help="largest request body accepted (MiB; 413 above it)")
    ap.add_argument("--decision-log", metavar="FILE",
                    help="append one JSON line per routed request: what the router knew, the route, every "
                         "estimate it weighed, the status and the time to first token")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                    help="log level of the router's own logger")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _instances(a: argparse.Namespace) -> list[Instance]:
    if a.bootstrap and len(a.bootstrap) != len(a.prefill):
        raise SystemExit("--bootstrap needs exactly one URL per --prefill")
    events = {}
    for spec in a.kv_events:
        url, sep, eps = spec.partition("=")
        if not sep or not eps:
            raise SystemExit(f"--kv-events takes URL=ENDPOINT[,REPLAY_ENDPOINT], got {spec!r}")
        ep, _, replay = eps.partition(",")
        events[normalize_url(url)] = (ep, replay or None)
    out = []
    for i, spec in enumerate(a.prefill):
        url, _, boot = spec.partition("@")
        out.append(make("prefill", url, a.bootstrap[i] if a.bootstrap else (boot or None)))
    out += [make("decode", u) for u in a.decode]
    out += [make("plain", u) for u in a.plain]
    if a.instances:
        try:
            out += load_file(a.instances)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    for inst in out:
        if inst.url in events:
            inst.events, inst.replay = events.pop(inst.url)
    if events:
        raise SystemExit(f"--kv-events names instances that are not given: {sorted(events)}")
    return out


def bytes_per_token(a: argparse.Namespace, root: str | None) -> float:
    if a.kv_bytes_per_token is not None:
        return a.kv_bytes_per_token
    from kvcore.platform import kv_bytes_per_token

    if root:
        try:
            return float(kv_bytes_per_token(root))
        except (OSError, KeyError, ValueError):
            pass
    logger.warning("KV bytes per token unknown (no readable config.json of the served model here; pass "
                   "--kv-bytes-per-token): transfers are estimated by their latency alone")
    return 0.0


def _served_root(pool: Pool, timeout: float) -> str | None:
    import requests

    for inst in pool.all:
        try:
            card = requests.get(inst.url + "/v1/models", timeout=timeout).json()["data"][0]
            return card.get("root") or card.get("id")
        except (requests.RequestException, KeyError, IndexError, ValueError):
            continue
    return None


ROUTER_DEFAULTS = {"local_compute_weight": 1.0}


def policy_config(raw: str | None) -> PolicyConfig:
    """``--policy-config``: :class:`multi.policy.PolicyConfig` fields, over the router's own
    defaults (:data:`ROUTER_DEFAULTS`): the router chooses by time to first token, so a decode
    instance's own compute counts at its seconds (``local_compute_weight`` 1; the connector's
    1.5 protects its decode batch, and made the router hand off requests that a direct route
    answered sooner: docs/benchmarks/router.md). Raises ``msgspec`` errors on bad input."""
    fields = msgspec.json.decode(raw) if raw else {}
    if not isinstance(fields, dict):
        raise ValueError(f"--policy-config must be a JSON object, got {raw!r}")
    return msgspec.convert({**ROUTER_DEFAULTS, **fields}, type=PolicyConfig)


def build_app(a: argparse.Namespace) -> web.Application:
    pool = Pool(_instances(a))
    try:
        pool.validate()
        if a.policy == "handoff" and not pool.disaggregated:
            raise ValueError("--policy handoff needs --prefill and --decode instances")
        cfg = policy_config(a.policy_config)
    except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:
        raise SystemExit(f"mctier proxy: {e}") from None
    root = None if a.kv_bytes_per_token is not None else _served_root(pool, a.connect_timeout)
    store_view = store_index = None
    if a.store and a.store != "approx":
        from multi.router.storeview import StoreIndex, StoreView

        url = (pool.role("decode", False) or pool.role("plain", False) or pool.all)[0].url
        store_view = StoreView(a.store, url)
        if a.store_index_blocks < 0:
            raise SystemExit("mctier proxy: --store-index-blocks must be >= 0")
        if a.store_index_blocks:
            store_index = StoreIndex(a.block_size, a.store_index_blocks)
    from kvcore.trust import SecretError, load_secret

    try:
        secret = load_secret(a.secret_file)
    except SecretError as e:
        raise SystemExit(f"mctier proxy: --secret-file: {e}") from None
    if not a.max_body_mb > 0:
        raise SystemExit("mctier proxy: --max-body-mb must be > 0")
    prompts = Prompts(a.tokenizer, a.connect_timeout, forward_ids=a.prompt_token_ids)
    try:
        router = Router(pool, Chooser(a.policy, bytes_per_token(a, root), cfg, direct_to_prefill=a.direct_to_prefill),
                        BlockIndex(a.block_size, a.index_blocks), prompts,
                        timeout=a.timeout, connect_timeout=a.connect_timeout, slo=a.ttft_slo, store_view=store_view,
                        store_approx=bool(a.store), health_interval=a.health_interval, instances_file=a.instances,
                        decision_log=a.decision_log, secret=secret, store_index=store_index,
                        probe_timeout=a.probe_timeout if a.probe_timeout is not None else 60.0 * (a.policy == "kv"))
    except OSError as e:  # the decision log cannot be opened
        raise SystemExit(f"mctier proxy: --decision-log: {e}") from None
    app = web.Application(client_max_size=int(a.max_body_mb * (1 << 20)))
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_handler)
    app["router"] = app["proxy"] = router
    return app


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=getattr(logging, a.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(a)
    r = app["router"]
    for i in r.pool.all:
        extra = f" (bootstrap {i.bootstrap})" if i.bootstrap else ""
        print(f"{i.role:<7} {i.url}{extra}" + (f" events {i.events}" if i.events else ""), flush=True)
    print(f"policy  {a.policy}; store view {a.store or 'none'}; TTFT target "
          f"{f'{a.ttft_slo:g}s' if a.ttft_slo else 'none'}; KV bytes/token {r.chooser.bytes_per_token:g}; "
          f"transfer parameters {'signed' if r.secret is not None else 'unsigned (no secret)'}", flush=True)
    # handler_cancellation: a client disconnect cancels the handler, which closes the
    # upstream connections, which makes vLLM abort both requests.
    web.run_app(app, host=a.host, port=a.port, handler_cancellation=True, access_log=None,
                print=lambda s: print(s, flush=True))
    return 0
