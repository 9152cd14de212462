"""Plots and the performance page drawn from a benchmark results file (:mod:`rmsnorm_suite.results`).

``plot_bandwidth`` draws bandwidth against N per provider (one panel per mode and timing: whole
calls, and GPU time where the run has it; the copy ceiling of the same run as a dashed line); the
``figures`` command and docs/performance.md use it.

``python -m rmsnorm_suite.plots`` (the ``perf_docs`` nox session) runs the benchmarks on this GPU,
or reads ``--results FILE``, then rewrites docs/performance.md and its plot.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rmsnorm_suite import harness, results
from rmsnorm_suite.console import markdown_table
from rmsnorm_suite.providers import available_providers
from rmsnorm_suite.results import Run
from rmsnorm_suite.timing import BenchUnavailable

# The shapes plotted: the memory-bound ones (cases.GROUPS), 65536x1024 among them.
PLOT_GROUPS = ("large", "medium")
# timing (a Row.timing kind) -> panel title
TIMINGS = {"whole": "whole calls", "device": "GPU time"}


def _check_timing(timing: str) -> None:
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {list(TIMINGS)}, got {timing!r}")


class NothingToPlot(ValueError):
    """A results file without a successful row of the dtype and groups asked for."""


PROVIDER_STYLE = {  # fixed colours, so a provider looks the same in every figure
    "kernel": ("#d62728", "o"),
    "eager": ("#7f7f7f", "v"),
    "native": ("#1f77b4", "s"),
    "compiled": ("#2ca02c", "^"),
    "liger": ("#9467bd", "D"),
    "quack": ("#ff7f0e", "P"),
}


def _as_run(run: Run | Mapping[str, Any] | str | Path) -> Run:
    """A Run from a Run, its JSON form, or a results file."""
    return results.load(run) if isinstance(run, (str, Path)) else results.as_run(run)


def _curves(points) -> dict[Any, list[tuple[int, float]]]:
    """curve -> [(N, TB/s)] sorted by N, from (curve, M, N, TB/s) points. Where two shapes share
    N (32768x4096 and 4096x4096), the one with more rows is kept: a curve is the sweep over N at
    a fixed, large tensor size."""
    best: dict[tuple[Any, int], tuple[int, float]] = {}
    for curve, m, n, tbs in points:
        if (curve, n) not in best or m > best[curve, n][0]:
            best[curve, n] = (m, tbs)
    curves: dict[Any, list[tuple[int, float]]] = {}
    for (curve, n), (_, tbs) in best.items():
        curves.setdefault(curve, []).append((n, tbs))
    return {c: sorted(points) for c, points in curves.items()}


def bandwidth_series(
    run: Run | Mapping[str, Any],
    mode: str,
    *,
    dtype: str = "bfloat16",
    groups: Sequence[str] = PLOT_GROUPS,
    timing: str = "whole",
) -> dict[str, list[tuple[int, float]]]:
    """provider -> [(N, TB/s)] sorted by N, for the successful rows of one mode and dtype in
    ``groups`` (one shape per N, as ``_curves`` keeps), timed as ``timing`` says (a key of
    TIMINGS)."""
    _check_timing(timing)
    return _curves(
        (r.provider, r.m, r.n, r.timing(timing).tbs)
        for r in _as_run(run).results
        if r.mode == mode
        and r.dtype == dtype
        and r.group in groups
        and not r.residual
        and r.ok
        and r.timing(timing).tbs is not None
    )


def same_bytes_copy_series(
    run: Run | Mapping[str, Any],
    *,
    dtype: str = "bfloat16",
    groups: Sequence[str] = PLOT_GROUPS,
    timing: str = "whole",
) -> list:
    """[(N, TB/s)] of the per-shape copies of x (the forward's bytes), one shape per N as
    ``bandwidth_series``; empty for a run without them."""
    _check_timing(timing)
    entries = _as_run(run).same_bytes_copy.values()
    return _curves(
        ("copy", e.m, e.n, e.tbs_of(timing))
        for e in entries
        if e.dtype == dtype and e.group in groups and e.tbs_of(timing) is not None
    ).get("copy", [])


def plot_bandwidth(
    run: Run | Mapping[str, Any] | str | Path,
    out: str | Path,
    *,
    dtype: str = "bfloat16",
    groups: Sequence[str] = PLOT_GROUPS,
    modes: Sequence[str] = harness.MODES,
) -> Path:
    """Write a PNG of bandwidth (TB/s, fewest bytes) against N per provider, a row of panels
    (one per mode) for whole calls and, where the run has GPU-time figures, one for those;
    returns its path."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    run = _as_run(run)
    rows = []
    for timing in TIMINGS:
        panels = [
            (mode, bandwidth_series(run, mode, dtype=dtype, groups=groups, timing=timing)) for mode in modes
        ]
        if any(series for _, series in panels):
            rows.append((timing, panels))
    if not rows:
        raise NothingToPlot(
            f"no successful {'/'.join(groups)} {dtype} rows for modes {list(modes)} in the results"
        )
    copy_tbs = run.copy.tbs
    fig = Figure(figsize=(5.5 * len(modes), 4.2 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(modes), squeeze=False)
    for row_axes, (timing, panels) in zip(axes, rows):
        _draw_row(row_axes, panels, timing, run, copy_tbs, dtype, groups)
    machine = run.machine
    fig.suptitle(
        f"RMSNorm bandwidth, {dtype}, the most rows at each N of the {'/'.join(groups)} shapes, "
        f"{machine.get('device', 'unknown device')}"
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _draw_row(axes, panels, timing: str, run: Run, copy_tbs, dtype: str, groups: Sequence[str]) -> None:
    """One row of ``plot_bandwidth``: a panel per mode, all timed as ``timing``."""
    for ax, (mode, series) in zip(axes, panels):
        for provider, points in series.items():
            color, marker = PROVIDER_STYLE.get(provider, (None, "x"))
            ns, tbs = zip(*points)
            ax.plot(
                ns,
                tbs,
                marker=marker,
                color=color,
                label=provider,
                linewidth=2 if provider == "kernel" else 1,
            )
        copies = (
            same_bytes_copy_series(run, dtype=dtype, groups=groups, timing=timing)
            if mode == "forward"
            else []
        )
        if copies:
            ns, tbs = zip(*copies)
            ax.plot(
                ns, tbs, color="black", linestyle=":", marker=".", linewidth=1, label="copy of x (same bytes)"
            )
        if copy_tbs:
            ax.axhline(
                copy_tbs, color="black", linestyle="--", linewidth=1, label=f"copy {copy_tbs:.2f} TB/s"
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (row width)")
        ax.set_ylabel("TB/s (fewest bytes moved)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode.replace('_', '+')}, {TIMINGS[timing]}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)


def performance_markdown(run: Run | Mapping[str, Any], png: str | None = None) -> str:
    """The performance tables: this kernel's time, the best peer and its time, the ratio
    (peer/kernel: above 1 the kernel is faster), bandwidth and fraction of the copy ceiling; once
    for whole calls (host work included), once for GPU time alone (CUDA-graph replays)."""
    run = _as_run(run)
    machine, settings = run.machine, run.settings
    copy_tbs = run.copy.tbs if run.copy.tbs is not None else float("nan")
    lines = [
        "# Performance",
        "",
        "Generated by `python -m rmsnorm_suite.plots` (nox session `perf_docs`); do not edit by hand.",
        "",
        f"Device {machine.get('device')}, torch {machine.get('torch')}, triton {machine.get('triton')}, "
        f"commit `{(run.git.commit or '?')[:12]}`, measured {run.created}. Device-to-device copy "
        f"ceiling measured in the same run: **{copy_tbs:.2f} TB/s**. Timing: "
        f"{settings.get('timing')}; medians of {settings.get('blocks')} blocks x "
        f"{settings.get('samples_per_block')} samples. Bandwidth counts the fewest "
        "bytes (forward 2·M·N·elem, forward+backward 5·M·N·elem). *Copy of x*: `x.clone()` at the "
        "forward's shape, timed the same way: the forward's bytes moved by a copy, what a pass of "
        "those bytes reaches at that size.",
        "",
        "## Whole calls",
        "",
        "What a caller waits for: host work (Python, autograd, launches) and the kernels.",
        "",
        *_table(run, "whole"),
    ]
    if any(r.device.median_ms for r in run.results):
        lines += [
            "",
            "## GPU time alone",
            "",
            f"Timing: {settings.get('device_timing')}. The kernels without the host work that issues "
            "them: what a model running under CUDA graphs (or with enough work queued) sees.",
            "",
            *_table(run, "device"),
        ]
    if png:
        lines += ["", f"![bandwidth against N per provider, whole calls and GPU time]({png})"]
    return "\n".join(lines) + "\n"


def _table(run: Run, kind: str) -> list[str]:
    """Rows of one table: the figures of timing ``kind``, "whole" (calls) or "device" (GPU time)."""
    rows = run.index()
    headers = ["shape", "mode", "kernel µs", "kernel TB/s", "of copy", "copy of x µs", "best peer", "peer µs"]
    headers.append("peer/kernel")
    table = []
    keys = sorted({(r.shape, r.mode) for r in run.results}, key=lambda k: _order(run, k))
    for shape, mode in keys:
        kernel = rows.get(("kernel", shape, mode))
        peers = [
            r
            for (p, s, m), r in rows.items()
            if s == shape
            and m == mode
            and p != "kernel"
            and not r.residual  # the fused residual pass is a different operation
            and r.ok
            and r.timing(kind).median_ms
        ]
        best = min(peers, key=lambda r: r.timing(kind).median_ms) if peers else None
        k = kernel.timing(kind) if kernel is not None else None
        kernel_ok = kernel is not None and kernel.ok and k.median_ms
        if not kernel_ok:
            k_cells = ["failed" if kernel and not kernel.ok else "-", "-", "-"]
        else:
            k_cells = [f"{k.median_ms * 1e3:.1f}", f"{k.tbs:.2f}", f"{100 * k.fraction_of_copy:.0f}%"]
        copy = run.same_bytes_copy.get(shape)
        copy_ms = copy.median_of(kind) if copy is not None and mode == "forward" else None
        k_cells.append(f"{copy_ms * 1e3:.1f}" if copy_ms else "-")
        if best is None:
            p_cells = ["-", "-", "-"]
        else:
            best_ms = best.timing(kind).median_ms
            ratio = f"{best_ms / k.median_ms:.2f}" if kernel_ok else "-"
            p_cells = [best.provider, f"{best_ms * 1e3:.1f}", ratio]
        table.append([shape, mode.replace("_", "+"), *k_cells, *p_cells])
    return markdown_table(headers, table).splitlines()


def _order(run: Run, key: tuple[str, str]) -> tuple[int, int]:
    names = list(dict.fromkeys(r.shape for r in run.results))
    return names.index(key[0]), list(harness.MODES).index(key[1]) if key[1] in harness.MODES else 9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rmsnorm_suite.plots", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--results", default=None, help="a results JSON; default: run the benchmarks now")
    parser.add_argument("--markdown", default="docs/performance.md")
    parser.add_argument("--png", default="docs/performance-bandwidth.png")
    parser.add_argument("--out", default="outputs/benchmark", help="where a fresh run's results JSON goes")
    parser.add_argument(
        "--saved",
        default="docs/performance-results.json",
        help="a fresh run's results JSON is also copied here, beside the page drawn from it",
    )
    args = parser.parse_args(argv)
    if args.results:
        run = results.load(args.results)
    else:
        try:
            run = harness.run_benchmarks(harness.select_cases(["all"]), available_providers(), harness.MODES)
        except BenchUnavailable as exc:
            print(exc, file=sys.stderr)
            return 2
        path = results.write(run, args.out)
        Path(args.saved).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, args.saved)
        print(f"results: {path} (copied to {args.saved})")
    png = plot_bandwidth(run, args.png)
    md = Path(args.markdown)
    md.parent.mkdir(parents=True, exist_ok=True)
    try:  # the page links the plot relative to itself
        link = png.resolve().relative_to(md.parent.resolve())
    except ValueError:
        link = png
    md.write_text(performance_markdown(run, str(link)), encoding="utf-8")
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
