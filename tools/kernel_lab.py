"""Kernel lab: variants of the forward and backward kernels timed beside the production launch
path at the large shapes, in one run. Development only; results go to stdout and a JSON file.

Each variant is a production kernel with one idea toggled by a constexpr:
  EVICT     loads that stream (x, dy) marked evict_first, reused ones (w) evict_last
  KEEP_RAW  the row kept in its storage dtype and widened where used (fewer registers)
  W_RELOAD  backward: the weight reloaded per row block instead of held in registers
  L2_KEEP   looped forward: first walk evict_last, second walk evict_first
"""

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from rmsnorm_kernel import kernels, launch


@triton.jit
def fwd_tile_v(
    X,
    W,
    Y,
    RSTD,
    M,
    N,
    stride_x,
    eps,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVICT: tl.constexpr,
    KEEP_RAW: tl.constexpr,
    W_EARLY: tl.constexpr,
    EVEN: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)[:, None]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if EVEN:
        if EVICT:
            raw = tl.load(X + rows64 * stride_x + cols[None, :], eviction_policy="evict_first")
        else:
            raw = tl.load(X + rows64 * stride_x + cols[None, :])
    else:
        if EVICT:
            raw = tl.load(
                X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
            )
        else:
            raw = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if W_EARLY:
        if EVICT:
            w_raw = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        else:
            w_raw = tl.load(W + cols, mask=cols < N, other=0.0)
    x = raw.to(tl.float32)
    rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rows < M)
    if KEEP_RAW:
        x = raw.to(tl.float32)
    if not W_EARLY:
        if EVICT:
            w_raw = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        else:
            w_raw = tl.load(W + cols, mask=cols < N, other=0.0)
    y = x * rstd[:, None] * w_raw.to(tl.float32)[None, :]
    if EVEN:
        tl.store(Y + rows64 * N + cols[None, :], y.to(Y.dtype.element_ty))
    else:
        tl.store(Y + rows64 * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def fwd_loop_v(
    X,
    W,
    Y,
    RSTD,
    M,
    N,
    programs,
    stride_x,
    eps,
    BLOCK_N: tl.constexpr,
    L2_KEEP: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    for row in range(pid, M, programs):
        row64 = tl.cast(row, tl.int64)
        x_row = X + row64 * stride_x
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            if L2_KEEP:
                x = tl.load(x_row + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
            else:
                x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
            acc += x * x
        rstd = kernels._rsqrt_rn(tl.sum(acc, axis=0) / N + eps)
        tl.store(RSTD + row, rstd)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            if L2_KEEP:
                x = tl.load(x_row + c, mask=c < N, other=0.0, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
            tl.store(Y + row64 * N + c, (x * rstd * w).to(Y.dtype.element_ty), mask=c < N)


@triton.jit
def bwd_tile_v(
    X,
    W,
    DY,
    RSTD,
    DX,
    DW_PARTIAL,
    M,
    N,
    programs,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVICT: tl.constexpr,
    W_RELOAD: tl.constexpr,
    KEEP_RAW: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if not W_RELOAD:
        scale = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for first in range(pid * ROWS, M, programs * ROWS):
        rows = first + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        if EVICT:
            x_raw = tl.load(
                X + rows64 * N + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
            )
            dy_raw = tl.load(
                DY + rows64 * N + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
            )
        else:
            x_raw = tl.load(X + rows64 * N + cols[None, :], mask=mask, other=0.0)
            dy_raw = tl.load(DY + rows64 * N + cols[None, :], mask=mask, other=0.0)
        if W_RELOAD:
            scale = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xn = x_raw.to(tl.float32) * rstd[:, None]
        dy = dy_raw.to(tl.float32)
        u = dy * scale[None, :]
        c = tl.sum(u * xn, axis=1) / N
        if KEEP_RAW:
            xn = x_raw.to(tl.float32) * rstd[:, None]
            u = dy_raw.to(tl.float32) * scale[None, :]
        dx = (u - xn * c[:, None]) * rstd[:, None]
        tl.store(DX + rows64 * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if KEEP_RAW:
            dy = dy_raw.to(tl.float32)
        dw_acc += dy * xn
    dw_row = tl.sum(dw_acc, axis=0)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_row, mask=col_ok)


def median_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "kernel_lab.json"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy = 4 * a.numel() / (median_us(lambda: b.copy_(a)) * 1e-6) / 1e12
    a = b = None
    print(f"copy ceiling {copy:.3f} TB/s", flush=True)
    results = dict(copy_tbs=copy, rows=[])

    def record(kind, shape, name, us, nbytes):
        tbs = nbytes / (us * 1e-6) / 1e12
        results["rows"].append(dict(kind=kind, shape=shape, variant=name, us=us, frac=tbs / copy))
        print(f"{kind:4} {shape:>16} {name:<44} {us:8.1f} us {tbs / copy:6.1%}", flush=True)

    fwd_shapes = [
        (32768, 4096, torch.bfloat16),
        (16384, 8192, torch.bfloat16),
        (8192, 16384, torch.bfloat16),
        (65536, 1024, torch.bfloat16),
        (4096, 4096, torch.float32),
        (4096, 4096, torch.float16),
        (2048, 65536, torch.bfloat16),
    ]
    for m, n, dt in fwd_shapes:
        torch.manual_seed(0)
        shape = f"{m}x{n}-{str(dt)[6:]}"
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dt)
        y = torch.empty_like(x)
        rstd = torch.empty(m, device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        record(
            "fwd",
            shape,
            "production",
            median_us(lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt)),
            nbytes,
        )
        record("fwd", shape, "native", median_us(lambda: F.rms_norm(x, (n,), w, 1e-6)), nbytes)
        block = triton.next_power_of_2(n)
        if n <= 16384:
            base_warps = launch.forward_config(n)[2]
            knobs = [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]  # evict, raw, early
            for warps, rows, (evict, keep, early) in itertools.product(
                sorted({max(4, base_warps // 2), base_warps, min(32, base_warps * 2)}), [1, 2], knobs
            ):
                if rows * block > 16384 or (rows == 2 and n > 2048):
                    continue
                even = int(n == block and m % rows == 0)
                name = f"tile w{warps} r{rows} ev{evict} raw{keep} early{early}"
                try:
                    us = median_us(
                        lambda: fwd_tile_v[(triton.cdiv(m, rows),)](
                            x,
                            w,
                            y,
                            rstd,
                            m,
                            n,
                            n,
                            1e-6,
                            block,
                            rows,
                            evict,
                            keep,
                            early,
                            even,
                            num_warps=warps,
                        )
                    )
                except Exception as e:
                    print(name, "failed", type(e).__name__, str(e)[:100])
                    continue
                record("fwd", shape, name, us, nbytes)
        else:
            for warps in [16, 32]:
                for keep in [0, 1]:
                    name = f"tile w{warps} r1 ev1 raw{keep} early0"
                    try:
                        us = median_us(
                            lambda: fwd_tile_v[(m,)](
                                x, w, y, rstd, m, n, n, 1e-6, block, 1, 1, keep, 0, 1, num_warps=warps
                            )
                        )
                    except Exception as e:
                        print(name, "failed", type(e).__name__, str(e)[:100])
                        continue
                    record("fwd", shape, name, us, nbytes)
            for lb, lw, per_sm, keep in itertools.product([8192, 16384], [8, 16, 32], [1, 2], [0, 1]):
                programs = min(m, per_sm * sms)
                name = f"loop b{lb} w{lw} p{per_sm} l2keep{keep}"
                try:
                    us = median_us(
                        lambda: fwd_loop_v[(programs,)](
                            x, w, y, rstd, m, n, programs, n, 1e-6, lb, keep, num_warps=lw
                        )
                    )
                except Exception as e:
                    print(name, "failed", type(e).__name__, str(e)[:100])
                    continue
                record("fwd", shape, name, us, nbytes)
        x = w = y = None

    bwd_shapes = [(8192, 16384), (16384, 8192), (32768, 4096)]
    dt = torch.bfloat16
    for m, n in bwd_shapes:
        torch.manual_seed(0)
        shape = f"{m}x{n}-bfloat16"
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dt)
        dy = torch.randn_like(x)
        _, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt)
        dx = torch.empty_like(x)
        dw = torch.empty_like(w)
        nbytes = 3 * x.numel() * 2
        record(
            "bwd",
            shape,
            "production",
            median_us(lambda: launch.backward(dy, None, x, w, rstd, 0.0, 0, True, dt)),
            nbytes,
        )
        block = triton.next_power_of_2(n)
        for warps, per_sm, rows, evict, reload in itertools.product([8, 16, 32], [1, 2], [1], [0, 1], [0, 1]):
            keep = evict
            if warps * 32 * 2 > rows * block:
                continue
            programs = min(triton.cdiv(m, rows), per_sm * sms)
            partial = torch.empty(programs, n, device="cuda")
            grid, constexprs = launch._reduce_plan(n, programs)

            def run():
                bwd_tile_v[(programs,)](
                    x,
                    w,
                    dy,
                    rstd,
                    dx,
                    partial,
                    m,
                    n,
                    programs,
                    block,
                    rows,
                    evict,
                    reload,
                    keep,
                    num_warps=warps,
                )
                kernels.reduce_columns[grid](partial, dw, programs, n, *constexprs, num_warps=4)

            name = f"tile w{warps} p{per_sm} r{rows} ev{evict} reload{reload} raw{keep}"
            try:
                us = median_us(run)
            except Exception as e:
                print(name, "failed", type(e).__name__, str(e)[:100])
                continue
            record("bwd", shape, name, us, nbytes)
        x = w = dy = None

    best = {}
    for r in results["rows"]:
        key = (r["kind"], r["shape"])
        if r["variant"] not in ("production", "native") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\nbest variant per shape (against production):")
    for (kind, shape), r in best.items():
        prod = next(
            p
            for p in results["rows"]
            if p["kind"] == kind and p["shape"] == shape and p["variant"] == "production"
        )
        print(
            f"{kind:4} {shape:>16} {r['variant']:<44} {r['us']:8.1f} us {r['frac']:6.1%}  "
            f"production {prod['us']:8.1f} us {prod['frac']:6.1%}"
        )
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    main()
