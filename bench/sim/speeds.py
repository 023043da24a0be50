"""Speed models of the simulated instances, and the cluster presets with their sources.

One engine step (vLLM's scheduler: the running decodes plus at most ``chunk_tokens`` of
prefill, chunked prefill) takes

    step(b, T, k, c) = max(decode.step_s, prefill.step_s if k else 0)
                       + decode.per_seq_s * b + decode.per_ctx_s * T
                       + prefill.token_s * k + prefill.attn_s * k * (c + k / 2)

for ``b`` decoding sequences holding ``T`` context tokens in all, and a prefill chunk of
``k`` new tokens after ``c`` tokens of its prompt already in the cache. The prefill terms
are the composite's own cost model (:mod:`multi.policy`: fixed step cost, linear work,
attention over the context), so one prefill alone costs exactly what the router's model
predicts once it has calibrated. Transfers take ``latency_s + bytes / (gbps * 1e9)``.

Presets:

- ``machine``: this machine's engines, from ``bench.trace_replay``'s ``speeds.json``
  (measured on the same run as the real replay; :func:`from_measured`);
- ``a800x8``: one instance = a node of 8 NVIDIA A800-SXM4-80GB running a model of
  LLaMA2-70B's shape at tensor parallelism 8, the testbed of Mooncake's FAST'25 paper
  (arXiv 2407.00079, "Experiments"). Derived from published figures, each named in
  :data:`A800X8_SOURCES`: a model, not a measurement.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Prefill:
    step_s: float
    token_s: float
    attn_s: float

    def seconds(self, start: int, end: int) -> float:
        """A whole prefill of ``[start, end)`` in one forward (the cost model's formula)."""
        n = end - start
        return self.step_s + self.token_s * n + self.attn_s * n * (start + n / 2) if n > 0 else 0.0


@dataclass(frozen=True)
class Decode:
    step_s: float
    per_seq_s: float
    per_ctx_s: float = 0.0


@dataclass(frozen=True)
class Link:
    gbps: float  # GB/s (1e9 bytes)
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9) if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Speeds:
    prefill: Prefill
    decode: Decode
    bytes_per_token: float
    p2p: Link  # prefill instance -> decode instance (per receiving instance, one at a time)
    store: Link  # store DRAM -> instance
    ssd: Link  # store SSD -> instance (the DRAM path's latency plus the disk's read rate)
    chunk_tokens: int = 2048  # prefill tokens per engine step (max_num_batched_tokens)
    # Before the router decides: the HTTP hops, the router's tokenization and store lookup,
    # the API server's work (a request is routed and served this much after it arrived).
    overhead_s: float = 0.0
    # Engines sharing one host (this 2-core machine: the API server and engine-core
    # processes are not pinned): each step takes (1 + contention * other busy engines) as
    # long, fixed when the step starts. 0 for instances on hosts of their own (the cluster
    # presets).
    contention: float = 0.0
    max_seqs: int = 256  # decoding sequences per instance
    sources: dict = field(default_factory=dict)
    # A role's own prefill speed where it was measured apart (role -> Prefill): the tiered
    # prefill instance saves every prompt to the store, on the core it computes on.
    role_prefill: dict = field(default_factory=dict)
    # A handoff's transfer waits for the end of the step its prefill instance is computing
    # (bench.sim.cluster, "links"): true of this machine's CPU engines, not assumed of GPUs.
    handoff_waits_step: bool = False

    def step_s(self, b: int, ctx: int, k: int, c: int, role: str | None = None) -> float:
        p, d = self.role_prefill.get(role, self.prefill), self.decode
        fixed = max(d.step_s if b else 0.0, p.step_s if k else 0.0)
        return (fixed + d.per_seq_s * b + d.per_ctx_s * ctx + p.token_s * k
                + p.attn_s * k * (c + k / 2))

    def to_dict(self) -> dict:
        return asdict(self)


# LLaMA2-70B: 80 layers, 8 KV heads of 128 (GQA), bf16: 2 * 80 * 8 * 128 * 2 bytes a token.
_KV_70B = 2 * 80 * 8 * 128 * 2
_FLOP_70B = 2 * 69e9  # forward FLOPs per token (2 x parameters), attention apart
_A800 = {"bf16_flops": 312e12, "hbm_bps": 2.039e12, "hbm_bytes": 80e9}
_MFU = 0.5  # assumed model FLOPs utilisation of a long prefill

A800X8_SOURCES = {
    "gpu": "NVIDIA A100/A800 80GB SXM datasheet: 312 TFLOPS dense bf16, 2,039 GB/s HBM2e, 80 GB",
    "model": "LLaMA2-70B (Touvron et al. 2023): 80 layers, GQA with 8 KV heads of 128, 69B parameters",
    "testbed": "Mooncake FAST'25 paper (arXiv 2407.00079): 8x A800-SXM4-80GB per node, LLaMA2-70B-shaped model",
    "mfu": f"assumed {_MFU:.0%} of peak for prefill (not measured)",
    "decode": "memory-bound step: weights (138 GB) plus each sequence's KV read once from 8 GPUs' HBM, "
              "at an assumed 60% of peak bandwidth",
    "p2p": "Mooncake's 'vLLM with Mooncake Transfer Engine Benchmark' (kvcache-ai.github.io/Mooncake): "
           "4.50 GB in 31.65 ms between two nodes over 8x RoCE, i.e. 142 GB/s",
    "store": "the same Transfer Engine path from a remote node's DRAM, taken as the P2P figure halved "
             "(DRAM and PCIe on both ends; an assumption)",
    "ssd": "8 NVMe drives per node at ~6 GB/s each, ~48 GB/s (an assumption from common datacenter drives)",
}


def a800x8() -> Speeds:
    flops = 8 * _A800["bf16_flops"] * _MFU
    hbm = 8 * _A800["hbm_bps"] * 0.6
    # Attention FLOPs per new token per context token: 4 * layers * heads * head_dim (QK^T and AV).
    attn = 4 * 80 * 64 * 128 / flops
    return Speeds(prefill=Prefill(step_s=0.02, token_s=_FLOP_70B / flops, attn_s=attn),
                  decode=Decode(step_s=2 * 69e9 / hbm, per_seq_s=2e-4, per_ctx_s=_KV_70B / hbm),
                  bytes_per_token=_KV_70B, p2p=Link(142.0, 0.002), store=Link(71.0, 0.003),
                  ssd=Link(48.0, 0.005), chunk_tokens=8192, max_seqs=256, sources=A800X8_SOURCES)


def from_measured(path: str | Path, deployment: str | None = None) -> Speeds:
    """This machine's engines from ``speeds.json`` (``bench.trace_replay``): the prefill
    and decode fits, the store's and P2P's GB/s and per-load latency from the replay's own
    transfers (a handoff's latency: its fixed cost seen from the router when measured,
    ``p2p.handoff.overhead_s``, less a decode step; SSD: not measured, taken as half the
    store's rate), and ``deployment``'s
    measured request overhead (``overhead``: the router's path, 0 when not measured). The
    prefill and decode fits are ``deployment``'s own when measured (``m[deployment]``, the
    tiered engines: their connector costs every step something), else the plain engine's;
    ``m[deployment]["prefill_instance"]``, when measured, is the prefill role's own."""
    m = json.loads(Path(path).read_text())
    missing = [k for k in ("prefill", "decode", "bytes_per_token") if k not in m]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: measure the speeds (bench.trace_replay "
                         f"without --skip-speeds)")
    own = m.get(deployment) if deployment else None  # that deployment's engines' own fits
    p, d = (own or m)["prefill"], (own or m)["decode"]

    def link(key: str) -> Link:
        x = m.get(key) or {}
        # A handoff's latency_s includes waiting for the prefill to end; the simulator
        # starts the pull at that end, so only the round trips (rtt_s) are the link's.
        lat = x["rtt_s"] if "rtt_s" in x else x.get("latency_s")
        return Link(x.get("gbps") or 1.0, lat or 0.0)

    # The tiered prefill instance's own fit, when measured (it saves every prompt, on its own
    # core): the simulated router's handoffs are sensitive to it (bench/sim validate, replay
    # of 2026-12-01: 40 of 145 at this fit, 26 at 1.075 times it, 36 at 1.03 times it).
    pi = own.get("prefill_instance") if own else None
    roles = {"prefill": Prefill(pi["step_s"], pi["token_s"], pi["attn_s"])} if pi else {}
    store, p2p = link("store"), link("p2p")
    handoff = ((m.get("p2p") or {}).get("handoff") or {}).get("overhead_s")
    if handoff is not None:
        # Measured from the router's side (bench.trace_replay.handoff_overhead): everything
        # between a prefill's answer and the decode's first token except the bytes (31 to
        # 44 ms here, where the Transfer Engine's own phases see about 1 ms). The simulator
        # adds the decode instance's step for the last token itself, so one decode step
        # comes off.
        p2p = replace(p2p, latency_s=max(p2p.latency_s, handoff - d["step_s"]))
    overhead = (m.get("overhead") or {}).get(deployment, 0.0) if deployment else 0.0
    return Speeds(prefill=Prefill(p["step_s"], p["token_s"], p["attn_s"]),
                  decode=Decode(d["step_s"], d["per_seq_s"], d.get("per_ctx_s", 0.0)),
                  bytes_per_token=m["bytes_per_token"], p2p=p2p, store=store,
                  ssd=replace(store, gbps=store.gbps / 2), chunk_tokens=p.get("chunk_tokens", 2048),
                  max_seqs=m.get("max_seqs", 256), overhead_s=overhead,
                  contention=(m.get("contention") or {}).get("factor", 0.0), role_prefill=roles,
                  handoff_waits_step=True,
                  sources={"measured": str(path)})


PRESETS = {"a800x8": a800x8}
