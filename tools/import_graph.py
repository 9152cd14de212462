"""The import graph of the op's package and the suite's, read from the source (no import runs).

``python tools/import_graph.py`` prints every edge, each module's layer and what breaks the rule
of docs/architecture.md; ``--dot`` prints the graph for Graphviz, ``--src DIR`` reads another tree
(an older checkout, for a before/after picture). tests/ci/test_architecture.py enforces the rule.

An edge is any import of a module of the two packages, at the top of a module or inside a
function (a lazy import is still a dependency), and any string constant that names one of them
exactly (``cli.COMMANDS``, ``guard.TRUSTED``: imported by name with importlib). The maintainer
tools (``maintainer/``, outside the wheel) are in no layer: the two packages may not import them.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rmsnorm_kernel", "rmsnorm_suite")
# Top-level packages of the checkout that the wheel leaves out: the packages may not import them.
OUTSIDE_WHEEL = ("maintainer",)

# The suite's layers, lowest first: a module may import its own layer and those below it, never
# one above; a command imports no other command (the walkthrough package counts as one). The
# op's package is below them all and imports nothing of the suite.
LAYERS: dict[str, tuple[str, ...]] = {
    "records": (
        "rmsnorm_suite", "rmsnorm_suite.cases", "rmsnorm_suite.numerics", "rmsnorm_suite.results",
        "rmsnorm_suite.config", "rmsnorm_suite.console",
    ),
    "harness": (
        "rmsnorm_suite.providers", "rmsnorm_suite.timing", "rmsnorm_suite.harness",
        "rmsnorm_suite.stopwatch", "rmsnorm_suite.guard", "rmsnorm_suite.worker",
        "rmsnorm_suite.telemetry", "rmsnorm_suite.checks", "rmsnorm_suite.probes",
        "rmsnorm_suite.checkreport", "rmsnorm_suite.torchchecks", "rmsnorm_suite.training",
        "rmsnorm_suite.mutants", "rmsnorm_suite.featurechecks", "rmsnorm_suite.mutanthunt",
        "rmsnorm_suite.distributed", "rmsnorm_suite.inference", "rmsnorm_suite.featurebench",
    ),
    "gate": (
        "rmsnorm_suite.thresholds", "rmsnorm_suite.gatereport", "rmsnorm_suite.gate",
        "rmsnorm_suite.accept", "rmsnorm_suite.power", "rmsnorm_suite.changepoint",
        "rmsnorm_suite.plots", "rmsnorm_suite.acceptedpage", "rmsnorm_suite.staging", "rmsnorm_suite.sandbox", "rmsnorm_suite.exchange", "rmsnorm_suite.rounds",
    ),
    "commands": (
        "rmsnorm_suite.bench", "rmsnorm_suite.pullrequest", "rmsnorm_suite.verdict",
        "rmsnorm_suite.history", "rmsnorm_suite.walkthrough",
    ),
    "entry": ("rmsnorm_suite.cli", "rmsnorm_suite.__main__"),
}  # fmt: skip
ORDER = ("op", *LAYERS)

# (importer, imported): edges against the rule that are kept for now, each with its reason
ALLOWED: dict[tuple[str, str], str] = {
    **{
        ("rmsnorm_suite.verdict", f"rmsnorm_suite.walkthrough.{name}"): (
            "verdict runs the walkthrough's checks, which live in its command modules"
        )
        for name in ("environment", "grids", "oraclecheck")
    },
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    kind: str  # "top" (module level), "lazy" (inside a function or class), "name" (a string)
    line: int


def modules(src: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the two packages under ``src``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((src / package).rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def edges(src: Path = ROOT / "src") -> list[Edge]:
    """Every edge between modules of the two packages (a module's edges to itself left out)."""
    known = modules(src)
    out: dict[tuple[str, str, str], Edge] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            kind = "top" if id(node) in top else "lazy"
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = _package_of(module, path).split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                if "." in node.value:  # a bare package name is as often a logger or op namespace
                    kind, targets = "name", [node.value]
            for target in targets:
                hit = _resolve(target, known)
                key = (module, hit, kind)
                if hit is not None and hit != module and (key not in out or out[key].line > node.lineno):
                    out[key] = Edge(module, hit, kind, node.lineno)
    return sorted(out.values(), key=lambda e: (e.importer, e.imported, e.kind))


def outside_imports(src: Path = ROOT / "src") -> list[Edge]:
    """Every import of a package the wheel leaves out (OUTSIDE_WHEEL) by a module of the two
    packages: at the top, inside a function, or a string that names it."""
    pattern = re.compile(rf"({'|'.join(OUTSIDE_WHEEL)})(\.\w+)*")
    found = []
    for module, path in modules(src).items():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            kind, names = "top" if id(node) in top else "lazy", []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                kind, names = "name", [node.value]
            found += [Edge(module, n, kind, node.lineno) for n in names if pattern.fullmatch(n)]
    return sorted(found, key=lambda e: (e.importer, e.imported, e.line))


def layer(module: str) -> str | None:
    """The layer of ``module``: "op" for the op's package, else the suite layer that lists it
    (a listed package covers its submodules), None when none does."""
    if module.split(".")[0] == "rmsnorm_kernel":
        return "op"
    best = None
    for name, members in LAYERS.items():
        for member in members:
            if (module == member or module.startswith(member + ".")) and (
                best is None or len(member) > len(best[1])
            ):
                best = (name, member)
    return best[0] if best else None


def forbidden(edge: Edge) -> str | None:
    """Why ``edge`` breaks the layer rule, or None when it keeps it."""
    mine, theirs = layer(edge.importer), layer(edge.imported)
    if mine is None or theirs is None:
        return f"{edge.importer if mine is None else edge.imported} is in no layer"
    if mine == "op" and theirs != "op":
        return "the op's package imports the suite"
    if ORDER.index(theirs) > ORDER.index(mine):
        return f"{mine} imports {theirs}, a layer above it"
    if mine == theirs == "commands" and _unit(edge.importer) != _unit(edge.imported):
        return "a command imports another command"
    return None


def _unit(module: str) -> str:
    """The command a module belongs to: the walkthrough package is one command."""
    return "rmsnorm_suite.walkthrough" if module.startswith("rmsnorm_suite.walkthrough") else module


def violations(found: list[Edge]) -> list[tuple[Edge, str]]:
    """The edges that break the rule and are not in ALLOWED."""
    return [
        (e, why)
        for e in found
        if (why := forbidden(e)) is not None and (e.importer, e.imported) not in ALLOWED
    ]


def cycles(found: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, over
    the import statements (a by-name reference imports nothing that is not loaded already) less
    the ALLOWED edges."""
    graph: dict[str, set[str]] = {}
    for e in found:
        if e.kind == "name" or (e.importer, e.imported) in ALLOWED:
            continue
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(component))

    sys.setrecursionlimit(max(1000, 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _short(module: str) -> str:
    return module.removeprefix("rmsnorm_suite.").removeprefix("rmsnorm_")


def dot(found: list[Edge]) -> str:
    """The graph in Graphviz's language, one cluster per layer, modules by their short names."""
    lines = ["digraph imports {", "  rankdir=BT; node [shape=box, fontsize=10];"]
    members: dict[str, set[str]] = {}
    for e in found:
        for m in (e.importer, e.imported):
            members.setdefault(layer(m) or "none", set()).add(m)
    for name in (*ORDER, "none"):
        if name in members:
            lines.append(f'  subgraph "cluster_{name}" {{ label="{name}";')
            lines += [f'    "{_short(m)}";' for m in sorted(members[name])]
            lines.append("  }")
    pairs = sorted({(e.importer, e.imported, e.kind == "top") for e in found})
    for a, b, top in pairs:
        style = "" if top else " [style=dashed]"
        lines.append(f'  "{_short(a)}" -> "{_short(b)}"{style};')
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the tree to read (default: src/)")
    parser.add_argument("--dot", action="store_true", help="print the graph for Graphviz")
    args = parser.parse_args(argv)
    found = edges(args.src)
    if args.dot:
        print(dot(found))
        return 0
    for e in found:
        print(f"{e.importer} -> {e.imported} ({e.kind}, line {e.line})")
    bad = violations(found)
    loops = cycles(found)
    outside = outside_imports(args.src)
    print(
        f"\n{len(found)} edges; {len(bad)} against the layer rule; {len(loops)} cycles; "
        f"{len(outside)} imports of what the wheel leaves out"
    )
    for e, why in bad:
        print(f"  forbidden: {e.importer} -> {e.imported} ({e.kind}, line {e.line}): {why}")
    for loop in loops:
        print(f"  cycle: {' <-> '.join(loop)}")
    for e in outside:
        print(f"  outside the wheel: {e.importer} -> {e.imported} ({e.kind}, line {e.line})")
    return 1 if bad or loops or outside else 0


if __name__ == "__main__":
    sys.exit(main())
