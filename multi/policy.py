"""The chooser: estimated time of each feasible plan for one request, and the pick.

A plan splits the prompt ``[0, N)`` into ranges: ``[0, L)`` already local,
``[L, S)`` from the store, ``[S, E)`` pulled from the prefill instance, the rest
recomputed (always at least the last token, which vLLM computes to sample).
The store and P2P loads of one plan run concurrently; recomputation follows them.

Estimated seconds:

- store load of ``b`` bytes: ``store_fit([1, b])``;
- P2P pull of ``b`` bytes: the prefill instance's remaining compute (it prefills
  the uncached part of the prompt, started when the request arrived) plus
  ``p2p_fit([1, b])``;
- recomputing ``n`` tokens after ``c`` cached ones: ``prefill_fit([1, n, n*(c+n/2)])``
  (linear work plus attention over the context), times ``local_compute_weight``:
  a decode instance that prefills delays the decode batch it serves, which is why
  P/D exists; 1.0 makes the choice purely by this request's time to first token.
"""

from __future__ import annotations

import msgspec

from kvcore.plan import Segment, Source, normalize


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A load parks the request for at least one extra engine step; that is most of
    # its fixed cost on loopback.
    store_latency_s: float = 0.02
    store_bandwidth_gbps: float = 1.0  # GB/s
    p2p_latency_s: float = 0.03
    p2p_bandwidth_gbps: float = 1.0
    prefill_step_s: float = 0.01  # fixed cost of a forward pass
    prefill_token_s: float = 3e-4  # per new token
    prefill_attn_s: float = 2e-8  # per new token per context token
    local_compute_weight: float = 1.5
    calibrate: bool = True


class Inputs(msgspec.Struct):
    prompt_tokens: int  # N
    local_tokens: int  # L (vLLM's prefix cache)
    store_tokens: int  # S: the store can supply [0, S), S <= N - 1
    p2p: bool  # a prefill instance holds (or is computing) this prompt
    bytes_per_token: float
    prefill_elapsed_s: float = 0.0  # time since the request arrived (the prefill instance's head start)


class Plan(msgspec.Struct):
    name: str
    segments: list[Segment]
    seconds: float
    parts: dict[str, float]

    def tokens(self, source: Source) -> int:
        return sum(s.tokens for s in self.segments if s.source == source)

    def end_of(self, source: Source) -> int:
        ends = [s.end for s in self.segments if s.source == source]
        return max(ends) if ends else 0


class Model:
    """Plan estimates from calibrated fits (see :mod:`multi.calibration`)."""

    def __init__(self, cfg: PolicyConfig):
        from multi.calibration import OnlineFit

        gb = 1e9
        self.cfg = cfg
        self.store = OnlineFit([cfg.store_latency_s, 1 / (cfg.store_bandwidth_gbps * gb)],
                               lower=[0.0, 1 / (1000 * gb)], upper=[5.0, 1 / (1e-3 * gb)], scale=[1.0, 1e9])
        self.p2p = OnlineFit([cfg.p2p_latency_s, 1 / (cfg.p2p_bandwidth_gbps * gb)],
                             lower=[0.0, 1 / (1000 * gb)], upper=[30.0, 1 / (1e-3 * gb)], scale=[1.0, 1e9])
        self.prefill = OnlineFit([cfg.prefill_step_s, cfg.prefill_token_s, cfg.prefill_attn_s],
                                 lower=[0.0, 1e-7, 0.0], upper=[5.0, 1.0, 1e-3], scale=[1.0, 1e3, 1e6])

    def store_s(self, nbytes: float) -> float:
        return self.store.predict([1.0, nbytes]) if nbytes > 0 else 0.0

    def p2p_s(self, nbytes: float) -> float:
        return self.p2p.predict([1.0, nbytes]) if nbytes > 0 else 0.0

    def compute_s(self, start: int, end: int) -> float:
        n = end - start
        return self.prefill.predict([1.0, n, n * (start + n / 2)]) if n > 0 else 0.0

    def plans(self, x: Inputs) -> list[Plan]:
        N, L = x.prompt_tokens, x.local_tokens
        w = self.cfg.local_compute_weight
        S = x.store_tokens if x.store_tokens > L else L
        # The prefill instance sends every block of the prompt; the engine recomputes the last token.
        E = N - 1 if x.p2p else L
        out: list[Plan] = []

        def plan(name: str, store_end: int, p2p_end: int) -> Plan:
            segs = [Segment(0, L, Source.LOCAL), Segment(L, store_end, Source.STORE)]
            p_start = max(store_end, L)
            segs.append(Segment(p_start, p2p_end, Source.P2P))
            tail = max(p2p_end, store_end, L)
            segs.append(Segment(tail, N, Source.RECOMPUTE))
            t_store = self.store_s((store_end - L) * x.bytes_per_token)
            t_p2p = 0.0
            if p2p_end > p_start:
                # The prefill instance computes what the store could not give it.
                wait = max(0.0, self.compute_s(x.store_tokens, N) - x.prefill_elapsed_s)
                t_p2p = wait + self.p2p_s((p2p_end - p_start) * x.bytes_per_token)
            t_compute = w * self.compute_s(tail, N)
            parts = {"store_s": t_store, "p2p_s": t_p2p, "recompute_s": t_compute}
            return Plan(name, normalize(segs), max(t_store, t_p2p) + t_compute, parts)

        out.append(plan("recompute", L, L))
        if S > L:
            out.append(plan("store", S, S))
        if E > L:
            out.append(plan("p2p", L, E))
            if S > L and E > S:
                out.append(plan("store+p2p", S, E))
        return out

    def choose(self, x: Inputs, force: str = "auto") -> tuple[Plan, list[Plan], str]:
        """(chosen plan, all estimates, reason)."""
        plans = self.plans(x)
        by_name = {p.name: p for p in plans}
        if force == "auto":
            best = min(plans, key=lambda p: p.seconds)
            return best, plans, "fastest estimate"
        wanted = {"store": ["store"], "p2p": ["p2p"], "recompute": ["recompute"]}[force]
        for name in wanted:
            if name in by_name:
                return by_name[name], plans, f"forced {force}"
        return by_name["recompute"], plans, f"forced {force}, but that source has nothing for this request"


FORCE_VALUES = ("auto", "store", "p2p", "recompute")


def requested_source(params: dict | None, default: str) -> tuple[str, str | None]:
    """The ``kv_source`` a request asks for, and a warning when the value is unusable."""
    value = (params or {}).get("kv_source", default)
    if value in FORCE_VALUES:
        return value, None
    return default, f"kv_source must be one of {FORCE_VALUES}, got {value!r}; using {default!r}"
