"""`rmsnorm-kernel pr-verdict --base SHA --head SHA`: the whole pull-request job on a GPU machine.

The judge is trusted, the commits are data: the harness, the oracle, the gate and its thresholds
are this checkout's, read before any commit's code runs; base (the merge-base) and head supply
their op alone, staged from git's objects. Rounds run interleaved ABBA, each a fresh sandboxed
worker whose results come back on a pipe (:mod:`rmsnorm_suite.exchange`) and end with the
judge's stopwatch; then head's GPU tests with the trusted conftest, then the gate. A deadline
bounds it all. Exit status as the gate's: 0 pass, 1 regression, 2 could not judge. The steps in
full: docs/gate.md, "The pull-request job".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import scipy.stats  # noqa: F401  the gate's statistics, loaded before any commit's code runs

from rmsnorm_suite import (
    accept,
    cases,  # noqa: F401  the gate orders its table by it
    exchange,
    gate,
    guard,
    harness,
    results,
    rounds,
    sandbox,
    staging,
    stopwatch,
    telemetry,
    timing,
    worker,
)

SIDES = ("base", "head")
DEFAULT_ROUNDS = 6
DEFAULT_SAMPLES = 100  # per round and side
DEFAULT_EPS = worker.EPS  # the op's eps in every round, both sides
DEFAULT_DEADLINE_S = 80 * 60  # under the GPU job's 90-minute limit, leaving time to upload
WORKER_TIMEOUT_S = 1200  # one round at most
TESTS_TIMEOUT_S = 3600
WORKER_TIMING = "cuda"  # "host": the worker's CPU stand-in (the CPU tests set it)
# The worker's bootstrap under `python -I`: the two staged folders first on the path, then the
# module run as `python -m rmsnorm_suite.worker SPEC` would run it.
BOOTSTRAP = (
    "import sys; sys.path[:0] = sys.argv[1:3]; del sys.argv[1:3]; "
    "import rmsnorm_suite.worker as w; sys.exit(w.main(sys.argv[1:]))"
)
# Head's GPU tests under `python -I`: head's staged src and tests first on the path, then pytest.
PYTEST_BOOTSTRAP = (
    "import sys; sys.path[:0] = ['/judge/head/src', '/judge/head']; import pytest; "
    "sys.exit(pytest.main(sys.argv[1:]))"
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


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_round(
    box: sandbox.Sandbox,
    spec: dict[str, Any],
    log_path: Path,
    timeout: float,
    hidden: Sequence[Path],
    watch: telemetry.Sampler | None = None,
    seeds: Sequence[int] = (0,),
) -> tuple[results.Run | None, str | None]:
    """One side's round in a sandboxed worker; (the validated results, None) or (None, why not).
    The spec goes in on standard input and the results come back on a pipe; then the stopwatch:
    ``seeds`` are its prepare seed and one go seed per block (:mod:`rmsnorm_suite.stopwatch`),
    drawn by the judge. This process validates what came back and writes every file itself; the
    stopwatch's seconds and answers go in the run's settings."""
    argv = [sys.executable, "-I", "-B", "-c", BOOTSTRAP, "/judge/suite", "/judge/op", "-"]
    spec = {**spec, "expect_suite_under": "/judge/suite", "expect_op_under": "/judge/op", "stopwatch": True}
    blocks = stopwatch.plan(
        [harness.case_from_json(c) for c in spec["cases"]], spec["modes"], spec["timing"], worker.HOST_SHAPE
    )
    if len(seeds) != len(blocks) + 1:
        raise ValueError(f"the stopwatch needs {len(blocks) + 1} seeds, not {len(seeds)}")
    says = [json.dumps({"prepare": seeds[0]})] + [json.dumps({"go": s}) for s in seeds[1:]]
    got = exchange.sandboxed(
        box, argv, lambda fd: json.dumps({**spec, "result_fd": fd}), timeout, hidden, watch,
        exchange=lambda k, _line: says[k - 1] if k <= len(says) else None,
    )  # fmt: skip
    log_path.write_text(got.out + got.err, encoding="utf-8")
    if got.code is None:
        return None, f"timed out after {timeout:.0f} s"
    if got.code == 3:
        return None, f"the clock was replaced: {_tail(got.err, 1)}"
    if got.code != 0:
        return None, f"exit {got.code}: {_tail(got.err, 3)}"
    if len(got.lines) != len(says) + 1 or len(got.seconds) != len(says) or None in got.seconds:
        return (
            None,
            f"it sent {len(got.lines)} lines, not its results and then, each after the judge's "
            f"line, the stopwatch's {len(says)} answers",
        )
    try:
        run = results.from_json(json.loads(got.lines[0]))
        guard.read_calibration(run.settings)
        if json.loads(got.lines[1]) != {"ready": seeds[0]}:
            raise ValueError("the stopwatch's ready line does not echo the judge's prepare seed")
        sums = [stopwatch.read_answer(line, b, s) for line, b, s in zip(got.lines[2:], blocks, seeds[1:])]
    except (ValueError, TypeError, KeyError) as exc:
        return None, f"its results were not valid: {str(exc)[:200]}"
    if run.label != spec["label"] or run.round != spec["round"] or run.git.commit != spec["commit"]:
        return None, "its results name another side, round or commit"
    if "eps" in spec and run.settings.get("eps") != spec["eps"]:  # verdict.json records the spec's
        return None, f"its results name eps {run.settings.get('eps')!r}, not the spec's {spec['eps']!r}"
    watch_ = {"prepare_s": got.seconds[0], "seconds": got.seconds[1:], "sums": sums, "seeds": list(seeds)}
    return dataclasses.replace(run, settings={**run.settings, "stopwatch": watch_}), None


def run_gpu_tests(
    box: sandbox.Sandbox, note: str, log_path: Path, timeout: float, hidden: Sequence[Path]
) -> gate.Row:
    """pytest -m gpu over head's tests, staged at /judge/head, in a sandbox (they can only add a
    failure). Failed tests: regression; no tests, a collection or usage error, a timeout: cannot judge."""
    argv = [sys.executable, "-I", "-B", "-c", PYTEST_BOOTSTRAP, "-m", "gpu", "-q", "-p", "no:cacheprovider",
            "-c", "/judge/head/pyproject.toml", "--rootdir", "/judge/head", "/judge/head/tests"]  # fmt: skip
    got = exchange.sandboxed(box, argv, lambda fd: "", timeout, hidden)
    code, out, err = got.code, got.out, got.err
    log_path.write_text(out + err, encoding="utf-8")
    if code is None:
        return gate.Row("gpu tests (head)", None, None, None, None, "error", "run", note=f"timed out; {note}")
    last = _tail(out, 1) or _tail(err, 1)
    verdict = {0: "pass", 1: "regression"}.get(code, "error")
    return gate.Row(
        "gpu tests (head)",
        None,
        None,
        None,
        None,
        verdict,
        "run",
        note=f"pytest -m gpu exit {code}: {last}; {note}",
    )


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
    parser.add_argument("--modes", nargs="+", default=list(harness.MODES), choices=harness.MODES)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="interleaved rounds per side")
    parser.add_argument(
        "--samples", type=int, default=DEFAULT_SAMPLES, help="samples per round, shape and mode"
    )
    parser.add_argument(
        "--eps", type=float, default=DEFAULT_EPS,
        help=f"the eps both sides' op is called with, and the oracle's (default {DEFAULT_EPS:g})",
    )  # fmt: skip
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
        "--keep-staged", action="store_true", help="leave the staged commits and sandbox states in place"
    )
    parser.add_argument(
        "--accept-approved-by",
        metavar="WHO",
        default=None,
        help="a maintainer approved the Accept-Regression trailers of the judged commits "
        "(the workflow passes who applied the accept-regression label; a commit cannot)",
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
    # A normal float32 up to 1: smaller ones round to 0 or a subnormal in the op's fp32, larger
    # ones overflow the oracle's comparison or flatten every row.
    if not 1.1754943508222875e-38 <= args.eps <= 1.0:
        raise ValueError(f"--eps must be a normal float32 in [1.18e-38, 1], got {args.eps}")
    deadline = Deadline(args.deadline_s)
    # Absolute: each round runs in its own folder and is handed its spec and result paths.
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if WORKER_TIMING == "cuda" and not torch.cuda.is_available():
        return _stop(out, "cuda", timing.cuda_message())
    # The judge's own inputs first, before any code of either commit runs.
    try:
        thresholds = gate.load_thresholds(args.thresholds)
    except ValueError as exc:
        return _stop(out, "thresholds", str(exc))
    label = args.thresholds or f"{gate.THRESHOLDS_NAME} of the trusted checkout"
    repo = Path(staging.git_text(Path(args.repo), "rev-parse", "--show-toplevel"))
    base_ref = staging.resolve(repo, args.base, "--base")
    head = staging.resolve(repo, args.head, "--head")
    shas = {"base": base_ref if args.exact_base else staging.merge_base(repo, base_ref, head), "head": head}
    commits = {"base_ref_sha": base_ref, "base_sha": shas["base"], "head_sha": head}
    cases_ = harness.select_cases(args.shapes)
    if problem := sandbox.check():
        return _stop(out, "sandbox", f"the commits' code cannot be sandboxed here: {problem}", commits)
    tmp = Path(tempfile.mkdtemp(prefix="rmsnorm-pr-verdict-"))
    try:
        trusted = staging.stage_trusted_suite(tmp / "path" / "trusted")
        ops: dict[str, Path] = {}
        problems: list[str] = []
        for side in SIDES:
            try:
                ops[side] = staging.stage_op(repo, shas[side], tmp / "path" / side)
            except ValueError as exc:
                problems.append(f"{side}: {exc}")
        if problems:
            return _stop(out, "op modules", "; ".join(problems), commits)
        boxes = {
            side: sandbox.Sandbox(
                _empty(tmp / "root" / side),
                {"/judge/suite": trusted, "/judge/op": ops[side]},
                tmp / "state" / side,
            )
            for side in SIDES
        }
        context = {"base_ref": base_ref, "shas": shas, "thresholds": thresholds, "label": label,
                   "repo": repo, "tmp": tmp}  # fmt: skip
        try:
            return _judge_pr(args, out, context, boxes, cases_, deadline)
        except Exception as exc:  # whatever a commit did to the judge's folders: a verdict, exit 2
            return _stop(out, "judge", f"the judge failed: {type(exc).__name__}: {exc}"[:400], commits)
    finally:
        if args.keep_staged:
            print(f"staged commits kept under {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _empty(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def share_builds(base: Path, head: Path) -> None:
    """Copies the base's compiled host path and Triton cache into head's state before head's first
    round (the base builds first: ABBA). Head's op rebuilds whatever its sources change; nothing
    of head ever reaches the base's state."""
    for sub in ("torch-extensions", "triton"):
        target = head / sub
        if (base / sub).is_dir() and not target.exists() and not target.is_symlink():
            shutil.copytree(base / sub, target, symlinks=True)
            if os.geteuid() == 0:  # head has not run yet: nothing in its state can race this
                for folder, dirs, files in os.walk(target):
                    for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
                        os.lchown(name, sandbox.NOBODY, sandbox.NOBODY)


def _sampler() -> tuple[telemetry.Sampler | None, str | None]:
    """(the GPU sampler, None) when rounds time the GPU; (None, why) when NVML cannot be read
    there (an error row: a round under a throttle or beside another process cannot be told)."""
    if WORKER_TIMING != "cuda":
        return None, None
    try:
        return telemetry.Sampler(), None
    except (ImportError, RuntimeError) as exc:
        return None, f"cannot watch the GPU: {exc}"


def clock_row(runs: Mapping[str, Sequence[results.Run]], thresholds: gate.Thresholds) -> gate.Row:
    """The judge's calibration copy of head held to base's, round by round (regression.toml [clock])."""
    cal = {side: {run.round: guard.read_calibration(run.settings) for run in runs[side]} for side in SIDES}
    verdict, ratio, note = guard.judge_clock(
        cal["base"], cal["head"], thresholds.clock_tolerance, thresholds.clock_checkpoint
    )
    return gate.Row("clock", None, None, ratio, 1.0 + thresholds.clock_tolerance, verdict, "run", note=note)


def stopwatch_row(
    runs: Mapping[str, Sequence[results.Run]], cases_: Sequence[cases.Case], modes: Sequence[str],
    thresholds: gate.Thresholds, requests: Sequence[accept.Request] = (),
) -> gate.Row:  # fmt: skip
    """Head's stopwatch held to base's and to head's own rows, round by round ([stopwatch]); an
    approved Accept-Regression of a (case, mode) allows its blocks the same factor."""
    blocks = stopwatch.plan(cases_, modes, WORKER_TIMING, worker.HOST_SHAPE)
    seeds = {side: {run.round: run.settings["stopwatch"]["seeds"] for run in runs[side]} for side in SIDES}
    same = {k for k in seeds["base"] if seeds["base"][k] == seeds["head"].get(k)}
    got = {
        side: {run.round: _stopwatch_side(run, blocks) for run in runs[side] if run.round in same}
        for side in SIDES
    }
    verdict, ratio, note = stopwatch.judge(
        got["base"], got["head"], blocks, thresholds.stopwatch_tolerance,
        thresholds.stopwatch_consistency, thresholds.stopwatch_sums, _accepted(requests, cases_, modes, thresholds),
        thresholds.stopwatch_share, thresholds.stopwatch_coarse, thresholds.stopwatch_single,
        thresholds.stopwatch_any_round, thresholds.min_rounds,
    )  # fmt: skip
    limit = 1.0 + thresholds.stopwatch_tolerance
    return gate.Row("stopwatch", None, None, ratio, limit, verdict, "run", note=note)


def _accepted(requests, cases_, modes, thresholds) -> dict[tuple[str, str], float]:
    """(case, mode) -> the largest factor the gate grants any of its latency rows."""
    checks = [f"{kind} {c.name} {m}" for kind in accept.KINDS for c in cases_ for m in modes]
    granted, _ = accept.grant(requests, thresholds.accept, checks)
    out: dict[tuple[str, str], float] = {}
    for r in granted.values():
        _, case, mode = r.check.split(" ")
        out[case, mode] = max(r.factor, out.get((case, mode), 1.0))
    return out


def _stopwatch_seeds(cases_: Sequence[cases.Case], modes: Sequence[str]) -> list[int]:
    """The stopwatch's inputs for a round: a prepare seed, then a go seed per block; the judge's,
    both sides' (a redo draws new ones for every side that runs on after it)."""
    blocks = stopwatch.plan(cases_, modes, WORKER_TIMING, worker.HOST_SHAPE)
    return [secrets.randbits(62) for _ in range(len(blocks) + 1)]


def _stopwatch_side(run: results.Run, blocks: Sequence[stopwatch.Block]) -> stopwatch.Side:
    """A round's stopwatch, with what its own rows claim each block's calls cost: reps x the
    median of the row's whole-call samples (the stopwatch's calls include their host work), else
    of its GPU time; the judge's median of the samples the gate judges, not the one reported."""
    rows = {(r.shape, r.mode): r for r in run.results if r.provider == "kernel"}
    claimed = []
    for b in blocks:
        row = rows.get((b.case, b.mode))
        samples = row and (row.whole.samples_ms or row.device.samples_ms)
        claimed.append(b.reps * (gate.median(samples) if samples else 0.0) / 1e3)
    watch = run.settings["stopwatch"]
    return stopwatch.Side(watch["seconds"], watch["sums"], claimed)


def _head_tests(context, out: Path, deadline: Deadline) -> gate.Row:
    """Head's GPU tests, staged from git with the trusted conftest, in a sandbox of their own."""
    tmp = context["tmp"]
    try:
        staged, note = staging.stage_head_tests(
            context["repo"], context["shas"]["head"], staging.trusted_root(), tmp / "head-tests"
        )
    except ValueError as exc:
        return gate.Row("gpu tests (head)", None, None, None, None, "error", "run", note=str(exc))
    box = sandbox.Sandbox(_empty(tmp / "root" / "tests"), {"/judge/head": staged}, tmp / "state" / "tests")
    return run_gpu_tests(box, note, out / "gpu-tests-head.log", deadline.cap(TESTS_TIMEOUT_S), [tmp])


def _judge_pr(args, out: Path, context, boxes, cases_, deadline: Deadline) -> int:
    t0 = time.time()
    shas, hidden = context["shas"], [context["tmp"]]
    rounds_dir = out / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[results.Run]] = {side: [] for side in SIDES}
    failures: dict[str, list[str]] = {side: [] for side in SIDES}
    extra: list[gate.Row] = []
    bar = harness._Progress(args.rounds * len(SIDES), "pr-verdict rounds", True)
    done = redos = 0
    head_started = False  # the base's builds are shared only before head's code ever ran
    seen: dict[str, dict[str, Any] | None] = {}  # each round's telemetry
    watch, why = _sampler()
    if why:
        extra.append(gate.Row("telemetry", None, None, None, None, "error", "run", note=why))

    wanted = [key for key in results.FEATURE_KEYS if key in context["thresholds"].features]
    feature_seeds = [secrets.randbits(62) for _ in range(args.rounds)]  # per round, both sides'

    def play(side: str, k: int, seeds: list[int], may_redo: bool = True):
        """One side's round k, redone while the telemetry finds it noisy and ``may_redo`` (within the
        bound, with new stopwatch seeds: a redo never knows its go seeds); (run, problem, the seeds
        it used, the noise that ended it or None)."""
        nonlocal done, redos
        spec = {
            "cases": [harness.case_to_json(c) for c in cases_],
            "providers": ["kernel"],
            "modes": list(args.modes),
            "samples": args.samples,
            "eps": args.eps,
            "errors": True,
            # the inference features' figures the judge's [features] declares (the gate's rows),
            # their sizes and data drawn by the judge's seed for the round
            "features": wanted,
            "feature_seed": feature_seeds[k],
            "label": side,
            "round": k,
            "commit": shas[side],
            "timing": WORKER_TIMING,
        }
        log = rounds_dir / f"{side}-{k}.log"
        while True:
            run, problem = run_round(
                boxes[side], spec, log, deadline.cap(WORKER_TIMEOUT_S), hidden, watch, seeds
            )
            done += 1
            noisy = watch.round.noisy() if watch is not None and run is not None else None
            seen[f"{side}-{k}"] = watch.round.summary() if watch is not None else None
            if noisy is None:
                return run, problem, seeds, None
            if not may_redo or redos >= context["thresholds"].telemetry_redo or deadline.passed:
                return None, f"noisy: {noisy}", seeds, noisy
            redos += 1
            seeds = _stopwatch_seeds(cases_, args.modes)
            print(f"round {k} {side} redone: {noisy}", file=sys.stderr, flush=True)

    try:
        for k in range(args.rounds):
            seeds = _stopwatch_seeds(cases_, args.modes)
            first, second = round_order(k)
            while True:
                # the first side may be redone alone (the second has not seen its seeds yet); a
                # noisy second side redoes the whole round, in order, on new seeds: both sides of
                # a round always run on the same seeds, which no side has seen before
                got: dict[str, tuple] = {}
                for side in (first, second):
                    if deadline.passed:
                        break
                    bar.step(f"round {k} {side}")
                    head_started = head_started or side == "head"
                    got[side] = play(side, k, seeds, may_redo=side == first)
                    seeds = got[side][2]
                    if got[side][0] is not None and side == "base" and not head_started:
                        share_builds(boxes["base"].state, boxes["head"].state)
                noisy = got[second][3] if second in got else None
                if noisy is None or redos >= context["thresholds"].telemetry_redo or deadline.passed:
                    break
                redos += 1
                seeds = _stopwatch_seeds(cases_, args.modes)
                print(f"round {k} redone, both sides: {noisy}", file=sys.stderr, flush=True)
            for side, (run, problem, *_) in got.items():
                if run is not None:
                    runs[side].append(run)
                    results.write(run, rounds_dir, f"{side}-{k}")
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
            merged[side] = rounds.merge_rounds(runs[side], side, shas[side])
        else:
            merged[side], missing[side] = None, "no round finished (see rounds/*.log)"
    if args.skip_gpu_tests:
        print("gpu tests of head skipped (--skip-gpu-tests)", file=sys.stderr)
    elif deadline.passed:
        extra.insert(0, gate.Row("gpu tests (head)", None, None, None, None, "error", "run", note="deadline"))
    else:
        print("running the GPU tests of head ...", file=sys.stderr, flush=True)
        extra.insert(0, _head_tests(context, out, deadline))
    for side in SIDES:
        if merged[side]:
            results.write(merged[side], out, side)
    try:  # Accept-Regression trailers: data read from git's objects, honoured only when approved
        requests = accept.approve(
            accept.from_git(context["repo"], shas["base"], shas["head"]), args.accept_approved_by
        )
    except (subprocess.SubprocessError, OSError) as exc:
        requests = []
        extra.append(
            gate.Row("accept-regression", None, None, None, None, "error", "run", note=str(exc)[:200])
        )
    watch_row = stopwatch_row(runs, cases_, args.modes, context["thresholds"], requests)
    extra.insert(0, watch_row)
    extra.insert(0, clock_row(runs, context["thresholds"]))
    verdict = gate.judge(
        merged["base"], merged["head"], context["thresholds"], extra_rows=extra, missing=missing,
        acceptances=requests,
    )  # fmt: skip
    verdict.thresholds = context["label"]
    if args.skip_gpu_tests:
        verdict.summary += " (GPU tests skipped)"
    if stopwatch.LOOSE in (watch_row.note or ""):  # say what the stopwatch held loosely
        verdict.summary += " (stopwatch: some blocks held only to its coarse limit; see its row)"
    md, js = gate.write_verdict(verdict, out)
    info = json.loads(js.read_text(encoding="utf-8"))
    info.update(base_ref_sha=context["base_ref"], base_sha=shas["base"], head_sha=shas["head"])
    info["trusted_sha"] = staging.trusted_commit()
    info["pr"] = {
        "base": shas["base"],
        "head": shas["head"],
        "base_ref": context["base_ref"],
        "compared_with": "base" if args.exact_base else "merge-base",
        "rounds": args.rounds,
        "samples_per_round": args.samples,
        "eps": args.eps,
        "shapes": [c.name for c in cases_],
        "modes": list(args.modes),
        "gpu_tests": not args.skip_gpu_tests,
        "deadline_s": deadline.seconds,
        "wall_s": round(time.time() - t0, 1),
        "rounds_redone": redos,
    }
    info["telemetry"] = seen if watch is not None else f"not recorded: {why or 'no GPU (host stand-in)'}"
    js.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    print(md.read_text(encoding="utf-8"))
    print(verdict.summary)
    print(f"verdict: {md} {js}")
    return verdict.exit_code
