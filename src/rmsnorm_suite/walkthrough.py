"""The tutorial's walkthrough as commands: check-environment, reference, check-forward, check-backward,
check-gamma, exercise, figures, check-checkpoints and clean.

Every command takes ``--config`` (default: the shipped ``minimum`` config) and writes its details as JSON
under the config's ``output_dir`` (``outputs/``). Commands that run the kernels take ``--device``:
``auto`` picks CUDA when torch sees a device, else the CPU under the Triton interpreter when
``TRITON_INTERPRET=1`` was set, else stops with an explanation.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from rmsnorm_suite import cases
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    DeviceUnavailable,
    add_common_arguments,
    fail,
    fmt,
    format_table,
    load,
    print_json,
    resolve_device,
    say,
    versions,
    write_json,
)

# ---------------------------------------------------------------------------------------------
# check-environment
# ---------------------------------------------------------------------------------------------


def environment_check(device_request: str = "auto") -> dict[str, Any]:
    """Versions, the device, and one forward+backward of the real kernels checked against the
    reference. ``result["passed"]`` is the verdict and ``result["diagnosis"]`` says what is off."""
    info = versions()
    result: dict[str, Any] = {
        "command": "check-environment",
        "versions": info,
        "passed": False,
        "diagnosis": [],
    }
    diag = result["diagnosis"]
    if info["triton"] is None:
        diag.append(
            f"triton is not importable ({info['triton_error']}). Install it with the project: "
            "`pip install -e .` (triton wheels exist for Linux x86_64 and aarch64)."
        )
        return result
    try:
        import rmsnorm_kernel
        from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference
    except Exception as exc:
        diag.append(f"rmsnorm_kernel does not import: {type(exc).__name__}: {exc}")
        return result
    try:
        device = resolve_device(device_request, "check-environment")
    except DeviceUnavailable as exc:
        diag.append(str(exc))
        return result
    result["device"] = device
    result["interpreter"] = device == "cpu"

    # One real kernel run: an irregular width (mask and true-N denominator), fp32.
    m, n, dtype = 17, 257, torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g).to(device).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(device).requires_grad_(True)
    dy = torch.randn(m, n, generator=g).to(device)
    rmsnorm_kernel.reset_counters()
    try:
        y = rmsnorm_kernel.rms_norm(x, weight=w, eps=cases.EPS)
        y.backward(dy)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as exc:
        diag.append(f"the kernel failed on {device}: {type(exc).__name__}: {exc}")
        return result
    tol = cases.TOLERANCES[dtype]
    with torch.no_grad():
        ref_y = rms_norm_reference(x, w, cases.EPS)
        ref_dx, ref_dw = rms_norm_backward_reference(x, w, dy, cases.EPS)
    kernel_run = {"shape": [m, n], "dtype": cases.dtype_name(dtype), "atol": tol.atol, "rtol": tol.rtol}
    ok = True
    for name, got, ref in (("y", y.detach(), ref_y), ("dx", x.grad, ref_dx), ("dw", w.grad, ref_dw)):
        err = (got.double() - ref.double()).abs()
        good = bool(torch.all(err <= tol.atol + tol.rtol * ref.double().abs()).item())
        kernel_run[name] = {"max_abs_err": err.max().item(), "passed": good}
        if not good:
            ok = False
            diag.append(
                f"{name} differs from the reference beyond atol={tol.atol}, rtol={tol.rtol} on {device}"
            )
    calls = dict(rmsnorm_kernel.CALLS)
    kernel_run["calls"] = calls
    if calls.get("forward") != 1 or calls.get("backward") != 1 or calls.get("fallback", 0) != 0:
        ok = False
        diag.append(
            f"the kernel path was not taken as expected: CALLS = {calls} (want 1 forward, 1 backward)"
        )
    result["kernel_run"] = kernel_run
    result["passed"] = ok
    return result


def cmd_check_environment(args: argparse.Namespace, cfg: Config) -> int:
    result = environment_check(args.device)
    out = write_json(cfg.outputs / "environment.json", result)
    if args.json:
        print_json(result)
        return 0 if result["passed"] else 1
    v = result["versions"]
    rows = [
        ["python", v["python"]],
        ["torch", f"{v['torch']} (CUDA build: {v['torch_cuda'] or 'none'})"],
        ["triton", v["triton"] or "NOT IMPORTABLE"],
        ["CUDA available", v["cuda_available"]],
        ["TRITON_INTERPRET", v["TRITON_INTERPRET"] or "unset"],
    ]
    if "device_name" in v:
        rows.append(
            ["device", f"{v['device_name']} (sm {v['device_capability']}, {v['device_memory_gib']} GiB)"]
        )
    if "device" in result:
        rows.append(["kernels run on", "cuda" if result["device"] == "cuda" else "cpu (Triton interpreter)"])
    print(format_table(["item", "value"], rows))
    if "kernel_run" in result:
        k = result["kernel_run"]
        print()
        print(f"one real kernel run: {k['shape'][0]}x{k['shape'][1]} {k['dtype']}, forward and backward")
        print(
            format_table(
                ["output", "max abs err", "atol / rtol", "pass"],
                [
                    [n, fmt(k[n]["max_abs_err"], 3), f"{k['atol']:g} / {k['rtol']:g}", k[n]["passed"]]
                    for n in ("y", "dx", "dw")
                ],
            )
        )
    for line in result["diagnosis"]:
        print(f"\nDIAGNOSIS: {line}")
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}: details in {out}")
    return 0 if result["passed"] else 1


# ---------------------------------------------------------------------------------------------
# reference: float64 gradcheck of the oracle and the synthetic splits
# ---------------------------------------------------------------------------------------------

GRADCHECK_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (3, 8), (4, 33), (2, 257))


def reference_checks(seed: int = 0) -> list[dict[str, Any]]:
    """float64 gradcheck of rms_norm_reference, and the explicit backward formula against
    autograd (torch.testing.assert_close's float64 defaults), on small irregular shapes."""
    from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference

    g = torch.Generator().manual_seed(seed)
    rows = []
    for m, n in GRADCHECK_SHAPES:
        x = torch.randn(m, n, generator=g, dtype=torch.float64, requires_grad=True)
        w = (1 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_(True)
        dy = torch.randn(m, n, generator=g, dtype=torch.float64)
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


# ---------------------------------------------------------------------------------------------
# check-forward / check-backward / check-gamma
# ---------------------------------------------------------------------------------------------

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


def _num(value: Any) -> float:
    return float(value)  # CaseResult.to_dict() writes non-finite floats as "nan" / "inf"


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
                "max_abs": max(_num(r["max_abs"]) for r in rows),
                "max_rel": max(_num(r["max_rel"]) for r in rows),
                "atol": rows[0]["atol"],
                "rtol": rows[0]["rtol"],
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
            "pass" if not s["failed"] else f"FAIL ({s['failed']})",
        ]
        for s in grid_summary(records)
    ]
    total_failed = sum(not r["passed"] for r in records)
    rows.append(["all", len(records), "", "", "", "pass" if not total_failed else f"FAIL ({total_failed})"])
    return format_table(["dtype", "cases", "max abs err", "max rel err", "tolerance", "pass"], rows)


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


# ---------------------------------------------------------------------------------------------
# exercise: the wrong denominator made observable
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------


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

    sources = [(k, outputs / f"check-{k}.json") for k in ("forward", "backward", "gamma")]
    present = [(k, json.loads(p.read_text())) for k, p in sources if p.is_file()]
    if not present:
        return (
            "skipped error distributions: no outputs/check-*.json yet "
            "(run check-forward, check-backward, check-gamma)"
        )
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 4), squeeze=False)
    names = [cases.dtype_name(d) for d in cases.DTYPES]
    for ax, (kind, data) in zip(axes[0], present):
        for i, name in enumerate(names):
            rows = [c for c in data["cases"] if c["dtype"] == name]
            if not rows:
                continue
            errs = [min(max(_num(c["max_abs"]), 1e-12), 1e3) for c in rows]
            xs = [i + 0.25 * ((j % 9) - 4) / 4 for j in range(len(errs))]
            colors = ["tab:blue" if c["passed"] else "tab:red" for c in rows]
            ax.scatter(xs, errs, s=12, c=colors, alpha=0.8)
            ax.hlines(rows[0]["atol"], i - 0.4, i + 0.4, colors="k", linestyles="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xticks(range(len(names)), names)
        ax.set_title(f"{GRID_TITLES[kind]} ({data['device']})")
        ax.set_ylabel("max abs error per case (dashed: atol; exact: 1e-12)")
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return f"wrote {target}"


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


# ---------------------------------------------------------------------------------------------
# check-checkpoints
# ---------------------------------------------------------------------------------------------


def checkpoint_checks(cfg: Config, device_request: str = "auto") -> dict[str, Any]:
    """Reload every checkpoint train-integration saved; each must reproduce its recorded parameter
    digest and its recorded test predictions exactly (zero difference)."""
    from rmsnorm_suite.training import (
        CHECKPOINT_DIR,
        RESULT_JSON,
        load_checkpoint,
        make_splits,
        splits_digest,
        state_digest,
    )

    folder = cfg.artifacts / CHECKPOINT_DIR
    files = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    result: dict[str, Any] = {
        "command": "check-checkpoints",
        "folder": str(folder),
        "checkpoints": [],
        "passed": False,
    }
    if not files:
        result["error"] = f"no checkpoints in {folder}/ (run train-integration first)"
        return result
    record = {}
    log = cfg.outputs / RESULT_JSON
    if log.is_file():
        record = {Path(v["file"]).name: v for v in json.loads(log.read_text())["checkpoints"].values()}
    splits = make_splits(cfg)
    digest = splits_digest(splits)
    test_x = splits["test"][0]
    try:
        kernel_device, device_error = resolve_device(device_request, "check-checkpoints"), None
    except DeviceUnavailable as exc:
        kernel_device, device_error = None, str(exc)
        result["device_error"] = device_error
    ok = True
    for file in files:
        entry: dict[str, Any] = {"file": str(file)}
        result["checkpoints"].append(entry)
        try:
            payload = torch.load(file, map_location="cpu", weights_only=True)
            meta = payload["meta"]
            entry.update(path=meta["path"], step=payload["step"], written_on=meta["device"])
            if meta.get("splits_digest") != digest:
                raise ValueError(
                    f"trained on other data than {cfg.source} describes (data section or seeds differ)"
                )
            if meta["path"] == "kernel":
                if kernel_device is None:
                    raise DeviceUnavailable(
                        "the kernel path needs CUDA or the Triton interpreter (see below)"
                    )
                device = kernel_device
            else:  # the reference path runs anywhere; reproduce it where it was written
                device = "cuda" if meta["device"] == "cuda" and torch.cuda.is_available() else "cpu"
            if meta["device"] != device:
                raise DeviceUnavailable(
                    f"written on {meta['device']}; its outputs are reproduced bitwise only there, "
                    f"and this machine runs it on {device}"
                )
            run, payload = load_checkpoint(file, device)
            run.model.eval()
            with torch.no_grad():
                out = run.model(test_x.to(device)).cpu()
            entry.update(
                device=device,
                digest_matches_checkpoint=state_digest(run.model) == payload["digest"],
                max_abs_output_diff=(out - payload["test_predictions"]).abs().max().item(),
            )
            if file.name in record and "digest" in record[file.name]:
                entry["digest_matches_training_log"] = record[file.name]["digest"] == payload["digest"]
            entry["passed"] = (
                entry["digest_matches_checkpoint"]
                and entry["max_abs_output_diff"] == 0.0
                and entry.get("digest_matches_training_log", True)
            )
        except (DeviceUnavailable, KeyError, RuntimeError, ValueError) as exc:
            entry["passed"] = False
            entry["error"] = (
                str(exc)
                if isinstance(exc, DeviceUnavailable | ValueError)
                else f"{type(exc).__name__}: {exc}"
            )
        ok = ok and entry["passed"]
    result["passed"] = ok
    return result


def cmd_check_checkpoints(args: argparse.Namespace, cfg: Config) -> int:
    result = checkpoint_checks(cfg, args.device)
    out = write_json(cfg.outputs / "check-checkpoints.json", result)
    if args.json:
        print_json(result)
        return 0 if result["passed"] else 1
    if "error" in result:
        return fail(result["error"], 1)
    rows = []
    for e in result["checkpoints"]:
        if "error" in e:
            rows.append(
                [
                    Path(e["file"]).name,
                    e.get("path", "-"),
                    e.get("step", "-"),
                    "-",
                    "-",
                    f"FAIL: {e['error']}",
                ]
            )
            continue
        rows.append(
            [
                Path(e["file"]).name,
                e["path"],
                e["step"],
                "same"
                if e["digest_matches_checkpoint"] and e.get("digest_matches_training_log", True)
                else "DIFFERENT",
                fmt(e["max_abs_output_diff"]),
                "pass" if e["passed"] else "FAIL",
            ]
        )
    print(format_table(["checkpoint", "path", "step", "parameters", "max |output diff|", "status"], rows))
    if result.get("device_error") and any("error" in e for e in result["checkpoints"]):
        print(f"\nDIAGNOSIS: {result['device_error']}")
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}: details in {out}")
    return 0 if result["passed"] else 1


# ---------------------------------------------------------------------------------------------
# clean
# ---------------------------------------------------------------------------------------------


def generated_paths(cfg: Config) -> list[Path]:
    """What `clean --scope generated` removes: the config's output and artifact folders, and only
    those (config.py already refuses absolute paths, '..' and the project root itself)."""
    return [cfg.outputs, cfg.artifacts]


def plan_clean(cfg: Config) -> list[dict[str, Any]]:
    plan = []
    for root in generated_paths(cfg):
        if root.is_symlink():
            plan.append({"path": str(root), "kind": "symlink", "files": 0, "bytes": 0})
        elif root.is_dir():
            files = [p for p in root.rglob("*") if p.is_file() or p.is_symlink()]
            size = sum(p.lstat().st_size for p in files)
            plan.append(
                {
                    "path": str(root),
                    "kind": "folder",
                    "files": len(files),
                    "bytes": size,
                    "list": [str(p) for p in sorted(files)],
                }
            )
        elif root.exists():
            plan.append({"path": str(root), "kind": "not a folder: left alone", "files": 0, "bytes": 0})
    return plan


def cmd_clean(args: argparse.Namespace, cfg: Config) -> int:
    plan = plan_clean(cfg)
    deleted = []
    if not args.dry_run:
        for entry in plan:
            path = Path(entry["path"])
            if entry["kind"] == "symlink":
                path.unlink()  # the link only, never what it points to
            elif entry["kind"] == "folder":
                shutil.rmtree(path)
            else:
                continue
            deleted.append(entry["path"])
    result = {
        "command": "clean",
        "scope": args.scope,
        "dry_run": args.dry_run,
        "plan": plan,
        "deleted": deleted,
    }
    if args.json:
        print_json(result)
        return 0
    if not plan:
        print("nothing to clean: " + ", ".join(f"{p}/" for p in generated_paths(cfg)) + " do not exist")
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for entry in plan:
        if entry["kind"] == "folder":
            print(f"{verb} {entry['path']}/ ({entry['files']} files, {entry['bytes'] / 1024:.1f} KiB)")
            for f in entry["list"][:50]:
                print(f"    {f}")
            if len(entry["list"]) > 50:
                print(f"    ... and {len(entry['list']) - 50} more")
        elif entry["kind"] == "symlink":
            print(f"{verb} the symlink {entry['path']} (not its target)")
        else:
            print(f"left alone {entry['path']}: {entry['kind']}")
    if args.dry_run:
        print("dry run: nothing was deleted; run without --dry-run to delete the files listed")
    return 0


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

NEEDS_DEVICE = {
    "check-environment",
    "check-forward",
    "check-backward",
    "check-gamma",
    "exercise",
    "check-checkpoints",
}

HANDLERS = {
    "check-environment": cmd_check_environment,
    "reference": cmd_reference,
    "check-forward": cmd_check_grid,
    "check-backward": cmd_check_grid,
    "check-gamma": cmd_check_grid,
    "exercise": cmd_exercise,
    "figures": cmd_figures,
    "check-checkpoints": cmd_check_checkpoints,
    "clean": cmd_clean,
}


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    if command not in HANDLERS:
        raise ValueError(f"command must be one of {sorted(HANDLERS)}, got {command!r}")
    add_common_arguments(parser, json_flag=True, device=command in NEEDS_DEVICE)
    if command == "clean":
        parser.add_argument(
            "--scope",
            choices=("generated",),
            required=True,
            help="generated: the output and artifact folders of the config (outputs/, artifacts/)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="list what would be deleted; delete nothing"
        )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load(args)
        return HANDLERS[args.command](args, cfg)
    except (ValueError, DeviceUnavailable) as exc:
        return fail(str(exc))
