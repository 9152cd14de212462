"""`reference`: float64 gradcheck of the oracle and the synthetic data splits."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from rmsnorm_suite import cases
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    add_common_arguments,
    fmt,
    format_table,
    print_json,
    run_command,
    write_json,
)

# Small irregular shapes, a 3-D one among them; each without and with Gemma's weight offset.
GRADCHECK_SHAPES: tuple[tuple[int, ...], ...] = (
    (1, 1),
    (3, 7),
    (3, 8),
    (4, 33),
    (2, 257),
    (17, 257),
    (2, 3, 5),
)
GRADCHECK_OFFSETS: tuple[float, ...] = (0.0, 1.0)
FORMULA_TOLERANCE = 1e-12  # rtol and atol: in float64 the formula and autograd differ by rounding only


def reference_check(shape: tuple[int, ...], offset: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """float64 gradcheck of rms_norm_reference at one shape and offset, and its explicit backward
    formula against autograd. x, weight and dy ~ N(0, 1): a weight of either sign, not near 1."""
    from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference

    g = torch.Generator().manual_seed(seed)
    x, w, dy = (torch.randn(*s, dtype=torch.float64, generator=g) for s in (shape, shape[-1:], shape))
    x.requires_grad_(True)
    w.requires_grad_(True)
    entry: dict[str, Any] = {"shape": list(shape), "offset": offset}
    try:
        entry["gradcheck"] = bool(
            torch.autograd.gradcheck(lambda a, b: rms_norm_reference(a, b, cases.EPS, offset=offset), (x, w))
        )
    except Exception as exc:
        entry["gradcheck"] = False
        entry["gradcheck_error"] = str(exc).splitlines()[0]
    y = rms_norm_reference(x, w, cases.EPS, offset=offset)
    ax, aw = torch.autograd.grad(y, (x, w), dy)
    with torch.no_grad():
        fx, fw = rms_norm_backward_reference(x, w, dy, cases.EPS, offset=offset)
    entry["formula_dx_max_abs_diff"] = (fx - ax).abs().max().item()
    entry["formula_dw_max_abs_diff"] = (fw - aw).abs().max().item()
    try:
        torch.testing.assert_close(fx, ax, rtol=FORMULA_TOLERANCE, atol=FORMULA_TOLERANCE)
        torch.testing.assert_close(fw, aw, rtol=FORMULA_TOLERANCE, atol=FORMULA_TOLERANCE)
        entry["formula_vs_autograd"] = True
    except AssertionError as exc:
        entry["formula_vs_autograd"] = False
        entry["formula_error"] = str(exc).splitlines()[0]
    entry["passed"] = entry["gradcheck"] and entry["formula_vs_autograd"]
    return entry


def reference_checks(seed: int = 0) -> list[dict[str, Any]]:
    """:func:`reference_check` at every shape and offset: the `reference` command and the verdict
    report these rows, tests/op/test_contract.py asserts on them."""
    return [reference_check(s, offset, seed) for s in GRADCHECK_SHAPES for offset in GRADCHECK_OFFSETS]


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
                "x".join(map(str, c["shape"])),
                fmt(c["offset"], 1),
                "pass" if c["gradcheck"] else "FAIL",
                fmt(c["formula_dx_max_abs_diff"], 3),
                fmt(c["formula_dw_max_abs_diff"], 3),
                "pass" if c["formula_vs_autograd"] else "FAIL",
            ]
            for c in checks
        ]
        print(
            format_table(
                ["shape", "offset", "gradcheck", "formula dx diff", "formula dw diff", "formula = autograd"],
                rows,
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
