"""The package layout: the op (rmsnorm_kernel) imports nothing of the suite, and the suite
(rmsnorm_suite) finds its thresholds, configs and mutant catalogue through the package, so the
installed CLI works from any working directory."""

import ast
import os
import subprocess
import sys
from pathlib import Path

from rmsnorm_suite import config
from rmsnorm_suite.thresholds import THRESHOLDS_IN_TREE, default_thresholds, load_thresholds

ROOT = Path(__file__).resolve().parents[2]


def python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_cli_help_from_another_directory(tmp_path):
    done = python("-m", "rmsnorm_suite", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "usage: rmsnorm-kernel" in done.stdout and "pr-verdict" in done.stdout


def test_resources_load_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty folder: nothing may be found relative to it
    thresholds = load_thresholds()
    assert ("large", "forward") in thresholds.latency
    assert default_thresholds().read_text() == (ROOT / THRESHOLDS_IN_TREE[0]).read_text()
    for name in config.SHIPPED_CONFIGS:
        assert config.load_config(name).source == str(config.config_path(name))
    assert config.load_config(config.DEFAULT_CONFIG).to_dict() | {
        "source": ""
    } == config.Config().to_dict() | {"source": ""}


def test_gate_command_reads_the_shipped_thresholds(tmp_path):
    """`gate` without --thresholds, run from an empty folder: it judges (here: missing results,
    exit 2) instead of failing to find regression.toml."""
    done = python("-m", "rmsnorm_suite", "gate", "--base", "b.json", "--head", "h.json", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "regression.toml" not in done.stderr
    assert "b.json" in done.stdout + done.stderr


def test_the_op_imports_nothing_of_the_suite(tmp_path):
    """Nothing of the suite, and none of its dependencies beyond what torch and triton load."""
    code = (
        "import sys, torch, triton\n"
        "before = set(sys.modules)\n"
        "import rmsnorm_kernel\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.split('.')[0] in ('rmsnorm_suite', 'yaml', 'tqdm', 'tomli')))\n"
    )
    done = python("-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _suite_imports(path: Path, modules: set[str]) -> set[str]:
    """The rmsnorm_suite modules (dotted names below the package, as in ``modules``) that a file
    imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rmsnorm_suite":
            base = node.module.partition(".")[2]
            for alias in node.names:  # a submodule imported by name, else the module it comes from
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if name in modules else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.partition(".")[2] for a in node.names if a.name.startswith("rmsnorm_suite.")}
    return found - {""}


def test_the_suite_has_no_import_cycles():
    package = ROOT / "src" / "rmsnorm_suite"
    files = {
        ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph = {name: _suite_imports(path, set(files)) - {name} for name, path in files.items()}
    assert graph["training"] and "walkthrough" not in graph["training"]  # the cycle this test guards
    state: dict[str, str] = {}

    def visit(module: str, trail: tuple[str, ...]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle: {' -> '.join((*trail, module))}"
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            visit(target, (*trail, module))
        state[module] = "done"

    for module in sorted(graph):
        visit(module, ())
