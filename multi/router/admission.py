"""Admission: a request's time-to-first-token target, and whether its route can meet it.

The target ``T`` (seconds) is ``--ttft-slo`` unless the request names its own: the
``X-TTFT-SLO`` header (:data:`SLO_HEADER`) or ``kv_transfer_params.ttft_slo_s``
(:data:`SLO_PARAM`, removed before the request is forwarded; it wins over the header).
A value that is not a positive number is a 400 (:class:`p2p.proxy.ProxyError`).

A route whose estimate exceeds ``T`` is rejected before any engine works on it (429),
with ``Retry-After = ceil(estimate - T)`` seconds, at least 1: roughly when the queue
ahead has drained enough (:func:`rejection`; :meth:`multi.router.choose.Chooser.choose`
applies it to the route it picked).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from p2p.proxy import ProxyError

SLO_HEADER = "X-TTFT-SLO"  # seconds; per-request TTFT target
SLO_PARAM = "ttft_slo_s"  # the same, as a kv_transfer_params key (removed before forwarding)


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
