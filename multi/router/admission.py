"""Admission: a request's time-to-first-token target, and whether its route can meet it.

The target ``T`` (seconds) is ``--ttft-slo`` unless the request names its own: the
``X-TTFT-SLO`` header (:data:`SLO_HEADER`) or ``kv_transfer_params.ttft_slo_s``
(:data:`SLO_PARAM`, removed before the request is forwarded; it wins over the header).
A value that is not a positive number is a 400 (:class:`p2p.proxy.ProxyError`).

The estimate (:func:`estimate_s`) is the route's predicted time to first token
(:mod:`multi.router.choose`), the queue ahead included:

    predicted = fixed + own + wait
    wait      = a * busy + b * k * own + c * w + d * decoding          (multi.router.fits)
    w         = queued prefill work ahead, worked through one after the other from the
                last departure (multi.router.instances.queue_ahead_s): each queued
                request's tokens at the instance's fitted per-token compute

with ``fixed`` its loads before its compute and ``own`` its compute. Admission adds what
the estimates are known to miss:

    estimate = m * predicted
    m        = multi.router.honesty.Honesty.margin: the 0.9-quantile of actual/predicted
               of the route's kind over the honesty window; while the window holds n < 16
               answers of the kind, over those n plus 16 - n at the prior m0
    m0       = PRIOR_MARGIN = 1.5 while anything runs on the pool, else 1

Why a prior on the whole estimate, from the first request: the start-up probe times each
instance alone, and a burst is slower than that: the other engines share the host's cores,
the requests decoding there share the steps, and prompts queued together finish in one
step. Over the first 16 answers of the five P/D admission runs of 2026-12-06 (target 0.55
s, docs/benchmarks/router.md), actual/predicted had a median of 1.09-1.40 and a
0.9-quantile of 1.54-2.89 per run; cold prompts alone (their compute, not a wait, the bulk
of the estimate; 35 answers pooled) a median of 1.12 and a 0.9-quantile of 1.43 (1.35 on
idle instances). Every late request at the last of those runs was such a cold prompt,
admitted at 1x its compute with only its wait counted 1.5x. The windows' 0.9-quantiles at
the end of the runs were 1.68-2.81. ``m0`` is the largest bias the honesty check tolerates
before it falls back (``exp(ENTER)``, :mod:`multi.router.honesty`); the prior applies only
while some instance of the pool has a request of the router in flight or decoding: on an
idle pool the probe's own condition holds (prior 1): a fresh router that sees one request
at a time admits what the probe says meets the target (with the prior, a request whose
target is below 1.5x the probe's estimate would wait for 16 answers that nothing admitted
would ever give).

**At risk.** A route with ``estimate > T`` but ``predicted <= T`` (it meets the target as
estimated, not with the margin) is still admitted when the lateness budget allows it
(:class:`LateBudget`): no other request admitted at risk is still unanswered (until its
answer ends, when its lateness is recorded), and none of the last ``LATE_WINDOW`` (32) admitted requests with a target answered
past it. Admission's target is an aggregate, 90% of what it admits on time, and a margin
that makes each request safe on its own refuses too much where the target is close to a
cold prompt's compute: in the P/D admission run at 94fb8f1 (target 0.55 s, cold 1,056-token
prompts estimated at 0.43-0.48 s) the margin from the first request refused every cold
prompt, so the prefixes the later requests would have reused were never computed: 7
admitted of 63, goodput 1.73 req/s (docs/benchmarks/router.md). One at a time, and
after 32 answers on time, at most one request admitted at risk is late per 32 admitted.

A route is rejected before any engine works on it when ``estimate > T`` (429), with
``Retry-After = ceil(estimate - T)`` seconds, at least 1: roughly when the queue ahead
has drained enough (:func:`rejection`; :meth:`multi.router.choose.Chooser.choose` applies
it to the route it picked).

It is also rejected when its prefill would push a request admitted before it past that
one's target (:func:`pushed_late`): the engine does not work its queue one prompt at a
time: every prompt still waiting when a step starts goes into that step, so a request
queued but not yet started on the instance gets its first token only when the new
one's prefill is done too, at ``now + estimate``. Not yet started: without its first token
(late or not), sent at ``t_j`` and predicted to start at ``start_j``
(:meth:`multi.router.instances.Instance.times`),
``t_j + m * (start_j - t_j) > now``, its wait counted with the margin the estimate uses
(``m``): a predicted start errs as a predicted wait does (in the P/D admission
run a cached request predicted to have started 1 ms before a cold prefill arrived got its
first token with it); or ``end_j <= now``: late, behind the queue model, so its start is not
known either (two requests 0.05-0.1 s past their predicted end got their first tokens with a
cold prefill admitted then). With ``D_j`` its deadline (sent + its
target), the new request is rejected when ``now + estimate > D_j`` for any of them, with
``Retry-After = ceil(now + estimate - min D_j)``, at least 1. (The queue model alone counted
only what was sent before a request: in the P/D admission run 6 of 45 admitted requests
missed their target, each a cached prompt whose first token came with a cold prefill
admitted after it, docs/benchmarks/router.md.)
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping

from p2p.proxy import ProxyError

SLO_HEADER = "X-TTFT-SLO"  # seconds; per-request TTFT target
SLO_PARAM = "ttft_slo_s"  # the same, as a kv_transfer_params key (removed before forwarding)
LATE_WINDOW = 32  # admitted answers with a target that must all be on time before a risk is taken


def ttft_target(headers: Mapping[str, str], body: dict, default: float | None) -> float | None:
    """The request's TTFT target in seconds (``default`` when it names none); pops
    :data:`SLO_PARAM` from the body's ``kv_transfer_params``. ``ProxyError(400)`` for a
    value that is not a number of seconds above 0."""
    params = body.get("kv_transfer_params")
    raw = headers.get(SLO_HEADER)
    if isinstance(params, dict) and SLO_PARAM in params:
        raw = params.pop(SLO_PARAM)
    if raw is None:
        return default
    try:
        v = float(raw)
    except (TypeError, ValueError):
        raise ProxyError(400, f"TTFT target must be seconds (a number), got {raw!r}") from None
    if not v > 0:
        raise ProxyError(400, f"TTFT target must be > 0 seconds, got {raw!r}")
    return v


def rejection(estimate_s: float, target_s: float | None) -> tuple[str, int] | None:
    """``(reason, retry_after_s)`` when a route estimated at ``estimate_s`` misses the
    target; None when it meets it or there is no target."""
    if target_s is None or not estimate_s > target_s:
        return None
    return (f"estimate {estimate_s:.3f}s > target {target_s:.3f}s",
            max(1, math.ceil(estimate_s - target_s)))


def pushed_late(deadlines: Iterable[float], first_token_at: float) -> tuple[str, int] | None:
    """``(reason, retry_after_s)`` when a prefill whose batch ends at ``first_token_at``
    would push requests queued with it past their ``deadlines`` (module docstring)."""
    late = [d for d in deadlines if first_token_at > d]
    if not late:
        return None
    return (f"would push {len(late)} admitted request(s) past their target by {first_token_at - min(late):.3f}s",
            max(1, math.ceil(first_token_at - min(late))))


def estimate_s(predicted_s: float, margin: float) -> float:
    """What admission compares with the target: ``margin * predicted`` (module docstring)."""
    return margin * predicted_s


class LateBudget:
    """Whether a route that meets its target only as estimated may be admitted (module
    docstring, "At risk"): the last :data:`LATE_WINDOW` admitted answers with a target
    (late or not) and the requests admitted at risk whose answer has not ended."""

    def __init__(self, window: int = LATE_WINDOW):
        self.answers: deque[bool] = deque(maxlen=window)  # True: answered past its target
        self.inflight: set[str] = set()  # request ids admitted at risk, until their answer ends

    def allows(self) -> bool:
        return not self.inflight and not any(self.answers)

    def record(self, ttft_s: float, target_s: float) -> None:
        self.answers.append(ttft_s > target_s)
