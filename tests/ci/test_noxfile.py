"""The nox sessions as the README and CI promise them: names, tags, defaults, the quickstart
commands, and GPU sessions that stop (never pass) without CUDA."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ci._fixtures import NOXFILE, noxfile_sessions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

# name -> tags: the session names everyone (README, workflows, docs) uses.
EXPECTED_SESSIONS = {
    "lint": {"cpu"},
    "tests": {"cpu"},
    "interpret": {"cpu"},
    "gpu": {"gpu"},
    "gpu-distributed": {"gpu"},
    "verdict": {"cpu", "gpu"},
    "bench": {"gpu"},
    "asv": {"gpu"},
    "pr_verdict": {"gpu"},
    "drift": {"gpu"},
    "bisect": {"gpu"},
    "changepoints": {"cpu"},
    "history": {"cpu"},
    "rehearse": {"cpu"},
    "perf_docs": {"gpu"},
    "mutation": {"gpu"},
}
GPU_SESSIONS = sorted(name for name, tags in EXPECTED_SESSIONS.items() if tags == {"gpu"})
HAS_NOX = importlib.util.find_spec("nox") is not None


def noxfile_default_sessions(path: Path = NOXFILE) -> list[str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            return list(ast.literal_eval(node.value))
    return []


def quickstart_commands() -> list[str]:
    """The command lines of the README's Quickstart code blocks, one command per block (pasting a
    block runs only its command)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert blocks, "README: the Quickstart section has no code block"
    commands = [[ln for ln in b.splitlines() if ln.strip() and not ln.startswith("#")] for b in blocks]
    assert all(len(c) == 1 for c in commands), f"README: one command per Quickstart block: {commands}"
    return [c[0] for c in commands]


def test_sessions_are_the_agreed_ones_with_their_tags():
    found = {name: s["tags"] for name, s in noxfile_sessions().items()}
    assert found == EXPECTED_SESSIONS


@pytest.mark.parametrize("name", sorted(EXPECTED_SESSIONS))
def test_session_has_a_description_for_nox_list(name):
    doc = noxfile_sessions()[name]["doc"]
    assert doc and len(doc.splitlines()[0]) <= 105, f"{name}: needs a one-line docstring for `nox -l`"


def test_plain_nox_runs_the_cpu_test_sessions():
    assert noxfile_default_sessions() == ["lint", "tests"]


def test_readme_quickstart_is_two_commands_verdict_then_tests():
    commands = quickstart_commands()
    assert len(commands) == 2, commands
    verdict, tests = commands
    assert verdict.endswith("nox -s verdict")
    assert tests.endswith("/nox") or tests.endswith(" nox")
    for command in commands:
        assert "-r requirements/nox.txt" in command
        assert (ROOT / "requirements" / "nox.txt").is_file()


def test_ci_run_runs_the_readme_test_command():
    text = CI_RUN.read_text(encoding="utf-8")
    assert quickstart_commands()[1] in text.splitlines()
    assert "set -euo pipefail" in text
    assert CI_RUN.stat().st_mode & stat.S_IXUSR, ".ci/run must be executable"


@pytest.mark.parametrize("name", sorted(EXPECTED_SESSIONS))
def test_readme_session_table_lists_every_session(name):
    lines = README.read_text(encoding="utf-8").splitlines()
    rows = [line for line in lines if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"README: no row for session {name}"
    runs_on = {t.strip() for t in rows[0].split("|")[2].split(",")}
    assert runs_on == EXPECTED_SESSIONS[name]


def test_pinned_requirement_files_pin_every_line():
    for path in sorted((ROOT / "requirements").glob("*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            requirement = line.split("#", 1)[0].strip()
            if requirement:
                assert re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", requirement), f"{path.name}: {line!r}"


def _nox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(NOXFILE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
def test_nox_lists_the_same_sessions_as_parsed():
    import json

    result = _nox("-l", "--json", "-t", "cpu", "gpu")  # every session carries one of the two tags
    assert result.returncode == 0, result.stderr
    listed = {s["name"]: set(s["tags"]) for s in json.loads(result.stdout)}
    assert listed == EXPECTED_SESSIONS


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
def test_tests_session_collects_the_cpu_tests_then_the_interpreter_tests():
    """Plain `nox` (and .ci/run) has no interpret session: `tests` must run both sets of tests.
    It collects one file that holds both kinds, not the whole tree twice."""
    both = str(Path("tests", "op", "test_qk_norm.py"))  # _nox runs in ROOT
    result = _nox("--no-venv", "-s", "tests", "--", both, "--collect-only", "-q")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    collected = [int(n) for n in re.findall(r"^(\d+)/\d+ tests collected", output, re.M)]
    markers = re.findall(r"-m '([^']+)'", output)
    assert markers == ["not gpu and not interpret", "interpret and not gpu"], output
    assert len(collected) == 2 and min(collected) > 0, output


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
def test_an_empty_pytest_run_is_accepted_only_beside_another_run():
    """`-k` may leave one of `tests`' two runs empty; `interpret` runs once, so empty fails it.
    The runs collect this file alone (the test it names is here): what is judged is the exit
    status of a run with nothing selected, not what a run collects, which the test above checks."""
    here = str(Path(__file__).relative_to(ROOT))
    narrowed = ("--", here, "-k", "test_plain_nox_runs_the_cpu_test_sessions", "--collect-only", "-q")
    tests = _nox("--no-venv", "-s", "tests", *narrowed)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    interpret = _nox("--no-venv", "-s", "interpret", *narrowed)
    assert interpret.returncode != 0, interpret.stdout + interpret.stderr
    assert "exit code 5" in interpret.stdout + interpret.stderr


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is absent")
@pytest.mark.parametrize("name", GPU_SESSIONS)
def test_gpu_session_without_cuda_stops_with_a_clear_message(name):
    env = {"RMSNORM_BASE_SHA": "HEAD", "RMSNORM_HEAD_SHA": "HEAD", "RMSNORM_DRIFT_BASELINE": "HEAD"}
    result = _nox("--no-venv", "-s", name, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "needs a CUDA device" in output, output
    assert f"Session {name} aborted" in output, output


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
def test_mutation_session_runs_the_runner_from_the_tree(tmp_path):
    """The runner lives in maintainer/mutation/, which the wheel leaves out: the session runs it
    from the tree, whatever PYTHONPATH it is given (here its `run --help`, on CPU)."""
    result = _nox(
        "--no-venv", "-s", "mutation", "--", "--device", "cpu", "--help", env={"PYTHONPATH": str(tmp_path)}
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "usage: python -m maintainer.mutation run" in output, output


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
def test_gpu_session_without_torch_says_so_without_a_traceback(tmp_path):
    """--no-venv where torch does not import: the clear message, not the probe's traceback."""
    shadow = tmp_path / "shadow" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    result = _nox("--no-venv", "-s", "gpu", env={"PYTHONPATH": str(shadow.parent)})
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "needs a CUDA device" in output and "torch-not-importable:ImportError" in output, output
    assert "Traceback" not in output, output


@pytest.mark.skipif(not HAS_NOX, reason="nox is not installed in this environment")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is absent")
def test_gpu_session_in_a_virtualenv_stops_before_installing(noxfile_module, tmp_path):
    """No NVIDIA device: the session says so before pip builds the (large) virtualenv."""
    if noxfile_module.nvidia_device_present():
        pytest.skip("this machine has an NVIDIA device node or nvidia-smi")
    result = _nox("--envdir", str(tmp_path / "envs"), "-s", "gpu")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "no NVIDIA device" in output and "Session gpu aborted" in output, output
    assert "pip install" not in output, output


@pytest.fixture(scope="module")
def noxfile_module():
    """The noxfile imported as a module, for its plain helpers (nox must be importable)."""
    if not HAS_NOX:
        pytest.skip("nox is not installed in this environment")
    spec = importlib.util.spec_from_file_location("noxfile_under_test", NOXFILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (posargs, environment, release tag found, expected baseline, head, rest)
DRIFT_ARGS = [
    ([], {}, "v0.2.0", "v0.2.0", "HEAD", ["--out", "outputs/drift"]),
    ([], {"RMSNORM_DRIFT_BASELINE": "abc123"}, "v0.2.0", "abc123", "HEAD", ["--out", "outputs/drift"]),
    (["--baseline", "v0.1.0", "--head", "main", "--rounds", "4"], {"RMSNORM_DRIFT_BASELINE": "abc123"}, "",
     "v0.1.0", "main", ["--rounds", "4", "--out", "outputs/drift"]),
    (["--out", "x", "--shapes", "large"], {}, "v1.0.0", "v1.0.0", "HEAD", ["--out", "x", "--shapes", "large"]),
    (["--out=x"], {}, "v1.0.0", "v1.0.0", "HEAD", ["--out=x"]),
]  # fmt: skip


@pytest.mark.parametrize("posargs, environ, tag, baseline, head, rest", DRIFT_ARGS)
def test_drift_arguments(noxfile_module, posargs, environ, tag, baseline, head, rest):
    assert noxfile_module.drift_arguments(posargs, environ, lambda: tag) == (baseline, head, rest)


def test_drift_without_a_baseline_says_how_to_give_one(noxfile_module):
    with pytest.raises(ValueError, match="RMSNORM_DRIFT_BASELINE"):
        noxfile_module.drift_arguments([], {}, lambda: "")


def test_last_release_tag_is_a_v_tag_or_nothing(noxfile_module):
    tag = noxfile_module.last_release_tag()
    assert tag == "" or tag.startswith("v")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine would go on to benchmark")
def test_drift_session_stops_before_benchmarking_without_a_baseline(noxfile_module):
    """No release tag and no RMSNORM_DRIFT_BASELINE: the session names both ways to give one."""
    if noxfile_module.last_release_tag():
        pytest.skip("this checkout has a release tag, so the session finds its baseline")
    env = {k: v for k, v in os.environ.items() if k != "RMSNORM_DRIFT_BASELINE"}
    result = subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(NOXFILE), "--no-venv", "-s", "drift"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "no release tag v*" in output and "RMSNORM_DRIFT_BASELINE" in output, output
    assert "Session drift aborted" in output, output


def test_one_constraints_file_pins_transformers_within_the_models_extra():
    """requirements/constraints.txt holds the one transformers pin; every installing session passes
    it to pip, and the pinned release satisfies the `models` extra (the GPU runner has it installed)."""
    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "requirements" / "constraints.txt").read_text(encoding="utf-8").splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement:
            name, version = requirement.split("==")
            pins[name] = version
    assert pins.get("transformers") == "5.17.0", pins
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    models = re.search(r'^models = \["([^"]+)"\]', pyproject, re.M).group(1)
    assert Requirement(models).specifier.contains(pins["transformers"]), models
    noxfile = NOXFILE.read_text(encoding="utf-8")
    assert '"-c", CONSTRAINTS' in noxfile and 'CONSTRAINTS = "requirements/constraints.txt"' in noxfile
    swap = (ROOT / "tests" / "op" / "test_swap.py").read_text(encoding="utf-8")
    assert f'TABLE_VERSION = "{pins["transformers"]}"' in swap, "the swap sweep's table is of another release"


def test_rehearse_takes_asv_from_the_bench_extra_with_the_constraints(noxfile_module):
    """The rehearse session installs asv as pyproject's `bench` extra declares it (no second copy
    of its floor in the noxfile), under the constraints file, and neither torch nor the package
    (which would bring torch)."""
    from packaging.requirements import Requirement

    packages = list(noxfile_module.REHEARSE_PACKAGES)
    assert packages[packages.index("-c") + 1] == "requirements/constraints.txt", packages
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    bench = re.findall(r'"([^"]+)"', re.search(r"^bench = \[(.*)\]$", pyproject, re.M).group(1))
    assert [r for r in packages if r.startswith("asv")] == [r for r in bench if r.startswith("asv")]
    for node in ast.walk(ast.parse(NOXFILE.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "REHEARSE_PACKAGES":
            written = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]  # literal items
            assert not [w for w in written if isinstance(w, str) and w.startswith("asv")], written
    names = set()
    for before, item in zip(["", *packages], packages):
        if item.startswith("-") or before in ("-c", "-r"):
            continue  # an option, or the file it names
        assert re.match(r"[A-Za-z0-9]", item), f"{item}: a path (the package, with torch), not a requirement"
        names.add(Requirement(item).name)
    assert not names & {"torch", "triton", "rmsnorm-kernel"}, packages


class _Session:
    """What warn_untested_torch and pytest_workers use of a nox session."""

    def __init__(self, posargs=(), xdist="3.8.0"):
        self.posargs, self.warnings, self.xdist = list(posargs), [], xdist
        self.venv_backend = "virtualenv"

    def warn(self, message):
        self.warnings.append(message)


@pytest.mark.parametrize(
    "version, warns",
    [("2.13.0", False), ("2.11.0+cpu", False), ("2.12.1", False), ("2.10.0", True), ("2.14.0+cu130", True),
     ("2.6.0", True), ("", False)],
)  # fmt: skip
def test_a_torch_outside_the_tested_range_warns_once_naming_it(noxfile_module, version, warns):
    session = _Session()
    assert noxfile_module.warn_untested_torch(session, version) is warns
    assert len(session.warnings) == (1 if warns else 0)
    if warns:
        assert f"torch {version} is outside the tested range (torch 2.11 to 2.13)" in session.warnings[0]


@pytest.mark.parametrize(
    "posargs, environ, xdist, expected",
    [
        ([], {}, "3.8.0", ("-n", "auto", "--dist", "worksteal")),
        ([], {"RMSNORM_PYTEST_WORKERS": "2"}, "3.8.0", ("-n", "2", "--dist", "worksteal")),
        ([], {}, "3.1.0", ("-n", "auto")),  # before worksteal
        ([], {"RMSNORM_PYTEST_WORKERS": "0"}, "3.8.0", ()),
        ([], {}, "", ()),  # no pytest-xdist (a GPU runner's own environment): one process
        (["-n", "3"], {}, "3.8.0", ()),  # the user's own -n wins
        (["--collect-only", "-q"], {}, "3.8.0", ()),
    ],
)
def test_pytest_workers(noxfile_module, monkeypatch, posargs, environ, xdist, expected):
    monkeypatch.delenv("RMSNORM_PYTEST_WORKERS", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(noxfile_module, "distribution_version", lambda session, name: session.xdist)
    assert noxfile_module.pytest_workers(_Session(posargs, xdist)) == expected


def test_gpu_distributed_skips_below_two_gpus_and_else_runs_every_gpu(noxfile_module, monkeypatch):
    """One GPU: skipped, saying why, nothing run; N GPUs: the multigpu tests, then the training
    comparison under torchrun with N processes and the arguments after `--`."""
    ran, count = [], [1]
    monkeypatch.setattr(noxfile_module, "install", lambda session, *a, **k: None)
    monkeypatch.setattr(noxfile_module, "require_cuda", lambda session: None)
    monkeypatch.setattr(noxfile_module, "gpu_count", lambda session: count[0])
    monkeypatch.setattr(noxfile_module, "run", lambda session, *a, **k: ran.append(a))

    class Skipped(Exception):
        pass

    def skip(message):
        raise Skipped(message)

    session = _Session(["--steps", "5"])
    session.skip = skip
    with pytest.raises(Skipped, match="needs two or more GPUs and this machine shows 1: nothing run"):
        noxfile_module.gpu_distributed(session)
    assert ran == []
    count[0] = 4
    noxfile_module.gpu_distributed(session)
    tests, training = ran
    assert tests[:3] == ("python", "-m", "pytest") and tests[-3:] == (
        "-m",
        "multigpu",
        "tests/op/test_distributed.py",
    )
    assert "--nproc-per-node=4" in training and "rmsnorm_suite.distributed" in training
    assert training[-2:] == ("--steps", "5")


def test_gpu_session_runs_the_clock_tests_last_and_alone(noxfile_module, monkeypatch):
    """Both host paths spread over the cores without the `timing` tests; then those, in one process
    (beside other processes' kernels their intervals would measure the neighbours)."""
    ran = []
    monkeypatch.delenv("RMSNORM_PYTEST_WORKERS", raising=False)
    monkeypatch.setattr(noxfile_module, "install", lambda session, *a, **k: None)
    monkeypatch.setattr(noxfile_module, "require_cuda", lambda session: None)
    monkeypatch.setattr(noxfile_module, "distribution_version", lambda session, name: "3.8.0")
    monkeypatch.setattr(noxfile_module, "run", lambda session, *a, **k: ran.append((a, dict(session.env))))
    session = _Session([], "3.8.0")
    session.env = {}
    noxfile_module.gpu(session)
    (compiled, env1), (python, env2), (clocks, env3) = ran
    assert "gpu and not multigpu and not timing" in compiled and ("-n", "auto") == compiled[-4:-2]
    assert "gpu and not multigpu and not timing" in python and "-n" in python
    assert env1["RMSNORM_KERNEL_HOST"] == "compiled" and env2["RMSNORM_KERNEL_HOST"] == "python"
    assert "gpu and timing and not multigpu" in clocks and "-n" not in clocks
    assert env3["RMSNORM_KERNEL_HOST"] == "compiled"
