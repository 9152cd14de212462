"""Kernel lab (development only): kernel and launch variants timed beside the production launch
path in one run, each variant's output first checked against the reference.

    python tools/kernel_lab.py ROUND [ROUND ...] [--out lab.json]     on a CUDA machine
    TRITON_INTERPRET=1 python tools/kernel_lab.py ROUND --smoke        tiny CPU check, no timing

Rounds, and what they decided (H200, bf16 unless named; figures in docs/performance-notes.md):
  tile        tile-kernel variants at N <= 16384: eviction hints, the weight loaded with x, the row
              kept in its storage dtype; warps and rows per program. Chose the weight loaded with x
              and 4 warps at N = 4096.
  persistent  a persistent forward, prefetching the next row or pipelined with tl.range stages:
              slower than one program per row at every shape; not used.
  two-walk    forward_looped with one program per row (chunk, warps, L2 hints) and
              backward_chunked (chunk, warps, programs per SM) at N = 4096-16384: chose the
              two-walk path of rows of 4097-16384.
  wide        forward_looped at N = 65536: chunk, warps, hints. (A persistent launch, one program
              per SM walking rows in a loop, measured 73% of copy against 79% for one program
              per row; the row loop has since been removed from the kernel.)
  lean, static  forward variants without masks, with a scalar row base, store and weight hints,
              and with N and the row stride known at compile time, beside Liger and
              torch.compile in the same run.
  confirm     the production forward beside its walk at other chunks and warps, the
              static-shape variants and the peers, at the five large bf16 shapes, an N that
              is not a multiple of the chunk, and 4096x4096: chose a compile-time N, 16 warps up
              to N = 16384, and one program per row with no row loop.
  tile1d      the tile forward as a one-dimensional block, one row per program, 2-16 warps:
              within the run-to-run spread of the production tile; not used.
  small       CUDA-graph timing (the rounds after it too): the tile backward at small and
              medium M with fewer programs than rows (chose one program per SM at N = 4096 when
              a program would get fewer than four rows), and the tile forward's rsqrt.

The first four rounds were run on the H200 as separate scripts and merged into this file; from
this file the H200 has run lean, static, confirm, tile1d and small. Every round passes --smoke.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rmsnorm_kernel import kernels, launch
from rmsnorm_kernel.reference import rms_norm_reference

EPS = 1e-6

# ---------------------------------------------------------------------------------------------
# Experimental kernels (the production ones are used directly where a round varies only launches)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_weight(W, cols, N, EVICT: tl.constexpr):
    if EVICT:
        return tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    return tl.load(W + cols, mask=cols < N, other=0.0)


@triton.jit
def fwd_tile_v(
    X, W, Y, RSTD, M, N, stride_x, eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, EVICT: tl.constexpr, KEEP_RAW: tl.constexpr,
    W_EARLY: tl.constexpr,
):  # fmt: skip
    """forward_tile with EVICT (x evict_first, w evict_last), KEEP_RAW (x widened where used),
    W_EARLY (the weight loaded with x)."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rows64 = rows.to(tl.int64)[:, None]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if EVICT:
        raw = tl.load(
            X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
        )
    else:
        raw = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    if W_EARLY:
        w_raw = _load_weight(W, cols, N, EVICT)
    x = raw.to(tl.float32)
    rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rows < M)
    if KEEP_RAW:
        x = raw.to(tl.float32)
    if not W_EARLY:
        w_raw = _load_weight(W, cols, N, EVICT)
    y = x * rstd[:, None] * w_raw.to(tl.float32)[None, :]
    tl.store(Y + rows64 * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bwd_tile_v(
    X, W, DY, RSTD, DX, DW_PARTIAL, M, N, programs,
    BLOCK_N: tl.constexpr, EVICT: tl.constexpr, W_RELOAD: tl.constexpr,
):  # fmt: skip
    """backward_tile (one row per step) with EVICT (x, dy evict_first, widened where used) and
    W_RELOAD (the weight reloaded per row instead of held in registers)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if not W_RELOAD:
        scale = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for row in range(pid, M, programs):
        row64 = tl.cast(row, tl.int64)
        if EVICT:
            x_raw = tl.load(X + row64 * N + cols, mask=col_ok, other=0.0, eviction_policy="evict_first")
            dy_raw = tl.load(DY + row64 * N + cols, mask=col_ok, other=0.0, eviction_policy="evict_first")
        else:
            x_raw = tl.load(X + row64 * N + cols, mask=col_ok, other=0.0)
            dy_raw = tl.load(DY + row64 * N + cols, mask=col_ok, other=0.0)
        if W_RELOAD:
            scale = tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(tl.float32)
        rstd = tl.load(RSTD + row)
        xn = x_raw.to(tl.float32) * rstd
        u = dy_raw.to(tl.float32) * scale
        c = tl.sum(u * xn, axis=0) / N
        if EVICT:
            xn = x_raw.to(tl.float32) * rstd
            u = dy_raw.to(tl.float32) * scale
        tl.store(DX + row64 * N + cols, ((u - xn * c) * rstd).to(DX.dtype.element_ty), mask=col_ok)
        dw_acc += dy_raw.to(tl.float32) * xn
    tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_acc, mask=col_ok)


@triton.jit
def fwd_persist_v(X, W, Y, RSTD, M, N, programs, eps, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """A persistent one-tile-per-row forward: STAGES = 0 prefetches the next row's x by hand,
    otherwise tl.range pipelines the row loop with that many stages."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if STAGES == 0:
        nxt = tl.load(X + tl.cast(pid, tl.int64) * N + cols, mask=(cols < N) & (pid < M), other=0.0)
        for row in range(pid, M, programs):
            x = nxt.to(tl.float32)
            following = row + programs
            nxt = tl.load(
                X + tl.cast(following, tl.int64) * N + cols, mask=(cols < N) & (following < M), other=0.0
            )
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
def fwd_tile_lean(
    X, W, Y, RSTD, M, N, stride_x, eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr, STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """forward_tile (weight loaded with x) with a scalar 64-bit row base and 32-bit offsets
    within the block, masks only where MASKED (M % ROWS or N % BLOCK_N), and STORE_POLICY on
    the y store ("" or "evict_first")."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    local = tl.arange(0, ROWS)
    base = pid.to(tl.int64) * ROWS * stride_x
    offs = local[:, None] * stride_x + cols[None, :]
    rows = pid * ROWS + local
    if MASKED:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        x = tl.load(X + base + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < N, other=0.0)
    else:
        x = tl.load(X + base + offs).to(tl.float32)
        w = tl.load(W + cols)
    rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=1) / N + eps)
    y = (x * rstd[:, None] * w.to(tl.float32)[None, :]).to(Y.dtype.element_ty)
    ybase = pid.to(tl.int64) * ROWS * N
    yoffs = local[:, None] * N + cols[None, :]
    if MASKED:
        tl.store(RSTD + rows, rstd, mask=rows < M)
        tl.store(Y + ybase + yoffs, y, mask=mask, eviction_policy=STORE_POLICY)
    else:
        tl.store(RSTD + rows, rstd)
        tl.store(Y + ybase + yoffs, y, eviction_policy=STORE_POLICY)


@triton.jit
def fwd_walk_lean(
    X, W, Y, RSTD, M, N, eps,
    BLOCK_N: tl.constexpr, STORE_POLICY: tl.constexpr, W_POLICY: tl.constexpr,
):  # fmt: skip
    """forward_looped, one program per row, N a multiple of BLOCK_N (no masks), hints
    evict_last / evict_first on the walks, STORE_POLICY on y and W_POLICY on the weight."""
    row64 = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x_row = X + row64 * N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_row + start + cols, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = kernels._rsqrt_rn(tl.sum(acc, axis=0) / N + eps)
    tl.store(RSTD + row64, rstd)
    for start in range(0, N, BLOCK_N):
        x = tl.load(x_row + start + cols, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + start + cols, eviction_policy=W_POLICY).to(tl.float32)
        tl.store(
            Y + row64 * N + start + cols, (x * rstd * w).to(Y.dtype.element_ty), eviction_policy=STORE_POLICY
        )


@triton.jit
def fwd_tile_static(X, W, Y, RSTD, eps, N: tl.constexpr, ROWS: tl.constexpr, WIDE_INDEX: tl.constexpr):
    """The tile forward with N (a power of two) and the row stride (N) known at compile time, as
    torch.compile's kernels have them, no masks, and 32-bit offsets unless WIDE_INDEX."""
    pid = tl.program_id(0)
    if WIDE_INDEX:
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, N)
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(X + offs).to(tl.float32)
    w = tl.load(W + cols)
    rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd)
    tl.store(Y + offs, (x * rstd[:, None] * w.to(tl.float32)[None, :]).to(Y.dtype.element_ty))


@triton.jit
def fwd_walk_static(X, W, Y, RSTD, eps, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """forward_looped, one program per row, N and the row stride known at compile time, 32-bit
    offsets, no masks; hints as torch.compile's: x evict_last then evict_first, w evict_last."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in tl.range(0, N, BLOCK_N):
        x = tl.load(X + row * N + start + cols, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = kernels._rsqrt_rn(tl.sum(acc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    for start in tl.range(0, N, BLOCK_N):
        x = tl.load(X + row * N + start + cols, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + start + cols, eviction_policy="evict_last").to(tl.float32)
        tl.store(Y + row * N + start + cols, (x * rstd * w).to(Y.dtype.element_ty))


@triton.jit
def fwd_tile_1d(
    X, W, Y, RSTD, N, stride_x, eps, BLOCK_N: tl.constexpr, FULL: tl.constexpr, HW_RSQRT: tl.constexpr
):  # fmt: skip
    """One row per program as a 1-D block (forward_tile's rows are a 2-D [ROWS, BLOCK_N] block),
    fp32 math as forward_tile; FULL (N == BLOCK_N) drops the masks; HW_RSQRT takes the hardware
    rsqrt instead of the correctly rounded one (what the per-row rounding costs in time)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    if FULL:
        x = tl.load(X + row * stride_x + cols).to(tl.float32)
        w = tl.load(W + cols)
    else:
        x = tl.load(X + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=cols < N, other=0.0)
    mean_square = tl.sum(x * x, axis=0) / N + eps
    if HW_RSQRT:
        rstd = tl.rsqrt(mean_square)
    else:
        rstd = kernels._rsqrt_rn(mean_square)
    tl.store(RSTD + row, rstd)
    y = (x * rstd * w.to(tl.float32)).to(Y.dtype.element_ty)
    if FULL:
        tl.store(Y + row * N + cols, y)
    else:
        tl.store(Y + row * N + cols, y, mask=cols < N)


# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


class Lab:
    """Inputs per shape, a check of every variant against the reference, and timing (medians of
    triton.testing.do_bench, L2 flushed between calls) with the copy ceiling of the same run.
    With ``smoke`` the shapes shrink to a few rows of a few columns on CPU and nothing is timed."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.rows: list[dict] = []
        self.sms = 2 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
        self.copy_tbs = None if smoke else self._copy_ceiling()
        if self.copy_tbs:
            print(f"copy ceiling {self.copy_tbs:.3f} TB/s", flush=True)

    @staticmethod
    def median_us(fn) -> float:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3

    def _copy_ceiling(self) -> float:
        a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
        b = torch.empty_like(a)
        return 4 * a.numel() / (self.median_us(lambda: b.copy_(a)) * 1e-6) / 1e12

    def shape(self, m: int, n: int, dtype=torch.bfloat16):
        """(m, n) with n kept (it picks the path) and m cut to 3 rows in smoke mode: x, w, dy,
        the reference y and gradients, and output buffers."""
        if self.smoke:
            m = min(m, 3)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, n, generator=g).to(dtype).to(self.device)
        w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(self.device)
        dy = torch.randn(m, n, generator=g).to(dtype).to(self.device)
        xg, wg = x.float().requires_grad_(), w.float().requires_grad_()
        y_ref = rms_norm_reference(xg, wg, EPS)
        y_ref.backward(dy.float())
        rstd = torch.rsqrt(x.float().square().mean(-1) + EPS)
        return dict(m=m, n=n, x=x, w=w, dy=dy, y_ref=y_ref.detach(), dx_ref=xg.grad, dw_ref=wg.grad, rstd=rstd,
                    y=torch.empty_like(x), dx=torch.empty_like(x), dw=torch.empty(n, device=self.device),
                    rstd_out=torch.empty(m, device=self.device), name=f"{m}x{n}-{str(dtype)[6:]}")  # fmt: skip

    def run(self, kind: str, s: dict, variant: str, fn, timed=None) -> None:
        """Run ``fn`` once and check its outputs (y for "fwd", dx and dw for "bwd"), then time it,
        or ``timed`` where given: the same work without the copies into the checked buffers
        that a call returning fresh outputs needs. The outputs are filled with NaN first, so a
        variant that writes nothing cannot pass."""
        for key in ("y", "dx", "dw"):
            s[key].fill_(float("nan"))
        try:
            fn()
            if self.device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # a variant may not compile (registers, shared memory)
            print(
                f"{kind} {s['name']:>20} {variant:<44} failed: {type(exc).__name__} {str(exc)[:80]}",
                flush=True,
            )
            return
        tol = dict(atol=2e-2, rtol=2e-2) if s["x"].dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
        try:  # a sanity check that the variant computes RMSNorm, not the numerics suite
            if kind == "fwd":
                torch.testing.assert_close(s["y"].float(), s["y_ref"], **tol)
            else:
                torch.testing.assert_close(s["dx"].float(), s["dx_ref"], **tol)
                dw_atol = tol["atol"] * s["m"] ** 0.5
                torch.testing.assert_close(s["dw"].float(), s["dw_ref"], atol=dw_atol, rtol=tol["rtol"])
        except AssertionError as exc:
            print(
                f"{kind} {s['name']:>20} {variant:<44} WRONG, not timed: {str(exc).splitlines()[0]}",
                flush=True,
            )
            return
        if self.smoke:
            print(f"{kind} {s['name']:>20} {variant:<44} checked", flush=True)
            return
        us = self.median_us(timed or fn)
        units = 2 if kind == "fwd" else 3
        frac = units * s["x"].numel() * s["x"].element_size() / (us * 1e-6) / 1e12 / self.copy_tbs
        self.rows.append(dict(kind=kind, shape=s["name"], variant=variant, us=us, frac=frac))
        print(f"{kind} {s['name']:>20} {variant:<44} {us:8.1f} us {frac:6.1%}", flush=True)

    def production(self, s: dict) -> None:
        """The production forward and backward, and torch's fused forward, at this shape."""
        x, w, dy, n = s["x"], s["w"], s["dy"], s["n"]

        def fwd():
            return launch.forward(x, w, None, EPS, 0.0, 0, x.dtype, x.dtype)

        def bwd():
            return launch.backward(dy, None, x, w, s["rstd"], 0.0, 0, True, x.dtype)

        def native():
            return F.rms_norm(x, (n,), w, EPS)

        self.run("fwd", s, "production", lambda: s["y"].copy_(fwd()[0]), fwd)
        self.run("bwd", s, "production", lambda: [s[k].copy_(t) for k, t in zip(("dx", "dw"), bwd())], bwd)
        if not self.smoke:
            self.run("fwd", s, "torch F.rms_norm", lambda: s["y"].copy_(native()), native)

    def reduce(self, s: dict, partial: torch.Tensor, programs: int):
        """The production fixed-order dw reduction of a (programs, N) scratch into s["dw"]."""
        grid, constexprs = launch._reduce_plan(s["n"], programs)
        kernels.reduce_columns[grid](partial, s["dw"], programs, s["n"], *constexprs, num_warps=4)

    def summary(self, out: str | None) -> None:
        best: dict[tuple, dict] = {}
        for r in self.rows:
            key = (r["kind"], r["shape"])
            if r["variant"] not in ("production", "torch F.rms_norm", "torch.compile", "liger", "quack"):
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        print("\nbest variant per shape, against production:")
        for (kind, shape), r in best.items():
            prod = next(
                (
                    p
                    for p in self.rows
                    if (p["kind"], p["shape"], p["variant"]) == (kind, shape, "production")
                ),
                None,
            )
            if prod is None:  # a shape timed without the production call
                print(f"{kind} {shape:>20} {r['variant']:<44} {r['us']:8.1f} us {r['frac']:6.1%}")
                continue
            print(f"{kind} {shape:>20} {r['variant']:<44} {r['us']:8.1f} us {r['frac']:6.1%} | "
                  f"production {prod['us']:8.1f} us {prod['frac']:6.1%}")  # fmt: skip
        if out:
            with open(out, "w") as f:
                json.dump(dict(copy_tbs=self.copy_tbs, rows=self.rows), f, indent=1)


# ---------------------------------------------------------------------------------------------
# Rounds
# ---------------------------------------------------------------------------------------------


def round_tile(lab: Lab) -> None:
    for m, n, dtype in [(32768, 4096, torch.bfloat16), (65536, 1024, torch.bfloat16), (4096, 4096, torch.float32),
                        (4096, 4096, torch.float16)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        block = triton.next_power_of_2(n)
        for warps, rows, evict, keep, early in itertools.product([4, 8], [1, 2], [0, 1], [0, 1], [0, 1]):
            if rows * block > 4096:
                continue
            lab.run("fwd", s, f"tile w{warps} r{rows} evict{evict} raw{keep} early{early}",
                    lambda: fwd_tile_v[(triton.cdiv(s["m"], rows),)](
                        s["x"], s["w"], s["y"], s["rstd_out"], s["m"], n, n, EPS, block, rows, evict, keep, early,
                        num_warps=warps))  # fmt: skip
        for warps, per_sm, evict, reload in itertools.product([8, 16], [1, 2], [0, 1], [0, 1]):
            programs = min(s["m"], per_sm * lab.sms)
            partial = torch.empty(programs, n, device=lab.device)

            def bwd():
                bwd_tile_v[(programs,)](s["x"], s["w"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n, programs,
                                        block, evict, reload, num_warps=warps)  # fmt: skip
                lab.reduce(s, partial, programs)

            lab.run("bwd", s, f"tile w{warps} p{per_sm} evict{evict} reload{reload}", bwd)


def round_persistent(lab: Lab) -> None:
    for m, n in [(32768, 4096), (65536, 1024)]:
        s = lab.shape(m, n)
        lab.production(s)
        for warps, per_sm, stages in itertools.product([4, 8], [1, 4, 8], [0, 1, 3]):
            programs = min(s["m"], per_sm * lab.sms)
            lab.run("fwd", s, f"persistent w{warps} p{per_sm} stages{stages}",
                    lambda: fwd_persist_v[(programs,)](s["x"], s["w"], s["y"], s["rstd_out"], s["m"], n, programs,
                                                       EPS, triton.next_power_of_2(n), stages, num_warps=warps))  # fmt: skip


def forward_looped(s: dict, block: int, warps: int, policies: tuple[str, str]):
    """The production forward_looped (one program per row) with a chosen launch, writing s["y"]."""
    x, m, n = s["x"], s["m"], s["n"]
    args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], n, n, n, n, EPS, 0.0)
    return lambda: kernels.forward_looped[(m,)](*args, True, False, 0, block, *policies, n, num_warps=warps)


HINTS = [("", ""), ("evict_last", "evict_first")]


def round_two_walk(lab: Lab) -> None:
    for m, n, dtype in [(16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
                        (32768, 4096, torch.bfloat16), (4096, 4096, torch.float32)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        for block, warps, hints in itertools.product([2048, 4096, 8192], [4, 8, 16], HINTS):
            if block > triton.next_power_of_2(n):
                continue
            name = f"two-walk fwd b{block} w{warps} {'hints' if hints[0] else 'no hints'}"
            lab.run("fwd", s, name, forward_looped(s, block, warps, hints))
        if n <= 4096:
            continue
        for chunk, warps, per_sm in itertools.product([2048, 4096], [4, 8, 16], [1, 2, 3]):
            chunks = triton.cdiv(n, chunk)
            if chunks > 4:
                continue
            programs = min(s["m"], per_sm * lab.sms)
            partial = torch.empty(programs, n, device=lab.device)
            strides = (n, n, n, n, 0.0)

            def bwd():
                kernels.backward_chunked[(programs,)](
                    s["x"], s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n, programs, *strides,
                    True, False, True, 0, chunk, chunks, num_warps=warps)  # fmt: skip
                lab.reduce(s, partial, programs)

            lab.run("bwd", s, f"chunked c{chunk} w{warps} p{per_sm}", bwd)


def round_wide(lab: Lab) -> None:
    s = lab.shape(2048, 65536)
    lab.production(s)
    policies = [("", ""), ("evict_last", "evict_first"), ("evict_last", ""), ("", "evict_first")]
    for warps, block, hints in itertools.product([16, 32], [4096, 8192, 16384], policies):
        name = f"looped w{warps} b{block} {hints[0] or '-'}/{hints[1] or '-'}"
        lab.run("fwd", s, name, forward_looped(s, block, warps, hints))


def peers(lab: Lab, s: dict) -> None:
    """Liger and torch.compile of the reference at this shape, in the same run (when installed)."""
    x, w = s["x"], s["w"]
    if not lab.smoke:
        compiled = torch.compile(lambda a, b: rms_norm_reference(a, b, EPS), dynamic=False)
        lab.run("fwd", s, "torch.compile", lambda: s["y"].copy_(compiled(x, w)), lambda: compiled(x, w))
        try:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        except ImportError:
            return

        def liger():
            return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)

        lab.run("fwd", s, "liger", lambda: s["y"].copy_(liger()), liger)
        try:
            from quack.rmsnorm import rmsnorm as quack_rmsnorm
        except ImportError:
            return

        def quack():
            return quack_rmsnorm(x, w, eps=EPS)

        lab.run("fwd", s, "quack", lambda: s["y"].copy_(quack()), quack)


def round_lean(lab: Lab) -> None:
    for m, n in [(32768, 4096), (65536, 1024), (16384, 8192), (8192, 16384)]:
        s = lab.shape(m, n)
        lab.production(s)
        peers(lab, s)
        if n <= 4096:
            options = [(4, 1), (8, 1)] if n == 4096 else [(w, r) for w in (2, 4, 8) for r in (1, 2, 4, 8)]
            for (warps, rows), masked, store in itertools.product(options, [0, 1], ["", "evict_first"]):
                if not masked and s["m"] % rows:
                    continue  # unmasked loads would run past the last row
                lab.run("fwd", s, f"lean tile w{warps} r{rows} mask{masked} store {store or '-'}",
                        lambda: fwd_tile_lean[(triton.cdiv(s["m"], rows),)](
                            s["x"], s["w"], s["y"], s["rstd_out"], s["m"], n, n, EPS, n, rows, masked, store,
                            num_warps=warps))  # fmt: skip
        else:
            for block, warps, store, wpol in itertools.product(
                [4096, 8192], [8, 16], ["", "evict_first"], ["", "evict_last"]
            ):
                lab.run("fwd", s, f"lean walk b{block} w{warps} store {store or '-'} w {wpol or '-'}",
                        lambda: fwd_walk_lean[(s["m"],)](
                            s["x"], s["w"], s["y"], s["rstd_out"], s["m"], n, EPS, block, store, wpol,
                            num_warps=warps))  # fmt: skip


def round_static(lab: Lab) -> None:
    """Production and peers against the production kernels at other warps and the static-shape
    variants (fwd_tile_static, fwd_walk_static), forward only."""
    for m, n in [(32768, 4096), (65536, 1024), (16384, 8192), (8192, 16384)]:
        s = lab.shape(m, n)
        lab.production(s)
        peers(lab, s)
        if n <= 4096:
            options = [(4, 1), (8, 1), (4, 2)] if n == 4096 else [(2, 1), (2, 2), (4, 2), (4, 4), (8, 8)]
            for (warps, rows), wide in itertools.product(options, [0, 1]):
                if s["m"] % rows:
                    continue
                lab.run("fwd", s, f"static tile w{warps} r{rows} {'i64' if wide else 'i32'}",
                        lambda: fwd_tile_static[(s["m"] // rows,)](
                            s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, rows, wide, num_warps=warps))  # fmt: skip
        else:
            for block, warps in itertools.product([4096, 8192], [8, 16]):
                lab.run(
                    "fwd",
                    s,
                    f"production kernel b{block} w{warps}",
                    forward_looped(s, block, warps, ("evict_last", "evict_first")),
                )
                lab.run("fwd", s, f"static walk b{block} w{warps}",
                        lambda: fwd_walk_static[(s["m"],)](
                            s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, block, num_warps=warps))  # fmt: skip


def round_confirm(lab: Lab) -> None:
    """Forward at the five large bf16 shapes, N = 12289 and 4096x4096: production and peers beside
    the production walk kernel at other chunks and warps, and the static-shape variants."""
    shapes = [(32768, 4096, torch.bfloat16), (65536, 1024, torch.bfloat16), (16384, 8192, torch.bfloat16),
              (8192, 16384, torch.bfloat16), (2048, 65536, torch.bfloat16), (8192, 12289, torch.bfloat16),
              (4096, 4096, torch.float32), (4096, 4096, torch.float16)]  # fmt: skip
    for m, n, dtype in shapes:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        if n <= 4096:
            lab.run("fwd", s, "static tile w4 r1 i32",
                    lambda: fwd_tile_static[(s["m"],)](
                        s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, 1, 0, num_warps=4))  # fmt: skip
            continue
        hints = ("evict_last", "evict_first")
        warps = [8, 16] if n <= 16384 else [16, 32]
        for block, w in itertools.product([4096, 8192, 16384], warps):
            if block > n:
                continue
            lab.run("fwd", s, f"walk b{block} w{w}", forward_looped(s, block, w, hints))
            if n % block:
                continue  # the static walk has no masks
            lab.run("fwd", s, f"static walk b{block} w{w}",
                    lambda: fwd_walk_static[(s["m"],)](
                        s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, block, num_warps=w))  # fmt: skip


def round_tile1d(lab: Lab) -> None:
    """The tile forward as a 1-D block, one row per program, beside production and Liger."""
    for m, n, dtype in [
        (32768, 4096, torch.bfloat16),
        (4096, 4096, torch.float16),
        (65536, 1024, torch.bfloat16),
    ]:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        for warps, full in itertools.product([2, 4, 8, 16], [0, 1]):
            lab.run("fwd", s, f"tile 1d w{warps} {'full' if full else 'masked'}",
                    lambda: fwd_tile_1d[(s["m"],)](
                        s["x"], s["w"], s["y"], s["rstd_out"], n, n, EPS, n, full, 0, num_warps=warps))  # fmt: skip


def round_small(lab: Lab) -> None:
    """The tile backward at small and medium M with fewer programs than rows (fewer dw scratch
    rows to write and reduce, less parallelism), timed as CUDA-graph replays (host launch time
    would hide sub-microsecond differences); and the tile forward's rsqrt at 32768x4096."""
    if not lab.smoke:
        from triton.testing import do_bench_cudagraph

        lab.median_us = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    for m, n, dtype in [(256, 4096, torch.bfloat16), (128, 257, torch.float32), (1024, 4096, torch.bfloat16),
                        (4096, 4096, torch.bfloat16), (4096, 4096, torch.float32)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        rows, warps, per_sm, constexprs = launch._backward_tile_plan(n, True, False, True, 0)
        blocks = triton.cdiv(s["m"], rows)
        for programs in sorted({16, 32, 64, 128, lab.sms, 2 * lab.sms, blocks}):
            if programs > blocks:
                continue
            partial = torch.empty(programs, n, device=lab.device)

            def bwd():
                kernels.backward_tile[(programs,)](
                    s["x"], s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n, programs,
                    n, n, n, n, 0.0, *constexprs, num_warps=warps)  # fmt: skip
                lab.reduce(s, partial, programs)

            lab.run("bwd", s, f"tile programs {programs}", bwd)
    s = lab.shape(32768, 4096)
    for hw, warps in itertools.product([0, 1], [4, 8]):
        lab.run("fwd", s, f"1d tile w{warps} {'hardware rsqrt' if hw else 'rsqrt_rn'}",
                lambda: fwd_tile_1d[(s["m"],)](s["x"], s["w"], s["y"], s["rstd_out"], 4096, 4096, EPS, 4096, 0, hw,
                                               num_warps=warps))  # fmt: skip


def forward_split(s: dict, segment: int, warps: int):
    """The production forward_split with a chosen segment width and warps, writing s["y"]."""
    x, m, n = s["x"], s["m"], s["n"]
    segments = triton.cdiv(n, segment)
    constexprs = (True, False, 0, segment, segments, triton.next_power_of_2(segments), n)

    def call():
        sync = torch.full((1 + m * segments,), -1, dtype=torch.int32, device=x.device)
        args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], sync, n, n, n, n, EPS, 0.0)
        kernels.forward_split[(m * segments,)](*args, *constexprs, num_warps=warps)

    return call


def backward_split(lab: Lab, s: dict, segment: int, warps: int, per_sm: int, prefetch: int):
    """The production backward_split and dw reduction with a chosen launch, writing s["dx"], s["dw"]."""
    x, m, n = s["x"], s["m"], s["n"]
    segments = triton.cdiv(n, segment)
    groups = min(m, max(1, per_sm * lab.sms // segments))
    partial = torch.empty(groups, n, device=x.device)
    constexprs = (True, False, True, 0, segment, segments, triton.next_power_of_2(segments), prefetch)

    def call():
        sync = torch.full((1 + m * segments,), -1, dtype=torch.int32, device=x.device)
        args = (x, s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, sync, m, n, groups, n, n, n, n, 0.0)
        kernels.backward_split[(groups * segments,)](*args, *constexprs, num_warps=warps)
        lab.reduce(s, partial, groups)

    return call


def round_split(lab: Lab) -> None:
    """The split forward (a row's segments on separate programs that exchange their sums of
    squares) at segment widths and warps, beside production, the two-walk forward and the peers,
    CUDA-graph timed. Under --smoke only one-segment launches run: the interpreter runs programs
    one after another, and a program of a split row waits for the others."""
    if not lab.smoke:
        from triton.testing import do_bench_cudagraph

        lab.median_us = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    for m, n in [(2048, 65536), (4096, 32768), (1024, 131072), (8192, 16384), (16384, 8192)]:
        s = lab.shape(m, n)
        lab.production(s)
        peers(lab, s)
        if n > 16384:
            lab.run(
                "fwd", s, "two-walk b8192 w32", forward_looped(s, 8192, 32, ("evict_last", "evict_first"))
            )
        for segment, warps in itertools.product([2048, 4096, 8192, 16384, 32768], [4, 8, 16]):
            per_thread = segment // (32 * warps)
            segments = triton.cdiv(n, segment)
            if not 4 <= per_thread <= 64 or segments > 16 or (lab.smoke and segments > 1):
                continue
            lab.run("fwd", s, f"split s{segment} w{warps}", forward_split(s, segment, warps))
        for segment, warps, per_sm, prefetch in itertools.product(
            [4096, 8192, 16384], [8, 16], [1, 2], [0, 1]
        ):
            per_thread = segment // (32 * warps)
            segments = triton.cdiv(n, segment)
            if not 4 <= per_thread <= 64 or segments > 16 or (lab.smoke and segments > 1):
                continue
            lab.run("bwd", s, f"split s{segment} w{warps} p{per_sm} prefetch{prefetch}",
                    backward_split(lab, s, segment, warps, per_sm, prefetch))  # fmt: skip
    if lab.smoke:  # the one-segment launches above need segment >= n
        s = lab.shape(3, 8192)
        lab.run("fwd", s, "split s8192 w8", forward_split(s, 8192, 8))
        for prefetch in (0, 1):
            lab.run(
                "bwd",
                s,
                f"split s8192 w8 p1 prefetch{prefetch}",
                backward_split(lab, s, 8192, 8, 1, prefetch),
            )


ROUNDS = {
    "tile": round_tile,
    "persistent": round_persistent,
    "two-walk": round_two_walk,
    "wide": round_wide,
    "lean": round_lean,
    "static": round_static,
    "confirm": round_confirm,
    "tile1d": round_tile1d,
    "small": round_small,
    "split": round_split,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", nargs="+", choices=sorted(ROUNDS))
    parser.add_argument("--out", default=None, help="write the timed rows as JSON here")
    parser.add_argument(
        "--smoke", action="store_true", help="check every variant on tiny CPU inputs (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--smoke runs the kernels on CPU: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("timing needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
    lab = Lab(args.smoke)
    for name in args.rounds:
        ROUNDS[name](lab)
    if not args.smoke:
        lab.summary(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
