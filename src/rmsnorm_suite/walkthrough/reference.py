"""`reference`: float64 gradcheck of the oracle and the synthetic data splits."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from rmsnorm_suite import cases, numerics
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    add_common_arguments,
    fmt,
    format_table,
    print_json,
    run_command,
    write_json,
)

GRADCHECK_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (3, 8), (4, 33), (2, 257))


def reference_checks(seed: int = 0) -> list[dict[str, Any]]:
    """float64 gradcheck of rms_norm_reference, and the explicit backward formula against
    autograd (torch.testing.assert_close's float64 defaults), on small irregular shapes."""
    from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference

    rows = []
    for m, n in GRADCHECK_SHAPES:
        x, w, dy = numerics.make_inputs(m, n, torch.float64, seed=seed)
        x.requires_grad_(True)
        w.requires_grad_(True)
        entry: dict[str, Any] = {"shape": [m, n]}
        try:
            entry["gradcheck"] = bool(
                torch.autograd.gradcheck(lambda a, b: rms_norm_reference(a, b, cases.EPS), (x, w))
            )
        except Exception as exc:
            entry["gradcheck"] = False
            entry["gradcheck_error"] = str(exc).splitlines()[0]
        y = rms_norm_reference(x, w, cases.EPS)
        ax, aw = torch.autograd.grad(y, (x, w), dy)
        with torch.no_grad():
            fx, fw = rms_norm_backward_reference(x, w, dy, cases.EPS)
        entry["formula_dx_max_abs_diff"] = (fx - ax).abs().max().item()
        entry["formula_dw_max_abs_diff"] = (fw - aw).abs().max().item()
        try:
            torch.testing.assert_close(fx, ax)
            torch.testing.assert_close(fw, aw)
            entry["formula_vs_autograd"] = True
        except AssertionError as exc:
            entry["formula_vs_autograd"] = False
            entry["formula_error"] = str(exc).splitlines()[0]
        entry["passed"] = entry["gradcheck"] and entry["formula_vs_autograd"]
        rows.append(entry)
    return rows


def cmd_reference(args: argparse.Namespace, cfg: Config) -> int:
    from rmsnorm_suite.training import make_splits, splits_digest

    checks = reference_checks(cfg.seeds.checks)
    splits = make_splits(cfg)
    data_dir = cfg.outputs / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    splits_file = data_dir / "splits.pt"
    torch.save({k: {"x": x, "y": y} for k, (x, y) in splits.items()}, splits_file)
    summary = {
        name: {"rows": x.shape[0], "features": x.shape[1], "y_mean": y.mean().item(), "y_std": y.std().item()}
        for name, (x, y) in splits.items()
    }
    passed = all(c["passed"] for c in checks)
    result = {
        "command": "reference",
        "passed": passed,
        "gradcheck": checks,
        "splits": {
            "file": str(splits_file),
            "seed": cfg.seeds.data,
            "digest": splits_digest(splits),
            "summary": summary,
        },
    }
    out = write_json(cfg.outputs / "reference.json", result)
    if args.json:
        print_json(result)
    else:
        print("float64 gradcheck of rms_norm_reference, and the explicit backward formula against autograd")
        rows = [
            [
                f"{c['shape'][0]}x{c['shape'][1]}",
                "pass" if c["gradcheck"] else "FAIL",
                fmt(c["formula_dx_max_abs_diff"], 3),
                fmt(c["formula_dw_max_abs_diff"], 3),
                "pass" if c["formula_vs_autograd"] else "FAIL",
            ]
            for c in checks
        ]
        print(
            format_table(
                ["shape", "gradcheck", "formula dx diff", "formula dw diff", "formula = autograd"], rows
            )
        )
        print(f"\nsynthetic splits (seed {cfg.seeds.data}) written to {splits_file}")
        print(
            format_table(
                ["split", "rows", "features", "y mean", "y std"],
                [
                    [k, s["rows"], s["features"], fmt(s["y_mean"], 4), fmt(s["y_std"], 4)]
                    for k, s in summary.items()
                ],
            )
        )
        print(f"\n{'PASS' if passed else 'FAIL'}: details in {out}")
    return 0 if passed else 1


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=False)


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_reference)
