"""The architecture as a test (ARCHITECTURE.md, "Layers"): what each package may import, no import circles,
no module over 350 lines, a config package light enough to build `--help` without torch or hivemind, a typed
peer/ (at most 10 `Any`, at hivemind's untyped edges) and comments that cite no issue numbers.

Imports are read from the source with `ast`, lazy ones inside functions and `TYPE_CHECKING` ones included: a
function-level import upward is as much an upward arrow as one at the top.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "p2p_diloco"

# Low to high. A module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("config",),
    ("wire",),
    ("sync",),
    ("train",),
    ("net.transport",),
    ("net.admission",),
    ("net.discovery",),
    ("net.statesync",),
    ("net.gossip",),
    ("net",),  # the package itself (its __init__): nothing but a docstring
    ("view",),  # what people see: snapshot, terminal view, web page, metrics, plots (no network of its own)
    ("peer", "bootstrap"),  # a learner unit's process, and the bootstrap node beside it
    ("sim",),  # the simulator and the in-memory network: used by nothing in the runtime below it
    ("cli",),
    ("__main__",),
)
MAX_LINES = 350
MAX_ANY_IN_PEER = 10


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, name: str) -> set[str]:
    """Every p2p_diloco module `path` imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("p2p_diloco"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("p2p_diloco"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module an import names (`from p2p_diloco.x import Name` names module p2p_diloco.x)."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def layer_of(name: str) -> int:
    rel = name.removeprefix("p2p_diloco").lstrip(".")
    best, best_len = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (rel == prefix or rel.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    if best is None and rel == "":
        return 0  # p2p_diloco/__init__.py
    assert best is not None, f"{name} is in no layer: add its package to LAYERS (and ARCHITECTURE.md)"
    return best


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {resolve(t, known) for t in imports_of(path, name)}
        edges[name] = {t for t in targets if t and t != name and t != "p2p_diloco"}
    return edges


def test_no_package_imports_a_package_above_it():
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in graph().items() for b in sorted(targets) if layer_of(b) > layer_of(a)]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_circles():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_is_at_most_350_lines(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it by job"


def test_peer_is_typed():
    """The peer is composed of typed parts (peer/compose.py): `Any` only where hivemind hands us untyped values."""
    found = {p.name: len(re.findall(r"\bAny\b", p.read_text())) for p in sorted((PACKAGE / "peer").glob("*.py"))}
    assert sum(found.values()) <= MAX_ANY_IN_PEER, {k: n for k, n in found.items() if n}


def test_the_code_cites_no_issue_numbers():
    """A reader of the code has ARCHITECTURE.md, not the tracker: comments say the reason or name a section."""
    cites = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\b[Ii]ssues? #?\d+", line)]
    assert not cites, cites


def test_config_is_light():
    """`p2p-diloco join --help` builds its options from the config package: it must not pull torch or hivemind."""
    import subprocess

    code = ("import sys, p2p_diloco.config; "
            "heavy = sorted(m for m in ('torch', 'hivemind', 'numpy') if m in sys.modules); print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"importing p2p_diloco.config imports {out.stdout.strip()}"


def test_the_test_parses_lazy_imports(tmp_path):
    """The checker itself: an import inside a function is seen (else upward lazy imports would pass unseen)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from p2p_diloco.sim.swarm import AsyncSwarm\n")
    assert "p2p_diloco.sim.swarm" in imports_of(f, "p2p_diloco.train.m")
