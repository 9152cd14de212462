"""`rmsnorm-kernel verdict`: every check this machine can run, one table, non-zero exit on failure.

On a CUDA machine the checks run on the GPU. Without CUDA they run the real Triton kernels on the
CPU under the Triton interpreter; the interpreter has to be chosen before the kernels are defined,
so when ``TRITON_INTERPRET`` is not set the command runs itself again in a subprocess with
``TRITON_INTERPRET=1``. Checks that need hardware this machine lacks (CUDA graphs without CUDA)
are reported as skipped with the reason, never as passed.

Writes ``outputs/verdict.md`` and ``outputs/verdict.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rmsnorm_suite.config import Config

CHILD_ENV = "RMSNORM_KERNEL_VERDICT_CHILD"  # set in the re-run, so it never re-runs itself twice

PASS, FAIL, SKIP = "pass", "FAIL", "skipped"


@dataclass
class Outcome:
    check: str
    status: str  # pass, FAIL or skipped
    figure: str  # the key figure, or the reason for a skip / failure
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


class Skip(Exception):
    """Raised by a check that this machine cannot run; the message is the reason."""


# ---------------------------------------------------------------------------------------------
# The checks. Each returns (passed, key figure, details) or raises Skip.
# ---------------------------------------------------------------------------------------------


def check_environment(cfg: Config, device: str):
    from rmsnorm_suite.console import write_json
    from rmsnorm_suite.walkthrough.environment import environment_check

    result = environment_check(device)
    write_json(cfg.outputs / "environment.json", result)
    v = result["versions"]
    where = v.get("device_name", "cuda") if device == "cuda" else "cpu (Triton interpreter)"
    figure = f"torch {v['torch']}, triton {v['triton']}, {where}"
    if not result["passed"]:
        figure += "; " + " ".join(result["diagnosis"]).splitlines()[0]
    return result["passed"], figure, result


def check_reference(cfg: Config, device: str):
    from rmsnorm_suite.walkthrough.oraclecheck import reference_checks

    rows = reference_checks(cfg.seeds.checks)
    good = sum(r["passed"] for r in rows)
    worst = max(max(r["formula_dx_max_abs_diff"], r["formula_dw_max_abs_diff"]) for r in rows)
    return (
        good == len(rows),
        f"{good}/{len(rows)} shapes x offsets; formula vs autograd max diff {worst:.2g}",
        {"shapes": rows},
    )


def _grid(kind: str):
    def check(cfg: Config, device: str):
        from rmsnorm_suite.console import write_json
        from rmsnorm_suite.walkthrough.grids import grid_summary, run_case_grid

        records = run_case_grid(kind, cfg, device)
        failed = [r for r in records if not r["passed"]]
        summary = grid_summary(records)
        write_json(
            cfg.outputs / f"check-{kind}.json",
            {
                "command": f"check-{kind}",
                "kind": kind,
                "device": device,
                "config": cfg.source,
                "passed": not failed and bool(records),
                "summary": summary,
                "cases": records,
            },
        )
        bound = _finite_max(s["bound_fraction"] for s in summary)
        oracle = _finite_max(s["oracle_fraction"] for s in summary)
        figure = (
            f"{len(records) - len(failed)}/{len(records)} cases; worst |err| at {bound:.0%} of "
            f"atol + rtol·|ref|, worst oracle error at {oracle:.0%} of its limit (pass: <= 100%)"
        )
        if failed:
            figure += f"; first failure {failed[0]['name']}: {failed[0]['reason']}"
        return not failed and bool(records), figure, {"summary": summary, "failed": failed}

    return check


def _finite_max(values) -> float:
    return max((v for v in values if not math.isnan(v)), default=math.nan)


def check_probes(cfg: Config, device: str):
    from rmsnorm_suite import checks, probes

    results = probes.run_probes(checks.kernel_impl, device, tolerances=cfg.checks.tolerances, progress=True)
    failed = [r for r in results if not r.passed]
    figure = f"{len(results) - len(failed)}/{len(results)} probes"
    if failed:
        figure += f"; {failed[0].check} {failed[0].kind}: {failed[0].reason}"
    return not failed, figure, {"results": [r.to_dict() for r in results]}


def check_mutants(cfg: Config, device: str):
    """Every deliberately broken variant in the catalogue (:mod:`rmsnorm_suite.mutants`) must be caught
    by the suite's own checks (run by :mod:`rmsnorm_suite.mutanthunt`); the report (mutant, check
    that caught it, case) goes to outputs/mutants.md."""
    from rmsnorm_suite import mutanthunt as module  # imported here: its mutants are Triton kernels

    # The broken variants overflow and divide by zero on purpose (fp16 squares, unwritten
    # buffers): under the interpreter NumPy warns about it. Those warnings are expected; they are
    # counted here instead of printed among the progress, and any other warning goes on as usual.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        entries = module.catalogue(device)
    expected = [
        w
        for w in caught
        if issubclass(w.category, RuntimeWarning) and EXPECTED_WARNING.search(str(w.message))
    ]
    for w in caught:
        if w not in expected:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if hasattr(module, "format_report"):
        cfg.outputs.mkdir(parents=True, exist_ok=True)
        (cfg.outputs / "mutants.md").write_text(module.format_report(entries), encoding="utf-8")
    survivors = [e["mutant"] for e in entries if not e["caught"]]
    figure = f"{len(entries) - len(survivors)}/{len(entries)} mutants caught"
    if survivors:
        figure += f"; SURVIVED: {', '.join(survivors)}"
    if expected:
        figure += f" ({len(expected)} expected overflow/NaN warnings of the mutants captured)"
    rows = [{k: e.get(k) for k in ("mutant", "caught", "check", "kind", "case", "reason")} for e in entries]
    noted = sorted({str(w.message) for w in expected})
    return bool(entries) and not survivors, figure, {"mutants": rows, "expected_warnings": noted}


# NumPy's floating-point warnings, which the broken variants raise on purpose
EXPECTED_WARNING = re.compile(r"(overflow|divide by zero|invalid value) encountered")


def _reported(result) -> tuple[bool, str, dict]:
    """A check of :mod:`rmsnorm_suite.torchchecks` as the verdict reports it: the first failure
    after the key figure, every failure in the details."""
    figure = result.figure
    if result.failures:
        figure += f"; {len(result.failures)} failed, first: {result.failures[0]}"
    return result.passed, figure, {**result.details, "failures": result.failures}


def check_opcheck(cfg: Config, device: str):
    from rmsnorm_suite import torchchecks

    return _reported(torchchecks.opcheck(device, cfg.checks.dtypes, seed=cfg.seeds.checks))


def check_compile(cfg: Config, device: str):
    from rmsnorm_suite import torchchecks

    return _reported(torchchecks.compile_fullgraph(device, seed=cfg.seeds.checks))


def check_cuda_graphs(cfg: Config, device: str):
    if device != "cuda":
        raise Skip("needs CUDA")
    from rmsnorm_suite import torchchecks

    return _reported(torchchecks.cuda_graphs(seed=cfg.seeds.checks))


def check_training(cfg: Config, device: str):
    from rmsnorm_suite.console import write_json
    from rmsnorm_suite.training import RESULT_JSON, run_integration

    result = run_integration(cfg, device)
    write_json(cfg.outputs / RESULT_JSON, result)
    t, calls = result["training"], result["calls"]
    mse = result["mse"]
    rel = abs(mse["reference"]["test"] - mse["kernel"]["test"]) / max(mse["reference"]["test"], 1e-30)
    resumed = next((c for c in result["checks"] if c["name"].startswith("resume")), None)
    figure = (
        f"{t['steps']} steps (hidden {t['hidden']}): {calls.get('forward')} fwd/{calls.get('backward')} bwd; "
        f"test MSE {mse['kernel']['test']:.5f}, rel diff {rel:.2g}; "
        f"resume {'identical' if resumed and resumed['ok'] else 'DIFFERS'}"
    )
    failed = [c["name"] for c in result["checks"] if c["ok"] is False]
    if failed:
        figure += f"; failed: {', '.join(failed)}"
    return result["passed"], figure, {k: v for k, v in result.items() if k != "losses"}


def _inference(which: str):
    """A check of :mod:`rmsnorm_suite.inference` on the op, its figures held to regression.toml's
    [features] limits (the gate's)."""

    def check(cfg: Config, device: str):
        from rmsnorm_suite import inference
        from rmsnorm_suite.thresholds import load_thresholds

        finding = inference.run(inference.op_impl, device, which)
        passed, figure = inference.judge(finding, load_thresholds().features)
        return passed, figure, asdict(finding)

    return check


CHECKS: tuple[tuple[str, Callable], ...] = (
    ("environment", check_environment),
    ("reference gradcheck", check_reference),
    ("forward grid (y)", _grid("forward")),
    ("backward grid (dx)", _grid("backward")),
    ("gamma grid (dw)", _grid("gamma")),
    ("probe checks", check_probes),
    ("mutant catalogue", check_mutants),
    ("opcheck", check_opcheck),
    ("torch.compile fullgraph", check_compile),
    ("CUDA graph capture", check_cuda_graphs),
    ("batch invariance", _inference("batch")),
    ("quantised output", _inference("quant")),
    ("QK-norm", _inference("qk")),
    ("training integration", check_training),
)
CHECK_NAMES = tuple(name for name, _ in CHECKS)


def run_checks(cfg: Config, device: str, skip: set[str] = frozenset(), log=print) -> list[Outcome]:
    outcomes = []
    for name, fn in CHECKS:
        if name in skip:
            outcomes.append(Outcome(name, SKIP, "skipped: --skip"))
            continue
        log(f"[verdict] {name} ...")
        t0 = time.perf_counter()
        try:
            passed, figure, details = fn(cfg, device)
            outcome = Outcome(name, PASS if passed else FAIL, figure, details=_jsonable(details))
        except Skip as exc:
            outcome = Outcome(name, SKIP, f"skipped: {exc}")
        except Exception as exc:  # a crashing check is a failed check, with its reason
            outcome = Outcome(
                name,
                FAIL,
                f"raised {type(exc).__name__}: {exc}".splitlines()[0],
                details={"traceback": traceback.format_exc()},
            )
        outcome.seconds = round(time.perf_counter() - t0, 2)
        log(f"[verdict] {name}: {outcome.status} ({outcome.seconds:.1f} s)")
        outcomes.append(outcome)
    return outcomes


# judged by other commands, never by the verdict: (what, why, where it is judged)
NEVER_JUDGED = (
    (
        "timing: latency, bandwidth, the regression gate",
        "the verdict checks correctness only",
        "`nox -s pr_verdict` on a GPU runner (docs/gate.md)",
    ),
)


def not_judged(device: str, outcomes: list[Outcome]) -> list[dict[str, str]]:
    """What this verdict did not judge, and why: the skipped checks, the compiled kernels when
    everything ran under the interpreter, and what only other commands judge. A PASS covers the
    table's passing rows only."""
    rows = [
        {"what": o.check, "why": o.figure.removeprefix("skipped: ")} for o in outcomes if o.status == SKIP
    ]
    if device != "cuda":
        rows.append(
            {
                "what": "the compiled GPU kernels",
                "why": "no CUDA device: every check ran the kernels under the Triton interpreter on CPU "
                "tensors; `nox -s gpu` and this command on a GPU machine judge the compiled ones",
            }
        )
    rows += [{"what": what, "why": f"{why}; judged by {where}"} for what, why, where in NEVER_JUDGED]
    return rows


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def table(outcomes: list[Outcome]) -> str:
    from rmsnorm_suite.console import format_table

    return format_table(["check", "status", "key figure"], [[o.check, o.status, o.figure] for o in outcomes])


def not_judged_lines(rows: list[dict[str, str]]) -> list[str]:
    return [f"- {r['what']}: {r['why']}" for r in rows]


def markdown(outcomes: list[Outcome], header: dict[str, Any], unjudged: list[dict[str, str]] = ()) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        f"# Verdict: {'PASS' if header['passed'] else 'FAIL'}",
        "",
        f"Device: {header['device']}. torch {header['torch']}, triton {header['triton']}, "
        f"Python {header['python']}. Config: {header['config']}.",
        "",
        "| check | status | key figure |",
        "|---|---|---|",
    ]
    lines += [f"| {o.check} | {o.status} | {cell(o.figure)} |" for o in outcomes]
    if unjudged:
        lines += ["", "Not judged here (a PASS covers the rows above only):", "", *not_judged_lines(unjudged)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    from rmsnorm_suite.console import add_common_arguments

    add_common_arguments(parser, json_flag=True, device=False)
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=CHECK_NAMES,
        metavar="CHECK",
        help=f"leave a check out (repeatable; reported as skipped): {', '.join(CHECK_NAMES)}",
    )


def child_argv(args: argparse.Namespace) -> list[str]:
    argv = ["verdict"]
    if args.config:
        argv += ["--config", args.config]
    if args.json:
        argv.append("--json")
    for name in args.skip:
        argv += ["--skip", name]
    return argv


def run(args: argparse.Namespace) -> int:
    from rmsnorm_suite import console as w

    cuda = torch.cuda.is_available()
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not cuda and not interpret:
        if os.environ.get(CHILD_ENV):
            return w.fail("the re-run with TRITON_INTERPRET=1 still sees no interpreter; giving up")
        print(
            "[verdict] no CUDA device: running the checks on CPU under the Triton interpreter "
            "(re-running with TRITON_INTERPRET=1)",
            file=sys.stderr,
            flush=True,
        )
        env = dict(os.environ, TRITON_INTERPRET="1", **{CHILD_ENV: "1"})
        return subprocess.run([sys.executable, "-m", "rmsnorm_suite", *child_argv(args)], env=env).returncode
    try:
        cfg = w.load(args)
        device = w.resolve_device("auto", "verdict")
    except (ValueError, w.DeviceUnavailable) as exc:
        return w.fail(str(exc))

    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    log(f"[verdict] running on {'cuda' if device == 'cuda' else 'cpu under the Triton interpreter'}")
    t0 = time.perf_counter()
    outcomes = run_checks(cfg, device, set(args.skip), log)
    passed = all(o.status != FAIL for o in outcomes)
    versions = w.versions()
    header = {
        "passed": passed,
        "device": versions.get("device_name", "cuda") if device == "cuda" else "cpu (Triton interpreter)",
        "torch": versions["torch"],
        "triton": versions.get("triton"),
        "python": versions["python"],
        "config": cfg.source,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    unjudged = not_judged(device, outcomes)
    payload = {**header, "checks": [asdict(o) for o in outcomes], "not_judged": unjudged}
    w.write_json(cfg.outputs / "verdict.json", payload)
    md = cfg.outputs / "verdict.md"
    md.write_text(markdown(outcomes, header, unjudged), encoding="utf-8")
    if args.json:
        w.print_json(payload)
    else:
        print(table(outcomes))
        print("\nNot judged here (a PASS covers the rows above only):")
        print("\n".join(not_judged_lines(unjudged)))
        counts = {s: sum(o.status == s for o in outcomes) for s in (PASS, FAIL, SKIP)}
        print(
            f"\n{'PASS' if passed else 'FAIL'}: {counts[PASS]} passed, {counts[FAIL]} failed, "
            f"{counts[SKIP]} skipped in {header['seconds']} s; {md} and {cfg.outputs / 'verdict.json'}"
        )
    return 0 if passed else 1
