"""The chooser: estimated time of each feasible plan for one request, the pick, and
the learning from measured samples (the only place that knows the features).

Inputs: the prompt length ``N``, the local hit ``L`` (vLLM's prefix cache) and, for
each configured tier ``t_1 .. t_k`` in their order of cheapness (the configured
order), its reach ``R_i`` (``lookup``: it can supply ``[0, R_i)``), capped at
``N - 1``: vLLM always computes the last token to sample.

A plan picks a subset of the tiers, in that order. Each picked tier loads from
where the previous one stopped to its own reach, ``[e_{j-1}, R_j)`` with
``e_0 = L``; a tier whose reach does not pass ``e_{j-1}`` cannot be picked there.
The rest, ``[e_last, N)``, is recomputed. Its name is the picked tiers joined
with ``+`` (``store+p2p``), or ``recompute``. With a store and a P2P tier these are
the four plans recompute, store ``[L,S)``, p2p ``[L,E)``, store+p2p ``[L,S)+[S,E)``.

Estimated seconds, with ``b_j`` the bytes of tier ``j``'s range (tokens times
``bytes_per_token``):

- a load from tier ``j``: ``load_j([1, b_j])``, a linear fit started from the
  tier's ``LoadPrior`` (``latency_s + b / bandwidth``);
- plus, for a tier whose KV a prefill instance computes (``remote_prefill``,
  the P2P handoff), that instance's own time before it can hand over,
  ``queue + max(0, own - elapsed)``: ``own`` is the time of the plan its own chooser
  picks over the tiers before this one, from its cached prefix ``C``
  (``remote_cached``) on, as when it is idle (``busy = 0``), counted unweighted
  (``max_j load_j + compute(e_last, N)``). With a store before the handoff that is the
  cheaper, as the prefill instance's chooser sees it, of loading ``[C, S)`` from the
  store and computing ``[S, N)``, or computing ``[C, N)``: an instance without the
  prefix loads what the store holds just as a decode instance would, and that load is
  part of the wait for its KV. ``C`` is known to a router (its index); a connector
  does not know it and takes ``C = R_before``, the largest reach of the tiers before
  (the instance holds what it stored), which leaves ``compute(max(R_before, C), N)``.
  ``queue`` is the prefill work queued ahead on it (``remote_queue_s``, 0 unless a
  router knows it) and ``elapsed`` the time since the request arrived;
- recomputing ``n`` tokens after ``c`` cached ones: ``compute(c, c+n) =
  prefill([1, n, n*(c+n/2)])`` (fixed step cost, linear work, attention over the
  context), weighted for this instance's own recomputation by what it stalls:
  ``weighted(c) = w * c`` while the instance holds other requests (``busy > 0``: a decode
  instance that prefills delays the decode batch it serves, which is why P/D exists),
  and ``weighted(c) = min(c, B) + w * max(0, c - B)`` while it holds none, with
  ``w = local_compute_weight`` and ``B = idle_compute_s``: alone, a short prefill stalls
  nobody and counts at its time, but a long one would stall the handoffs that arrive
  meanwhile. ``w = 1`` makes the choice purely by this request's time to first token.

The loads of one plan run concurrently; recomputation follows them:
``seconds = max_j(load time of j) + weighted(compute(e_last, N))``.

Learning: workers measure :class:`ForwardSample` (one forward pass: new tokens and
context per scheduled request) and :class:`LoadSample` (one finished load: bytes
and seconds of one tier; the scheduler replaces the seconds with the whole load, from its
planning until the scheduler learns it finished, less, for a ``remote_prefill`` tier, the
prefill instance's own time it estimated, :meth:`multi.scheduler.TieredScheduler.load_seconds`, so that
every tier's fit learns the steps around its transfer alike); they travel on the stats record through
:func:`encode_samples` / :func:`decode_samples`, and :meth:`CostModel.learn`
updates the fits with them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Annotated

import msgspec

from kvcore.plan import Segment, Source, normalize
from kvcore.tier import LoadPrior


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The cost model's settings: ``policy`` of ``TieredConnector``, ``--policy-config`` of
    ``mctier proxy``. The ``prefill_*`` priors are where the compute fit starts
    (``compute(c, c+n) = step + token * n + attn * n*(c+n/2)`` seconds for ``n`` new tokens
    after ``c`` cached ones), before calibration."""

    tiers: Annotated[dict[str, LoadPrior], msgspec.Meta(description=(
        "Load-time priors by tier name (LoadPrior); a tier not listed starts from its own "
        "Tier.load_prior."))] = msgspec.field(default_factory=dict)
    prefill_step_s: Annotated[float, msgspec.Meta(description=(
        "Prior fixed cost of a forward pass (seconds)."))] = 0.01
    prefill_token_s: Annotated[float, msgspec.Meta(description=(
        "Prior cost per new token (seconds)."))] = 3e-4
    prefill_attn_s: Annotated[float, msgspec.Meta(description=(
        "Prior cost per new token per context token, the attention term (seconds)."))] = 2e-8
    local_compute_weight: Annotated[float, msgspec.Meta(ge=0, description=(
        "w: this instance's own recomputation counts w times its seconds while the instance holds other "
        "requests (the compute stalls them), and past idle_compute_s while it holds none. 1: the choice "
        "is by this request's time to first token alone."))] = 1.5
    idle_compute_s: Annotated[float, msgspec.Meta(ge=0, description=(
        "Seconds of an idle instance's own compute that count at weight 1 (see local_compute_weight)."))] = 0.5
    calibrate: Annotated[bool, msgspec.Meta(description=(
        "Update the compute and load-time fits online from measured forward passes and loads; false: "
        "keep the priors."))] = True


class TierReach(msgspec.Struct, frozen=True):
    """What one configured tier can give one request (``Inputs.tiers``, cheapest first)."""

    tier: str
    tokens: int  # lookup: the tier can supply [0, tokens)
    remote_prefill: bool = False  # Tier.remote_prefill
    prior: LoadPrior = LoadPrior()  # Tier.load_prior, unless PolicyConfig.tiers overrides it
    # A remote prefill instance's own state, when known (the router knows it): its
    # prefix-cache hit and the seconds of prefill work queued ahead of this request. A
    # connector does not know them: None takes the instance to hold what the tiers before
    # this one hold (in 1P1D the prefill instance wrote what the store holds, and in the
    # decision benchmark it held it: its wait for READY was one token's step), and the
    # queue 0.
    remote_cached: int | None = None
    remote_queue_s: float = 0.0


class Inputs(msgspec.Struct, kw_only=True):
    prompt_tokens: int  # N
    local_tokens: int  # L (vLLM's prefix cache)
    tiers: list[TierReach]  # configured tiers, cheapest first
    bytes_per_token: float
    prefill_elapsed_s: float = 0.0  # time since the request arrived (a prefill instance's head start)
    busy: int = 0  # other requests this instance holds (running or waiting): what its compute stalls


class Plan(msgspec.Struct):
    name: str
    segments: list[Segment]
    seconds: float
    # "<tier>_s" (0 when unused), "<tier>_remote_s" (a remote prefill's own time, in "<tier>_s"),
    # "recompute_s" (weighted, what the plan's seconds add) and "compute_s" (the same compute unweighted)
    parts: dict[str, float]

    def tokens(self, source: str) -> int:
        return sum(s.tokens for s in self.segments if s.source == source)

    def end_of(self, source: str) -> int:
        ends = [s.end for s in self.segments if s.source == source]
        return max(ends) if ends else 0


class ForwardSample(msgspec.Struct, tag="forward", array_like=True):
    """One timed forward pass: request ``i`` computed ``new_tokens[i]`` after ``context[i]``."""

    new_tokens: list[int]
    context: list[int]
    seconds: float


class LoadSample(msgspec.Struct, tag="load", array_like=True):
    """One successful load: ``bytes`` from tier ``tier`` in ``seconds`` (a ``kvcore.tier.LoadReport``),
    for request ``req_id`` (the scheduler times the load whole by it), after ``waited_s``
    waiting for a remote prefill (measured by the tier)."""

    tier: str
    bytes: int
    seconds: float
    req_id: str = ""
    waited_s: float = 0.0


Sample = ForwardSample | LoadSample


def encode_samples(samples: Iterable[Sample]) -> list:
    """Samples as plain lists (what a stats record may carry between processes)."""
    return msgspec.to_builtins(list(samples))


def decode_samples(raw: list) -> list[Sample]:
    """Inverse of :func:`encode_samples`; raises ``msgspec.ValidationError`` on foreign data."""
    return msgspec.convert(raw, list[Sample])


def forward_features(new_tokens: Sequence[int], context: Sequence[int]) -> list[float]:
    """``[1, sum n, sum n*(c + n/2)]`` of a forward pass computing ``n`` tokens after ``c`` per request."""
    return [1.0, float(sum(new_tokens)), float(sum(n * (c + n / 2) for n, c in zip(new_tokens, context)))]


def load_features(nbytes: float) -> list[float]:
    return [1.0, float(nbytes)]


class CostModel:
    """Plan estimates from calibrated fits (see :mod:`multi.calibration`)."""

    def __init__(self, cfg: PolicyConfig, fit=None):
        """``fit``: what makes the fits (default :class:`multi.calibration.OnlineFit`; the
        replay of recorded samples, ``bench.calibration_replay``, passes one weighted the
        previous way)."""
        from multi.calibration import OnlineFit

        self.cfg = cfg
        self._fit = fit or OnlineFit
        self.loads: dict[str, OnlineFit] = {}  # tier name -> load-time fit, made at first use
        self.prefill = self._fit([cfg.prefill_step_s, cfg.prefill_token_s, cfg.prefill_attn_s],
                                 lower=[0.0, 1e-7, 0.0], upper=[5.0, 1.0, 1e-3], scale=[1.0, 1e3, 1e6])

    def load_fit(self, tier: str, prior: LoadPrior | None = None):
        fit = self.loads.get(tier)
        if fit is None:
            gb = 1e9
            p = self.cfg.tiers.get(tier) or prior or LoadPrior()
            fit = self.loads[tier] = self._fit([p.latency_s, 1 / (p.bandwidth_gbps * gb)],
                                               lower=[0.0, 1 / (1000 * gb)], upper=[30.0, 1 / (1e-3 * gb)],
                                               scale=[1.0, 1e9], clip_after=0)
        return fit

    def load_s(self, reach: TierReach, nbytes: float) -> float:
        return self.load_fit(reach.tier, reach.prior).predict(load_features(nbytes)) if nbytes > 0 else 0.0

    def compute_s(self, start: int, end: int) -> float:
        n = end - start
        return self.prefill.predict(forward_features([n], [start])) if n > 0 else 0.0

    def weighted(self, seconds: float, busy: int) -> float:
        """This instance's own compute of ``seconds``, weighted by what it stalls (module doc)."""
        w = self.cfg.local_compute_weight
        if busy > 0:
            return w * seconds
        alone = min(seconds, self.cfg.idle_compute_s)
        return alone + w * (seconds - alone)

    def plans(self, x: Inputs) -> list[Plan]:
        reach = [min(t.tokens, x.prompt_tokens - 1) for t in x.tiers]
        # A prefill instance's own part depends on the request alone, not on the plan: once per
        # remote-prefill tier that any plan can use (its reach past the local hit).
        remote = {i: t.remote_queue_s + max(0.0, self.remote_own_s(x, i) - x.prefill_elapsed_s)
                  for i, t in enumerate(x.tiers) if t.remote_prefill and reach[i] > x.local_tokens}
        out: list[Plan] = []
        # Subsets in order of size, each in tier order: recompute first, then one tier, ...
        for k in range(len(x.tiers) + 1):
            for picked in itertools.combinations(range(len(x.tiers)), k):
                plan = self._plan(x, reach, picked, remote)
                if plan is not None:
                    out.append(plan)
        return out

    def _plan(self, x: Inputs, reach: list[int], picked: tuple[int, ...],
              remote: dict[int, float]) -> Plan | None:
        N, L = x.prompt_tokens, x.local_tokens
        segs = [Segment(0, L, Source.LOCAL)]
        parts = {f"{t.tier}_s": 0.0 for t in x.tiers}
        end, t_load = L, 0.0
        for i in picked:
            t = x.tiers[i]
            if reach[i] <= end:
                return None  # nothing left for this tier after the ones before it
            segs.append(Segment(end, reach[i], t.tier))
            seconds = self.load_s(t, (reach[i] - end) * x.bytes_per_token)
            if t.remote_prefill:
                parts[f"{t.tier}_remote_s"] = remote[i]  # what the scheduler takes off a whole handoff's time
                seconds += remote[i]
            parts[f"{t.tier}_s"] = seconds
            t_load = max(t_load, seconds)
            end = reach[i]
        segs.append(Segment(end, N, Source.RECOMPUTE))
        # Both: the weighted seconds the choice adds up, and the compute's own estimate (what
        # a measured prefill compares with; the weighted one exceeds it by design).
        parts["compute_s"] = self.compute_s(end, N)
        parts["recompute_s"] = self.weighted(parts["compute_s"], x.busy)
        name = "+".join(x.tiers[i].tier for i in picked) or Source.RECOMPUTE
        return Plan(name, normalize(segs), t_load + parts["recompute_s"], parts)

    def remote_own_s(self, x: Inputs, i: int) -> float:
        """Seconds the prefill instance behind remote-prefill tier ``i`` takes for its own
        part: the plan its chooser picks over the tiers before ``i`` from its cached prefix
        (unknown: what those tiers hold), idle, so weighted as it weighs, and timed
        unweighted: its loads, then its compute."""
        n = x.prompt_tokens
        cached = x.tiers[i].remote_cached
        if cached is None:  # unknown (a connector): it holds what the tiers before hold
            cached = max((u.tokens for u in x.tiers[:i]), default=0)
        own = Inputs(prompt_tokens=n, local_tokens=min(cached, n - 1),
                     tiers=x.tiers[:i], bytes_per_token=x.bytes_per_token)
        p = self.choose(own)[0]
        return p.seconds - p.parts["recompute_s"] + p.parts["compute_s"]

    def choose(self, x: Inputs, force: str = "auto") -> tuple[Plan, list[Plan], str]:
        """(chosen plan, all estimates, reason). ``force`` is ``auto``, ``recompute`` or a tier
        name: the plan that uses only that tier, else recomputation."""
        plans = self.plans(x)
        if force == "auto":
            return min(plans, key=lambda p: p.seconds), plans, "fastest estimate"
        by_name = {p.name: p for p in plans}
        if force in by_name:
            return by_name[force], plans, f"forced {force}"
        return by_name[Source.RECOMPUTE], plans, f"forced {force}, but that source has nothing for this request"

    # -- learning ------------------------------------------------------------------------

    def learn(self, sample: Sample) -> tuple[str, float, float]:
        """Feed one measured sample to its fit (when ``calibrate``); returns ``(kind, estimate
        before the update, measured seconds)``, kind = ``forward`` or the tier name."""
        if isinstance(sample, ForwardSample):
            kind, fit, x = "forward", self.prefill, forward_features(sample.new_tokens, sample.context)
        else:
            kind, fit, x = sample.tier, self.load_fit(sample.tier), load_features(sample.bytes)
        est = fit.predict(x)
        if self.cfg.calibrate:
            fit.update(x, sample.seconds)
        return kind, est, sample.seconds


def force_values(tiers: Iterable[str]) -> tuple[str, ...]:
    """What ``kv_source`` / ``default_source`` may be with these tiers configured."""
    return ("auto", Source.RECOMPUTE, *tiers)


def requested_source(params: dict | None, default: str, tiers: Iterable[str] | None = None) -> tuple[str, str | None]:
    """The ``kv_source`` a request asks for, and a warning when the value is unusable
    (not ``auto``, ``recompute`` or one of ``tiers``; with ``tiers`` None, any tier name)."""
    value = (params or {}).get("kv_source", default)
    if tiers is not None:
        allowed = force_values(tiers)
        if value in allowed:
            return value, None
        return default, f"kv_source must be one of {allowed}, got {value!r}; using {default!r}"
    if isinstance(value, str) and value:
        return value, None
    return default, f"kv_source must be 'auto', 'recompute' or a tier name, got {value!r}; using {default!r}"
