"""The code base's shape, read from the source (no import runs): which package may import
which, no import cycles, and modules a reader can take in at once.

Layers: ``multi`` (the composite, its router and command line) may import ``mcstore`` and
``p2p`` (the two tiers), which may import ``kvcore`` (what every tier shares); nothing imports
upwards, the tiers never import each other, and no product module imports the benchmarks
(``bench``) or the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"kvcore": 0, "mcstore": 1, "p2p": 1, "multi": 2}  # a package may import its own and lower layers
NOT_PRODUCT = ("bench", "tests")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for pkg in LAYER for p in sorted((ROOT / pkg).rglob("*.py"))}


class _Imports(ast.NodeVisitor):
    """Every import of one module, absolute: ``(line, imported module, inside a function)``.
    ``from a.b import c`` names the module ``a.b.c`` when there is one, else ``a.b``; an import
    under ``if TYPE_CHECKING:`` counts (only annotations use it, but the direction rule holds
    for them too)."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[int, str, bool]] = []
        self._depth = 0

    def _function(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((node.lineno, alias.name, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self.found.append((node.lineno, sub if sub in MODULES else base, self._depth > 0))


def _imports() -> dict[str, list[tuple[int, str, bool]]]:
    out = {}
    for name, path in MODULES.items():
        v = _Imports(name, path.name == "__init__.py")
        v.visit(ast.parse(path.read_text(), str(path)))
        out[name] = v.found
    return out


IMPORTS = _imports()


def test_the_walk_sees_every_package_and_its_imports():
    # A walk that found nothing would pass every rule below.
    assert {m.split(".")[0] for m in MODULES} == set(LAYER)
    assert len(MODULES) > 50
    assert any(t == "kvcore.tier" for m in ("mcstore.connector", "p2p.connector") for _, t, _ in IMPORTS[m])
    multi_imports = {t.split(".")[0] for m, found in IMPORTS.items() if m.startswith("multi.") for _, t, _ in found}
    assert {"mcstore", "p2p", "kvcore"} <= multi_imports


def test_imports_run_from_multi_to_the_tiers_to_kvcore():
    """``multi -> {mcstore, p2p} -> kvcore``, imports inside functions included: mcstore and
    p2p never import each other, kvcore none of them, and no product module imports
    ``bench`` or ``tests``."""
    wrong = []
    for module, found in IMPORTS.items():
        own = module.split(".")[0]
        for line, target, _ in found:
            top = target.split(".")[0]
            if top in NOT_PRODUCT:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} (not product code)")
            elif top in LAYER and top != own and LAYER[top] >= LAYER[own]:
                lower = ", ".join(sorted(p for p in LAYER if LAYER[p] < LAYER[own]))
                rule = f"{own} may import {lower} only" if lower else f"{own} imports none of the other packages"
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} ({rule})")
    assert not wrong, "\n".join(wrong)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), and modules
    that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_product_modules():
    """Over every import, those inside functions included: an import deferred into a function
    (to load vLLM, torch or a tool's dependencies only where they are needed) cannot meet a
    half-initialised module, but it is still a dependency, and a loop of dependencies is a
    loop a reader has to untangle. A package's ``__init__`` counts as the module its name
    says (``from multi.policy import x`` is an edge to ``multi.policy`` only)."""
    edges = {m: {t for _, t, _ in found if t in MODULES} for m, found in IMPORTS.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_every_product_module_is_at_most_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by what they hold): {long}"
