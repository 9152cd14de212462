"""`python -m rmsnorm_suite.worker SPEC.json|-`: one pr-verdict round of one commit, in its own process.

pr-verdict starts it in a sandbox, the trusted suite and the commit's op alone on its path. It
binds the judge's clocks before the op is imported and checks them after the import and the round
(:mod:`rmsnorm_suite.guard`; exit 3 if one was replaced), times the calibration copy around each
case, sends its results on the spec's ``result_fd`` (or writes ``out``), then answers the judge's
stopwatch (:mod:`rmsnorm_suite.stopwatch`). ``"timing": "host"`` is the CPU stand-in: small CPU
tensors timed with the host clock, the same results format, so pr-verdict's tests need no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rmsnorm_suite import cases, guard, harness, inference, numerics, providers, results, stopwatch
from rmsnorm_suite import timing as clocks  # `timing` names the spec's choice here

TIMINGS = ("cuda", "host")
# The stopwatch's class as the trusted suite defines it, bound before any commit's code runs
# (a tuple: nothing in it can be swapped in place), with its functions' code.
STOPWATCH_CLASS = tuple((k, v, getattr(v, "__code__", None)) for k, v in vars(stopwatch.Stopwatch).items())
BLOCK = stopwatch.Stopwatch.block
HOST_SHAPE = (4, 64)  # rows, columns (at most the case's) of the host stand-in's CPU inputs
EPS = cases.EPS  # the op's eps when the spec names none (pr-verdict's --eps default)
# Bound at import, before any commit's code: the Run is assembled with these, not with whatever
# dataclasses.replace is when the round ends (the guard also holds both).
REPLACE, FEATURE = dataclasses.replace, results.Feature


def check_origin(module: str, expected_under: str | None) -> str | None:
    """None when ``module`` was imported from under ``expected_under``, else what went wrong."""
    if not expected_under:
        return None
    where = Path(importlib.import_module(module).__file__).resolve()
    if not where.is_relative_to(Path(expected_under).resolve()):
        return f"{module} imported from {where}, expected under {expected_under}"
    return None


def host_stand_in(spec: dict[str, Any], before_case=None) -> results.Run:
    """The results of one round, timed on the CPU with the host clock (no CUDA needed)."""
    import torch

    eps = spec.get("eps", EPS)
    fn = providers.get_provider("kernel").build(eps)
    rows = []
    for case in map(harness.case_from_json, spec["cases"]):
        if before_case is not None:
            before_case()
        m, n = min(case.m, HOST_SHAPE[0]), min(case.n, HOST_SHAPE[1])
        x, w, dy = numerics.make_inputs(m, n, torch.float32)
        oracle = numerics.oracle(x, w, dy, eps)
        for mode in spec["modes"]:
            call, grads = harness.make_call(fn, x, w, dy, mode)
            times = []
            for _ in range(spec["samples"]):
                clocks.prepare_sample(grads, None)
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e3)
            errors = harness.provider_errors(fn, x, w, dy, oracle, [mode])[mode]
            # the host clock stands in for every timing; the copy ceiling is 1 TB/s
            timing = results.timing(times, [clocks.median(times)], case.nbytes[mode], 1.0)
            rows.append(
                results.Row(
                    "kernel",
                    case.name,
                    mode,
                    "ok",
                    case.m,
                    case.n,
                    str(case.dtype).removeprefix("torch."),
                    case.group,
                    bytes=case.nbytes[mode],
                    errors=errors,
                    whole=timing,
                    device=timing,
                    device_reps=1,
                    host=timing,
                )  # fmt: skip
            )
    return results.Run(
        tuple(rows),
        machine={"device": "host stand-in (CPU, host clock)"},
        git=results.Git(spec.get("commit"), False),
        settings={"samples_per_block": spec["samples"], "blocks": 1, "eps": eps, "timing": "host stand-in"},
        copy=results.CopyCeiling(tbs=1.0),
    )


def feature_figures(timing: str, seed: int = 0, wanted=None) -> dict[str, results.Feature]:
    """The inference checks' figures on this commit's op (rmsnorm_suite.inference): the GPU's
    cases, or the host stand-in's small CPU ones; sizes and data drawn by the judge's ``seed``;
    only the checks with a figure in ``wanted`` (the judge's [features] keys; None: all)."""
    if timing == "host":
        found = inference.gate_figures("cpu", table=inference.HOST_CASES, seed=seed, wanted=wanted)
    else:
        found = inference.gate_figures(clocks.DEVICE, seed=seed, wanted=wanted)
    return {k: FEATURE(f["status"], f["value"], f["note"], tuple(f["cases"])) for k, f in found.items()}


def _wanted(spec: dict[str, Any]):
    """The figures the judge asks for: ``features`` true (all), or a list of figure names."""
    asked = spec.get("features")
    return None if asked is True else tuple(asked or ())


def run_round(spec: dict[str, Any], before_case=None) -> results.Run:
    if spec.get("timing", "cuda") == "host":
        return host_stand_in(spec, before_case)
    return harness.run_benchmarks(
        [harness.case_from_json(c) for c in spec["cases"]],
        spec.get("providers", ["kernel"]),
        spec["modes"],
        samples=spec["samples"],
        blocks=1,
        eps=spec.get("eps", EPS),
        warmup_ms=spec.get("warmup_ms", clocks.DEFAULT_WARMUP_MS),
        errors=spec.get("errors", True),
        copy_elements=spec.get("copy_elements", clocks.COPY_ELEMENTS),
        progress=False,
        git=results.Git(spec.get("commit"), False),
        device_time=spec.get("device_time", True),
        same_bytes_copy=False,  # the gate compares the kernel's rows only
        before_case=before_case,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rmsnorm_suite.worker")
    parser.add_argument("spec", metavar="SPEC.json", help="the round's spec, or - for standard input")
    args = parser.parse_args(argv)
    # one line from standard input: the judge's go line may follow it on the same stream
    text = sys.stdin.readline() if args.spec == "-" else Path(args.spec).read_text(encoding="utf-8")
    spec = json.loads(text)
    timing = spec.get("timing", "cuda")
    if timing not in TIMINGS:
        print(f"spec: timing must be one of {list(TIMINGS)}, got {spec.get('timing')!r}", file=sys.stderr)
        return 2
    # The judge's clocks, bound before any code of the commit runs.
    held = guard.Guard()
    try:
        calibration = guard.Calibration(timing, clocks.DEVICE)
    except Exception as exc:
        print(f"calibration: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    # The suite must be the trusted one and the op the commit's, not an installed copy of either.
    for module, key in (("rmsnorm_suite", "expect_suite_under"), ("rmsnorm_kernel", "expect_op_under")):
        try:
            problem = check_origin(module, spec.get(key))
        except Exception as exc:  # the commit's op may fail to import in any way
            problem = f"import {module} failed: {type(exc).__name__}: {exc}"
        if problem:
            print(problem, file=sys.stderr)
            return 2
    out, fd = spec.get("out"), spec.get("result_fd")
    if fd is None and Path(out or "").suffix != ".json":
        print(f"spec: out must name a .json file, or result_fd a descriptor; got {out!r}", file=sys.stderr)
        return 2
    if replaced := held.replaced():
        print(f"the clock was replaced when the op was imported: {', '.join(replaced[:8])}", file=sys.stderr)
        return 3
    calibrations = [calibration.measure()]
    try:
        result = run_round(spec, before_case=lambda: calibrations.append(calibration.measure()))
    except clocks.BenchUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    calibrations.append(calibration.measure())
    if spec.get("features"):  # the inference features' figures, inside the guarded span
        seed = int(spec.get("feature_seed", 0))
        result = REPLACE(result, features=feature_figures(timing, seed, _wanted(spec)))
    if replaced := held.replaced():
        print(f"the clock was replaced during the round: {', '.join(replaced[:8])}", file=sys.stderr)
        return 3
    settings = {**result.settings, "calibration_ms": calibrations}
    result = REPLACE(result, label=spec.get("label"), round=spec.get("round"), settings=settings)
    if fd is None:
        results.write(result, Path(out).parent, Path(out).stem)
        return 0
    with open(int(fd), "w", encoding="utf-8", closefd=True) as pipe:
        pipe.write(json.dumps(result.to_json()) + "\n")
        pipe.flush()
        if spec.get("stopwatch"):
            return answer_stopwatch(spec, pipe, held)
    return 0


def answer_stopwatch(spec: dict[str, Any], pipe, held: guard.Guard) -> int:
    """The stopwatch's exchange: the judge's ``prepare`` seed, then ``ready``; per block the
    judge's ``go`` seed, then the block's projections. The guard is checked at the end: a clock
    replaced on the way ends the round (exit 3), whatever was answered."""
    line = sys.stdin.readline()
    if not line:
        return 0  # the judge did not start the stopwatch
    seed = int(json.loads(line)["prepare"])
    fn = providers.get_provider("kernel").build(spec.get("eps", EPS))
    timing = spec.get("timing", "cuda")
    blocks = stopwatch.plan(
        [harness.case_from_json(c) for c in spec["cases"]], spec["modes"], timing, HOST_SHAPE
    )
    device = "cpu" if timing == "host" else clocks.DEVICE
    watch = stopwatch.Stopwatch(fn, blocks, seed, device)
    inputs = dict(watch.inputs)
    # no full collection of this heap inside a timed block (tens of milliseconds): what exists
    # now is frozen out of the collector's scans, which still free what the calls leave
    gc.collect()
    gc.freeze()
    pipe.write(json.dumps({"ready": seed}) + "\n")
    pipe.flush()
    for i in range(len(blocks)):
        line = sys.stdin.readline()
        if not line:
            return 0
        go = int(json.loads(line)["go"])
        if not _intact(watch, fn, blocks, device, inputs):
            print("the clock was replaced during the stopwatch: its instance or class", file=sys.stderr)
            return 3
        pipe.write(json.dumps({"go": go, "sums": BLOCK(watch, i, go)}) + "\n")
        pipe.flush()
    if replaced := held.replaced():
        print(f"the clock was replaced during the stopwatch: {', '.join(replaced[:8])}", file=sys.stderr)
        return 3
    return 0


def _intact(watch: Any, fn: Any, blocks: list, device: str, inputs: dict) -> bool:
    """The stopwatch is the class as imported and the instance as the worker built it: an op
    that reached it (through the frames, in its untimed warm-up) set no method, field or input."""
    return (
        type(watch) is stopwatch.Stopwatch
        and _same(vars(stopwatch.Stopwatch), {k: v for k, v, _ in STOPWATCH_CLASS})
        and all(getattr(v, "__code__", None) is code for _, v, code in STOPWATCH_CLASS)
        and set(vars(watch)) == {"torch", "fn", "blocks", "device", "inputs"}
        and watch.fn is fn
        and watch.blocks == list(blocks)
        and watch.device == device
        and _same(watch.inputs, inputs)
    )


def _same(now: Any, then: dict) -> bool:
    """``now`` (a mapping) holds the very objects ``then`` held, under the same names."""
    return dict(now).keys() == then.keys() and all(now[k] is v for k, v in then.items())
