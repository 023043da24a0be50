"""The shipped Grafana dashboard (``kvcore/assets/grafana-mctier.json``) and the metric
names it queries, so that tests can hold it to what engines and the master export.

Two sources feed it: vLLM's ``/metrics`` (``vllm:mctier_*``, declared once per tier by a
:class:`kvcore.metrics.MetricSpec`) and the Mooncake master's ``/metrics`` (every other
name). :func:`queried_metrics` reads the names out of every panel's PromQL;
:func:`missing` lists those a Prometheus text exposition does not export.

Names are compared as Prometheus stores them (the exported series names), with one
exception: a histogram is named by its family (``x_seconds``) whether a panel reads
``x_seconds_bucket``, ``_sum`` or ``_count``. A ``_sum``/``_count`` suffix is taken as a
histogram's only when the dashboard also reads ``<base>_bucket`` or the base ends in
``_seconds`` (this project's histograms), so a gauge such as ``master_key_count`` keeps its
name. Counters keep the name they are scraped under: ``foo_total`` for a prometheus_client
counter declared as ``foo`` (or ``foo_total``), and exactly the declared name for the
master's counters that lack the suffix (``mem_cache_hit_nums_``, ``master_evicted_key_count``).

PromQL is read lexically (strings, label matchers, ranges, grouping clauses, numbers,
Grafana variables and function calls removed); a selector written as
``{__name__="..."}`` is not recognised.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

VLLM = "vllm"
MASTER = "mooncake_master"

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VARS = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NUMBERS = re.compile(r"(?<![\w:.])(?:(?:\d+(?:ms|[smhdwy]))+|0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
                      r"(?![\w:])")  # durations (1h30m), hex, decimals, exponents
_COMMENTS = re.compile(r"#[^\n]*")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_TYPE_LINE = re.compile(r"^#\s*TYPE\s+(\S+)\s+(\S+)", re.M)
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                       "unless", "offset", "inf", "nan", "Inf", "NaN"})


def dashboard_path() -> Path:
    """The dashboard JSON that ships inside the package (import it into Grafana)."""
    return Path(__file__).resolve().parent / "assets" / "grafana-mctier.json"


def load(path: str | Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or dashboard_path()).read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside (collapsed) rows included."""
    stack = list(reversed(dashboard.get("panels") or []))
    while stack:
        p = stack.pop()
        yield p
        stack.extend(reversed(p.get("panels") or []))


def exprs(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of every panel target."""
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets") or () if t.get("expr")]


def metric_names(expr: str) -> set[str]:
    """Metric names one PromQL expression selects, as written."""
    s = _COMMENTS.sub(" ", _STRINGS.sub(" ", expr))
    s = _VARS.sub(" ", s)
    while True:  # innermost first: a matcher never nests, but be safe with brackets
        t = _BRACKETS.sub(" ", _BRACES.sub(" ", s))
        if t == s:
            break
        s = t
    s = _GROUPING.sub(" ", s)
    s = _NUMBERS.sub(" ", s)
    out = set()
    for m in _IDENT.finditer(s):
        name = m.group()
        if name in _KEYWORDS or s[m.end():].lstrip().startswith("("):
            continue  # a keyword, or a function / aggregation call
        out.add(name)
    return out


def source_of(name: str) -> str:
    return VLLM if name.startswith("vllm:") else MASTER


def _family(name: str, written: set[str]) -> str:
    if name.endswith("_bucket"):
        return name[: -len("_bucket")]
    for suffix in ("_sum", "_count"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if f"{base}_bucket" in written or base.endswith("_seconds"):
                return base
    return name


def queried_metrics(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    """``{"vllm": names, "mooncake_master": names}``: what the panels query, histograms by
    family name (see the module docstring)."""
    written = set().union(*(metric_names(e) for e in exprs(dashboard)))
    out: dict[str, set[str]] = {VLLM: set(), MASTER: set()}
    for name in written:
        out[source_of(name)].add(_family(name, written))
    return out


def exposed_names(exposition: str) -> set[str]:
    """Names a Prometheus text exposition exports, in the form :func:`queried_metrics` uses:
    series names, plus every family named by a ``# TYPE`` line (a labelled metric that has
    no child yet shows only that line), histogram and summary families by family name too."""
    from prometheus_client.parser import text_string_to_metric_families

    declared = dict(_TYPE_LINE.findall(exposition))
    names: set[str] = set()
    for fam in text_string_to_metric_families(exposition):
        if fam.type == "counter":
            # The parser names a counter family without "_total" and renames the samples of
            # one declared without the suffix (Mooncake's) to "<name>_total": undo that.
            names.add(f"{fam.name}_total" if f"{fam.name}_total" in declared else fam.name)
            names.update(s.name for s in fam.samples if not s.name.endswith("_total"))  # _created
            continue
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
        if fam.type in ("histogram", "gaugehistogram"):
            names.update(f"{fam.name}{s}" for s in ("_bucket", "_sum", "_count"))
        elif fam.type == "summary":
            names.update(f"{fam.name}{s}" for s in ("_sum", "_count"))
    return names


def missing(dashboard: dict[str, Any], exposition_text: str, sources: Iterable[str] | str | None = None) -> set[str]:
    """Queried names (of ``sources``, default all: ``"vllm"``, ``"mooncake_master"``) that
    ``exposition_text`` does not export. Check an engine's ``/metrics`` with
    ``sources="vllm"`` and a master's with ``sources="mooncake_master"``."""
    if isinstance(sources, str):
        sources = (sources,)
    q = queried_metrics(dashboard)
    wanted = set().union(*(q[s] for s in (sources or q)))
    return wanted - exposed_names(exposition_text)

