"""`check-environment`: versions, the device, and a tiny call of the op against the reference."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from rmsnorm_suite import cases, numerics
from rmsnorm_suite.config import Config
from rmsnorm_suite.console import (
    DeviceUnavailable,
    add_common_arguments,
    fmt,
    format_table,
    print_json,
    resolve_device,
    run_command,
    versions,
    write_json,
)


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
    x, w, dy = numerics.make_inputs(m, n, dtype, device=device)
    x.requires_grad_(True)
    w.requires_grad_(True)
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


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    add_common_arguments(parser, device=True)


def run(args: argparse.Namespace) -> int:
    return run_command(args, cmd_check_environment)
