"""Kernel lab, round 2: a software-pipelined persistent forward and a two-walk backward for wide
tile rows, beside production and torch.compile. Development only."""

import itertools
import json
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from rmsnorm_kernel import kernels, launch
from rmsnorm_kernel.reference import rms_norm_reference


@triton.jit
def fwd_persist_v(
    X, W, Y, RSTD, M, N, programs, eps, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if PREFETCH:
        nxt = tl.load(X + tl.cast(pid, tl.int64) * N + cols, mask=(cols < N) & (pid < M), other=0.0)
        for row in range(pid, M, programs):
            raw = nxt
            following = row + programs
            nxt = tl.load(
                X + tl.cast(following, tl.int64) * N + cols, mask=(cols < N) & (following < M), other=0.0
            )
            x = raw.to(tl.float32)
            rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=0) / N + eps)
            tl.store(RSTD + row, rstd)
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(
                Y + tl.cast(row, tl.int64) * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=cols < N
            )
    else:
        for row in tl.range(pid, M, programs, num_stages=STAGES):
            x = tl.load(X + tl.cast(row, tl.int64) * N + cols, mask=cols < N, other=0.0).to(tl.float32)
            rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=0) / N + eps)
            tl.store(RSTD + row, rstd)
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(
                Y + tl.cast(row, tl.int64) * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=cols < N
            )


@triton.jit
def _dx_chunk(X, W, DY, DX, row64, start, N, rstd, cdot, CHUNK: tl.constexpr):
    c = start + tl.arange(0, CHUNK)
    x = tl.load(X + row64 * N + c, mask=c < N, other=0.0, eviction_policy="evict_first").to(tl.float32)
    dy = tl.load(DY + row64 * N + c, mask=c < N, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    xn = x * rstd
    tl.store(DX + row64 * N + c, ((dy * w - xn * cdot) * rstd).to(DX.dtype.element_ty), mask=c < N)
    return dy * xn


@triton.jit
def bwd_chunked_v(
    X,
    W,
    DY,
    RSTD,
    DX,
    DW_PARTIAL,
    M,
    N,
    programs,
    CHUNK: tl.constexpr,
    CHUNKS: tl.constexpr,
    KEEP: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    acc0 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc1 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc2 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc3 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc4 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc5 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc6 = tl.zeros((CHUNK,), dtype=tl.float32)
    acc7 = tl.zeros((CHUNK,), dtype=tl.float32)
    for row in range(pid, M, programs):
        row64 = tl.cast(row, tl.int64)
        rstd = tl.load(RSTD + row)
        dot = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in range(0, N, CHUNK):
            c = start + cols
            if KEEP:
                x = tl.load(X + row64 * N + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(
                    tl.float32
                )
                dy = tl.load(DY + row64 * N + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(
                    tl.float32
                )
            else:
                x = tl.load(X + row64 * N + c, mask=c < N, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * N + c, mask=c < N, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
            dot += dy * w * x
        cdot = tl.sum(dot, axis=0) * rstd / N
        acc0 += _dx_chunk(X, W, DY, DX, row64, 0, N, rstd, cdot, CHUNK)
        if CHUNKS > 1:
            acc1 += _dx_chunk(X, W, DY, DX, row64, CHUNK, N, rstd, cdot, CHUNK)
        if CHUNKS > 2:
            acc2 += _dx_chunk(X, W, DY, DX, row64, 2 * CHUNK, N, rstd, cdot, CHUNK)
        if CHUNKS > 3:
            acc3 += _dx_chunk(X, W, DY, DX, row64, 3 * CHUNK, N, rstd, cdot, CHUNK)
        if CHUNKS > 4:
            acc4 += _dx_chunk(X, W, DY, DX, row64, 4 * CHUNK, N, rstd, cdot, CHUNK)
            acc5 += _dx_chunk(X, W, DY, DX, row64, 5 * CHUNK, N, rstd, cdot, CHUNK)
            acc6 += _dx_chunk(X, W, DY, DX, row64, 6 * CHUNK, N, rstd, cdot, CHUNK)
            acc7 += _dx_chunk(X, W, DY, DX, row64, 7 * CHUNK, N, rstd, cdot, CHUNK)
    base = DW_PARTIAL + pid.to(tl.int64) * N + cols
    tl.store(base, acc0, mask=cols < N)
    if CHUNKS > 1:
        tl.store(base + CHUNK, acc1, mask=CHUNK + cols < N)
    if CHUNKS > 2:
        tl.store(base + 2 * CHUNK, acc2, mask=2 * CHUNK + cols < N)
    if CHUNKS > 3:
        tl.store(base + 3 * CHUNK, acc3, mask=3 * CHUNK + cols < N)
    if CHUNKS > 4:
        tl.store(base + 4 * CHUNK, acc4, mask=4 * CHUNK + cols < N)
        tl.store(base + 5 * CHUNK, acc5, mask=5 * CHUNK + cols < N)
        tl.store(base + 6 * CHUNK, acc6, mask=6 * CHUNK + cols < N)
        tl.store(base + 7 * CHUNK, acc7, mask=7 * CHUNK + cols < N)


def median_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "kernel_lab2.json"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy = 4 * a.numel() / (median_us(lambda: b.copy_(a)) * 1e-6) / 1e12
    a = b = None
    print(f"copy ceiling {copy:.3f} TB/s", flush=True)
    rows_out = []

    def record(kind, shape, name, fn, nbytes):
        try:
            us = median_us(fn)
        except Exception as e:
            print(kind, shape, name, "failed", type(e).__name__, str(e)[:120], flush=True)
            return
        frac = nbytes / (us * 1e-6) / 1e12 / copy
        rows_out.append(dict(kind=kind, shape=shape, variant=name, us=us, frac=frac))
        print(f"{kind:4} {shape:>16} {name:<40} {us:8.1f} us {frac:6.1%}", flush=True)

    dt = torch.bfloat16
    for m, n in [(32768, 4096), (16384, 8192), (8192, 16384), (65536, 1024)]:
        torch.manual_seed(0)
        shape = f"{m}x{n}"
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dt)
        y = torch.empty_like(x)
        rstd = torch.empty(m, device="cuda")
        nbytes = 2 * x.numel() * 2
        record("fwd", shape, "production", lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt), nbytes)
        comp = torch.compile(lambda a, b: rms_norm_reference(a, b, 1e-6), dynamic=False)
        record("fwd", shape, "compiled", lambda: comp(x, w), nbytes)
        block = triton.next_power_of_2(n)
        base_warps = launch.forward_config(n)[2]
        for warps, per_sm, (prefetch, stages) in itertools.product(
            sorted({max(2, base_warps // 2), base_warps, min(32, base_warps * 2)}),
            [1, 2, 4, 8],
            [(1, 1), (0, 1), (0, 2), (0, 3)],
        ):
            programs = min(m, per_sm * sms)
            record(
                "fwd",
                shape,
                f"persist w{warps} p{per_sm} pf{prefetch} st{stages}",
                lambda: fwd_persist_v[(programs,)](
                    x, w, y, rstd, m, n, programs, 1e-6, block, prefetch, stages, num_warps=warps
                ),
                nbytes,
            )
        if n >= 8192:
            dy = torch.randn_like(x)
            _, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt)
            dx = torch.empty_like(x)
            dw = torch.empty_like(w)
            nb = 3 * x.numel() * 2
            record(
                "bwd",
                shape,
                "production",
                lambda: launch.backward(dy, None, x, w, rstd, 0.0, 0, True, dt),
                nb,
            )
            for chunk, warps, per_sm, keep in itertools.product(
                [2048, 4096], [4, 8, 16], [1, 2, 3, 4], [0, 1]
            ):
                chunks = n // chunk
                if chunks > 4 or warps * 32 * 4 > chunk:
                    continue
                programs = min(m, per_sm * sms)
                partial = torch.empty(programs, n, device="cuda")
                grid, constexprs = launch._reduce_plan(n, programs)

                def run():
                    bwd_chunked_v[(programs,)](
                        x, w, dy, rstd, dx, partial, m, n, programs, chunk, chunks, keep, num_warps=warps
                    )
                    kernels.reduce_columns[grid](partial, dw, programs, n, *constexprs, num_warps=4)

                record("bwd", shape, f"chunked c{chunk} w{warps} p{per_sm} keep{keep}", run, nb)
        x = w = y = dy = None
    with open(out, "w") as f:
        json.dump(dict(copy=copy, rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
