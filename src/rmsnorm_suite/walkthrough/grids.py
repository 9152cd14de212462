"""`check-forward`, `check-backward`, `check-gamma`: the case grid of y, dx or dw against the reference."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from rmsnorm_suite import cases
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    add_common_arguments,
    fail,
    fmt,
    format_table,
    print_json,
    resolve_device,
    run_command,
    say,
    write_json,
)

GRID_KINDS = {"check-forward": "forward", "check-backward": "backward", "check-gamma": "gamma"}
GRID_TITLES = {"forward": "forward (y)", "backward": "input gradient (dx)", "gamma": "weight gradient (dw)"}


def run_case_grid(kind: str, cfg: Config, device: str) -> list[dict[str, Any]]:
    """Run one grid (forward, backward or gamma) of the config on ``device`` with the suite's
    check functions and the config's tolerances (declared, or tighter); one JSON record per case."""
    from rmsnorm_suite import checks

    results = checks.run_grid(
        kind,
        checks.kernel_impl,
        cfg.checks.grid_cases(device),
        device,
        seed=cfg.seeds.checks,
        tolerances=cfg.checks.tolerances,
        progress=True,
    )
    return [r.to_dict() for r in results]


def recorded_float(value: Any) -> float:
    return float(value)  # CaseResult.to_dict() writes non-finite floats as "nan" / "inf"


def oracle_fraction(record: dict[str, Any]) -> float:
    """The case's relative L2 error against the float64 oracle as a share of its limit (<= 1 passes)."""
    limit = recorded_float(record.get("oracle_limit", "nan"))
    return recorded_float(record["oracle_error"]) / limit if limit > 0 else math.nan


def _worst(values) -> float:
    finite = [v for v in (recorded_float(x) for x in values if x is not None) if not math.isnan(v)]
    return max(finite) if finite else math.nan


def grid_summary(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per dtype and a total: cases, worst errors, tolerance, failures."""
    out = []
    for name in [cases.dtype_name(d) for d in cases.DTYPES]:
        rows = [r for r in records if r["dtype"] == name]
        if not rows:
            continue
        out.append(
            {
                "dtype": name,
                "cases": len(rows),
                "max_abs": max(recorded_float(r["max_abs"]) for r in rows),
                "max_rel": max(recorded_float(r["max_rel"]) for r in rows),
                "atol": rows[0]["atol"],
                "rtol": rows[0]["rtol"],
                "bound_fraction": _worst(r.get("bound_fraction") for r in rows),
                "oracle_fraction": _worst(oracle_fraction(r) for r in rows),
                "failed": sum(not r["passed"] for r in rows),
            }
        )
    return out


def grid_table(records: list[dict[str, Any]]) -> str:
    rows = [
        [
            s["dtype"],
            s["cases"],
            fmt(s["max_abs"], 3),
            fmt(s["max_rel"], 3),
            f"atol {s['atol']:g}, rtol {s['rtol']:g}",
            _share(s["bound_fraction"]),
            _share(s["oracle_fraction"]),
            "pass" if not s["failed"] else f"FAIL ({s['failed']})",
        ]
        for s in grid_summary(records)
    ]
    total_failed = sum(not r["passed"] for r in records)
    verdict = "pass" if not total_failed else f"FAIL ({total_failed})"
    rows.append(["all", len(records), "", "", "", "", "", verdict])
    headers = ["dtype", "cases", "max abs err", "max rel", "tolerance", "of bound", "of oracle limit", "pass"]
    from rmsnorm_suite.checkreport import CRITERION

    return format_table(headers, rows) + "\n\n" + CRITERION


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


def cmd_check_grid(args: argparse.Namespace, cfg: Config) -> int:
    kind = GRID_KINDS[args.command]
    device = resolve_device(args.device, args.command)
    grid = cfg.checks.grid_cases(device)
    if not grid:
        return fail(f"{cfg.source}: the case grid is empty (checks.grid / checks.dtypes select nothing)")
    say(args, f"{args.command}: {GRID_TITLES[kind]} on {device}, {len(grid)} cases, against the reference")
    t0 = time.perf_counter()
    records = run_case_grid(kind, cfg, device)
    failed = [r for r in records if not r["passed"]]
    result = {
        "command": args.command,
        "kind": kind,
        "device": device,
        "config": cfg.source,
        "passed": not failed and bool(records),
        "summary": grid_summary(records),
        "cases": records,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    out = write_json(cfg.outputs / f"{args.command}.json", result)
    if args.json:
        print_json(result)
    else:
        print(grid_table(records))
        for r in failed[:20]:
            print(f"  FAIL {r['m']}x{r['n']} {r['dtype']}: {r['reason']}")
        print(
            f"\n{'PASS' if result['passed'] else 'FAIL'}: {len(records) - len(failed)}/{len(records)} cases; "
            f"details in {out}"
        )
    return 0 if result["passed"] else 1


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=True)


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_check_grid)
