"""`figures`: PNG plots from the recorded outputs (errors, losses, bandwidth)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rmsnorm_suite import cases
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    add_common_arguments,
    print_json,
    run_command,
)
from rmsnorm_suite.walkthrough.grids import GRID_TITLES, oracle_fraction, recorded_float

BENCH_DIR = "benchmark"  # under outputs/: where `rmsnorm-kernel benchmark` writes its results


def latest_bench_json(outputs: Path) -> Path | None:
    """The newest results file of `rmsnorm-kernel benchmark` (outputs/benchmark/*.json)."""
    folder = outputs / BENCH_DIR
    found = [p for p in folder.glob("*.json") if p.is_file()] if folder.is_dir() else []
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def figure_errors(outputs: Path, target: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    sources = [(k, outputs / f"check-{k}.json") for k in ("forward", "backward", "gamma")]
    present = [(k, json.loads(p.read_text())) for k, p in sources if p.is_file()]
    if not present:
        return (
            "skipped error distributions: no outputs/check-*.json yet "
            "(run check-forward, check-backward, check-gamma)"
        )
    # What decides a case, as a share of its limit (<= 1 passes): the worst element against
    # atol + rtol·|ref| (+ fp32 rounding), and the relative L2 error against the float64 oracle.
    fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 4.5), squeeze=False)
    names = [cases.dtype_name(d) for d in cases.DTYPES]
    for ax, (kind, data) in zip(axes[0], present):
        for i, name in enumerate(names):
            rows = [c for c in data["cases"] if c["dtype"] == name]
            xs = [i + 0.25 * ((j % 9) - 4) / 4 for j in range(len(rows))]
            for field, marker, offset in (("bound_fraction", "o", -0.12), ("oracle", "x", 0.12)):
                shares = [_share(c, field) for c in rows]
                pairs = [(x + offset, v, c["passed"]) for x, v, c in zip(xs, shares, rows) if v is not None]
                if pairs:
                    px, py, ok = zip(*pairs)
                    colors = ["tab:blue" if o else "tab:red" for o in ok]
                    ax.scatter(px, py, s=14, c=colors, marker=marker, alpha=0.8, linewidths=1)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names)
        ax.set_title(f"{GRID_TITLES[kind]} ({data['device']})")
        ax.set_ylabel("error / its limit (pass: <= 1; exact: 1e-6)")
    handles = [
        Line2D([], [], marker="o", ls="", color="tab:blue", label="worst |err| / (atol + rtol·|ref|)"),
        Line2D(
            [], [], marker="x", ls="", color="tab:blue", label="rel. L2 error vs float64 oracle / its limit"
        ),
        Line2D([], [], marker="o", ls="", color="tab:red", label="a failing case"),
        Line2D([], [], ls="--", color="k", label="limit: a case passes when both are <= 1"),
    ]
    wide = len(present) > 1
    fig.legend(handles=handles, loc="lower center", ncol=2 if wide else 1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12 if wide else 0.2, 1, 1))
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return f"wrote {target}"


def _share(case: dict, field: str) -> float | None:
    """The case's error as a share of the limit that decides it (clipped for the log axis), or None
    where the record has no such figure (a case that could not compare, a file from before it)."""
    value = oracle_fraction(case) if field == "oracle" else recorded_float(case.get(field, "nan"))
    return None if math.isnan(value) else min(max(value, 1e-6), 1e3)


def figure_losses(outputs: Path, target: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source = outputs / "train-integration.json"
    if not source.is_file():
        return f"skipped training loss curves: no {source} yet (run train-integration)"
    data = json.loads(source.read_text())
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, style in (("reference", "-"), ("kernel", "--"), ("resumed", ":")):
        losses = data["losses"].get(key)
        if losses:
            ax.plot(
                range(1, len(losses) + 1),
                losses,
                style,
                label=f"{key} path" if key != "resumed" else "kernel, resumed",
            )
    ax.set_xlabel("Adam step")
    ax.set_ylabel("training MSE (batch)")
    ax.set_yscale("log")
    t = data["training"]
    ax.set_title(
        f"Linear-RMSNorm-SiLU-Linear, hidden {t['hidden']}, batch {t['batch_size']} ({data['device']})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return f"wrote {target}"


def figure_bandwidth(outputs: Path, target: Path) -> str:
    bench = latest_bench_json(outputs)
    if bench is None:
        return (
            f"skipped bandwidth plot: no benchmark results in {outputs / BENCH_DIR}/ yet "
            "(run `rmsnorm-kernel benchmark` on a GPU)"
        )
    try:
        from rmsnorm_suite import plots
    except ImportError as exc:
        return f"skipped bandwidth plot: rmsnorm_suite.plots is not importable ({exc})"
    try:
        plots.plot_bandwidth(bench, target)
    except plots.NothingToPlot as exc:  # e.g. a run of the small shapes only
        return f"skipped bandwidth plot: {exc} ({bench})"
    return f"wrote {target} (from {bench})"


def cmd_figures(args: argparse.Namespace, cfg: Config) -> int:
    fig_dir = cfg.outputs / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    messages = []
    for name, make in (
        ("bandwidth.png", figure_bandwidth),
        ("errors.png", figure_errors),
        ("losses.png", figure_losses),
    ):
        try:
            messages.append(make(cfg.outputs, fig_dir / name))
        except Exception as exc:  # one bad input must not hide the other figures
            messages.append(f"FAILED {name}: {type(exc).__name__}: {exc}")
    failed = any(m.startswith("FAILED") for m in messages)
    if args.json:
        print_json({"command": "figures", "passed": not failed, "messages": messages})
    else:
        print("\n".join(messages))
    return 1 if failed else 0


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=False)


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_figures)
