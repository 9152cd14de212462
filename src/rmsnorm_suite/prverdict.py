"""`rmsnorm-kernel pr-verdict --base SHA --head SHA`: the whole pull-request job on a GPU machine.

The judge is trusted, the commits are data. This process runs from the trusted checkout (the
default branch, which the workflow checks out); the harness (``bench.py``), the oracle, the gate
and its thresholds are this checkout's, and the thresholds are read before any code of either
commit runs. Base and head only supply their op.

1. The merge-base of base and head is what head is compared with (a branch behind the base is
   not blamed for the base's later changes); git worktrees of it and of head in a temporary
   folder (local git only: no network).
2. A staging folder per commit with a copy of the trusted suite (``rmsnorm_suite``) and of that
   commit's op alone (``rmsnorm_kernel``; in older commits, where the suite lived inside the
   op's package, its OP_MODULES only). Each round is a fresh ``python -I`` process running
   :mod:`rmsnorm_suite.worker` with exactly those two on the path;
   nothing else of the commit is imported, and the worker checks where both packages came from.
3. Rounds interleaved ABBA, the rounds merged per side (one median per round: the gate's
   independent units; errors: the largest seen).
4. The GPU tests of head (``pytest -m gpu`` in the head worktree): they can only add a failure.
5. The gate (:mod:`rmsnorm_suite.gate`); verdict.md and verdict.json, and the summary printed.

A global deadline (``--deadline-s``, below the job's limit) bounds every subprocess: when it
passes, the rounds stop and the verdict is ``error``, instead of a job killed without one.
Code of a commit runs with this process's rights; what isolates it from the runner is the
runner (docs/ci.md), not this module.

Exit status as the gate's: 0 pass, 1 regression, 2 could not judge.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import scipy.stats  # noqa: F401  the gate's statistics, loaded before any commit's code runs

import rmsnorm_suite
from rmsnorm_suite import bench, cases, gate, results  # noqa: F401  cases: the gate orders its table by it

SIDES = ("base", "head")
DEFAULT_ROUNDS = 6
DEFAULT_SAMPLES = 100  # per round and side
DEFAULT_DEADLINE_S = 80 * 60  # under the GPU job's 90-minute limit, leaving time to upload
WORKER_TIMEOUT_S = 1200  # one round at most
TESTS_TIMEOUT_S = 3600
OP_PACKAGE = "src/rmsnorm_kernel"
OP_MODULES = ("__init__", "kernels", "launch", "ops", "module", "reference")  # the op, in both layouts
WORKER_TIMING = "cuda"  # "host": the worker's CPU stand-in (the CPU tests set it)
# The worker's bootstrap under `python -I`: the two staged folders first on the path, then the
# module run as `python -m rmsnorm_suite.worker SPEC` would run it.
BOOTSTRAP = (
    "import sys, runpy; sys.path[:0] = sys.argv[1:3]; del sys.argv[1:3]; "
    "runpy.run_module('rmsnorm_suite.worker', run_name='__main__', alter_sys=True)"
)


class Deadline:
    """Seconds left until a fixed moment; every subprocess gets at most that."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def cap(self, timeout: float) -> float:
        return min(timeout, self.left())

    @property
    def passed(self) -> bool:
        return self.left() <= 0


def round_order(k: int) -> tuple[str, str]:
    """ABBA: even rounds run base first, odd rounds head first, so that a drift of the device
    during the run (clocks, temperature) falls on both sides alike."""
    return SIDES if k % 2 == 0 else SIDES[::-1]


def merge_rounds(
    runs: Sequence[results.Run | Mapping[str, Any]], label: str, commit: str | None
) -> results.Run:
    """One run from several rounds of one side: samples concatenated, one median per round (whole
    call, device and host: the gate's units), the largest error seen, failed when any round failed."""
    if not runs:
        raise ValueError(f"no rounds to merge for {label}")
    runs = [results.as_run(run) for run in runs]
    merged: dict[results.Key, _Merged] = {}
    for k, run in enumerate(runs):
        k = run.round if run.round is not None else k
        for row in run.results:
            into = merged.setdefault(row.key, _Merged(row))
            if not row.ok:
                if into.error is None:
                    into.error = f"round {k}: {row.error}"
                continue
            into.samples.extend(row.whole.samples_ms)
            into.medians.append(bench.median(row.whole.samples_ms))
            if row.host.samples_ms:
                into.host_samples.extend(row.host.samples_ms)
                into.host_medians.append(bench.median(row.host.samples_ms))
            if row.device_error or not row.device.samples_ms:
                into.device_error = (
                    into.device_error or f"round {k}: {row.device_error or 'no device samples'}"
                )
            else:
                into.device_samples.extend(row.device.samples_ms)
                into.device_medians.append(bench.median(row.device.samples_ms))
            for q, v in row.errors.items():
                into.errors[q] = max(v, into.errors.get(q, v))
    copies = [run.copy.tbs for run in runs if run.copy.tbs is not None]
    copy_tbs = bench.median(copies) if copies else None
    first = runs[0]
    rounds = [run.round if run.round is not None else k for k, run in enumerate(runs)]
    return results.Run(
        tuple(m.row(copy_tbs) for m in merged.values()),
        label=label,
        created=first.created,
        machine=first.machine,
        git=results.Git(commit, False),
        # round_indices: the rounds merged, in order; the gate pairs two runs' rounds by them
        settings={**first.settings, "rounds": len(runs), "round_indices": rounds},
        copy=results.CopyCeiling(tbs=copy_tbs, rounds_tbs=tuple(copies)),
    )


@dataclass
class _Merged:
    """One (provider, shape, mode) while its rounds are merged: the first round's row, and what
    the rounds add to it."""

    first: results.Row
    error: str | None = None  # the first failed round's
    samples: list[float] = field(default_factory=list)
    medians: list[float] = field(default_factory=list)
    device_samples: list[float] = field(default_factory=list)
    device_medians: list[float] = field(default_factory=list)
    device_error: str | None = None
    host_samples: list[float] = field(default_factory=list)
    host_medians: list[float] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)

    def row(self, copy_tbs: float | None) -> results.Row:
        ok, nbytes = self.error is None, self.first.bytes
        return dataclasses.replace(
            self.first,
            status="ok" if ok else "failed",
            error=self.error,
            errors=self.errors,
            whole=results.timing(self.samples, self.medians, nbytes, copy_tbs, summarise=ok),
            device=results.timing(self.device_samples, self.device_medians, nbytes, copy_tbs, summarise=ok),
            device_error=self.device_error,
            # rounds pair by position: a round without host samples voids the others'
            host=(
                results.timing(self.host_samples, self.host_medians, None, None, summarise=ok)
                if len(self.host_medians) == len(self.medians)
                else results.Timing()
            ),
        )


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


def resolve(repo: Path, rev: str, flag: str) -> str:
    try:
        return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except ValueError:
        raise ValueError(f"{flag}: {rev!r} is not a commit of {repo}") from None


def merge_base(repo: Path, base: str, head: str) -> str:
    try:
        return _git(repo, "merge-base", base, head)
    except ValueError:
        raise ValueError(f"--base: {base[:12]} and --head {head[:12]} have no merge-base in {repo}") from None


def trusted_commit() -> str | None:
    """The commit of the trusted checkout this suite runs from, when it is a git checkout."""
    try:
        return _git(Path(rmsnorm_suite.__file__).resolve().parent, "rev-parse", "HEAD")
    except (ValueError, OSError):
        return None


def stage_trusted_suite(dest: Path) -> Path:
    """A copy of the running (trusted) suite package under ``dest``; returns ``dest``."""
    source = Path(rmsnorm_suite.__file__).resolve().parent
    shutil.copytree(source, dest / "rmsnorm_suite", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def stage_op(tree: Path, dest: Path) -> Path:
    """A copy of a checkout's op under ``dest``; returns ``dest``. Where the suite has its own
    package (``src/rmsnorm_suite``), ``src/rmsnorm_kernel`` is the op alone and its modules are
    copied, with the compiled host path's sources (``csrc/``: without them the op falls back to
    the Python host path and the verdict would time a path its users do not take); in older
    commits the suite lived in the same package, and only OP_MODULES are, so that only the
    trusted suite can be imported. Plain files only: no nested folders, no links."""
    package = tree / OP_PACKAGE
    if not (package / "__init__.py").is_file():
        raise ValueError(f"{tree.name}: no {OP_PACKAGE}/__init__.py in this commit")
    split = (tree / "src" / "rmsnorm_suite").is_dir()
    names = sorted(p.stem for p in package.glob("*.py")) if split else OP_MODULES
    _copy_plain_files([package / f"{name}.py" for name in names], dest / "rmsnorm_kernel")
    csrc = package / "csrc"
    if split and csrc.is_dir() and not csrc.is_symlink():
        _copy_plain_files(sorted(csrc.iterdir()), dest / "rmsnorm_kernel" / "csrc")
    return dest


def _copy_plain_files(sources: Sequence[Path], to: Path) -> None:
    """Copies the plain files among ``sources`` (no links, no folders) into a new folder ``to``."""
    to.mkdir(parents=True)
    for source in sources:
        if source.is_file() and not source.is_symlink():
            shutil.copyfile(source, to / source.name)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_bounded(
    cmd: Sequence[str], cwd: Path, env: dict[str, str], timeout: float
) -> tuple[int | None, str, str]:
    """Run a command in a process group of its own; on timeout the whole group is killed and the
    exit status is None."""
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=max(timeout, 0.01))
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return None, out, err


def worker_env() -> dict[str, str]:
    """The environment of a worker: this one without variables that would put other code first
    (``python -I`` ignores PYTHON* anyway) or switch the kernels to the interpreter."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "TRITON_INTERPRET")
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_round(
    trusted: Path, op: Path, spec: dict[str, Any], spec_path: Path, log_path: Path, timeout: float
) -> str | None:
    """One side's round in a worker process; returns None on success, else what went wrong."""
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    cmd = [sys.executable, "-I", "-c", BOOTSTRAP, str(trusted), str(op), str(spec_path)]
    # Each side builds and loads its op's compiled host path (rmsnorm_kernel/host.py) in a cache
    # of its own, never one the other side's code wrote.
    env = {**worker_env(), "TORCH_EXTENSIONS_DIR": str(op.parent / f"{op.name}-torch-extensions")}
    code, out, err = run_bounded(cmd, spec_path.parent, env, timeout)
    log_path.write_text(out + err, encoding="utf-8")
    if code is None:
        return f"timed out after {timeout:.0f} s"
    if code != 0:
        return f"exit {code}: {_tail(err, 3)}"
    return None


def run_gpu_tests(worktree: Path, log_path: Path, timeout: float = TESTS_TIMEOUT_S) -> gate.Row:
    """pytest -m gpu in the head worktree (head's own tests: they can only add a failure).
    Failed tests: regression; no tests, a collection or usage error, a timeout: cannot judge."""
    env = {**worker_env(), "PYTHONPATH": str(worktree / "src")}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    code, out, err = run_bounded(cmd, worktree, env, timeout)
    log_path.write_text(out + err, encoding="utf-8")
    if code is None:
        return gate.Row("gpu tests (head)", None, None, None, None, "error", "run", note="timed out")
    last = _tail(out, 1) or _tail(err, 1)
    verdict = {0: "pass", 1: "regression"}.get(code, "error")
    note = f"pytest -m gpu exit {code}: {last}"
    return gate.Row("gpu tests (head)", None, None, None, None, verdict, "run", note=note)


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--base", required=True, metavar="SHA",
        help="tip of the branch merged into; head is compared with the merge-base of the two",
    )  # fmt: skip
    parser.add_argument("--head", required=True, metavar="SHA", help="head commit (the pull request)")
    parser.add_argument("--out", default="outputs/pr-verdict", metavar="DIR")
    parser.add_argument(
        "--shapes", nargs="+", default=["all"], metavar="SHAPE",
        help='benchmark shape names, or "all", "large", "medium", "small" (default: all)',
    )  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=list(bench.MODES), choices=bench.MODES)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="interleaved rounds per side")
    parser.add_argument(
        "--samples", type=int, default=DEFAULT_SAMPLES, help="samples per round, shape and mode"
    )
    parser.add_argument(
        "--thresholds", default=None, metavar="TOML",
        help="default: the regression.toml of the suite running this command (the trusted checkout)",
    )  # fmt: skip
    parser.add_argument("--repo", default=".", help="git repository holding both commits (default: .)")
    parser.add_argument(
        "--deadline-s", type=float, default=DEFAULT_DEADLINE_S, metavar="S",
        help=f"stop and write an error verdict after S seconds (default {DEFAULT_DEADLINE_S})",
    )  # fmt: skip
    parser.add_argument(
        "--exact-base", action="store_true",
        help="compare with --base itself, not the merge-base (drift: a pinned baseline)",
    )  # fmt: skip
    parser.add_argument("--skip-gpu-tests", action="store_true", help="benchmarks and gate only")
    parser.add_argument(
        "--keep-worktrees", action="store_true", help="leave the temporary worktrees in place"
    )


def _stop(out: Path, check: str, note: str, commits: dict[str, str] | None = None) -> int:
    """An `error` verdict before any round ran; ``commits``: the SHA fields of verdict.json."""
    row = gate.Row(check, None, None, None, None, "error", "run", note=note)
    verdict = gate.Verdict("error", f"ERROR: could not judge: {note}", [row])
    _, js = gate.write_verdict(verdict, out)
    if commits:
        js.write_text(json.dumps({**verdict.to_json(), **commits}, indent=1) + "\n", encoding="utf-8")
    print(verdict.summary, file=sys.stderr)
    return verdict.exit_code


def run(args: argparse.Namespace) -> int:
    if args.rounds < 2:
        raise ValueError(f"--rounds must be >= 2 (base and head each first at least once), got {args.rounds}")
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if not args.deadline_s > 0:
        raise ValueError(f"--deadline-s must be > 0, got {args.deadline_s}")
    deadline = Deadline(args.deadline_s)
    # Absolute: each round runs in its own folder and is handed its spec and result paths.
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if WORKER_TIMING == "cuda" and not torch.cuda.is_available():
        return _stop(out, "cuda", bench.cuda_message())
    # The judge's own inputs first, before any code of either commit runs.
    try:
        thresholds = gate.load_thresholds(args.thresholds)
    except ValueError as exc:
        return _stop(out, "thresholds", str(exc))
    label = args.thresholds or f"{gate.THRESHOLDS_NAME} of the trusted checkout"
    repo = Path(_git(Path(args.repo), "rev-parse", "--show-toplevel"))
    base_ref = resolve(repo, args.base, "--base")
    head = resolve(repo, args.head, "--head")
    shas = {"base": base_ref if args.exact_base else merge_base(repo, base_ref, head), "head": head}
    cases_ = bench.select_cases(args.shapes)
    tmp = Path(tempfile.mkdtemp(prefix="rmsnorm-pr-verdict-"))
    trees = {side: tmp / side for side in SIDES}
    try:
        for side in SIDES:
            _git(repo, "worktree", "add", "--detach", "--force", str(trees[side]), shas[side])
        trusted = stage_trusted_suite(tmp / "path" / "trusted")
        ops: dict[str, Path] = {}
        problems: list[gate.Row] = []
        for side in SIDES:
            try:
                ops[side] = stage_op(trees[side], tmp / "path" / side)
            except ValueError as exc:
                problems.append(gate.Row(f"{side} op", None, None, None, None, "error", "run", note=str(exc)))
        if problems:
            commits = {"base_ref_sha": base_ref, "base_sha": shas["base"], "head_sha": head}
            return _stop(out, "op modules", "; ".join(r.note for r in problems), commits)
        context = {"base_ref": base_ref, "shas": shas, "thresholds": thresholds, "label": label}
        return _judge_pr(args, out, context, trees, trusted, ops, cases_, deadline)
    finally:
        if args.keep_worktrees:
            print(f"worktrees kept under {tmp}", file=sys.stderr)
        else:
            for side in SIDES:
                if trees[side].exists():
                    subprocess.run(["git", "worktree", "remove", "--force", str(trees[side])], cwd=repo)
            subprocess.run(["git", "worktree", "prune"], cwd=repo)
            shutil.rmtree(tmp, ignore_errors=True)


def _judge_pr(args, out: Path, context, trees, trusted: Path, ops, cases_, deadline: Deadline) -> int:
    t0 = time.time()
    shas = context["shas"]
    rounds_dir = out / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[results.Run]] = {side: [] for side in SIDES}
    failures: dict[str, list[str]] = {side: [] for side in SIDES}
    extra: list[gate.Row] = []
    bar = bench._Progress(args.rounds * len(SIDES), "pr-verdict rounds", True)
    done = 0
    try:
        for k in range(args.rounds):
            for side in round_order(k):
                if deadline.passed:
                    break
                bar.step(f"round {k} {side}")
                result_path = rounds_dir / f"{side}-{k}.json"
                spec = {
                    "cases": [bench.case_to_json(c) for c in cases_],
                    "providers": ["kernel"],
                    "modes": list(args.modes),
                    "samples": args.samples,
                    "errors": True,
                    "label": side,
                    "round": k,
                    "commit": shas[side],
                    "timing": WORKER_TIMING,
                    "expect_suite_under": str(trusted),
                    "expect_op_under": str(ops[side]),
                    "out": str(result_path),
                }
                paths = (rounds_dir / f"{side}-{k}.spec.json", rounds_dir / f"{side}-{k}.log")
                timeout = deadline.cap(WORKER_TIMEOUT_S)
                problem = run_round(trusted, ops[side], spec, *paths, timeout)
                done += 1
                if problem is None:  # read at once: a later round cannot rewrite it
                    runs[side].append(results.load(result_path))
                else:
                    failures[side].append(f"round {k}: {problem}")
    finally:
        bar.close()
    if deadline.passed:
        note = f"the {deadline.seconds:g} s deadline passed after {done} of {args.rounds * 2} rounds"
        extra.append(gate.Row("deadline", None, None, None, None, "error", "run", note=note))
    merged: dict[str, results.Run | None] = {}
    missing: dict[str, str] = {}
    for side in SIDES:
        if failures[side]:
            note = "; ".join(failures[side])[:400]
            extra.append(gate.Row(f"{side} benchmark", None, None, None, None, "error", "run", note=note))
        if runs[side]:
            merged[side] = merge_rounds(runs[side], side, shas[side])
        else:
            merged[side], missing[side] = None, "no round finished (see rounds/*.log)"
    if args.skip_gpu_tests:
        print("gpu tests of head skipped (--skip-gpu-tests)", file=sys.stderr)
    elif deadline.passed:
        extra.insert(0, gate.Row("gpu tests (head)", None, None, None, None, "error", "run", note="deadline"))
    else:
        print("running the GPU tests of head ...", file=sys.stderr, flush=True)
        timeout = deadline.cap(TESTS_TIMEOUT_S)
        extra.insert(0, run_gpu_tests(trees["head"], out / "gpu-tests-head.log", timeout))
    # Written after head's tests, which run head's code: the files match what was judged.
    for side in SIDES:
        if merged[side]:
            results.write(merged[side], out, side)
    verdict = gate.judge(
        merged["base"], merged["head"], context["thresholds"], extra_rows=extra, missing=missing
    )
    verdict.thresholds = context["label"]
    if args.skip_gpu_tests:
        verdict.summary += " (GPU tests skipped)"
    md, js = gate.write_verdict(verdict, out)
    info = json.loads(js.read_text(encoding="utf-8"))
    info.update(base_ref_sha=context["base_ref"], base_sha=shas["base"], head_sha=shas["head"])
    info["trusted_sha"] = trusted_commit()
    info["pr"] = {
        "base": shas["base"],
        "head": shas["head"],
        "base_ref": context["base_ref"],
        "compared_with": "base" if args.exact_base else "merge-base",
        "rounds": args.rounds,
        "samples_per_round": args.samples,
        "shapes": [c.name for c in cases_],
        "modes": list(args.modes),
        "gpu_tests": not args.skip_gpu_tests,
        "deadline_s": deadline.seconds,
        "wall_s": round(time.time() - t0, 1),
    }
    js.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    print(md.read_text(encoding="utf-8"))
    print(verdict.summary)
    print(f"verdict: {md} {js}")
    return verdict.exit_code
