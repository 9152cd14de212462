#!/usr/bin/env python3
"""Power and family-wise false alarms of the gate, by resampling the rounds of recorded A/A runs.

Input: A/A pr-verdict output folders (``base.json``, ``head.json``) or ``--record`` files. Trials of
R rounds are drawn from their per-round log ratios, head's rounds of one class of rows multiplied
by each shift, and judged as the gate does (rmsnorm_suite.power); per candidate rule it prints the
false-alarm rate across rows and the power per class. ``--synthetic``: a stated noise model,
labelled SYNTHETIC, for testing the tool only. docs/gate.md shows the method and results.

    PYTHONPATH=src python tools/gate_power.py --aa outputs/aa-0 ... --factors 1.02 1.03 --rounds 6 10
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rmsnorm_suite import cases, power  # noqa: E402
from rmsnorm_suite.thresholds import load_thresholds  # noqa: E402

# The noise model of --synthetic: per-round SD of the log ratio (sigma) and of a run's offset
# (tau), per (kind, group). Stated here, not measured: rough readings of the A/A ranges in
# docs/gate.md (device ratios of one run within about +-0.3%, whole-call rows at the host-bound
# shapes moving by tens of percent), for exercising the tool only.
SIGMA = {
    ("device", "large"): 0.003, ("device", "medium"): 0.003, ("device", "small"): 0.005,
    ("whole", "large"): 0.004, ("whole", "medium"): 0.05, ("whole", "small"): 0.10,
    ("host", "large"): 0.10, ("host", "medium"): 0.10, ("host", "small"): 0.10,
}  # fmt: skip
TAU = {key: value / 3 for key, value in SIGMA.items()}


def all_rows() -> list[power.RowKey]:
    return [
        power.RowKey(kind, s.name, mode, s.group)
        for kind in power.KINDS
        for s in cases.BENCH_SHAPES
        for mode in cases.BENCH_MODES
    ]


def dataset(args) -> power.AASet:
    if args.synthetic:
        model = power.NoiseModel(SIGMA, TAU, rho=0.5)
        return power.synthetic_aa(all_rows(), model, args.synthetic_runs, args.synthetic_rounds, args.seed)
    if not args.aa:
        raise SystemExit("gate_power: give --aa PATH... (A/A pr-verdict outputs or records) or --synthetic")
    return power.load_aa(args.aa)


def render(aa: power.AASet, entries: list[dict], resolve: dict | None, args) -> str:
    label = f"**{aa.source}**" if aa.synthetic else aa.source
    rounds = ", ".join(str(x.shape[1]) for x in aa.d)
    lines = [
        f"data: {label}: {len(aa.d)} runs (rounds per run: {rounds}), {len(aa.rows)} latency rows; "
        f"{args.trials} trials per cell",
        "",
    ]
    keys = sorted({k for e in entries for k in e["power"]})
    head = (
        "| candidate | family-wise false alarm | "
        + " | ".join(f"power {k} (mean / min row)" for k in keys)
        + " |"
    )
    lines += [head, "|---" * (2 + len(keys)) + "|"]
    for e in entries:
        cells = [e["candidate"], f"{e['false_alarm']:.4f}"]
        cells += [
            f"{e['power'][k]['mean']:.3f} / {e['power'][k]['min']:.3f}" if k in e["power"] else "-"
            for k in keys
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if resolve:
        lines += [
            "",
            f"smallest shift flagged with 90% power at the table's factors ({args.resolve_rounds} rounds):",
            "",
        ]
        lines += [f"- {cls}: {f'x{v:g}' if v else 'none on the grid'}" for cls, v in resolve.items()]
    if aa.synthetic:
        lines += ["", f"{power.SYNTHETIC}: these figures test the tool, they justify no threshold."]
    elif len(aa.d) < 10:
        lines += [
            "",
            f"only {len(aa.d)} A/A runs: the run-to-run offset is poorly sampled (10 or more wanted).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--aa", nargs="*", default=[], metavar="PATH", help="A/A pr-verdict output folders or their records"
    )
    parser.add_argument(
        "--record",
        nargs=2,
        metavar=("FOLDER", "FILE"),
        default=None,
        help="write FOLDER's per-round medians to FILE (docs/data/aa/) and stop",
    )
    parser.add_argument("--about", default="", help="--record: where and how the run ran (one line)")
    parser.add_argument("--synthetic", action="store_true", help="a SYNTHETIC A/A set (noise model above)")
    parser.add_argument("--synthetic-runs", type=int, default=10)
    parser.add_argument("--synthetic-rounds", type=int, default=6)
    parser.add_argument("--thresholds", default=None, help="regression.toml (default: the suite's)")
    parser.add_argument("--factors", type=float, nargs="+", default=[1.03], help="device-row factors to try")
    parser.add_argument("--rounds", type=int, nargs="+", default=[6])
    parser.add_argument("--statistics", nargs="+", default=["bound"], choices=power.STATISTICS)
    parser.add_argument("--family", nargs="+", default=["holm"], choices=["holm", "none"])
    parser.add_argument("--rate", type=float, default=None, help="default: regression.toml [family] rate")
    parser.add_argument("--shifts", type=float, nargs="+", default=[1.03, 1.05])
    parser.add_argument("--classes", nargs="*", default=None, help="e.g. device/large/forward (default: all)")
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resolve", action="store_true", help="smallest shift with 90%% power per class")
    parser.add_argument("--resolve-rounds", type=int, default=6)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if args.record:
        folder, target = args.record
        record = power.record_aa(folder, about={"run": args.about} if args.about else None)
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(record, indent=0) + "\n", encoding="utf-8")
        print(f"{target}: {len(record['rows'])} rows")
        return 0
    thresholds = load_thresholds(args.thresholds)
    rate = args.rate if args.rate is not None else (thresholds.family.rate or 0.05)
    aa = dataset(args)
    candidates = [
        power.Candidate(f, r, s, fam, rate)
        for f in args.factors
        for r in args.rounds
        for s in args.statistics
        for fam in (args.family if s == "bound" else ["none"])
    ]
    entries = power.study(aa, thresholds, candidates, args.shifts, args.classes, args.trials, args.seed)
    resolve = None
    if args.resolve:
        grid = [1.01, 1.02, 1.03, 1.05, 1.08, 1.10, 1.15, 1.25, 1.5, 2.0, 3.0, 4.0]
        resolve = power.resolvable(
            aa, thresholds, args.resolve_rounds, grid, trials=max(200, args.trials // 4), rate=rate
        )
    print(render(aa, entries, resolve, args), end="")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"data": aa.source, "runs": aa.labels, "entries": entries, "resolvable": resolve}
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
