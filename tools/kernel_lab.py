"""Kernel lab: production's kernels at other launches, timed beside production and its peers.

Development only. Each variant is first checked against the reference, then timed in the same run
as the production launch path and its peers, to re-tune launch.py's constants (the speed-only ones
are launch.Tuning's fields: the lab reads production's values from launch.TUNING and launches its
variants itself). ``--help`` lists the rounds and what each tunes; what each decided, with its
figures: docs/performance-notes.md, "Why the launch constants are what they are".

    python tools/kernel_lab.py ROUND [ROUND ...] [--out lab.json]     on a CUDA machine
    TRITON_INTERPRET=1 python tools/kernel_lab.py ROUND --smoke        tiny CPU check, no timing
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton

from rmsnorm_kernel import kernels, launch
from rmsnorm_kernel.reference import rms_norm_reference

EPS = 1e-6
# Rows the summary compares variants against, not variants themselves.
PEERS = ("production", "torch F.rms_norm", "torch.compile", "liger", "quack")

# ---------------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------------


def reduce_columns_call(partial, out, rows: int, n: int, block_p: int, block_c: int, warps: int):
    """reduce_columns of a (rows, n) fp32 scratch into ``out`` with the given launch, as a call."""
    grid = (triton.cdiv(n, block_c),)
    return lambda: kernels.reduce_columns[grid](partial, out, rows, n, block_p, block_c, num_warps=warps)


class Lab:
    """Inputs per shape, a check of every variant against the reference, and timing (medians of
    triton.testing.do_bench, L2 flushed between calls) with the copy ceiling of the same run.
    With ``smoke`` the shapes shrink to a few rows of a few columns on CPU and nothing is timed."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.timing = "flushed"  # "graphs" after time_with_graphs: rows compare within a timing
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

    def time_with_graphs(self) -> None:
        """Time the rest of the run as CUDA-graph replays (triton.testing.do_bench_cudagraph), so
        that host launch time does not hide sub-microsecond differences. No-op in smoke mode."""
        if self.smoke:
            return
        from triton.testing import do_bench_cudagraph

        self.timing = "graphs"
        self.median_us = lambda fn: do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3

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

    def _say(self, kind: str, s: dict, variant: str, what: str) -> None:
        print(f"{kind} {s['name']:>20} {variant:<44} {what}", flush=True)

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
            return self._say(kind, s, variant, f"failed: {type(exc).__name__} {str(exc)[:80]}")
        tol = dict(atol=2e-2, rtol=2e-2) if s["x"].dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
        try:  # a sanity check that the variant computes RMSNorm, not the numerics suite
            if kind == "fwd":
                torch.testing.assert_close(s["y"].float(), s["y_ref"], **tol)
            else:
                torch.testing.assert_close(s["dx"].float(), s["dx_ref"], **tol)
                dw_atol = tol["atol"] * s["m"] ** 0.5
                torch.testing.assert_close(s["dw"].float(), s["dw_ref"], atol=dw_atol, rtol=tol["rtol"])
        except AssertionError as exc:
            return self._say(kind, s, variant, f"WRONG, not timed: {str(exc).splitlines()[0]}")
        if self.smoke:
            return self._say(kind, s, variant, "checked")
        try:
            us = self.median_us(timed or fn)
        except Exception as exc:  # e.g. a launch that graph capture rejects
            return self._say(kind, s, variant, f"timing failed: {type(exc).__name__} {str(exc)[:80]}")
        self._record(kind, s, variant, us)

    def time_reference(self, s: dict, variant: str, fn) -> None:
        """Time ``fn``, a point of reference that computes no RMSNorm (a copy of the same bytes,
        say), unchecked; the summary does not count it as a variant."""
        if not self.smoke:
            self._record("fwd", s, variant, self.median_us(fn), reference=True)

    def _record(self, kind: str, s: dict, variant: str, us: float, **marks) -> None:
        """Keep and print one timed row: µs and the fraction of the copy ceiling its bytes reach
        (forward 2, backward 3 tensors of x's size)."""
        units = 2 if kind == "fwd" else 3
        frac = units * s["x"].numel() * s["x"].element_size() / (us * 1e-6) / 1e12 / self.copy_tbs
        self.rows.append(
            dict(kind=kind, shape=s["name"], variant=variant, us=us, frac=frac, timing=self.timing, **marks)
        )
        self._say(kind, s, variant, f"{us:8.1f} us {frac:6.1%}")

    def production(self, s: dict, backward: bool = True) -> None:
        """The production forward and (``backward``) backward, and torch's fused forward, at
        this shape."""
        x, w, dy, n = s["x"], s["w"], s["dy"], s["n"]

        def fwd():
            return launch.forward(x, w, None, EPS, 0.0, 0, x.dtype, x.dtype)

        def bwd():
            return launch.backward(dy, None, x, w, s["rstd"], 0.0, 0, True, x.dtype)

        def native():
            return F.rms_norm(x, (n,), w, EPS)

        self.run("fwd", s, "production", lambda: s["y"].copy_(fwd()[0]), fwd)
        if backward:
            grads = ("dx", "dw")
            self.run("bwd", s, "production", lambda: [s[k].copy_(t) for k, t in zip(grads, bwd())], bwd)
        if not self.smoke:
            self.run("fwd", s, "torch F.rms_norm", lambda: s["y"].copy_(native()), native)

    def reduce(self, s: dict, partial: torch.Tensor, programs: int):
        """The production fixed-order dw reduction of a (programs, N) scratch into s["dw"]."""
        plan = launch._reduce_plan(s["n"], programs)
        reduce_columns_call(partial, s["dw"], programs, s["n"], *plan.constexprs, plan.num_warps)()

    def summary(self, out: str | None) -> None:
        """The fastest variant per shape and timing beside production in the same timing; the
        timed rows as JSON to ``out``."""
        best: dict[tuple, dict] = {}
        prod: dict[tuple, dict] = {}
        for r in self.rows:
            key = (r["kind"], r["shape"], r["timing"])
            if r["variant"] == "production":
                prod[key] = r
            elif r["variant"] not in PEERS and not r.get("reference"):
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        print("\nbest variant per shape and timing, against production in the same timing:")
        for (kind, shape, timing), r in best.items():
            line = f"{kind} {shape:>20} {timing:<7} {r['variant']:<44} {r['us']:8.1f} us {r['frac']:6.1%}"
            if (p := prod.get((kind, shape, timing))) is not None:  # a shape may lack production
                line += f" | production {p['us']:8.1f} us {p['frac']:6.1%}"
            print(line)
        if out:
            with open(out, "w") as f:
                json.dump(dict(copy_tbs=self.copy_tbs, rows=self.rows), f, indent=1)


def peers(lab: Lab, s: dict) -> None:
    """torch.compile of the reference, Liger and quack at this shape, in the same run (the last
    two when installed; not under --smoke)."""
    if lab.smoke:
        return
    x, w = s["x"], s["w"]
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


# ---------------------------------------------------------------------------------------------
# The production kernels at a chosen launch (weight, no residual, default casting)
# ---------------------------------------------------------------------------------------------


def tile_forward(s: dict, rows: int, warps: int, even: bool = False):
    """forward_tile with ROWS = rows, the given warps and masks or not (EVEN), writing s["y"]."""
    x, m, n = s["x"], s["m"], s["n"]
    args = (x, x, s["w"], s["y"], x, s["rstd_out"], m, n, n, n, n, n, EPS, 0.0)
    constexprs = (True, False, 0, triton.next_power_of_2(n), rows, even)
    return lambda: kernels.forward_tile[(triton.cdiv(m, rows),)](*args, *constexprs, num_warps=warps)


def forward_looped(s: dict, block: int, warps: int, policies: tuple[str, str]):
    """forward_looped (one program per row) with a chosen chunk, warps and walks' L2 hints, y's
    stores unhinted and the walks rolled as production runs them up to TWO_WALK_MAX."""
    x, m, n = s["x"], s["m"], s["n"]
    args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], n, n, EPS, 0.0)
    # ..., N, CONTIGUOUS, HAS_OFFSET as production launches contiguous rows with a zero offset
    return lambda: kernels.forward_looped[(m,)](
        *args, True, False, 0, block, *policies, "", False, n, True, False, num_warps=warps
    )


def backward_call(lab: Lab, kernel, s: dict, programs: int, warps: int, constexprs: tuple):
    """backward_tile or backward_chunked over ``programs`` programs with the given constexprs
    (from HAS_WEIGHT on), then production's dw reduction, writing s["dx"], s["dw"]."""
    n = s["n"]
    partial = torch.empty(programs, n, device=lab.device)

    def call():
        kernel[(programs,)](s["x"], s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n, programs,
                            n, n, n, n, 0.0, *constexprs, num_warps=warps)  # fmt: skip
        lab.reduce(s, partial, programs)

    return call


# ---------------------------------------------------------------------------------------------
# Rounds
# ---------------------------------------------------------------------------------------------


def round_two_walk(lab: Lab) -> None:
    """forward_looped over chunk, warps and the walks' L2 hints, and backward_chunked over chunk,
    warps and programs per SM (rows of 4097-16384 only), beside production."""
    for m, n, dtype in [(16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
                        (32768, 4096, torch.bfloat16), (4096, 4096, torch.float32)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        hints = [("", ""), ("evict_last", "evict_first")]
        for block, warps, policies in itertools.product([2048, 4096, 8192], [4, 8, 16], hints):
            if block > triton.next_power_of_2(n):
                continue
            name = f"two-walk fwd b{block} w{warps} {'hints' if policies[0] else 'no hints'}"
            lab.run("fwd", s, name, forward_looped(s, block, warps, policies))
        if n <= 4096:
            continue
        for chunk, warps, per_sm in itertools.product([2048, 4096], [4, 8, 16], [1, 2, 3]):
            chunks = triton.cdiv(n, chunk)
            if chunks > 4:
                continue
            programs = min(s["m"], per_sm * lab.sms)
            constexprs = (True, False, True, 0, chunk, chunks)
            lab.run("bwd", s, f"chunked c{chunk} w{warps} p{per_sm}",
                    backward_call(lab, kernels.backward_chunked, s, programs, warps, constexprs))  # fmt: skip


def round_small(lab: Lab) -> None:
    """The tile backward at small and medium M with fewer programs than rows (fewer dw scratch
    rows to write and reduce, less parallelism). CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [(256, 4096, torch.bfloat16), (128, 257, torch.float32), (1024, 4096, torch.bfloat16),
                        (4096, 4096, torch.bfloat16), (4096, 4096, torch.float32)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        rows, warps, per_sm, constexprs = launch._backward_tile_plan(n, True, False, True, 0)
        blocks = triton.cdiv(s["m"], rows)
        for programs in sorted({16, 32, 64, 128, lab.sms, 2 * lab.sms, blocks}):
            if programs <= blocks:
                lab.run("bwd", s, f"tile programs {programs}",
                        backward_call(lab, kernels.backward_tile, s, programs, warps, constexprs))  # fmt: skip


def round_prefetch(lab: Lab) -> None:
    """The tile backward with the next row block's loads issued before the current block's work
    (PREFETCH) or not, at rows, warps and programs per SM around production's. CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [(32768, 4096, torch.bfloat16), (65536, 1024, torch.bfloat16), (4096, 4096, torch.bfloat16),
                        (4096, 4096, torch.float32), (256, 4096, torch.bfloat16)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        block_n = launch.backward_config(n).block_n
        rows_options = [1, 2] if n <= 1024 else [1]
        for rows, warps, per_sm, prefetch in itertools.product(rows_options, [4, 8, 16], [1, 2, 4], [0, 1]):
            programs = min(triton.cdiv(s["m"], rows), per_sm * lab.sms)
            constexprs = (True, False, True, 0, block_n, rows, prefetch)
            lab.run("bwd", s, f"tile r{rows} w{warps} p{per_sm} prefetch{prefetch}",
                    backward_call(lab, kernels.backward_tile, s, programs, warps, constexprs))  # fmt: skip


def round_reorder2(lab: Lab) -> None:
    """The tile forward at N = 4096 with 2 warps (production's) and 4, fp32 and fp16 too, beside
    production and the peers. CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [(32768, 4096, torch.bfloat16), (4096, 4096, torch.float32), (4096, 4096, torch.float16),
                        (4096, 4096, torch.bfloat16), (256, 4096, torch.bfloat16)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        for warps in (2, 4):
            lab.run("fwd", s, f"tile r1 w{warps}", tile_forward(s, 1, warps))


def round_launch(lab: Lab) -> None:
    """The tile forward at the launch-bound shapes over rows per program and warps, beside
    production and the peers: production picks its launch by N, tuned on large M, and a program
    alone on its SM wants more warps (FORWARD_TILE's few_warps). CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16), (128, 257, torch.float32),
                        (128, 257, torch.float16)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        if not lab.smoke:
            lab.production(s)
            peers(lab, s)
        for rows, warps in itertools.product([1, 2, 4, 8], [1, 2, 4, 8, 16]):
            if rows > 1 and (m == 1 or n > 1024) or rows * triton.next_power_of_2(n) // (32 * warps) < 1:
                continue
            lab.run("fwd", s, f"tile rows {rows} w{warps}", tile_forward(s, rows, warps))


def round_narrow(lab: Lab) -> None:
    """The tile forward at the narrow widths over rows per program and warps, few rows to many,
    beside production and the peers. CUDA-graph timing."""
    lab.time_with_graphs()
    bf16, fp32 = torch.bfloat16, torch.float32
    plan = [
        (128, bf16, (256, 4096, 65536, 262144), (4, 8, 16, 32), (1, 2, 4)),
        (256, bf16, (256, 4096, 65536), (2, 4, 8, 16), (1, 2, 4)),
        (512, bf16, (256, 4096, 65536), (1, 2, 4, 8), (1, 2, 4)),
        (257, fp32, (128, 4096, 16384), (1, 2, 4, 8), (1, 2, 4)),
        (1024, bf16, (256, 4096, 65536), (1, 2, 4), (1, 2, 4)),
    ]
    if lab.smoke:
        plan = [(128, fp32, (3,), (4,), (1,))]
    for n, dtype, ms, rows_list, warps_list in plan:
        for m in ms:
            s = lab.shape(m, n, dtype)
            if not lab.smoke:
                lab.production(s, backward=False)
                peers(lab, s)
            for rows, warps in itertools.product(rows_list, warps_list):
                lab.run("fwd", s, f"tile rows {rows} w{warps}", tile_forward(s, rows, warps))


def round_even(lab: Lab) -> None:
    """Production's forward (forward_tile without masks, EVEN, for launches of at most
    EVEN_MAX_ROWS rows with N the tile width) beside the same kernel with its masks and without
    (only where M is a multiple of the rows per program, as a launcher would have to ask) and the
    peers, from 1 to 32768 rows of 4096; up to 1024 rows also with 4 and 8 warps (Liger runs 8 at
    N = 4096). With the L2 flushed, then CUDA-graph replays."""
    cases = [(3, 4096, torch.bfloat16)] if lab.smoke else [
        (1, 4096, torch.bfloat16), (64, 4096, torch.bfloat16), (256, 4096, torch.bfloat16),
        (512, 4096, torch.bfloat16), (1024, 4096, torch.bfloat16), (256, 2048, torch.bfloat16),
        (4096, 4096, torch.bfloat16), (32768, 4096, torch.bfloat16)]  # fmt: skip
    for graphs in (False,) if lab.smoke else (False, True):
        if graphs:
            lab.time_with_graphs()
        for m, n, dtype in cases:
            s = lab.shape(m, n, dtype)
            if not lab.smoke:
                lab.production(s, backward=False)
                peers(lab, s)
            rows, warps = launch.forward_config(n, m <= launch.TUNING.EVEN_MAX_ROWS)[1:]
            evens = (False, True) if s["m"] % rows == 0 else (False,)
            for even, w in itertools.product(evens, sorted({warps, 4, 8} if m <= 1024 else {warps})):
                lab.run("fwd", s, f"tile EVEN={even} rows{rows} w{w}", tile_forward(s, rows, w, even))


def round_reduce(lab: Lab) -> None:
    """The dw reduction alone (reduce_columns over production's (programs, N) scratch, just
    written, so read from L2 as in a call) at production's launch and over BLOCK_P, BLOCK_C and
    warps, beside production's backward kernel alone and the whole backward; then over the wide
    backward's short scratch. CUDA-graph timing."""
    lab.time_with_graphs()
    cases = [(65536, 1024, torch.bfloat16), (32768, 4096, torch.bfloat16), (4096, 4096, torch.bfloat16),
             (4096, 4096, torch.float32), (256, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16),
             (8192, 16384, torch.bfloat16)]  # fmt: skip
    for m, n, dtype in cases:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        # Production's backward kernel here: the tile or the two-walk one (N <= TWO_WALK_MAX).
        tile = n <= launch.BACKWARD_MAX_TILE
        plan = launch._backward_tile_plan if tile else launch._backward_chunked_plan
        rows, warps, per_sm, constexprs = plan(n, True, False, True, 0)
        kernel = kernels.backward_tile if tile else kernels.backward_chunked
        programs = launch.backward_programs(triton.cdiv(s["m"], rows), per_sm, lab.sms)
        partial = torch.empty(programs, n, device=lab.device)

        def dx_kernel():
            kernel[(programs,)](s["x"], s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n,
                                programs, n, n, n, n, 0.0, *constexprs, num_warps=warps)  # fmt: skip

        def with_reduce(block_p, block_c, reduce_warps):
            reduce = reduce_columns_call(partial, s["dw"], programs, n, block_p, block_c, reduce_warps)

            def both():
                dx_kernel()
                reduce()

            return both, reduce

        plan = launch._reduce_plan(n, programs)
        both, _ = with_reduce(*plan.constexprs, plan.num_warps)
        lab.run("bwd", s, f"dx kernel alone ({programs} programs)", both, dx_kernel)
        for block_p, block_c, reduce_warps in itertools.product([16, 32, 64, 128], [8, 16, 32, 64, 128],
                                                                [2, 4, 8]):  # fmt: skip
            if not 512 <= block_p * block_c <= 4096 or block_c > n:
                continue
            if lab.smoke and (block_p, block_c, reduce_warps) != (32, 64, 4):
                continue
            both, reduce = with_reduce(block_p, block_c, reduce_warps)
            lab.run("bwd", s, f"reduce alone p{block_p} c{block_c} w{reduce_warps}", both, reduce)
    # The wide backward's scratch: one row per row group of the one-launch backward (33 at
    # 2048x65536 on 132 SMs), and of the two launches (66). Filled with random values and checked
    # against torch's sum; timed unchecked beside production's plan.
    for rows, n in [(2, 64)] if lab.smoke else [(33, 65536), (66, 65536), (33, 131072), (66, 32768)]:
        partial = torch.randn(rows, n, device=lab.device)
        expected = partial.sum(0)
        out = torch.empty(n, device=lab.device)
        s = dict(name=f"scratch {rows}x{n}", x=out)  # x: the bytes _record counts (here the sum)
        plan = launch._reduce_plan(n, rows)
        plans = {"production": (plan.num_warps, plan.constexprs)}
        for block_p, block_c, reduce_warps in itertools.product([16, 32, 64], [16, 32, 64, 128, 256], [4, 8]):
            if 512 <= block_p * block_c <= 8192 and not lab.smoke:
                plans[f"p{block_p} c{block_c} w{reduce_warps}"] = (reduce_warps, (block_p, block_c))
        for variant, (reduce_warps, (block_p, block_c)) in plans.items():
            reduce = reduce_columns_call(partial, out, rows, n, block_p, block_c, reduce_warps)
            out.fill_(float("nan"))
            reduce()
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
            if lab.smoke:
                print(f"bwd {s['name']:>20} reduce {variant:<37} checked", flush=True)
                continue
            lab.time_reference(s, f"reduce {variant}", reduce)


ROUNDS = {
    "two-walk": round_two_walk,
    "small": round_small,
    "prefetch": round_prefetch,
    "reorder2": round_reorder2,
    "launch": round_launch,
    "narrow": round_narrow,
    "even": round_even,
    "reduce": round_reduce,
}


ROUNDS_HELP = """\
Rounds and the constants they tune (what each decided, with its figures: docs/performance-notes.md,
"Why the launch constants are what they are"):
  two-walk   forward_looped's chunk, warps and L2 hints at N = 4096-16384, backward_chunked's
             chunk, warps and programs per SM (FORWARD_WALK_*, TWO_WALK_BACKWARD*)
  small      the tile backward with fewer programs than rows at small M (FEW_ROW_BLOCKS)
  prefetch   the tile backward over rows, warps, programs per SM and PREFETCH (BACKWARD_TILE)
  reorder2   the tile forward at N = 4096 with 2 and 4 warps (FORWARD_TILE)
  launch     the tile forward at launch-bound shapes over rows and warps (FORWARD_TILE's
             few_warps: a program alone on its SM wants more warps)
  narrow     the tile forward at N = 128-1024 over rows and warps, from 128 to 262144 rows
             (FORWARD_TILE's entries below 2048)
  even       forward_tile with and without masks, 1 to 32768 rows of 4096 (EVEN_MAX_ROWS)
  reduce     reduce_columns alone over production's scratch and the wide backward's (_reduce_plan)
Timing: medians with the L2 flushed before each call until a round switches to CUDA-graph replays
(small, prefetch, reorder2, launch, reduce; even times both). The wide backward's constants are
swept by tools/tune_sweep.py. Every other round the lab has run, with the kernel variants it
timed, is in tools/kernel_lab.py at commit 031e3fe8fb18; docs/performance-notes.md, "Rejected
variants", lists them with their figures.
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=ROUNDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
