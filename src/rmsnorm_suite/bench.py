"""`rmsnorm-kernel benchmark`: the harness run from the command line, and its table.

``configure`` and ``run`` are the command (cli.py); :func:`format_table` prints one line per
(shape, mode, provider) with the ratios to this kernel. The measuring is done by
:mod:`rmsnorm_suite.harness` (the run), :mod:`rmsnorm_suite.timing` (the clocks) and
:mod:`rmsnorm_suite.providers` (what is timed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rmsnorm_suite import results
from rmsnorm_suite.harness import DEFAULT_BLOCKS, DEFAULT_SAMPLES, MODES, run_benchmarks, select_cases
from rmsnorm_suite.providers import PROVIDERS, available_providers, get_provider, provider_available
from rmsnorm_suite.timing import DEFAULT_WARMUP_MS, MAX_LEAD_US, cuda_message


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--shapes", nargs="+", default=["all"], metavar="SHAPE",
        help='shape names such as 4096x4096-bfloat16, or "all", "large", "medium", "small" (default: all)',
    )  # fmt: skip
    parser.add_argument(
        "--providers", nargs="+", default=None, metavar="NAME",
        help=f"some of {list(PROVIDERS)} (default: every one importable here)",
    )  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="timed calls per block")
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help="timing blocks per shape")
    parser.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS)
    parser.add_argument("--no-errors", action="store_true", help="skip the float64-oracle error check")
    parser.add_argument("--config", default=None, help="walkthrough config (output_dir and seeds.checks)")
    parser.add_argument(
        "--out", default=None, help="folder for the results JSON (default: OUTPUT_DIR/benchmark)"
    )
    parser.add_argument(
        "--residual",
        action="store_true",
        help="benchmark the fused residual add + RMSNorm (this kernel, the unfused pair, peers) instead",
    )
    parser.add_argument(
        "--feature",
        choices=("quant", "qk"),
        default=None,
        help="benchmark an inference feature instead: quantised output (fp8/int8 per token) or QK-norm "
        "(rmsnorm_suite.featurebench; --shapes then names its shapes, or decode, prefill)",
    )
    parser.add_argument(
        "--no-device-time", action="store_true", help="skip the CUDA-graph (GPU time only) samples"
    )
    parser.add_argument(
        "--lead-us", type=float, default=0.0, metavar="US",
        help="queue a GPU wait of US microseconds before each whole-call sample's flush, so every "
        "provider's launch waits behind the flush whatever its host time (default: 0)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.blocks < 1:
        raise ValueError(f"--blocks must be >= 1, got {args.blocks}")
    if not 0 <= args.lead_us <= MAX_LEAD_US:
        raise ValueError(f"--lead-us must be in [0, {MAX_LEAD_US}], got {args.lead_us}")
    out_dir, seed = "outputs", 0
    if args.config:
        from rmsnorm_suite.config import load_config

        config = load_config(args.config)
        out_dir, seed = config.output_dir, config.seeds.checks
    out_dir = args.out or str(Path(out_dir) / "benchmark")
    if getattr(args, "feature", None):
        return _run_feature(args, out_dir, seed)
    chosen = select_cases(args.shapes)
    providers = args.providers or None
    if providers:
        for name in providers:
            get_provider(name)
        missing = [p for p in providers if not provider_available(p)]
        if missing:
            raise ValueError(
                f"--providers: {missing} cannot be imported here; available: {available_providers()}"
            )
    if not torch.cuda.is_available():
        print(cuda_message(), file=sys.stderr)
        return 2
    if providers is None:
        providers = available_providers(residual=args.residual)
    device_time = not args.no_device_time
    result = run_benchmarks(
        chosen,
        providers,
        args.modes,
        samples=args.samples,
        blocks=args.blocks,
        warmup_ms=args.warmup_ms,
        seed=seed,
        errors=not args.no_errors,
        progress=not args.quiet,
        device_time=device_time,
        lead_us=args.lead_us,
    )
    path = results.write(result, out_dir)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_table(result))
        print(f"\nresults: {path}")
    failed = [r for r in result.results if not r.ok]
    for r in failed:
        print(f"FAILED {r.provider} {r.shape} {r.mode}: {r.error}", file=sys.stderr)
    return 1 if any(r.provider == "kernel" for r in failed) else 0


def _run_feature(args: argparse.Namespace, out_dir: str, seed: int) -> int:
    """`benchmark --feature`: the feature's providers on its shapes (rmsnorm_suite.featurebench)."""
    from rmsnorm_suite import featurebench

    shapes = featurebench.feature_shapes(args.feature, args.shapes)
    providers = args.providers or featurebench.providers_of(args.feature)
    wrong = [p for p in providers if featurebench.FEATURE_PROVIDERS.get(p, None) is None
             or featurebench.FEATURE_PROVIDERS[p].feature != args.feature]  # fmt: skip
    if wrong:
        raise ValueError(
            f"--providers: {wrong} are not {args.feature} providers: {featurebench.providers_of(args.feature)}"
        )
    if not torch.cuda.is_available():
        print(cuda_message(), file=sys.stderr)
        return 2
    result = featurebench.run_feature_benchmarks(
        shapes, providers, args.modes, samples=args.samples, blocks=args.blocks, warmup_ms=args.warmup_ms,
        seed=seed, progress=not args.quiet, device_time=not args.no_device_time,
    )  # fmt: skip
    path = results.write(result, out_dir)
    print(json.dumps(result.to_json()) if args.json else f"{format_table(result)}\n\nresults: {path}")
    failed = [r for r in result.results if not r.ok]
    for r in failed:
        print(f"FAILED {r.provider} {r.shape} {r.mode}: {r.error}", file=sys.stderr)
    return 1 if any(r.provider.startswith("kernel") for r in failed) else 0


def _baseline(r: results.Row) -> str:
    """The op's provider a row is compared with: its feature's, the fused residual's or the plain op's."""
    from rmsnorm_suite.featurebench import FEATURE_PROVIDERS

    if r.provider in FEATURE_PROVIDERS:
        return FEATURE_PROVIDERS[r.provider].baseline
    return "kernel_residual" if r.residual else "kernel"


def _paired_blocks(t: results.Timing, kernel: results.Timing) -> tuple[tuple, tuple] | None:
    """The two rows' block medians, block i beside block i; None unless both ran every block."""
    mine, theirs = t.block_medians_ms, kernel.block_medians_ms
    if not mine or len(mine) != len(theirs):
        return None
    return tuple(mine), tuple(theirs)


def _slower_blocks(t: results.Timing, kernel: results.Timing) -> str:
    """ "k/n": in k of the n blocks both rows ran, ``t``'s block median exceeded the kernel's."""
    pairs = _paired_blocks(t, kernel)
    if pairs is None:
        return "-"
    mine, theirs = pairs
    return f"{sum(a > b for a, b in zip(mine, theirs))}/{len(mine)}"


def _ratio_interval(t: results.Timing, kernel: results.Timing, alpha: float = 0.05) -> str:
    """ "low-high": the two-sided (1 - 2 alpha) interval of t's time over the kernel's, from the
    paired block medians (gate.ratio_estimate, as the gate judges rounds). Above 1 throughout: t is
    slower in this run beyond its noise; below 1 throughout: faster."""
    from rmsnorm_suite import gate

    pairs = _paired_blocks(t, kernel)
    if pairs is None or len(pairs[0]) < 2:
        return "-"
    mine, theirs = pairs
    est = gate.ratio_estimate(theirs, mine, alpha, paired=True)
    return f"{est.low:.2f}-{est.high:.2f}"


def format_table(result: results.Run) -> str:
    """One line per (shape, mode, provider): median, the block medians, TB/s, fraction of the copy
    ceiling, errors, the time relative to this kernel (>1: slower than the kernel), in how many
    blocks it was slower than the kernel and the 90% interval of that ratio over the blocks
    (providers take turns within a block, so block i of one row and of another ran side by side:
    where whole calls are noisy, the pairs say more than one median), the GPU time and the host
    time of a call; the failed rows' errors below."""
    from rmsnorm_suite import console  # here, not at the top: the worker needs none of its configs

    machine = result.machine
    lines = [
        f"device {machine.get('device')}  torch {machine.get('torch')}  triton {machine.get('triton')}  "
        f"copy ceiling {result.copy.tbs:.2f} TB/s"
        + (f"  host lead {lead:g} us" if (lead := result.settings.get("lead_us")) else ""),
        "",
    ]
    headers = ["shape", "mode", "provider", "median us", "blocks us", "TB/s", "copy%", "err", "vs kernel"]
    headers += ["slower in", "ratio 90%", "gpu us", "gpu copy%", "host us"]
    rows, failures = [], []
    index = result.index()
    for r in result.results:
        t = r.whole
        if not r.ok or t.median_ms is None:
            rows.append([r.shape, r.mode, r.provider, "FAILED"] + ["-"] * 10)
            failures.append(f"  {r.shape} {r.mode} {r.provider}: {str(r.error)[:80]}")
            continue
        blocks = "/".join(f"{b * 1e3:.1f}" for b in t.block_medians_ms)
        errs = " ".join(f"{k}={v:.1e}" for k, v in r.errors.items())
        kernel = index.get((_baseline(r), r.shape, r.mode))
        vs = f"{t.median_ms / kernel.whole.median_ms:.2f}x" if kernel and kernel.whole.median_ms else "-"
        paired = kernel and kernel is not r
        slower = _slower_blocks(t, kernel.whole) if paired else "-"
        interval = _ratio_interval(t, kernel.whole) if paired else "-"
        gpu = ["-", "-"]
        if r.device.median_ms:
            gpu = [f"{r.device.median_ms * 1e3:.1f}", f"{100 * r.device.fraction_of_copy:.1f}%"]
        host = f"{r.host.median_ms * 1e3:.1f}" if r.host.median_ms else "-"
        rows.append(
            [r.shape, r.mode, r.provider, f"{t.median_ms * 1e3:.1f}", blocks, f"{t.tbs:.2f}"]
            + [f"{100 * t.fraction_of_copy:.1f}%", errs, vs, slower, interval, *gpu, host]
        )
    lines.append(console.format_table(headers, rows, right=range(3, 14)))
    if failures:
        lines += ["", "failed:", *failures]
    copies = {name: c for name, c in result.same_bytes_copy.items() if c.median_ms}
    if copies:
        lines += ["", "copy of x (x.clone(), the forward's bytes):"]
        for name, c in copies.items():
            gpu = f", gpu {c.device_median_ms * 1e3:.1f} us" if c.device_median_ms else ""
            lines.append(
                f"  {name:<22} {c.median_ms * 1e3:.1f} us{gpu}, {100 * c.tbs / result.copy.tbs:.1f}% of copy"
            )
    return "\n".join(lines)
