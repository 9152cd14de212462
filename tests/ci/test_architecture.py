"""The import-layer rule of docs/architecture.md, on the source as it stands (tools/import_graph.py),
and the maintainer tools kept apart from the wheel."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = graph  # dataclasses look their module up while the class is built
_spec.loader.exec_module(graph)

EDGES = graph.edges()
SUITE_LIMIT = 600  # lines per module of the suite's package (issue: "no module over ~600 lines")
# modules above the limit that other work is splitting; each leaves this list when it is split
OVER_LIMIT: set[str] = set()


def test_every_module_has_a_layer():
    assert [m for m in graph.modules(ROOT / "src") if graph.layer(m) is None] == []


def test_no_edge_breaks_the_layer_rule():
    assert [
        f"{e.importer} -> {e.imported} ({e.kind}, line {e.line}): {why}" for e, why in graph.violations(EDGES)
    ] == []


def test_no_cycle():
    assert graph.cycles(EDGES) == []


def test_the_op_never_imports_the_suite():
    assert [e for e in EDGES if graph.layer(e.importer) == "op" and graph.layer(e.imported) != "op"] == []


def test_the_shipped_packages_never_import_the_maintainer_tools():
    assert graph.outside_imports() == []


def test_the_wheel_leaves_the_maintainer_tools_out():
    """The wheel packages what lies under src/ (pyproject.toml), and the maintainer tools lie
    beside it, not in it."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert declared["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    assert set(graph.OUTSIDE_WHEEL) <= {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert not any((ROOT / "src" / name).exists() for name in graph.OUTSIDE_WHEEL)


def test_an_import_of_the_maintainer_tools_is_found(tmp_path):
    """At the top, inside a function and by name; a word in a message is not an import."""
    (tmp_path / "rmsnorm_kernel").mkdir()
    (tmp_path / "rmsnorm_suite").mkdir()
    (tmp_path / "rmsnorm_kernel" / "__init__.py").write_text("import maintainer.mutation\n")
    (tmp_path / "rmsnorm_suite" / "__init__.py").write_text(
        "def f():\n    from maintainer.mutation import cli\n    return 'no maintainer approval'\n"
    )
    (tmp_path / "rmsnorm_suite" / "cli.py").write_text("COMMANDS = ('maintainer.mutation.cli',)\n")
    found = {(e.importer, e.imported, e.kind) for e in graph.outside_imports(tmp_path)}
    assert found == {
        ("rmsnorm_kernel", "maintainer.mutation", "top"),
        ("rmsnorm_suite", "maintainer.mutation", "lazy"),
        ("rmsnorm_suite.cli", "maintainer.mutation.cli", "name"),
    }


@pytest.mark.parametrize("pair", sorted(graph.ALLOWED))
def test_every_exception_is_still_needed(pair):
    """An allowed edge that is gone, or that the rule would accept, leaves ALLOWED."""
    found = [e for e in EDGES if (e.importer, e.imported) == pair]
    assert found, f"{pair} is no longer in the graph: remove it from ALLOWED"
    breaks_rule = any(graph.forbidden(e) for e in found)
    without = dict(graph.ALLOWED)
    del without[pair]
    closes_cycle = False
    if not breaks_rule:
        original = graph.ALLOWED
        graph.ALLOWED = without
        try:
            closes_cycle = bool(graph.cycles(EDGES))
        finally:
            graph.ALLOWED = original
    assert breaks_rule or closes_cycle, f"{pair} keeps the rule: remove it from ALLOWED"


def test_the_rule_catches_what_it_forbids(tmp_path):
    """A made-up tree: the op importing the suite, the harness importing a command, two commands
    importing each other, and a cycle, all found."""
    op, suite = tmp_path / "rmsnorm_kernel", tmp_path / "rmsnorm_suite"
    op.mkdir()
    suite.mkdir()
    (op / "__init__.py").write_text("from rmsnorm_suite import cases\n")
    (suite / "__init__.py").write_text("")
    (suite / "cases.py").write_text("def f():\n    from rmsnorm_suite import results\n")
    (suite / "results.py").write_text("from rmsnorm_suite.cases import f\n")
    (suite / "timing.py").write_text("from rmsnorm_suite import bench\n")
    (suite / "bench.py").write_text("import rmsnorm_suite.verdict\n")
    (suite / "verdict.py").write_text("MODULES = ('rmsnorm_suite.bench',)\n")
    found = graph.edges(tmp_path)
    why = {(e.importer, e.imported): graph.forbidden(e) for e in found}
    assert why[("rmsnorm_kernel", "rmsnorm_suite.cases")] == "the op's package imports the suite"
    assert "a layer above" in why[("rmsnorm_suite.timing", "rmsnorm_suite.bench")]
    assert why[("rmsnorm_suite.bench", "rmsnorm_suite.verdict")] == "a command imports another command"
    assert why[("rmsnorm_suite.verdict", "rmsnorm_suite.bench")] == "a command imports another command"
    assert graph.cycles(found) == [["rmsnorm_suite.cases", "rmsnorm_suite.results"]]


def test_suite_modules_stay_under_the_line_limit():
    long = {
        p.name: n
        for p in (ROOT / "src" / "rmsnorm_suite").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > SUITE_LIMIT
    }
    assert set(long) <= OVER_LIMIT, {k: v for k, v in long.items() if k not in OVER_LIMIT}


def test_maintainer_modules_stay_under_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "maintainer").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > SUITE_LIMIT
    }
    assert long == {}


# module docstrings over the limit in files other work is changing; each leaves when shortened
LONG_DOCSTRINGS: set[str] = set()


def test_module_docstrings_are_short():
    """At most ~10 lines, what a module is for; longer explanations live in docs/."""
    long = {}
    for path in sorted((ROOT / "src" / "rmsnorm_suite").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.splitlines()) > 11 and path.name not in LONG_DOCSTRINGS:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert long == {}


def _scripts() -> list[Path]:
    return sorted(
        [*(ROOT / "tools").glob("*.py"), *(ROOT / ".github" / "scripts").glob("*.py"), ROOT / "noxfile.py"]
    )


def test_script_docstrings_are_short():
    """The tools, the workflows' scripts and the noxfile open as the modules do: at most ~10
    lines; usage beyond that goes to --help or docs/."""
    long = {}
    for path in _scripts():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        name = str(path.relative_to(ROOT))
        if doc and len(doc.splitlines()) > 11:
            long[name] = len(doc.splitlines())
    assert long == {}


def test_maintainer_modules_open_with_a_short_docstring():
    found = {
        str(path.relative_to(ROOT)): ast.get_docstring(ast.parse(path.read_text()), clean=False)
        for path in sorted((ROOT / "maintainer").rglob("*.py"))
    }
    assert found and {p: doc for p, doc in found.items() if not doc or len(doc.splitlines()) > 11} == {}


def _test_module_imports(path: Path, root: Path) -> set[str]:
    """The test modules (test_*.py) that ``path`` imports, by dotted name, wherever the import
    stands (top, inside a function, relative or absolute, as a module or from a package)."""
    package = ".".join(path.relative_to(root).parent.parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{node.module}" if node.level and node.module else (node.module or base)
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(n for n in names if n.rsplit(".", 1)[-1].startswith("test_"))
    return found


def _test_imports(root: Path = ROOT) -> set[tuple[str, str]]:
    return {
        (str(path.relative_to(root)), imported)
        for path in sorted((root / "tests").rglob("test_*.py"))
        for imported in _test_module_imports(path, root)
    }


def test_no_test_module_imports_another():
    """Shared helpers live in a _fixtures.py module or a conftest.py, never in a test module:
    importing one runs its tests' module code and ties two test files together."""
    assert _test_imports() == set()


def test_a_test_module_import_is_found(tmp_path):
    """Relative, absolute, from a package and inside a function; a helper module is not one."""
    folder = tmp_path / "tests" / "suite"
    folder.mkdir(parents=True)
    (folder / "test_a.py").write_text(
        "from .test_b import x\nfrom . import _fixtures\nimport tests.suite.test_c\n"
        "def f():\n    from tests.suite import test_d\n"
    )
    (folder / "test_e.py").write_text("from tests.suite._fixtures import git\nfrom ..ci import test_f\n")
    assert _test_imports(tmp_path) == {
        ("tests/suite/test_a.py", "tests.suite.test_b"),
        ("tests/suite/test_a.py", "tests.suite.test_c"),
        ("tests/suite/test_a.py", "tests.suite.test_d"),
        ("tests/suite/test_e.py", "tests.ci.test_f"),
    }


def _op_patches(paths) -> list[str]:
    """``module.name = ...`` (or augmented, or deeper: ``a.b.c = ...``) where ``module`` was
    imported from rmsnorm_kernel."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        op_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rmsnorm_kernel"):
                op_names.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                op_names.update(
                    (a.asname or a.name).split(".")[0]
                    for a in node.names
                    if a.name.startswith("rmsnorm_kernel")
                )
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if root is not target and isinstance(root, ast.Name) and root.id in op_names:
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(target)}")
    return found


def test_tools_pass_a_tuning_instead_of_patching_the_op():
    """Sweeps and labs pass a launch.Tuning (or other argument); none assigns into the op's modules."""
    paths = sorted((ROOT / "tools").glob("*.py")) + sorted((ROOT / "maintainer").rglob("*.py"))
    assert _op_patches(paths) == []


def test_a_patch_of_the_op_is_found(tmp_path):
    bad = tmp_path / "sweep.py"
    bad.write_text("from rmsnorm_kernel import launch\nimport rmsnorm_kernel.ops\nlaunch._wide_fused = 1\n"
                   "rmsnorm_kernel.ops.X += 1\nother = 2\n")  # fmt: skip
    assert _op_patches([bad]) == ["sweep.py:3 launch._wide_fused", "sweep.py:4 rmsnorm_kernel.ops.X"]
