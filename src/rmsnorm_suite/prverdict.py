"""`rmsnorm-kernel pr-verdict --base SHA --head SHA`: the whole pull-request job on a GPU machine.

1. Git worktrees of base and head in a temporary folder (local git only: no network).
2. Benchmarks of both in the same run, interleaved: rounds alternate base/head and head/base,
   each round a fresh subprocess that imports ``rmsnorm_kernel`` from its worktree's ``src``
   (PYTHONPATH) and is timed by one copy of this checkout's harness (``bench.py``), so a change
   to the harness in the pull request cannot favour either side.
3. The rounds merged per side (samples concatenated, errors: the largest seen).
4. The GPU tests of head (``pytest -m gpu`` in the head worktree).
5. The gate (:mod:`rmsnorm_suite.gate`) with the base's regression.toml, so that a pull request
   cannot loosen its own thresholds; verdict.md and verdict.json, and the summary printed.

Exit status as the gate's: 0 pass, 1 regression, 2 could not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rmsnorm_suite import bench, gate

SIDES = ("base", "head")
DEFAULT_ROUNDS = 6
DEFAULT_SAMPLES = 100  # per round and side: 600 samples per (shape, mode) with 6 rounds
WORKER_TIMEOUT_S = 1200
TESTS_TIMEOUT_S = 3600


def round_order(k: int) -> tuple[str, str]:
    """ABBA: even rounds run base first, odd rounds head first, so that a drift of the device
    during the run (clocks, temperature) falls on both sides alike."""
    return SIDES if k % 2 == 0 else SIDES[::-1]


def merge_rounds(runs: Sequence[dict[str, Any]], label: str, commit: str | None) -> dict[str, Any]:
    """One run from several rounds of one side: samples concatenated, one block median per
    round, the largest error seen, failed when any round failed."""
    if not runs:
        raise ValueError(f"no rounds to merge for {label}")
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for k, run in enumerate(runs):
        for row in run["results"]:
            key = (row["provider"], row["shape"], row["mode"])
            into = merged.get(key)
            if into is None:
                into = merged[key] = {**row, "samples_ms": [], "block_medians_ms": [], "errors": {}}
                into["status"], into["error"] = "ok", None
                into["device_samples_ms"], into["device_error"] = [], None
            if row["status"] != "ok":
                if into["status"] == "ok":
                    into["status"], into["error"] = "failed", f"round {k}: {row.get('error')}"
                continue
            into["samples_ms"].extend(row["samples_ms"])
            into["block_medians_ms"].append(bench.median(row["samples_ms"]))
            if row.get("device_error") or not row.get("device_samples_ms"):
                into["device_error"] = (
                    into["device_error"] or f"round {k}: {row.get('device_error') or 'no device samples'}"
                )
            else:
                into["device_samples_ms"].extend(row["device_samples_ms"])
            for q, v in row.get("errors", {}).items():
                into["errors"][q] = max(v, into["errors"].get(q, v))
    copies = [r["copy"]["tbs"] for r in runs if r.get("copy")]
    copy_tbs = bench.median(copies) if copies else None
    rows = []
    for row in merged.values():
        if row["status"] == "ok" and row["samples_ms"] and copy_tbs:
            bench._summarise(row, copy_tbs)
        elif row["status"] == "ok" and row["samples_ms"]:
            row["median_ms"] = bench.median(row["samples_ms"])
        else:
            row["median_ms"] = row["tbs"] = row["fraction_of_copy"] = None
        rows.append(row)
    first = runs[0]
    return {
        "schema": bench.SCHEMA,
        "label": label,
        "created": first.get("created"),
        "machine": first.get("machine"),
        "git": {"commit": commit, "dirty": False},
        "settings": {**first.get("settings", {}), "rounds": len(runs)},
        "copy": {"tbs": copy_tbs, "rounds_tbs": copies},
        "results": rows,
    }


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


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_round(
    harness: Path, worktree: Path, spec: dict[str, Any], spec_path: Path, log_path: Path
) -> str | None:
    """One side's round in a subprocess; returns None on success, else what went wrong."""
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(worktree / "src")}
    env.pop("TRITON_INTERPRET", None)
    try:
        done = subprocess.run(
            [sys.executable, str(harness), "--worker", str(spec_path)],
            cwd=worktree,
            env=env,
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {WORKER_TIMEOUT_S} s"
    log_path.write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        return f"exit {done.returncode}: {_tail(done.stderr, 3)}"
    return None


def run_gpu_tests(worktree: Path, log_path: Path) -> gate.Row:
    """pytest -m gpu in the head worktree. Failed tests: regression; no tests, a collection or
    usage error: the gate cannot judge."""
    env = {**os.environ, "PYTHONPATH": str(worktree / "src")}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    try:
        done = subprocess.run(
            cmd, cwd=worktree, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return gate.Row("gpu tests (head)", None, None, None, None, "error", "run", note="timed out")
    log_path.write_text(done.stdout + done.stderr, encoding="utf-8")
    last = _tail(done.stdout, 1) or _tail(done.stderr, 1)
    verdict = {0: "pass", 1: "regression"}.get(done.returncode, "error")
    note = f"pytest -m gpu exit {done.returncode}: {last}"
    return gate.Row("gpu tests (head)", None, None, None, None, verdict, "run", note=note)


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--base", required=True, metavar="SHA", help="base commit (the branch merged into)")
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
        "--thresholds", default=None, metavar="TOML", help="default: the base's regression.toml"
    )
    parser.add_argument("--repo", default=".", help="git repository (default: .)")
    parser.add_argument("--skip-gpu-tests", action="store_true", help="benchmarks and gate only")
    parser.add_argument(
        "--keep-worktrees", action="store_true", help="leave the temporary worktrees in place"
    )


def run(args: argparse.Namespace) -> int:
    if args.rounds < 2:
        raise ValueError(f"--rounds must be >= 2 (base and head each first at least once), got {args.rounds}")
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    # Absolute: each round runs in its worktree and is handed its spec and result paths.
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        row = gate.Row("cuda", None, None, None, None, "error", "run", note=bench.cuda_message())
        verdict = gate.Verdict("error", f"ERROR: could not judge: {bench.cuda_message()}", [row])
        gate.write_verdict(verdict, out)
        print(verdict.summary, file=sys.stderr)
        return verdict.exit_code
    repo = Path(_git(Path(args.repo), "rev-parse", "--show-toplevel"))
    shas = {"base": resolve(repo, args.base, "--base"), "head": resolve(repo, args.head, "--head")}
    cases_ = bench.select_cases(args.shapes)
    tmp = Path(tempfile.mkdtemp(prefix="rmsnorm-pr-verdict-"))
    trees = {side: tmp / side for side in SIDES}
    try:
        for side in SIDES:
            _git(repo, "worktree", "add", "--detach", "--force", str(trees[side]), shas[side])
        harness = tmp / "harness" / "rmsnorm_bench_harness.py"
        harness.parent.mkdir()
        shutil.copyfile(bench.__file__, harness)
        return _judge_pr(args, out, shas, trees, harness, cases_)
    finally:
        if args.keep_worktrees:
            print(f"worktrees kept under {tmp}", file=sys.stderr)
        else:
            for side in SIDES:
                if trees[side].exists():
                    subprocess.run(["git", "worktree", "remove", "--force", str(trees[side])], cwd=repo)
            subprocess.run(["git", "worktree", "prune"], cwd=repo)
            shutil.rmtree(tmp, ignore_errors=True)


def _judge_pr(args, out: Path, shas, trees, harness: Path, cases_) -> int:
    t0 = time.time()
    rounds_dir = out / "rounds"
    rounds_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    failures: dict[str, list[str]] = {side: [] for side in SIDES}
    total = args.rounds * len(SIDES)
    bar = bench._Progress(total, "pr-verdict rounds", True)
    try:
        for k in range(args.rounds):
            for side in round_order(k):
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
                    "expect_package_under": str(trees[side] / "src"),
                    "out": str(result_path),
                }
                problem = run_round(
                    harness,
                    trees[side],
                    spec,
                    rounds_dir / f"{side}-{k}.spec.json",
                    rounds_dir / f"{side}-{k}.log",
                )
                if problem is None:
                    runs[side].append(bench.load_run(result_path))
                else:
                    failures[side].append(f"round {k}: {problem}")
    finally:
        bar.close()
    extra: list[gate.Row] = []
    merged: dict[str, dict[str, Any] | None] = {}
    missing: dict[str, str] = {}
    for side in SIDES:
        if failures[side]:
            note = "; ".join(failures[side])[:400]
            extra.append(gate.Row(f"{side} benchmark", None, None, None, None, "error", "run", note=note))
        if runs[side]:
            merged[side] = merge_rounds(runs[side], side, shas[side])
            bench.write_run(merged[side], out, side)
        else:
            merged[side], missing[side] = None, "every round failed (see rounds/*.log)"
    if args.skip_gpu_tests:
        print("gpu tests of head skipped (--skip-gpu-tests)", file=sys.stderr)
    else:
        print("running the GPU tests of head ...", file=sys.stderr, flush=True)
        extra.insert(0, run_gpu_tests(trees["head"], out / "gpu-tests-head.log"))
    if args.thresholds:
        thresholds_path, label = Path(args.thresholds), str(args.thresholds)
    elif (trees["base"] / gate.DEFAULT_THRESHOLDS).is_file():
        thresholds_path, label = trees["base"] / gate.DEFAULT_THRESHOLDS, f"{gate.DEFAULT_THRESHOLDS} of base"
    else:  # the pull request that introduces the gate
        thresholds_path, label = trees["head"] / gate.DEFAULT_THRESHOLDS, f"{gate.DEFAULT_THRESHOLDS} of head"
        label += " (base has none)"
    try:
        thresholds = gate.load_thresholds(thresholds_path)
    except ValueError as exc:
        row = gate.Row("thresholds", None, None, None, None, "error", "run", note=str(exc))
        verdict = gate.Verdict("error", f"ERROR: could not judge: {exc}", [*extra, row])
        gate.write_verdict(verdict, out)
        print(verdict.summary)
        return verdict.exit_code
    verdict = gate.judge(merged["base"], merged["head"], thresholds, extra_rows=extra, missing=missing)
    verdict.thresholds = label
    if args.skip_gpu_tests:
        verdict.summary += " (GPU tests skipped)"
    md, js = gate.write_verdict(verdict, out)
    extra_info = json.loads(js.read_text(encoding="utf-8"))
    extra_info["pr"] = {
        "base": shas["base"],
        "head": shas["head"],
        "rounds": args.rounds,
        "samples_per_round": args.samples,
        "shapes": [c.name for c in cases_],
        "modes": list(args.modes),
        "gpu_tests": not args.skip_gpu_tests,
        "wall_s": round(time.time() - t0, 1),
    }
    js.write_text(json.dumps(extra_info, indent=1) + "\n", encoding="utf-8")
    print(md.read_text(encoding="utf-8"))
    print(verdict.summary)
    print(f"verdict: {md} {js}")
    return verdict.exit_code
