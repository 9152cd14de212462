"""`exercise`: the wrong denominator (the padded block size instead of N) made observable."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from rmsnorm_suite import cases
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    add_common_arguments,
    fmt,
    format_table,
    print_json,
    resolve_device,
    run_command,
    write_json,
)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def padded_row_norm(x: torch.Tensor, eps: float, denominator: int) -> dict[str, torch.Tensor]:
    """RMSNorm forward of one row (weight 1) computed the way a one-row-per-program kernel does:
    the row is loaded into a BLOCK-wide buffer whose extra lanes are 0 (the masked load), the
    squares are summed in fp32, and the sum is divided by ``denominator`` (N is right; BLOCK is
    the exercise's bug). Only the first N lanes are returned (the masked store)."""
    n = x.numel()
    block = next_power_of_2(n)
    buf = torch.zeros(block, dtype=torch.float32, device=x.device)
    buf[:n] = x.reshape(-1).to(torch.float32)
    sum_sq = (buf * buf).sum()
    mean = sum_sq / denominator
    denom = torch.sqrt(mean + eps)
    r = torch.rsqrt(mean + eps)
    y = (buf * r)[:n]
    return {"sum_sq": sum_sq, "mean": mean, "denominator": denom, "r": r, "y": y}


def padded_row_dx(
    x: torch.Tensor, dy: torch.Tensor, r: torch.Tensor, denominator: int
) -> dict[str, torch.Tensor]:
    """dx of one row (weight 1) with the saved r: dx = r*u - x*r^3*sum(u*x)/denominator, summed
    over the zero-padded BLOCK-wide buffer. Dividing by BLOCK here is the backward's version of
    the bug, which a correct forward does not repair."""
    n = x.numel()
    block = next_power_of_2(n)
    xb = torch.zeros(block, dtype=torch.float32, device=x.device)
    ub = torch.zeros(block, dtype=torch.float32, device=x.device)
    xb[:n] = x.reshape(-1).to(torch.float32)
    ub[:n] = dy.reshape(-1).to(torch.float32)  # u = dy * weight, weight 1
    mean_ux = (ub * xb).sum() / denominator
    dx = (r * ub - xb * r * r * r * mean_ux)[:n]
    return {"mean_ux": mean_ux, "dx": dx}


def expected_row(n: int, value: float, eps: float, denominator: int) -> dict[str, float]:
    """The tutorial's arithmetic in float64 for a row of ``n`` copies of ``value``, weight 1, dy 1."""
    sum_sq = n * value * value
    mean = sum_sq / denominator
    r = 1.0 / math.sqrt(mean + eps)
    r_true = 1.0 / math.sqrt(sum_sq / n + eps)  # the backward reads the forward's (correct) r
    mean_ux = n * value / denominator  # u = 1, so sum(u * x) = n * value
    return {
        "sum_sq": sum_sq,
        "mean": mean,
        "denominator": math.sqrt(mean + eps),
        "y": value * r,
        "mean_ux": mean_ux,
        "dx": r_true - value * r_true**3 * mean_ux,
    }


def exercise_row(n: int, value: float, device: str) -> dict[str, Any]:
    """Expected (float64 arithmetic) and observed values for one width: the real kernel divides by
    N; the deliberately wrong computation divides by BLOCK, in the forward mean and, separately,
    in the backward's mean(u*x)."""
    from rmsnorm_kernel.ops import forward_op, rms_norm

    eps = cases.EPS
    block = next_power_of_2(n)
    x = torch.full((1, n), value, dtype=torch.float32, device=device)
    w = torch.ones(n, dtype=torch.float32, device=device)
    dy = torch.ones(1, n, dtype=torch.float32, device=device)

    # Correct side: the real kernel. Its saved r gives the denominator and mean it used.
    y_k, rstd_k, _ = forward_op(x, w, None, eps, 0.0, 0, torch.float32, torch.float32)
    xg = x.clone().requires_grad_(True)
    rms_norm(xg, weight=w, eps=eps).backward(dy)
    r_k = rstd_k.reshape(()).double().item()
    dx_k = xg.grad[0, 0].double().item()
    kernel = {
        "sum_sq": n * (1.0 / r_k**2 - eps),
        "mean": 1.0 / r_k**2 - eps,
        "denominator": 1.0 / r_k,
        "y": y_k[0, 0].double().item(),
        "mean_ux": (r_k * 1.0 - dx_k) / (value * r_k**3),  # solved from dx = r*u - x*r^3*mean(u*x)
        "dx": dx_k,
    }

    # Wrong side: the same computation with BLOCK as the denominator.
    fwd = padded_row_norm(x, eps, block)
    right_r = padded_row_norm(x, eps, n)["r"]
    bwd = padded_row_dx(x, dy, right_r, block)
    wrong = {
        "sum_sq": fwd["sum_sq"].item(),
        "mean": fwd["mean"].item(),
        "denominator": fwd["denominator"].item(),
        "y": fwd["y"][0].item(),
        "mean_ux": bwd["mean_ux"].item(),
        "dx": bwd["dx"][0].item(),
    }
    return {
        "n": n,
        "block": block,
        "value": value,
        "expected_n": expected_row(n, value, eps, n),
        "kernel": kernel,
        "expected_block": expected_row(n, value, eps, block),
        "wrong_block": wrong,
        "defect_visible": {
            "forward": abs(wrong["y"] - kernel["y"]) > cases.TOLERANCES[torch.float32].atol,
            "backward": abs(wrong["dx"] - kernel["dx"]) > cases.TOLERANCES[torch.float32].atol,
        },
    }


EXERCISE_QUANTITIES = (
    ("sum_sq", "sum of squares"),
    ("mean", "mean used"),
    ("denominator", "denominator sqrt(mean + eps)"),
    ("y", "output per coordinate"),
    ("mean_ux", "backward mean(u*x), dy = 1"),
    ("dx", "backward dx per coordinate, dy = 1"),
)


def exercise_table(row: dict[str, Any]) -> str:
    n, block = row["n"], row["block"]
    rows = [
        [
            label,
            fmt(row["expected_n"][k], 9),
            fmt(row["kernel"][k], 9),
            fmt(row["expected_block"][k], 9),
            fmt(row["wrong_block"][k], 9),
        ]
        for k, label in EXERCISE_QUANTITIES
    ]
    headers = [
        "quantity",
        f"expected (/{n})",
        "kernel (real, fp32)",
        f"expected (/{block})",
        f"wrong variant (/{block})",
    ]
    return format_table(headers, rows)


def cmd_exercise(args: argparse.Namespace, cfg: Config) -> int:
    device = resolve_device(args.device, args.command)
    value = cfg.exercise.value
    rows = [exercise_row(n, value, device) for n in cfg.exercise.widths]
    # The lesson holds when the kernel matches the N-arithmetic and the bug shows exactly where N != BLOCK.
    ok = True
    tol = cases.TOLERANCES[torch.float32]
    for row in rows:
        for key in ("y", "dx"):
            if abs(row["kernel"][key] - row["expected_n"][key]) > tol.atol + tol.rtol * abs(
                row["expected_n"][key]
            ):
                ok = False
        if row["defect_visible"]["forward"] != (row["n"] != row["block"]):
            ok = False
    result = {"command": "exercise", "device": device, "eps": cases.EPS, "passed": ok, "rows": rows}
    out = write_json(cfg.outputs / "exercise.json", result)
    if args.json:
        print_json(result)
        return 0 if ok else 1
    print("Exercise: the denominator is the row's N, never the block width BLOCK = next_power_of_2(N).")
    print(f"Weight 1, eps {cases.EPS:g}; the kernel column is the real kernel on {device}, the wrong column")
    print("divides the same zero-padded sums by BLOCK (forward mean; separately, the backward's mean).\n")
    for row in rows:
        print(f"row of {row['n']} values equal to {fmt(row['value'])} (BLOCK = {row['block']})")
        print(exercise_table(row))
        vis = row["defect_visible"]
        if row["n"] == row["block"]:
            print(
                f"N = BLOCK = {row['n']}: both divisions agree, so a test at this width cannot see the bug.\n"
            )
        else:
            print(
                f"N = {row['n']} < BLOCK = {row['block']}: the padded zeros are counted, the mean shrinks, "
                "the "
                f"output grows ({'visible' if vis['forward'] else 'NOT visible'}); a backward that divides "
                f"mean(u*x) by BLOCK gives a wrong dx even after the forward is fixed "
                f"({'visible' if vis['backward'] else 'NOT visible'}).\n"
            )
    print(f"{'PASS' if ok else 'FAIL'}: details in {out}")
    return 0 if ok else 1


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=True)


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_exercise)
