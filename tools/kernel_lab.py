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
  split       rows wider than 16384 split over programs that exchange their sums through global
              memory (forward_split_kernel, backward_split_kernel; a ticket counter orders the
              programs so that waiting is safe): at best 76% of copy forward and 64% backward,
              slower than the walks at every width; not used.
  wide2       the wide two-walk forward with 16384-wide chunks and y's stores hinted evict_first
              (2048x65536: 140 against 148 µs), its second walk reversed (no change), and the
              split kernels spinning on loads or without tickets (still slower): chose the chunk
              and the store hint.
  wide3       the wide forward with its first walk unrolled (fwd_row4: 134 µs at 2048x65536,
              quack 133 in the same run) or the row kept in registers (slower: 137-152 µs);
              the tile backward with a row-wide tile at N = 8192 and 16384 (slower than the
              two-walk backward): chose the unrolled first walk.
  prefetch    the tile backward loading its next row block before working on the current one
              (32768x4096 234.7 to 203.6 µs, 65536x1024 121.0 to 109.1, 4096x4096 bf16 38.2 to
              33.8): chose it at N = 1024 and 4096. fwd_row4 beside the production wide forward
              with its first walk unrolled (134.4 against 140.3 µs at 2048x65536 bf16).
  reorder     loads issued before stores: the wide forward's unrolled second walk with every
              chunk's load first (2048x65536 bf16 136.0 µs, the previous kernel 140.3 in the
              prefetch round; quack 133.1, fwd_row4 133.7 in the same run); the two-walk backward with both walks unrolled and its second walk's loads
              first (bwd_chunked_v: 16384x8192 204.9 against 246.5 µs with 8 warps, 2 programs
              per SM; 8192x16384 217.9 against 277.8 with 16 warps, 1 per SM; prefetching the next
              row or a row tile with prefetch was slower); the tile forward at 2 warps per row
              (32768x4096 128.0 against 131.6 µs). Chose all three.
  reorder2    those choices in production beside the lab variants, fp32 and 256x4096 too: the
              same figures within 1.5 µs; the wide forward launched straight into the checked
              buffer ran as production (136.5 µs), so the gap to fwd_row4 is in the kernel.
  tile2       the tile forward with L2 hints and 1-4 warps, and the tile backward at N = 1024
              over rows, warps and programs per SM: nothing faster than production.
  offset      (removed with the flag it timed) the forward kernels adding the weight offset
              only when it is nonzero: 2048x65536 135.9 against 136.6 µs in bf16, 135.5 against
              136.2 in fp16, the tile shapes level; not kept.
  hints3      the wide forward's L2 hints with the L2 flushed before each call, as the page
              times, 2048x65536 bf16: production's hints stay the fastest (140.6 µs; the other
              variants 141.4-156.3, 16 warps 146.7). A probe of the same variants with quack
              installed: production 140.2-141.0, the others 140.9-156.5, quack 135.4-136.1.

  ahead       the wide backward in one cooperative launch (backward_ahead_kernel): segment sums
              posted LOOKAHEAD rows ahead of their use, so x and dy come from HBM once. 8192-wide
              segments, 8 warps, two programs per SM, one row ahead: 257.6 against 322.2 µs at
              2048x65536 (two launches); chose it (kernels.backward_wide_fused).
  ahead2      self-validating sum slots in place of the counter, and the next row's loads issued
              before the current row's dx: no faster, or too many registers for two programs
              per SM.
  ahead3      the one launch with narrower segments and more programs per SM at the same 128
              registers: 4096-wide segments of 4 warps, four per SM, 246.8 against 257.3 µs at
              2048x65536 (249.6 against 256.5 at 4096x32768, 253.0 against 263.2 at
              1024x131072); 2048-wide of 2 warps, eight per SM, 256.2, 245.9 and 295.0; three per
              SM or 4-warp 2048-wide segments slower. Chose the first
              (launch.FUSED_SEGMENT, FUSED_WARPS, FUSED_PER_SM).
  carry       the one-launch wide backward with each row's x and dy carried in registers to the
              step that finishes it (read once from HBM, no L2 re-read). Within 128 registers
              only 4096-wide segments with 8 warps (two programs per SM) or 8192-wide with 16
              (one) fit; 8192-wide with 8 warps takes 202-254. At best 269.4 µs at 2048x65536
              (8192-wide, 16 warps, self-validating slots) against production's 256.6, and
              340-388 µs with the release counter: not used.
  launch      the tile forward at the launch-bound shapes over rows per program and warps
              (CUDA-graph timing): no launch beats production by more than 0.1 µs (1x4096 bf16
              1.6 against 1.7 µs; 256x4096 2.5 at every launch; 128x257 1.6), so the launch
              stays chosen by N alone. torch.compile and Liger run 0.1-0.2 µs faster at
              256x4096 (2.3 µs) and torch.compile 0.1 faster at 128x257.
  launch2     the tile forward at those shapes as a 1-D block (fwd_tile_1d): unmasked at N = 4096
              it ran 2.2 µs at 256x4096 against production's 2.5 (Liger 2.4, torch.compile 2.3);
              the hardware rsqrt changed nothing measurable. A follow-up (launch3, on commit
              759691d, since removed with the flag it measured) gave forward_tile an unmasked
              variant for N = BLOCK_N and one row per program: 2.3 against 2.5 µs at 256x4096,
              level at 1x4096, but slower at every large shape the tile forward runs (32768x4096
              bf16 131.6-131.8 against 128.0 µs with masks, 4096x4096 bf16 19.2-19.3 against
              18.0, fp16 19.1 against 17.5, fp32 35.3-35.4 against 34.2), so the masks stay.
  maxnreg     the forward kernels with registers per thread capped (Triton's maxnreg) so that
              more programs fit on an SM: every cap that raised occupancy spilled or slowed the
              kernel (65536x1024: 40 registers for the 2-row tile, 66.3 against production's 65.9
              µs, CUDA-graph timing; 2048x65536: 32 for the 32-warp walk, 153-172 against 136.6;
              32768x4096: 128 or 96 for the 2-warp tile, 164-414 against 129.4); not used.
  l2prefetch  the wide forward prefetching a later row into L2 (inline PTX prefetch, one per
              128-byte line): one program per row prefetching 1-3 SM-counts ahead, or persistent
              with one or two programs per SM, before or between the walks: 141.4-187 µs at
              2048x65536 against production's 136.6 (CUDA-graph timing); not used.
  row4gap     fwd_row4 with production's differences one at a time (2048x65536 bf16, CUDA-graph
              timing): N as the row stride and no offset add 134.2 µs, the add 134.7, runtime
              strides 136.0, both 136.6 = production. Chose N as the stride where rows are
              contiguous and the add only for a nonzero offset (production then 134.3).
  stride      the same two asked of the tile forward (fwd_tile_s) at N = 1024 and 4096: within
              the spread (65536x1024 65.8-66.1 against 66.3 µs; 32768x4096 128.1-128.8 against
              129.7; 4096x4096 fp16 17.8-18.2 against 17.7); not used.
  fahead      the wide forward as the one-launch backward runs (forward_ahead_kernel: segment
              sums of squares posted one or two rows ahead of their use, a cooperative grid),
              2048-16384-wide segments, 2-16 warps, 1-8 programs per SM, y's store hint, the
              finishing row's L2 load issued first or last: at best 188.7 µs at 2048x65536
              (66% of copy, 4096-wide segments of 4 warps, four per SM) against production's
              136.7 in the same run (CUDA-graph timing; 142.0 against 188.7-410 with the L2
              flushed), and 190-410 µs against 128-131 at 4096x32768 and 8192x16384. The
              forward does too little per element for the exchange to hide behind: not used.
  even        forward_tile without masks (EVEN) from 1 to 32768 rows of 4096, beside the masked
              kernel and the peers, 2, 4 and 8 warps up to 1024 rows (CUDA-graph timing):
              unmasked 2.3-2.4 µs at 256x4096 against 2.5 masked (Liger 2.3-2.4, torch.compile
              2.5), level at 1-64 and 512 rows, slower at 1024 (4.7 against 4.6), 4096x4096
              (19.1-19.2 against 18.0-18.1) and 32768x4096 (131.7-131.8 against 127.9-128.4).
              Chose EVEN for launches of at most 256 rows (launch.EVEN_MAX_ROWS). 4 or 8 warps
              ran 0.1 µs faster than 2 at 1 and 64 rows, level at 256: within the 0.1 µs the
              lab reports, so the warps stay chosen by N.
  even2       the same at many rows of 1024 and 2048 (the unmasked kernel only where M is a
              multiple of the rows per program): 65536x1024 66.4 against 66.7 µs masked,
              16384x1024 18.5 against 18.6, N = 2048 level; torch.compile 65.7 and 17.6 in the
              same run. Not used: within the spread, and short of torch.compile. Inductor's
              kernel there (tools/inductor_code.py, dumped on the H200) is a persistent
              reduction of XBLOCK rows with no masks, the row stride a constant and the weight
              loaded evict_last (its XBLOCK and warps were not read out).
  rows1024    the tile forward at N = 1024 over 2, 4 and 8 rows per program, 4 and 8 warps, with
              and without masks. Inductor's heuristics give that kernel 8 rows with 8 warps (its
              one persistent-reduction config in torch 2.13's triton_heuristics; the H200 runs 2.11). At
              65536x1024, CUDA-graph timing: production (2 rows, 4 warps) 66.0 µs, unmasked
              65.9, 8 rows with 8 warps 66.8-66.9, the other launches 67.8-74.1; torch.compile
              65.3. At 16384x1024: production 18.6, nothing faster; torch.compile 17.6. The
              launch is not what puts torch.compile ahead at N = 1024; not used.
  rsqrt       the tile forward's per-row costs that Inductor's kernel does not pay, each
              switched off (fwd_tile_r): the correctly rounded rsqrt (for the hardware one), the
              r store, 64-bit row offsets; beside a device copy of the same bytes at the large
              shapes. 65536x1024 bf16: no r store 68.6 against 70.0 µs with the L2 flushed, 65.5
              against 66.0 in CUDA-graph replays (16384x1024: 21.6 against 22.0, 18.1 against
              18.4); the hardware rsqrt and 32-bit offsets within the spread (32768x4096: the
              hardware rsqrt 131.2 against 128.6). The copy of the same bytes: 68.6 and 65.1 µs
              at 65536x1024, 129.9 and 127.7 at 2048x65536 (production's walked forward 138.9
              and 134.6, quack 135.1 and 132.9). Chose: no r store where no backward follows.
  splitrow    the wide forward with a row shared by 2, 4 or 8 programs, each walking the whole
              row for the sum of squares and scaling its own part (no exchange; smaller units of
              work for extra L2 reads), 8192- or 16384-wide chunks, 16 or 32 warps, the first
              walk rotated to start at the program's own part or not. Slower at every setting:
              2048x65536 bf16 at best 143.2 µs against production's 134.3 (CUDA-graph timing;
              146.1 against 139.0 flushed), 4096x32768 at best 137.7 against 128.6; 4 and 8
              programs per row 164-457 µs. Not used.
  reduce      the dw reduction alone over production's scratch, by columns per program, scratch
              rows per step and warps, beside the backward kernel alone, and over the wide
              backward's short scratch (33-66 rows of 32768-131072): 64-column strips of 4
              warps took 2.9-7.3 µs at the tall scratch of the large shapes (7.3 at 65536x1024,
              16 programs over 528 rows), 16-column strips of 8 warps 2.0-3.1 (2.5), but
              4.1-10.5 at the short ones, where strips of N / 256 columns with 4 warps took
              3.3-4.6 (64-column strips 3.3-6.0). Chose both (launch._reduce_plan).

The first four rounds were run on the H200 as separate scripts and merged into this file; from
this file the H200 has run lean, static, confirm, tile1d, small, split, wide2, wide3,
prefetch, reorder, reorder2, tile2, offset, hints3, ahead, ahead2, carry, launch, launch2,
ahead3, fahead, maxnreg, l2prefetch, row4gap, stride, even, even2, rows1024, rsqrt,
splitrow and reduce. Every round passes --smoke.
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
def fwd_walk_order(
    X, W, Y, RSTD, eps, N: tl.constexpr, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr, FIRST_POLICY: tl.constexpr,
    STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """forward_looped (N a multiple of BLOCK_N, no masks) with the second walk optionally run
    backwards, so that it starts on the chunks the first walk read last (still in L2 when a row's
    chunks do not all stay there), and a cache hint on y's stores."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x_row = X + row * N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.range(0, N // BLOCK_N):
        x = tl.load(x_row + k * BLOCK_N + cols, eviction_policy=FIRST_POLICY).to(tl.float32)
        acc += x * x
    rstd = kernels._rsqrt_rn(tl.sum(acc, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    for k in tl.range(0, N // BLOCK_N):
        if REVERSE:
            start = (N // BLOCK_N - 1 - k) * BLOCK_N
        else:
            start = k * BLOCK_N
        x = tl.load(x_row + start + cols, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(W + start + cols).to(tl.float32)
        tl.store(
            Y + row * N + start + cols, (x * rstd * w).to(Y.dtype.element_ty), eviction_policy=STORE_POLICY
        )


@triton.jit
def _widen(x, SHIFT: tl.constexpr):
    """bf16 -> fp32 as a bit shift when SHIFT: not the extension the first walk uses, so the
    compiler keeps the bf16 values, not fp32 copies of them, alive between the walks."""
    if SHIFT:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def fwd_row4(
    X, W, Y, RSTD, eps, N: tl.constexpr, BLOCK: tl.constexpr, KEEP: tl.constexpr, SHIFT: tl.constexpr,
    FIRST_POLICY: tl.constexpr, STORE_POLICY: tl.constexpr,
):  # fmt: skip
    """One program per row of N = 4 * BLOCK: the first walk unrolled (all four chunk loads issued
    together); with KEEP the chunks stay in registers for the scale (the row read once), else they
    are read again from L2."""
    row = tl.program_id(0).to(tl.int64)
    base = X + row * N
    cols = tl.arange(0, BLOCK)
    x0 = tl.load(base + cols, eviction_policy=FIRST_POLICY)
    x1 = tl.load(base + BLOCK + cols, eviction_policy=FIRST_POLICY)
    x2 = tl.load(base + 2 * BLOCK + cols, eviction_policy=FIRST_POLICY)
    x3 = tl.load(base + 3 * BLOCK + cols, eviction_policy=FIRST_POLICY)
    f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    total = tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=0)
    rstd = kernels._rsqrt_rn(total / N + eps)
    tl.store(RSTD + row, rstd)
    if not KEEP:
        x0, x1, x2, x3 = _row4_reload(base, cols, BLOCK)
    y = Y + row * N + cols
    dt = Y.dtype.element_ty
    w0 = tl.load(W + cols).to(tl.float32)
    tl.store(y, (_widen(x0, SHIFT) * rstd * w0).to(dt), eviction_policy=STORE_POLICY)
    w1 = tl.load(W + BLOCK + cols).to(tl.float32)
    tl.store(y + BLOCK, (_widen(x1, SHIFT) * rstd * w1).to(dt), eviction_policy=STORE_POLICY)
    w2 = tl.load(W + 2 * BLOCK + cols).to(tl.float32)
    tl.store(y + 2 * BLOCK, (_widen(x2, SHIFT) * rstd * w2).to(dt), eviction_policy=STORE_POLICY)
    w3 = tl.load(W + 3 * BLOCK + cols).to(tl.float32)
    tl.store(y + 3 * BLOCK, (_widen(x3, SHIFT) * rstd * w3).to(dt), eviction_policy=STORE_POLICY)


@triton.jit
def _row4_rstd(base, cols, BLOCK: tl.constexpr, N: tl.constexpr, eps):
    """fwd_row4's first walk over a row of four chunks (all four loads issued together, kept in
    L2): the row's rstd."""
    x0 = tl.load(base + cols, eviction_policy="evict_last")
    x1 = tl.load(base + BLOCK + cols, eviction_policy="evict_last")
    x2 = tl.load(base + 2 * BLOCK + cols, eviction_policy="evict_last")
    x3 = tl.load(base + 3 * BLOCK + cols, eviction_policy="evict_last")
    f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    total = tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=0)
    return kernels._rsqrt_rn(total / N + eps)


@triton.jit
def _row4_reload(base, cols, BLOCK: tl.constexpr):
    """fwd_row4's second walk's loads: the row's four chunks back from L2 (then dropped)."""
    x0 = tl.load(base + cols, eviction_policy="evict_first")
    x1 = tl.load(base + BLOCK + cols, eviction_policy="evict_first")
    x2 = tl.load(base + 2 * BLOCK + cols, eviction_policy="evict_first")
    x3 = tl.load(base + 3 * BLOCK + cols, eviction_policy="evict_first")
    return x0, x1, x2, x3


@triton.jit
def _prefetch_to_l2(row_ptr, N: tl.constexpr, LINE: tl.constexpr, ON: tl.constexpr):
    """Ask L2 to fetch a row (one prefetch per LINE elements, a 128-byte line), kept with the
    first walk's evict_last priority. Nothing is loaded into registers. Off (ON = 0) under the
    interpreter, which has no inline assembly."""
    if ON:
        offs = tl.arange(0, N // LINE) * LINE
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [row_ptr + offs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def fwd_wide_prefetch(
    X, W, Y, RSTD, M, programs, eps, N: tl.constexpr, BLOCK: tl.constexpr, LINE: tl.constexpr,
    AHEAD: tl.constexpr, PERSISTENT: tl.constexpr, WHERE: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """fwd_row4's two walks (N = 4 * BLOCK, weight, no residual) with an L2 prefetch of a row
    processed later, so that an SM's HBM reads continue while it reduces and writes. Without
    PERSISTENT, program r (one per row) prefetches row r + AHEAD, which the in-order block
    dispatch starts about a row's time later; with it, ``programs`` programs walk rows r,
    r + programs, ... and each prefetches its own next row. WHERE: the prefetch is issued
    before the first walk (0) or between the walks (1)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if PERSISTENT:
        first = pid
        step = programs
    else:
        first = pid
        step = M
    for row in range(first, M, step):
        row64 = tl.cast(row, tl.int64)
        base = X + row64 * N
        if PERSISTENT:
            nxt = row + programs
        else:
            nxt = row + AHEAD
        if WHERE == 0:
            if nxt < M:
                _prefetch_to_l2(X + tl.cast(nxt, tl.int64) * N, N, LINE, PREFETCH)
        rstd = _row4_rstd(base, cols, BLOCK, N, eps)
        tl.store(RSTD + row, rstd)
        if WHERE == 1:
            if nxt < M:
                _prefetch_to_l2(X + tl.cast(nxt, tl.int64) * N, N, LINE, PREFETCH)
        x0 = tl.load(base + cols, eviction_policy="evict_first")
        x1 = tl.load(base + BLOCK + cols, eviction_policy="evict_first")
        x2 = tl.load(base + 2 * BLOCK + cols, eviction_policy="evict_first")
        x3 = tl.load(base + 3 * BLOCK + cols, eviction_policy="evict_first")
        y = Y + row64 * N + cols
        dt = Y.dtype.element_ty
        w0 = tl.load(W + cols).to(tl.float32)
        tl.store(y, (x0.to(tl.float32) * rstd * w0).to(dt), eviction_policy="evict_first")
        w1 = tl.load(W + BLOCK + cols).to(tl.float32)
        tl.store(y + BLOCK, (x1.to(tl.float32) * rstd * w1).to(dt), eviction_policy="evict_first")
        w2 = tl.load(W + 2 * BLOCK + cols).to(tl.float32)
        tl.store(y + 2 * BLOCK, (x2.to(tl.float32) * rstd * w2).to(dt), eviction_policy="evict_first")
        w3 = tl.load(W + 3 * BLOCK + cols).to(tl.float32)
        tl.store(y + 3 * BLOCK, (x3.to(tl.float32) * rstd * w3).to(dt), eviction_policy="evict_first")


@triton.jit
def fwd_row4_v(
    X, W, Y, RSTD, stride_x, stride_y, eps, offset, N: tl.constexpr, BLOCK: tl.constexpr,
    STRIDED: tl.constexpr, ADD_OFFSET: tl.constexpr, WIDE_ROW: tl.constexpr,
):  # fmt: skip
    """fwd_row4 (KEEP = 0) with production's differences one at a time: rows addressed by the
    runtime strides (STRIDED) instead of N, the weight offset added (ADD_OFFSET), the row base
    computed from a 64-bit row index (WIDE_ROW) or as fwd_row4 does."""
    if WIDE_ROW:
        row = tl.cast(tl.program_id(0), tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    if STRIDED:
        base = X + row * stride_x
        y = Y + row * stride_y
    else:
        base = X + row * N
        y = Y + row * N
    cols = tl.arange(0, BLOCK)
    rstd = _row4_rstd(base, cols, BLOCK, N, eps)
    tl.store(RSTD + row, rstd)
    x0, x1, x2, x3 = _row4_reload(base, cols, BLOCK)
    y = y + cols
    dt = Y.dtype.element_ty
    for k in tl.static_range(4):
        w = tl.load(W + k * BLOCK + cols).to(tl.float32)
        if ADD_OFFSET:
            w = offset + w
        if k == 0:
            xk = x0
        elif k == 1:
            xk = x1
        elif k == 2:
            xk = x2
        else:
            xk = x3
        tl.store(y + k * BLOCK, (xk.to(tl.float32) * rstd * w).to(dt), eviction_policy="evict_first")


@triton.jit
def _tile_block(M, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """The (ROWS, BLOCK_N) block of this program in the lab's copies of forward_tile (masked):
    its first row, row offsets within it, rows, columns, valid rows and the block's mask."""
    first = tl.program_id(0) * ROWS
    local = tl.arange(0, ROWS)
    rows = first + local
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    return first, local, rows, cols, row_ok, row_ok[:, None] & (cols < N)[None, :]


@triton.jit
def fwd_tile_s(
    X, W, Y, RSTD, M, N, stride_x, eps, offset, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    STRIDE: tl.constexpr, HAS_OFFSET: tl.constexpr,
):  # fmt: skip
    """forward_tile (weight, no residual, default casting) with the row stride a compile-time
    constant (STRIDE, for rows stored contiguously; 0: the runtime stride_x, and N for y, as
    production) and the weight offset added only with HAS_OFFSET."""
    first, local, rows, cols, row_ok, mask = _tile_block(M, N, BLOCK_N, ROWS)
    first64 = first.to(tl.int64)
    local64 = local.to(tl.int64)[:, None]
    if STRIDE:
        x_ptrs = (X + first64 * STRIDE) + local64 * STRIDE
        y_ptrs = (Y + first64 * STRIDE) + local64 * STRIDE
    else:
        x_ptrs = (X + first64 * stride_x) + local64 * stride_x
        y_ptrs = (Y + first64 * N) + local64 * N
    x = tl.load(x_ptrs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w_raw = tl.load(W + cols, mask=cols < N, other=0.0)
    rstd = kernels._rsqrt_rn(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    w = w_raw.to(tl.float32)
    if HAS_OFFSET:
        w = offset + w
    tl.store(y_ptrs + cols[None, :], (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_chunk(row_ptr, k: tl.constexpr, CHUNK: tl.constexpr, N, ok, POLICY: tl.constexpr):
    """Chunk k of one row (zeros where the row is past M or the chunk past N)."""
    c = k * CHUNK + tl.arange(0, CHUNK)
    return tl.load(row_ptr + c, mask=ok & (c < N), other=0.0, eviction_policy=POLICY)


@triton.jit
def _row_chunks(x_row, dy_row, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, N, ok, POLICY: tl.constexpr):
    """A row's x and dy chunks (x0-x3, d0-d3), loads issued together; with two chunks the last
    two of each are the second again, never loaded."""
    x0 = _row_chunk(x_row, 0, CHUNK, N, ok, POLICY)
    d0 = _row_chunk(dy_row, 0, CHUNK, N, ok, POLICY)
    x1 = _row_chunk(x_row, 1, CHUNK, N, ok, POLICY)
    d1 = _row_chunk(dy_row, 1, CHUNK, N, ok, POLICY)
    x2 = x1
    d2 = d1
    x3 = x1
    d3 = d1
    if CHUNKS == 4:
        x2 = _row_chunk(x_row, 2, CHUNK, N, ok, POLICY)
        d2 = _row_chunk(dy_row, 2, CHUNK, N, ok, POLICY)
        x3 = _row_chunk(x_row, 3, CHUNK, N, ok, POLICY)
        d3 = _row_chunk(dy_row, 3, CHUNK, N, ok, POLICY)
    return x0, x1, x2, x3, d0, d1, d2, d3


@triton.jit
def _chunk_dot(x, dy, W, k: tl.constexpr, CHUNK: tl.constexpr, N):
    """u * x of one loaded chunk (u = dy * w)."""
    c = k * CHUNK + tl.arange(0, CHUNK)
    w = tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return dy.to(tl.float32) * w * x.to(tl.float32)


@triton.jit
def _chunk_dx(x, dy, W, dx_row, k: tl.constexpr, CHUNK: tl.constexpr, N, rstd, mean_uxn):
    """dx of one loaded chunk, stored; returns its dw terms dy * xn."""
    c = k * CHUNK + tl.arange(0, CHUNK)
    w = tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    xn = x.to(tl.float32) * rstd
    dyf = dy.to(tl.float32)
    dx = (dyf * w - xn * mean_uxn) * rstd
    tl.store(dx_row + c, dx.to(dx_row.dtype.element_ty), mask=c < N)
    return dyf * xn


@triton.jit
def bwd_chunked_v(
    X, W, DY, RSTD, DX, DW_PARTIAL, M, N, programs, stride,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, LOAD_ALL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """backward_chunked (weight, no dh, no casting) with both walks unrolled over CHUNKS (2 or
    4) chunks. LOAD_ALL: the second walk issues every chunk's x and dy loads before its first
    store. PREFETCH: the next row's first-walk loads are issued before this row's second walk,
    so they are in flight during it (the row's chunks then live in registers across the loop)."""
    tl.static_assert(CHUNKS == 2 or CHUNKS == 4)
    pid = tl.program_id(0)
    dw0 = tl.zeros((CHUNK,), dtype=tl.float32)
    dw1 = tl.zeros((CHUNK,), dtype=tl.float32)
    dw2 = tl.zeros((CHUNK,), dtype=tl.float32)
    dw3 = tl.zeros((CHUNK,), dtype=tl.float32)
    first = pid.to(tl.int64) * stride
    first_ok = pid < M * PREFETCH  # without PREFETCH these loads are masked off: placeholders
    px0, px1, px2, px3, pd0, pd1, pd2, pd3 = _row_chunks(X + first, DY + first, CHUNK, CHUNKS, N, first_ok,
                                                         "evict_last")  # fmt: skip
    for row in range(pid, M, programs):
        base = tl.cast(row, tl.int64) * stride
        x_row = X + base
        dy_row = DY + base
        if not PREFETCH:
            px0, px1, px2, px3, pd0, pd1, pd2, pd3 = _row_chunks(
                x_row, dy_row, CHUNK, CHUNKS, N, True, "evict_last"
            )
        dot = _chunk_dot(px0, pd0, W, 0, CHUNK, N) + _chunk_dot(px1, pd1, W, 1, CHUNK, N)
        if CHUNKS == 4:
            dot += _chunk_dot(px2, pd2, W, 2, CHUNK, N) + _chunk_dot(px3, pd3, W, 3, CHUNK, N)
        rstd = tl.load(RSTD + row)
        mean_uxn = tl.sum(dot, axis=0) * rstd / N
        if PREFETCH:
            following = row + programs
            nxt = tl.cast(following, tl.int64) * stride
            px0, px1, px2, px3, pd0, pd1, pd2, pd3 = _row_chunks(X + nxt, DY + nxt, CHUNK, CHUNKS, N, following < M,
                                                                 "evict_last")  # fmt: skip
        dx_row = DX + base
        if LOAD_ALL:
            x0, x1, x2, x3, d0, d1, d2, d3 = _row_chunks(x_row, dy_row, CHUNK, CHUNKS, N, True, "evict_first")
            dw0 += _chunk_dx(x0, d0, W, dx_row, 0, CHUNK, N, rstd, mean_uxn)
            dw1 += _chunk_dx(x1, d1, W, dx_row, 1, CHUNK, N, rstd, mean_uxn)
            if CHUNKS == 4:
                dw2 += _chunk_dx(x2, d2, W, dx_row, 2, CHUNK, N, rstd, mean_uxn)
                dw3 += _chunk_dx(x3, d3, W, dx_row, 3, CHUNK, N, rstd, mean_uxn)
        else:  # chunk by chunk: each chunk's loads after the previous chunk's store
            dw0 += _chunk_dx(_row_chunk(x_row, 0, CHUNK, N, True, "evict_first"),
                             _row_chunk(dy_row, 0, CHUNK, N, True, "evict_first"), W, dx_row, 0, CHUNK, N, rstd,
                             mean_uxn)  # fmt: skip
            dw1 += _chunk_dx(_row_chunk(x_row, 1, CHUNK, N, True, "evict_first"),
                             _row_chunk(dy_row, 1, CHUNK, N, True, "evict_first"), W, dx_row, 1, CHUNK, N, rstd,
                             mean_uxn)  # fmt: skip
            if CHUNKS == 4:
                dw2 += _chunk_dx(_row_chunk(x_row, 2, CHUNK, N, True, "evict_first"),
                                 _row_chunk(dy_row, 2, CHUNK, N, True, "evict_first"), W, dx_row, 2, CHUNK, N, rstd,
                                 mean_uxn)  # fmt: skip
                dw3 += _chunk_dx(_row_chunk(x_row, 3, CHUNK, N, True, "evict_first"),
                                 _row_chunk(dy_row, 3, CHUNK, N, True, "evict_first"), W, dx_row, 3, CHUNK, N, rstd,
                                 mean_uxn)  # fmt: skip
    out = DW_PARTIAL + pid.to(tl.int64) * N + tl.arange(0, CHUNK)
    tl.store(out, dw0)
    tl.store(out + CHUNK, dw1)
    if CHUNKS == 4:
        tl.store(out + 2 * CHUNK, dw2)
        tl.store(out + 3 * CHUNK, dw3)


@triton.jit
def forward_split_kernel(
    X,
    RES,
    W,
    Y,
    H,
    RSTD,
    SYNC,  # int32 [1 + M * SEGMENTS], all -1 at launch: a ticket counter, then one slot per segment
    stride_x,
    stride_res,
    stride_y,
    stride_h,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CASTING: tl.constexpr,
    SEGMENT: tl.constexpr,  # segment width, a power of two; the last segment may be partial
    SEGMENTS: tl.constexpr,  # segments per row, cdiv(N, SEGMENT)
    SEGMENTS_POW2: tl.constexpr,  # SEGMENTS rounded up to a power of two
    N: tl.constexpr,
    SPIN_LOAD: tl.constexpr = 0,
    TICKETS: tl.constexpr = 1,
):
    """Wide rows read once: each row is split into SEGMENTS segments, one program per segment,
    and each program holds its segment in registers from load to store. The programs of a row
    exchange their partial sums of squares through SYNC:

        partial[s] = sum over segment s of x^2          one fp32 sum per program
        r          = 1 / sqrt(sum over s of partial[s] / N + eps)

    Every program of the row waits for all SEGMENTS partials and adds them in the same fixed
    order, so all of them, and every run, get the same r. Against the two-walk path this drops
    the second read of the row (from L2) and keeps SEGMENTS programs' loads in flight per row.

    Waiting on other programs is safe only if they are running. A program therefore takes its
    (row, segment) from a ticket counter when it starts, not from its program id: tickets go to
    programs that are already resident, in order, so every row whose tickets are all out has all
    its programs resident and finishes; only the row holding the newest ticket can be waiting,
    and the slots that the finished rows free start the programs that complete it. The launcher
    keeps SEGMENTS far below the programs a GPU holds at once. (The interpreter runs programs one
    after another, so there SEGMENTS is 1: no program waits.)

    A partial is >= 0 (or NaN, whose sign bit is cleared before publishing), so its fp32 bits
    read as a non-negative int32 and -1 marks "not yet".
    """
    if TICKETS:
        ticket = tl.atomic_add(SYNC, 1, sem="relaxed") + 1
    else:
        ticket = tl.program_id(0)
    row = ticket // SEGMENTS
    segment = ticket % SEGMENTS
    row64 = tl.cast(row, tl.int64)
    cols = segment * SEGMENT + tl.arange(0, SEGMENT)
    mask = cols < N
    x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(RES + row64 * stride_res + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        x = (x.to(tl.float32) + res.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + row64 * stride_h + cols, x, mask=mask)
    xf = x.to(tl.float32)
    partial = tl.sum(xf * xf, axis=0)

    slots = SYNC + 1 + row64 * SEGMENTS
    tl.atomic_xchg(slots + segment, partial.to(tl.int32, bitcast=True) & 0x7FFFFFFF, sem="release")
    others = tl.arange(0, SEGMENTS_POW2)
    present = others < SEGMENTS
    if SPIN_LOAD:
        bits = tl.load(slots + others, mask=present, other=0, volatile=True)
        while tl.min(tl.where(present, bits, 0), axis=0) < 0:
            bits = tl.load(slots + others, mask=present, other=0, volatile=True)
    else:
        bits = tl.atomic_add(slots + others, 0, mask=present, sem="acquire")
        while tl.min(tl.where(present, bits, 0), axis=0) < 0:
            bits = tl.atomic_add(slots + others, 0, mask=present, sem="acquire")
    total = tl.sum(tl.where(present, bits.to(tl.float32, bitcast=True), 0.0), axis=0)
    rstd = kernels._rsqrt_rn(total / N + eps)
    if segment == 0:
        tl.store(RSTD + row, rstd)

    xn = xf * rstd
    if CASTING == 1:
        xn = xn.to(x.dtype).to(tl.float32)
    if HAS_WEIGHT:
        xn = xn * (offset + w.to(tl.float32))
    tl.store(Y + row64 * stride_y + cols, xn.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def backward_split_kernel(
    X,  # as in backward_tile
    W,
    DY,
    DH,
    RSTD,
    DX,
    DW_PARTIAL,  # fp32 scratch [groups, N]: one row per row group (if COMPUTE_DW)
    SYNC,  # int32 [1 + M * SEGMENTS], all -1 at launch: a ticket counter, then one slot per segment
    M,
    N,
    groups,  # row groups: the programs of group g handle rows g, g + groups, ...
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    SEGMENT: tl.constexpr,  # segment width, a power of two; the last segment may be partial
    SEGMENTS: tl.constexpr,  # segments per row, cdiv(N, SEGMENT)
    SEGMENTS_POW2: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next row's x and dy before waiting on this row's sums
    SPIN_LOAD: tl.constexpr = 0,
):
    """Wide rows in one pass: SEGMENTS programs per row group, one per column segment, each
    holding its segment of a row in registers and its share of dw in registers across the group's
    rows. Per row the programs of the group exchange their partial sums of u * x through SYNC
    (as forward_split exchanges its sums of squares), so x and dy are read once:

        partial[s] = sum over segment s of u * x        u = dy * (offset + w)
        c          = r * (sum over s of partial[s]) / N   added in a fixed order: deterministic
        dx         = r * (u - x * r * c)

    Tickets make the waiting safe (see forward_split). A partial may be negative, so its slot
    holds its fp32 bits with NaN made canonical (0x7FC00000): -1 (0xFFFFFFFF, a NaN pattern that
    then cannot occur) marks "not yet"."""
    ticket = tl.atomic_add(SYNC, 1, sem="relaxed") + 1
    g = ticket // SEGMENTS
    segment = ticket % SEGMENTS
    cols = segment * SEGMENT + tl.arange(0, SEGMENT)
    col_ok = cols < N
    if HAS_WEIGHT:
        scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    others = tl.arange(0, SEGMENTS_POW2)
    present = others < SEGMENTS
    dw_acc = tl.zeros((SEGMENT,), dtype=tl.float32)
    if PREFETCH:
        first = tl.cast(g, tl.int64)
        ok = col_ok & (g < M)
        x_next = tl.load(X + first * stride_x + cols, mask=ok, other=0.0, eviction_policy="evict_first")
        dy_next = tl.load(DY + first * stride_dy + cols, mask=ok, other=0.0, eviction_policy="evict_first")
    for row in range(g, M, groups):
        row64 = tl.cast(row, tl.int64)
        if PREFETCH:
            x_raw = x_next
            dy = dy_next.to(tl.float32)
            nxt = row64 + groups
            ok = col_ok & (nxt < M)
            x_next = tl.load(X + nxt * stride_x + cols, mask=ok, other=0.0, eviction_policy="evict_first")
            dy_next = tl.load(DY + nxt * stride_dy + cols, mask=ok, other=0.0, eviction_policy="evict_first")
        else:
            x_raw = tl.load(
                X + row64 * stride_x + cols, mask=col_ok, other=0.0, eviction_policy="evict_first"
            )
            dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0, eviction_policy="evict_first")
            dy = dy.to(tl.float32)
        rstd = tl.load(RSTD + row)
        x = x_raw.to(tl.float32)
        if HAS_WEIGHT:
            u = dy * scale
        else:
            u = dy
        partial = tl.sum(u * x, axis=0)
        bits = tl.where(partial != partial, 0x7FC00000, partial.to(tl.int32, bitcast=True))
        slots = SYNC + 1 + row64 * SEGMENTS
        tl.atomic_xchg(slots + segment, bits, sem="release")
        if SPIN_LOAD:
            seen = tl.load(slots + others, mask=present, other=0, volatile=True)
            while tl.max(tl.where(present, seen == -1, 0), axis=0) > 0:
                seen = tl.load(slots + others, mask=present, other=0, volatile=True)
        else:
            seen = tl.atomic_add(slots + others, 0, mask=present, sem="acquire")
            while tl.max(tl.where(present, seen == -1, 0), axis=0) > 0:
                seen = tl.atomic_add(slots + others, 0, mask=present, sem="acquire")
        total = tl.sum(tl.where(present, seen.to(tl.float32, bitcast=True), 0.0), axis=0)
        mean_uxn = total * rstd / N
        xn = x * rstd
        dx = (u - xn * mean_uxn) * rstd
        if HAS_DH:
            dx += tl.load(DH + row64 * stride_dh + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
        if COMPUTE_DW:
            if CASTING == 1:
                xn = xn.to(x_raw.dtype).to(tl.float32)
            dw_acc += dy * xn
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + tl.cast(g, tl.int64) * N + cols, dw_acc, mask=col_ok)


@triton.jit
def _post_segment_sum(DOT, COUNT, k, k64, seg, x, u, scale, SEGMENTS: tl.constexpr, SLOTS: tl.constexpr):
    """Post row k's sum of u * x over this segment: an fp32 sum and a release count in COUNT, or
    with SLOTS its bits into a self-validating slot of DOT (NaN made canonical, 0x7FC00000, so -1
    never occurs; no fence, COUNT unused). The exchange of the one-launch lab kernels."""
    partial = tl.sum(u.to(tl.float32) * scale * x.to(tl.float32), axis=0)
    if SLOTS:
        bits = tl.where(partial != partial, 0x7FC00000, partial.to(tl.int32, bitcast=True))
        tl.atomic_xchg(DOT + k64 * SEGMENTS + seg, bits, sem="relaxed", scope="gpu")
    else:
        tl.store(DOT + k64 * SEGMENTS + seg, partial)
        tl.debug_barrier()
        tl.atomic_add(COUNT + k, 1, sem="release", scope="gpu")


@triton.jit
def _row_total(DOT, COUNT, row, row64, others, SEGMENTS: tl.constexpr, SLOTS: tl.constexpr,
                 SPIN_LIMIT: tl.constexpr):  # fmt: skip
    """The fixed-order total of row's posted segment sums, once all are there."""
    present = others < SEGMENTS
    spins = 0
    if SLOTS:
        slots = DOT + row64 * SEGMENTS + others
        seen = tl.load(slots, mask=present, other=0, volatile=True)
        while (tl.max(tl.where(present & (seen == -1), 1, 0), axis=0) > 0) & (spins < SPIN_LIMIT):
            seen = tl.load(slots, mask=present, other=0, volatile=True)
            spins += 1
        total = tl.sum(tl.where(present, seen.to(tl.float32, bitcast=True), 0.0), axis=0)
    else:
        seen = tl.atomic_add(COUNT + row, 0, sem="acquire", scope="gpu")
        while (seen < SEGMENTS) & (spins < SPIN_LIMIT):
            seen = tl.atomic_add(COUNT + row, 0, sem="acquire", scope="gpu")
            spins += 1
        sums = tl.load(DOT + row64 * SEGMENTS + others, mask=present, other=0.0, cache_modifier=".cg")
        total = tl.sum(sums, axis=0)
    return total


@triton.jit
def forward_ahead_kernel(
    X,  # bf16/fp16/fp32 [M, N], weight, no residual, default casting
    W,
    Y,
    RSTD,
    SQ,  # fp32 [M, SEGMENTS]: each segment's sum of x^2
    COUNT,  # int32 [M], zeros at launch: segments of the row whose sums are posted
    M,
    N,
    groups,  # row groups: program (g, segment) handles rows g, g + groups, ...
    stride_x,
    stride_y,
    eps,
    offset,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    SEGMENTS_POW2: tl.constexpr,
    LOOKAHEAD: tl.constexpr,  # rows of the group between posting a row's sum and using it
    STORE_POLICY: tl.constexpr,  # L2 hint of y's stores
    EARLY: tl.constexpr,  # issue the finishing row's (L2) load before the posting row's sum
    SPIN_LIMIT: tl.constexpr,
):
    """The wide forward as backward_ahead_kernel runs the backward: program (g, segment) owns one
    column segment of a group of rows. At each step it sums x^2 over its segment of the row
    LOOKAHEAD rows ahead (loads kept in L2), posts the sum, then finishes the row LOOKAHEAD rows
    behind: waits for all its segments' sums (in steady state they are there), adds them in a
    fixed order, re-reads its x segment from L2 and stores y. x comes from HBM once, as in the
    two walks of forward_looped, but a program's unit of work is a segment rather than a whole
    row, so the launch fills and drains in a segment's time. Cooperative launch only."""
    g = tl.program_id(0)
    seg = tl.program_id(1)
    cols = seg * SEGMENT + tl.arange(0, SEGMENT)
    col_ok = cols < N
    scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    others = tl.arange(0, SEGMENTS_POW2)
    for k in range(g, M + LOOKAHEAD * groups, groups):
        row = k - LOOKAHEAD * groups
        row64 = tl.cast(row, tl.int64)
        if EARLY:
            x_old = tl.load(X + row64 * stride_x + cols, mask=col_ok & (row >= 0), other=0.0,
                            eviction_policy="evict_first")  # fmt: skip
        if k < M:  # post row k's sum of squares over this segment
            k64 = tl.cast(k, tl.int64)
            x = tl.load(X + k64 * stride_x + cols, mask=col_ok, other=0.0, eviction_policy="evict_last")
            _post_segment_sum(SQ, COUNT, k, k64, seg, x, x, 1.0, SEGMENTS, 0)
        if row >= 0:  # finish the row LOOKAHEAD steps behind
            total = _row_total(SQ, COUNT, row, row64, others, SEGMENTS, 0, SPIN_LIMIT)
            rstd = kernels._rsqrt_rn(total / N + eps)
            if seg == 0:
                tl.store(RSTD + row, rstd)
            if not EARLY:
                x_old = tl.load(
                    X + row64 * stride_x + cols, mask=col_ok, other=0.0, eviction_policy="evict_first"
                )
            y = x_old.to(tl.float32) * rstd * scale
            tl.store(Y + row64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=col_ok,
                     eviction_policy=STORE_POLICY)  # fmt: skip


@triton.jit
def backward_ahead_kernel(
    X,  # as in backward_tile (weight, no dh, default casting)
    W,
    DY,
    RSTD,
    DX,
    DW_PARTIAL,  # fp32 scratch [groups, N]: one row per row group
    DOT,  # fp32 [M, SEGMENTS]: each segment's sum of u * x
    COUNT,  # int32 [M], zeros at launch: segments of the row whose sums are posted
    M,
    N,
    groups,  # row groups: program (g, segment) handles rows g, g + groups, ...
    stride_x,
    stride_dy,
    stride_dx,
    offset,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    SEGMENTS_POW2: tl.constexpr,
    LOOKAHEAD: tl.constexpr,  # rows of the group between posting a row's sum and using it
    DX_POLICY: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,  # bound on the wait (lab safety: a broken exchange gives wrong dx, not a hang)
):
    """The segmented backward in one launch, its exchange run ahead of its use. Program
    (g, segment) owns one column segment of a group of rows (its dw share in registers, as in
    backward_wide). At each step it sums u * x over its segment of the row LOOKAHEAD rows ahead
    (loads kept in L2), posts that sum in DOT and counts it in COUNT (release), then finishes the
    row LOOKAHEAD rows behind: waits until all SEGMENTS sums of that row are posted (acquire),
    adds them in a fixed order, re-reads its x and dy segment from L2 and stores dx. The sums
    arrive LOOKAHEAD steps before they are needed, so in steady state nothing waits, and x and dy
    are read once from HBM (the two-launch segmented backward reads them twice). Launched as a
    cooperative grid: every program is resident, so waiting on the group's other programs is
    safe."""
    g = tl.program_id(0)
    seg = tl.program_id(1)
    cols = seg * SEGMENT + tl.arange(0, SEGMENT)
    col_ok = cols < N
    scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    others = tl.arange(0, SEGMENTS_POW2)
    dw_acc = tl.zeros((SEGMENT,), dtype=tl.float32)
    for k in range(g, M + LOOKAHEAD * groups, groups):
        if k < M:  # post row k's sum over this segment
            k64 = tl.cast(k, tl.int64)
            x = tl.load(X + k64 * stride_x + cols, mask=col_ok, other=0.0, eviction_policy="evict_last")
            u = tl.load(DY + k64 * stride_dy + cols, mask=col_ok, other=0.0, eviction_policy="evict_last")
            _post_segment_sum(DOT, COUNT, k, k64, seg, x, u, scale, SEGMENTS, 0)
        row = k - LOOKAHEAD * groups
        if row >= 0:  # finish the row LOOKAHEAD steps behind
            row64 = tl.cast(row, tl.int64)
            total = _row_total(DOT, COUNT, row, row64, others, SEGMENTS, 0, SPIN_LIMIT)
            rstd = tl.load(RSTD + row)
            mean_uxn = total * rstd / N
            x_raw = tl.load(
                X + row64 * stride_x + cols, mask=col_ok, other=0.0, eviction_policy="evict_first"
            )
            dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0, eviction_policy="evict_first")
            dy = dy.to(tl.float32)
            xn = x_raw.to(tl.float32) * rstd
            dx = (dy * scale - xn * mean_uxn) * rstd
            tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok,
                     eviction_policy=DX_POLICY)  # fmt: skip
            dw_acc += dy * xn
    tl.store(DW_PARTIAL + tl.cast(g, tl.int64) * N + cols, dw_acc, mask=col_ok)


@triton.jit
def backward_ahead2_kernel(
    X,  # as in backward_ahead_kernel
    W,
    DY,
    RSTD,
    DX,
    DW_PARTIAL,
    DOT,  # int32 [M, SEGMENTS]: each segment's sum of u * x as fp32 bits; -1 at launch ("not yet")
    M,
    N,
    groups,
    stride_x,
    stride_dy,
    stride_dx,
    offset,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    SEGMENTS_POW2: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
    PRE_ISSUE: tl.constexpr,  # issue the ahead row's loads before finishing the row behind
    SPIN_LIMIT: tl.constexpr,
):
    """backward_ahead_kernel with self-validating slots instead of a counter: each sum is posted
    by one relaxed exchange of its bits (NaN made canonical, 0x7FC00000, so -1 never occurs), and
    the row behind waits until none of its slots reads -1. No fence orders the post after earlier
    stores, so a post does not wait for the previous row's dx stores to drain."""
    g = tl.program_id(0)
    seg = tl.program_id(1)
    cols = seg * SEGMENT + tl.arange(0, SEGMENT)
    col_ok = cols < N
    scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    others = tl.arange(0, SEGMENTS_POW2)
    dw_acc = tl.zeros((SEGMENT,), dtype=tl.float32)
    for k in range(g, M + LOOKAHEAD * groups, groups):
        k64 = tl.cast(k, tl.int64)
        ahead_ok = col_ok & (k < M)
        if PRE_ISSUE:
            x = tl.load(X + k64 * stride_x + cols, mask=ahead_ok, other=0.0, eviction_policy="evict_last")
            u = tl.load(DY + k64 * stride_dy + cols, mask=ahead_ok, other=0.0, eviction_policy="evict_last")
        else:
            if k < M:
                x = tl.load(X + k64 * stride_x + cols, mask=ahead_ok, other=0.0, eviction_policy="evict_last")
                u = tl.load(
                    DY + k64 * stride_dy + cols, mask=ahead_ok, other=0.0, eviction_policy="evict_last"
                )
                _post_segment_sum(DOT, DOT, k, k64, seg, x, u, scale, SEGMENTS, 1)
        row = k - LOOKAHEAD * groups
        if row >= 0:
            row64 = tl.cast(row, tl.int64)
            total = _row_total(DOT, DOT, row, row64, others, SEGMENTS, 1, SPIN_LIMIT)
            rstd = tl.load(RSTD + row)
            mean_uxn = total * rstd / N
            # production's dx step (weight, no dh, default casting, every access evict_first)
            dw_acc += kernels._wide_segment_dx(X, DY, DY, DX, row64, cols, col_ok, scale, rstd, mean_uxn,
                                               stride_x, stride_dy, 0, stride_dx, True, False, 0, "evict_first")  # fmt: skip
        if PRE_ISSUE:
            if k < M:
                _post_segment_sum(DOT, DOT, k, k64, seg, x, u, scale, SEGMENTS, 1)
    tl.store(DW_PARTIAL + tl.cast(g, tl.int64) * N + cols, dw_acc, mask=col_ok)


@triton.jit
def backward_carry_kernel(
    X,  # as in backward_ahead_kernel (weight, no dh, default casting)
    W,
    DY,
    RSTD,
    DX,
    DW_PARTIAL,
    DOT,  # fp32 [M, SEGMENTS] with COUNT, or int32 slots (-1 at launch) with SLOTS
    COUNT,  # int32 [M], zeros at launch (unused with SLOTS)
    M,
    N,
    groups,
    stride_x,
    stride_dy,
    stride_dx,
    offset,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    SEGMENTS_POW2: tl.constexpr,
    SLOTS: tl.constexpr,  # the exchange: 0 a release counter, 1 self-validating slots
    POST_FIRST: tl.constexpr,  # 1: post row k before finishing row k - 1; 0: after
    RELOAD_SCALE: tl.constexpr,  # 1: re-read offset + w at each step instead of holding it in registers
    SPIN_LIMIT: tl.constexpr,
):
    """The one-launch segmented backward with each row's x and dy carried in registers from the
    step that loads them to the step that finishes the row, instead of re-read from L2
    (backward_ahead_kernel with LOOKAHEAD = 1). At step k a program issues row k's loads, then
    (POST_FIRST = 0) finishes row k - 1 from the registers while they fly, then sums and posts
    row k; or (POST_FIRST = 1) sums and posts row k first. x and dy are read once, from HBM only."""
    g = tl.program_id(0)
    seg = tl.program_id(1)
    cols = seg * SEGMENT + tl.arange(0, SEGMENT)
    col_ok = cols < N
    if not RELOAD_SCALE:
        scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    others = tl.arange(0, SEGMENTS_POW2)
    dw_acc = tl.zeros((SEGMENT,), dtype=tl.float32)
    g64 = tl.cast(g, tl.int64)
    x_prev = tl.load(X + g64 * stride_x + cols, mask=col_ok, other=0.0, eviction_policy="evict_first")
    u_prev = tl.load(DY + g64 * stride_dy + cols, mask=col_ok, other=0.0, eviction_policy="evict_first")
    if RELOAD_SCALE:
        scale = offset + tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(
            tl.float32
        )
    _post_segment_sum(DOT, COUNT, g, g64, seg, x_prev, u_prev, scale, SEGMENTS, SLOTS)
    for k in range(g + groups, M + groups, groups):
        k64 = tl.cast(k, tl.int64)
        ahead_ok = col_ok & (k < M)
        x = tl.load(X + k64 * stride_x + cols, mask=ahead_ok, other=0.0, eviction_policy="evict_first")
        u = tl.load(DY + k64 * stride_dy + cols, mask=ahead_ok, other=0.0, eviction_policy="evict_first")
        if RELOAD_SCALE:
            scale = offset + tl.load(W + cols, mask=col_ok, other=0.0, eviction_policy="evict_last").to(
                tl.float32
            )
        if POST_FIRST:
            if k < M:
                _post_segment_sum(DOT, COUNT, k, k64, seg, x, u, scale, SEGMENTS, SLOTS)
        row = k - groups
        row64 = tl.cast(row, tl.int64)
        total = _row_total(DOT, COUNT, row, row64, others, SEGMENTS, SLOTS, SPIN_LIMIT)
        rstd = tl.load(RSTD + row)
        mean_uxn = total * rstd / N
        dy = u_prev.to(tl.float32)
        xn = x_prev.to(tl.float32) * rstd
        dx = (dy * scale - xn * mean_uxn) * rstd
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok,
                 eviction_policy="evict_first")  # fmt: skip
        dw_acc += dy * xn
        if not POST_FIRST:
            if k < M:
                _post_segment_sum(DOT, COUNT, k, k64, seg, x, u, scale, SEGMENTS, SLOTS)
        x_prev = x
        u_prev = u
    tl.store(DW_PARTIAL + g64 * N + cols, dw_acc, mask=col_ok)


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


@triton.jit
def fwd_tile_r(
    X, W, Y, RSTD, M, N, stride_x, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    HW_RSQRT: tl.constexpr, STORE_RSTD: tl.constexpr, ADDR32: tl.constexpr,
):  # fmt: skip
    """forward_tile (weight, no residual, default casting, masked) with three of its per-row
    costs switchable: HW_RSQRT takes the hardware rsqrt (as Inductor's libdevice.rsqrt) instead
    of the correctly rounded one, STORE_RSTD off skips the per-row r store (a forward that no
    backward will follow), ADDR32 computes row offsets in 32-bit (valid while M * stride fits)."""
    first, local, rows, cols, row_ok, mask = _tile_block(M, N, BLOCK_N, ROWS)
    if ADDR32:
        x_ptrs = X + rows[:, None] * stride_x
        y_ptrs = Y + rows[:, None] * N
    else:
        first64 = first.to(tl.int64)
        local64 = local.to(tl.int64)[:, None]
        x_ptrs = (X + first64 * stride_x) + local64 * stride_x
        y_ptrs = (Y + first64 * N) + local64 * N
    x = tl.load(x_ptrs + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w_raw = tl.load(W + cols, mask=cols < N, other=0.0)
    mean_square = tl.sum(x * x, axis=1) / N + eps
    if HW_RSQRT:
        rstd = tl.rsqrt(mean_square)
    else:
        rstd = kernels._rsqrt_rn(mean_square)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    y = x * rstd[:, None] * w_raw.to(tl.float32)[None, :]
    tl.store(y_ptrs + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def fwd_split_row(
    X, W, Y, eps, N: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, ROTATE: tl.constexpr,
):  # fmt: skip
    """The wide forward with each row shared by SPLIT programs and no exchange between them:
    every program walks the whole row for the sum of squares (evict_last), then re-reads and
    scales only its own 1/SPLIT of the row. Each program's unit of work is 1/SPLIT of a row, at
    the price of SPLIT - 1 extra reads of the row from L2. ROTATE: a program's first walk starts
    at its own segment, so that each chunk comes from HBM once, by its owner, and the others
    find it in L2; else all start at chunk 0 and meet on the same lines. Rows contiguous, N a
    multiple of SPLIT * BLOCK, with at most four chunks per program's segment; a weight, no
    offset, default casting, no r stored."""
    CHUNKS: tl.constexpr = N // BLOCK
    PER: tl.constexpr = CHUNKS // SPLIT
    tl.static_assert(PER * SPLIT * BLOCK == N and PER <= 4, "N = SPLIT * BLOCK * (1 to 4)")
    pid = tl.program_id(0)
    row = pid // SPLIT
    seg = pid % SPLIT
    cols = tl.arange(0, BLOCK)
    x_row = X + row.to(tl.int64) * N
    y_row = Y + row.to(tl.int64) * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        if ROTATE:
            k = (seg * PER + c) % CHUNKS
        else:
            k = c
        x = tl.load(x_row + k * BLOCK + cols, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = kernels._rsqrt_rn(tl.sum(acc, axis=0) / N + eps)
    start = seg * (PER * BLOCK)
    x0 = tl.load(x_row + start + cols, eviction_policy="evict_first")
    x1 = x0
    x2 = x0
    x3 = x0
    if PER > 1:
        x1 = tl.load(x_row + start + BLOCK + cols, eviction_policy="evict_first")
    if PER > 2:
        x2 = tl.load(x_row + start + 2 * BLOCK + cols, eviction_policy="evict_first")
    if PER > 3:
        x3 = tl.load(x_row + start + 3 * BLOCK + cols, eviction_policy="evict_first")
    kernels._store_scaled(x0, y_row, W, start + cols, N, rstd, 0.0, "evict_first", True, False, 0, False)
    if PER > 1:
        kernels._store_scaled(
            x1, y_row, W, start + BLOCK + cols, N, rstd, 0.0, "evict_first", True, False, 0, False
        )
    if PER > 2:
        kernels._store_scaled(
            x2, y_row, W, start + 2 * BLOCK + cols, N, rstd, 0.0, "evict_first", True, False, 0, False
        )
    if PER > 3:
        kernels._store_scaled(
            x3, y_row, W, start + 3 * BLOCK + cols, N, rstd, 0.0, "evict_first", True, False, 0, False
        )


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

    def flushed_then_graphs(self):
        """For a round's loop: yields False (calls timed with the L2 flushed before each, as the
        performance page times), then True after switching to CUDA-graph replays; only False
        under --smoke."""
        yield False
        if not self.smoke:
            self.time_with_graphs()
            yield True

    def forward_shapes(self, cases, with_peers: bool = False):
        """For a forward round: under each timing (flushed_then_graphs), each case ((M, N) or
        (M, N, dtype)) as a shape dict, yielded once production's forward and, ``with_peers``,
        the peers have been timed on it."""
        for _graphs in self.flushed_then_graphs():
            for case in cases:
                s = self.shape(*case)
                self.production_forward(s)
                if with_peers and not self.smoke:
                    peers(self, s)
                yield s

    def production_forward(self, s: dict) -> None:
        """The production forward at this shape, the baseline of a forward round (not under
        --smoke)."""
        if self.smoke:
            return
        x, w = s["x"], s["w"]

        def fwd():
            return launch.forward(x, w, None, EPS, 0.0, 0, x.dtype, x.dtype)

        self.run("fwd", s, "production", lambda: s["y"].copy_(fwd()[0]), fwd)

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
        try:
            us = self.median_us(timed or fn)
        except Exception as exc:  # e.g. a launch that graph capture rejects
            print(f"{kind} {s['name']:>20} {variant:<44} timing failed: {type(exc).__name__} {str(exc)[:80]}",
                  flush=True)  # fmt: skip
            return
        self._record(kind, s, variant, us)

    def time_reference(self, s: dict, variant: str, fn) -> None:
        """Time ``fn``, a point of reference that computes no RMSNorm (a copy of the same bytes,
        say), unchecked; the summary does not count it as a variant."""
        if self.smoke:
            return
        self._record("fwd", s, variant, self.median_us(fn), reference=True)

    def _record(self, kind: str, s: dict, variant: str, us: float, **marks) -> None:
        """Keep and print one timed row: µs and the fraction of the copy ceiling its bytes reach
        (forward 2, backward 3 tensors of x's size)."""
        units = 2 if kind == "fwd" else 3
        frac = units * s["x"].numel() * s["x"].element_size() / (us * 1e-6) / 1e12 / self.copy_tbs
        self.rows.append(
            dict(kind=kind, shape=s["name"], variant=variant, us=us, frac=frac, timing=self.timing, **marks)
        )
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
        _grid, warps, (block_p, block_c) = launch._reduce_plan(s["n"], programs)
        reduce_columns_call(partial, s["dw"], programs, s["n"], block_p, block_c, warps)()

    def summary(self, out: str | None) -> None:
        best: dict[tuple, dict] = {}
        for r in self.rows:
            key = (r["kind"], r["shape"], r["timing"])
            peer = r["variant"] in ("production", "torch F.rms_norm", "torch.compile", "liger", "quack")
            if not peer and not r.get("reference"):
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        print("\nbest variant per shape and timing, against production in the same timing:")
        for (kind, shape, timing), r in best.items():
            prod = next(
                (
                    p
                    for p in self.rows
                    if (p["kind"], p["shape"], p["timing"], p["variant"])
                    == (kind, shape, timing, "production")
                ),
                None,
            )
            line = f"{kind} {shape:>20} {timing:<7} {r['variant']:<44} {r['us']:8.1f} us {r['frac']:6.1%}"
            if prod is not None:  # a shape may be timed without the production call
                line += f" | production {prod['us']:8.1f} us {prod['frac']:6.1%}"
            print(line)
        if out:
            with open(out, "w") as f:
                json.dump(dict(copy_tbs=self.copy_tbs, rows=self.rows), f, indent=1)


# ---------------------------------------------------------------------------------------------
# Rounds
# ---------------------------------------------------------------------------------------------


def tile_backward(lab: Lab, s: dict, programs: int, warps: int, constexprs: tuple):
    """The production backward_tile over ``programs`` programs with the given constexprs
    (HAS_WEIGHT, HAS_DH, COMPUTE_DW, CASTING, BLOCK_N, ROWS, PREFETCH), then the dw reduction,
    writing s["dx"], s["dw"]."""
    n = s["n"]
    partial = torch.empty(programs, n, device=lab.device)

    def call():
        kernels.backward_tile[(programs,)](
            s["x"], s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n, programs,
            n, n, n, n, 0.0, *constexprs, num_warps=warps)  # fmt: skip
        lab.reduce(s, partial, programs)

    return call


def tile_forward(s: dict, rows: int, warps: int):
    """The production forward_tile (weight, no residual) with ROWS = rows and the given warps,
    writing s["y"]; N a power of two."""
    x, m, n = s["x"], s["m"], s["n"]
    return lambda: kernels.forward_tile[(triton.cdiv(m, rows),)](
        x,
        x,
        s["w"],
        s["y"],
        x,
        s["rstd_out"],
        m,
        n,
        n,
        n,
        n,
        n,
        EPS,
        0.0,
        True,
        False,
        0,
        n,
        rows,
        num_warps=warps,
    )


def row4_forward(s: dict, warps: int, keep=0, shift=0, first_policy="evict_last", store="evict_first"):
    """fwd_row4 (N four chunks wide) at this shape, writing s["y"]."""
    n = s["n"]
    return lambda: fwd_row4[(s["m"],)](s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, n // 4, keep, shift,
                                       first_policy, store, num_warps=warps)  # fmt: skip


def chunked_backward(lab: Lab, s: dict, warps: int, per_sm: int, load_all: int, prefetch: int):
    """bwd_chunked_v over per_sm programs per SM (4096-wide chunks), then the dw reduction,
    writing s["dx"], s["dw"]."""
    n = s["n"]
    programs = min(s["m"], per_sm * lab.sms)
    partial = torch.empty(programs, n, device=lab.device)

    def call():
        bwd_chunked_v[(programs,)](s["x"], s["w"], s["dy"], s["rstd"], s["dx"], partial, s["m"], n, programs, n,
                                   4096, n // 4096, load_all, prefetch, num_warps=warps)  # fmt: skip
        lab.reduce(s, partial, programs)

    return call


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


def forward_looped(s: dict, block: int, warps: int, policies: tuple[str, str], store: str = "", unroll=False):
    """The production forward_looped (one program per row) with a chosen launch, writing s["y"]."""
    x, m, n = s["x"], s["m"], s["n"]
    args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], n, n, EPS, 0.0)
    # ..., N, CONTIGUOUS, HAS_OFFSET as production launches contiguous rows with a zero offset
    return lambda: kernels.forward_looped[(m,)](
        *args, True, False, 0, block, *policies, store, unroll, n, True, False, num_warps=warps
    )


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
    lab.time_with_graphs()
    for m, n, dtype in [(256, 4096, torch.bfloat16), (128, 257, torch.float32), (1024, 4096, torch.bfloat16),
                        (4096, 4096, torch.bfloat16), (4096, 4096, torch.float32)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        rows, warps, per_sm, constexprs = launch._backward_tile_plan(n, True, False, True, 0)
        blocks = triton.cdiv(s["m"], rows)
        for programs in sorted({16, 32, 64, 128, lab.sms, 2 * lab.sms, blocks}):
            if programs > blocks:
                continue
            lab.run("bwd", s, f"tile programs {programs}", tile_backward(lab, s, programs, warps, constexprs))
    s = lab.shape(32768, 4096)
    for hw, warps in itertools.product([0, 1], [4, 8]):
        lab.run("fwd", s, f"1d tile w{warps} {'hardware rsqrt' if hw else 'rsqrt_rn'}",
                lambda: fwd_tile_1d[(s["m"],)](s["x"], s["w"], s["y"], s["rstd_out"], 4096, 4096, EPS, 4096, 0, hw,
                                               num_warps=warps))  # fmt: skip


def forward_split(s: dict, segment: int, warps: int, spin_load: int = 0, tickets: int = 1):
    """The production forward_split with a chosen segment width and warps, writing s["y"]."""
    x, m, n = s["x"], s["m"], s["n"]
    segments = triton.cdiv(n, segment)
    constexprs = (True, False, 0, segment, segments, triton.next_power_of_2(segments), n, spin_load, tickets)

    def call():
        sync = torch.full((1 + m * segments,), -1, dtype=torch.int32, device=x.device)
        args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], sync, n, n, n, n, EPS, 0.0)
        forward_split_kernel[(m * segments,)](*args, *constexprs, num_warps=warps)

    return call


def backward_split(
    lab: Lab, s: dict, segment: int, warps: int, per_sm: int, prefetch: int, spin_load: int = 0
):
    """The production backward_split and dw reduction with a chosen launch, writing s["dx"], s["dw"]."""
    x, m, n = s["x"], s["m"], s["n"]
    segments, groups = launch._wide_grid(m, n, segment, per_sm, lab.sms)
    partial = torch.empty(groups, n, device=x.device)
    constexprs = (
        True,
        False,
        True,
        0,
        segment,
        segments,
        triton.next_power_of_2(segments),
        prefetch,
        spin_load,
    )

    def call():
        sync = torch.full((1 + m * segments,), -1, dtype=torch.int32, device=x.device)
        args = (x, s["w"], s["dy"], s["dy"], s["rstd"], s["dx"], partial, sync, m, n, groups, n, n, n, n, 0.0)
        backward_split_kernel[(groups * segments,)](*args, *constexprs, num_warps=warps)
        lab.reduce(s, partial, groups)

    return call


def round_split(lab: Lab) -> None:
    """The split forward (a row's segments on separate programs that exchange their sums of
    squares) at segment widths and warps, beside production, the two-walk forward and the peers,
    CUDA-graph timed. Under --smoke only one-segment launches run: the interpreter runs programs
    one after another, and a program of a split row waits for the others."""
    lab.time_with_graphs()
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


def backward_wide(lab: Lab, s: dict):
    """The segmented backward (backward_wide_dot, then backward_wide) as launched before the split
    backward, writing s["dx"], s["dw"]."""
    x, m, n = s["x"], s["m"], s["n"]
    seg, warps = launch.SEGMENT, launch.SEGMENT_WARPS
    segments = triton.cdiv(n, seg)
    groups = min(m, max(1, 2 * lab.sms // segments))
    partial = torch.empty(groups, n, device=x.device)

    def call():
        dot = torch.empty(m, segments, device=x.device)
        kernels.backward_wide_dot[(m, segments)](x, s["w"], s["dy"], dot, n, n, n, 0.0, segments, True, seg,
                                                 num_warps=warps)  # fmt: skip
        kernels.backward_wide[(groups, segments)](
            x, s["w"], s["dy"], s["dy"], s["rstd"], dot, s["dx"], partial, m, n, groups, n, n, n, n, 0.0, segments,
            True, False, True, 0, seg, triton.next_power_of_2(segments), num_warps=warps)  # fmt: skip
        lab.reduce(s, partial, groups)

    return call


def round_wide2(lab: Lab) -> None:
    """Rows of 32768-131072: the two-walk forward with its second walk reversed and y's stores
    hinted, and the split kernels spinning on loads instead of atomics, or without tickets,
    beside production, the segmented backward and the peers (CUDA-graph timing)."""
    lab.time_with_graphs()
    for m, n in [(2048, 65536), (1024, 131072), (4096, 32768)]:
        s = lab.shape(m, n)
        lab.production(s)
        peers(lab, s)
        for block, warps, reverse, first, store in itertools.product(
            [8192, 16384], [16, 32], [0, 1], ["evict_last", ""], ["", "evict_first"]
        ):
            lab.run("fwd", s, f"walk b{block} w{warps} rev{reverse} {first or '-'} store {store or '-'}",
                    lambda: fwd_walk_order[(s["m"],)](s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, block, reverse,
                                                      first, store, num_warps=warps))  # fmt: skip
        if lab.smoke:
            continue
        for segment, warps, spin_load, tickets in itertools.product([8192, 16384], [4, 8], [0, 1], [0, 1]):
            lab.run("fwd", s, f"split s{segment} w{warps} spinload{spin_load} tickets{tickets}",
                    forward_split(s, segment, warps, spin_load, tickets))  # fmt: skip
        lab.run("bwd", s, "segmented (backward_wide)", backward_wide(lab, s))
        for segment, warps, per_sm, spin_load in itertools.product([4096, 8192], [8], [1, 2], [0, 1]):
            lab.run("bwd", s, f"split s{segment} w{warps} p{per_sm} prefetch1 spinload{spin_load}",
                    backward_split(lab, s, segment, warps, per_sm, 1, spin_load))  # fmt: skip


def round_wide3(lab: Lab) -> None:
    """Rows of 32768 and 65536 held whole by one program (fwd_row4: the row read once, or its
    first walk unrolled), beside the two-walk forward with 16384-wide chunks and y's stores hinted
    evict_first; and the tile backward with a row-wide tile at N = 8192 and 16384 (one or two
    programs per SM) beside production. CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [
        (2048, 65536, torch.bfloat16),
        (4096, 32768, torch.bfloat16),
        (2048, 65536, torch.float16),
    ]:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        for block, store in itertools.product([8192, 16384], ["", "evict_first"]):
            lab.run("fwd", s, f"walk b{block} w32 store {store or '-'}",
                    lambda: fwd_walk_order[(s["m"],)](s["x"], s["w"], s["y"], s["rstd_out"], EPS, n, block, 0,
                                                      "evict_last", store, num_warps=32))  # fmt: skip
        shifts = [0, 1] if dtype == torch.bfloat16 else [0]
        for warps, keep, shift, store in itertools.product([16, 32], [0, 1], shifts, ["", "evict_first"]):
            if shift and not keep:
                continue
            policy = "evict_first" if keep else "evict_last"
            lab.run("fwd", s, f"row4 w{warps} keep{keep} shift{shift} store {store or '-'}",
                    row4_forward(s, warps, keep, shift, policy, store))  # fmt: skip
    for m, n in [(8192, 16384), (16384, 8192)]:
        s = lab.shape(m, n)
        lab.production(s)
        for warps, per_sm in itertools.product([8, 16, 32], [1, 2]):
            programs = min(s["m"], per_sm * lab.sms)
            constexprs = (True, False, True, 0, n, 1, 0)  # a row-wide tile, one row per step, no prefetch
            lab.run(
                "bwd", s, f"row tile w{warps} p{per_sm}", tile_backward(lab, s, programs, warps, constexprs)
            )


def round_prefetch(lab: Lab) -> None:
    """The tile backward with the next row block's loads issued before the current block's work
    (PREFETCH), at warps and programs per SM around production's, beside production; and the
    production wide forward (first walk unrolled, unmasked) beside fwd_row4. CUDA-graph timing."""
    lab.time_with_graphs()
    shapes = [(32768, 4096, torch.bfloat16), (65536, 1024, torch.bfloat16), (4096, 4096, torch.bfloat16),
              (4096, 4096, torch.float32), (256, 4096, torch.bfloat16)]  # fmt: skip
    for m, n, dtype in shapes:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        block_n, *_ = launch.backward_config(n)
        rows_options = [1, 2] if n <= 1024 else [1]
        for rows, warps, per_sm, prefetch in itertools.product(rows_options, [4, 8, 16], [1, 2, 4], [0, 1]):
            blocks = triton.cdiv(s["m"], rows)
            programs = min(blocks, per_sm * lab.sms)
            constexprs = (True, False, True, 0, block_n, rows, prefetch)
            lab.run("bwd", s, f"tile r{rows} w{warps} p{per_sm} prefetch{prefetch}",
                    tile_backward(lab, s, programs, warps, constexprs))  # fmt: skip
    for m, n, dtype in [(2048, 65536, torch.bfloat16), (2048, 65536, torch.float16)]:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        for warps in (16, 32):
            lab.run("fwd", s, f"row4 w{warps} keep0 store evict_first", row4_forward(s, warps))


def round_reorder(lab: Lab) -> None:
    """Loads issued earlier: the production wide forward, whose unrolled second walk now issues
    every chunk's load before its first store, beside fwd_row4 and quack; the two-walk forward
    at N = 8192 and 16384 unrolled the same way; the two-walk backward with its walks unrolled
    (bwd_chunked_v: the second walk's loads all first, the next row's first walk prefetched)
    and the tile backward with prefetch at N = 8192 and 16384; the tile forward's rows per
    program and warps at N = 1024 and 4096 beside the peers. CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [
        (2048, 65536, torch.bfloat16),
        (2048, 65536, torch.float16),
        (4096, 32768, torch.bfloat16),
    ]:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        lab.run("fwd", s, "row4 w32 keep0 store evict_first", row4_forward(s, 32))
    for m, n, dtype in [(32768, 4096, torch.bfloat16), (65536, 1024, torch.bfloat16), (4096, 4096, torch.bfloat16),
                        (4096, 4096, torch.float16)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        for rows, warps in itertools.product([1, 2, 4, 8], [2, 4, 8, 16]):
            if rows * n > 8192 or rows * n // (32 * warps) < 4:
                continue
            lab.run("fwd", s, f"tile r{rows} w{warps}", tile_forward(s, rows, warps))
    for m, n in [(16384, 8192), (8192, 16384)]:
        s = lab.shape(m, n)
        lab.production(s)
        peers(lab, s)
        for block, warps, unroll in itertools.product([4096, 8192], [16, 32], [0, 1]):
            if block >= n or (unroll and n > 4 * block):
                continue
            lab.run("fwd", s, f"walk b{block} w{warps} unroll{unroll}",
                    forward_looped(s, block, warps, ("evict_last", "evict_first"), "", unroll))  # fmt: skip
        for load_all, prefetch, warps, per_sm in itertools.product([0, 1], [0, 1], [4, 8, 16, 32], [1, 2]):
            lab.run("bwd", s, f"chunked loadall{load_all} prefetch{prefetch} w{warps} p{per_sm}",
                    chunked_backward(lab, s, warps, per_sm, load_all, prefetch))  # fmt: skip
        for warps, per_sm, prefetch in itertools.product([8, 16, 32], [1, 2], [0, 1]):
            programs = min(s["m"], per_sm * lab.sms)
            constexprs = (True, False, True, 0, n, 1, prefetch)
            lab.run("bwd", s, f"row tile w{warps} p{per_sm} prefetch{prefetch}",
                    tile_backward(lab, s, programs, warps, constexprs))  # fmt: skip


def round_reorder2(lab: Lab) -> None:
    """Confirmation of reorder's choices in production: the tile forward at N = 4096 with 2
    warps (4 beside it, fp32 too), the wide forward launched directly into the checked buffer
    beside production and fwd_row4, and the two-walk backward with its second walk's loads
    issued first beside bwd_chunked_v. CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n, dtype in [(32768, 4096, torch.bfloat16), (4096, 4096, torch.float32), (4096, 4096, torch.float16),
                        (4096, 4096, torch.bfloat16), (256, 4096, torch.bfloat16)]:  # fmt: skip
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        for warps in (2, 4):
            lab.run("fwd", s, f"tile r1 w{warps}", tile_forward(s, 1, warps))
    for m, n, dtype in [(2048, 65536, torch.bfloat16), (2048, 65536, torch.float16)]:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        peers(lab, s)
        wide = (
            launch.FORWARD_WIDE_BLOCK,
            launch.FORWARD_WIDE_WARPS,
            ("evict_last", "evict_first"),
            "evict_first",
            True,
        )
        lab.run("fwd", s, "forward_looped into y", forward_looped(s, *wide))
        lab.run("fwd", s, "row4 w32 keep0 store evict_first", row4_forward(s, 32))
    for m, n, warps, per_sm in [(16384, 8192, 8, 2), (8192, 16384, 16, 1)]:
        s = lab.shape(m, n)
        lab.production(s)
        lab.run(
            "bwd",
            s,
            f"chunked loadall1 prefetch0 w{warps} p{per_sm}",
            chunked_backward(lab, s, warps, per_sm, 1, 0),
        )


def round_tile2(lab: Lab) -> None:
    """The tile forward with the L2 hints (x evict_first, w evict_last) and 1-4 warps, and the
    tile backward at N = 1024 with 1-4 rows per step, 2-8 warps and 2-8 programs per SM (prefetch
    on), beside production and torch.compile. CUDA-graph timing."""
    lab.time_with_graphs()
    for m, n in [(65536, 1024), (32768, 4096)]:
        s = lab.shape(m, n)
        lab.production(s)
        peers(lab, s)
        for rows, warps, evict in itertools.product([1, 2, 4], [1, 2, 4], [0, 1]):
            if rows * n > 4096:
                continue
            lab.run("fwd", s, f"tile r{rows} w{warps} evict{evict}",
                    lambda: fwd_tile_v[(triton.cdiv(s["m"], rows),)](
                        s["x"], s["w"], s["y"], s["rstd_out"], s["m"], n, n, EPS, n, rows, evict, 0, 1,
                        num_warps=warps))  # fmt: skip
        if n != 1024:
            continue
        for rows, warps, per_sm in itertools.product([1, 2, 4], [2, 4, 8], [2, 4, 8]):
            programs = min(triton.cdiv(s["m"], rows), per_sm * lab.sms)
            constexprs = (True, False, True, 0, n, rows, 1)
            lab.run("bwd", s, f"tile r{rows} w{warps} p{per_sm} prefetch1",
                    tile_backward(lab, s, programs, warps, constexprs))  # fmt: skip


def round_hints3(lab: Lab) -> None:
    """The wide forward's L2 hints again, this time with the L2 flushed before each call as on the
    performance page (the earlier rounds that chose them timed CUDA-graph replays): first walk
    evict_last or none, second walk evict_first, none or evict_last, y's stores evict_first or
    none, and 16 warps, beside production and the peers."""
    s = lab.shape(2048, 65536)
    lab.production(s)
    peers(lab, s)
    unroll = s["n"] <= launch.FORWARD_WIDE_UNROLL * launch.FORWARD_WIDE_BLOCK
    block = launch.FORWARD_WIDE_BLOCK
    for first, second, store in itertools.product(
        ["evict_last", ""], ["evict_first", "", "evict_last"], ["evict_first", ""]
    ):
        name = f"wide first={first or '-'} second={second or '-'} store={store or '-'}"
        lab.run("fwd", s, name, forward_looped(s, block, 32, (first, second), store, unroll))
    lab.run(
        "fwd",
        s,
        "wide w16",
        forward_looped(s, block, 16, ("evict_last", "evict_first"), "evict_first", unroll),
    )


def _cooperative_wide(
    lab: Lab, s: dict, kernel, segment: int, warps: int, per_sm: int, variant: tuple, exchange
):
    """A wide-backward lab kernel with backward_ahead_kernel's parameters (its exchange buffers
    made per call by ``exchange(m, segments)``, its constexprs SEGMENT, SEGMENTS, SEGMENTS_POW2,
    then ``variant``, then SPIN_LIMIT) as a cooperative launch over ``per_sm`` programs per SM,
    then the dw reduction, writing s["dx"], s["dw"]."""
    x, m, n = s["x"], s["m"], s["n"]
    segments, groups = launch._wide_grid(m, n, segment, per_sm, lab.sms)
    partial = torch.empty(groups, n, device=x.device)
    constexprs = (segment, segments, triton.next_power_of_2(segments), *variant, 1 << 22)

    def call():
        buffers = exchange(m, segments)
        args = (x, s["w"], s["dy"], s["rstd"], s["dx"], partial, *buffers, m, n, groups, n, n, n, 0.0)
        kernel[(groups, segments)](*args, *constexprs, num_warps=warps, launch_cooperative_grid=not lab.smoke)
        lab.reduce(s, partial, groups)

    return call


def backward_ahead(lab: Lab, s: dict, segment: int, warps: int, per_sm: int, lookahead: int, dx_policy: str):
    """backward_ahead_kernel: per-segment sums in DOT, a zeroed counter per row."""

    def exchange(m, segments):
        dot = torch.empty(m, segments, device=s["x"].device)
        return dot, torch.zeros(m, dtype=torch.int32, device=s["x"].device)

    return _cooperative_wide(
        lab, s, backward_ahead_kernel, segment, warps, per_sm, (lookahead, dx_policy), exchange
    )


def round_ahead(lab: Lab) -> None:
    """The segmented backward in one cooperative launch whose per-segment sums are posted
    LOOKAHEAD rows ahead of their use (backward_ahead_kernel), at segment widths, warps, programs
    per SM and lookaheads, beside production (two launches: backward_wide_dot, backward_wide),
    CUDA-graph timed. Under --smoke only one-segment launches run (the interpreter runs programs
    one after another)."""
    lab.time_with_graphs()
    shapes = [(3, 8192)] if lab.smoke else [(2048, 65536), (1024, 131072), (4096, 32768)]
    for m, n in shapes:
        s = lab.shape(m, n)
        if not lab.smoke:
            lab.production(s)
        first = (m, n) == shapes[0]
        for (segment, warps), per_sm, lookahead, policy in itertools.product(
            [(4096, 4), (4096, 8), (8192, 8), (8192, 16)], [1, 2], [1, 2, 3], ["evict_first", ""]
        ):
            if lab.smoke and (n > segment or (per_sm, lookahead, policy) != (1, 1, "evict_first")):
                continue
            if (policy == "" or not first) and lookahead != 2 or (policy == "" and not first):
                continue
            lab.run("bwd", s, f"ahead s{segment} w{warps} p{per_sm} d{lookahead} dx {policy or '-'}",
                    backward_ahead(lab, s, segment, warps, per_sm, lookahead, policy))  # fmt: skip


def backward_ahead2(lab: Lab, s: dict, segment: int, warps: int, per_sm: int, lookahead: int, pre_issue: int):
    """backward_ahead2_kernel: self-validating sum slots, -1 ("not yet") at launch."""

    def exchange(m, segments):
        return (torch.full((m, segments), -1, dtype=torch.int32, device=s["x"].device),)

    return _cooperative_wide(
        lab, s, backward_ahead2_kernel, segment, warps, per_sm, (lookahead, pre_issue), exchange
    )


def round_ahead2(lab: Lab) -> None:
    """backward_ahead2_kernel (self-validating slots; the ahead row's loads issued before or after
    the row behind) beside backward_ahead_kernel's best launch from round ahead and production,
    CUDA-graph timed. Under --smoke only one-segment launches run."""
    lab.time_with_graphs()
    shapes = [(3, 8192)] if lab.smoke else [(2048, 65536), (4096, 32768), (1024, 131072)]
    for m, n in shapes:
        s = lab.shape(m, n)
        first = (m, n) == shapes[0]
        if not lab.smoke:
            lab.production(s)
            lab.run("bwd", s, "ahead s8192 w8 p2 d1 dx evict_first",
                    backward_ahead(lab, s, 8192, 8, 2, 1, "evict_first"))  # fmt: skip
        for (segment, warps, per_sm), lookahead, pre_issue in itertools.product(
            [(8192, 8, 2), (16384, 16, 1), (8192, 8, 1)], [1, 2], [0, 1]
        ):
            if lab.smoke and (n > segment or lookahead != 1):
                continue
            if not first and (segment, warps, per_sm) != (8192, 8, 2):
                continue
            lab.run("bwd", s, f"ahead2 s{segment} w{warps} p{per_sm} d{lookahead} pre{pre_issue}",
                    backward_ahead2(lab, s, segment, warps, per_sm, lookahead, pre_issue))  # fmt: skip


def backward_carry(
    lab: Lab, s: dict, segment: int, warps: int, per_sm: int, slots: int, post_first: int, reload: int
):
    """backward_carry_kernel with either exchange."""
    x = s["x"]

    def exchange(m, segments):
        if slots:  # COUNT unused: any int32 tensor
            return torch.full((m, segments), -1, dtype=torch.int32, device=x.device), s["rstd"]
        return torch.empty(m, segments, device=x.device), torch.zeros(m, dtype=torch.int32, device=x.device)

    return _cooperative_wide(
        lab, s, backward_carry_kernel, segment, warps, per_sm, (slots, post_first, reload), exchange
    )


def round_carry(lab: Lab) -> None:
    """backward_carry_kernel (each row's x and dy carried in registers to the step that finishes
    it: read once, from HBM only) at both exchanges, both orders, w held or re-read, beside
    production (backward_wide_fused), CUDA-graph timed. Launches that fit in 128 registers
    (sm_90, Triton 3.6, bf16): 4096-wide segments with 8 warps (two programs per SM) and
    8192-wide with 16 warps (one); 8192-wide with 8 warps takes 202-254. Under --smoke only
    one-segment launches run."""
    lab.time_with_graphs()
    shapes = [(3, 4096)] if lab.smoke else [(2048, 65536), (4096, 32768), (1024, 131072)]
    for m, n in shapes:
        s = lab.shape(m, n)
        first = (m, n) == shapes[0]
        if not lab.smoke:
            lab.production(s)
        launches = [(4096, 8, 2), (8192, 16, 1)]
        for (segment, warps, per_sm), slots, post_first, reload in itertools.product(
            launches, [0, 1], [0, 1], [0, 1]
        ):
            if lab.smoke and n > segment or not first and (slots, reload) != (0, 1):
                continue
            lab.run("bwd", s, f"carry s{segment} w{warps} p{per_sm} slots{slots} post{post_first} reload{reload}",
                    backward_carry(lab, s, segment, warps, per_sm, slots, post_first, reload))  # fmt: skip


def tile_forward_any(s: dict, rows: int, warps: int):
    """The production forward_tile (weight, no residual) at any N up to the tile width, with ROWS
    = rows and the given warps, writing s["y"]."""
    x, m, n = s["x"], s["m"], s["n"]
    args = (x, x, s["w"], s["y"], x, s["rstd_out"], m, n, n, n, n, n, EPS, 0.0)
    constexprs = (True, False, 0, triton.next_power_of_2(n), rows)
    return lambda: kernels.forward_tile[(triton.cdiv(m, rows),)](*args, *constexprs, num_warps=warps)


def round_launch(lab: Lab) -> None:
    """The tile forward at the launch-bound shapes (1x4096 and 256x4096 bf16, 128x257 fp32 and
    fp16) over rows per program and warps, beside production, torch.compile and Liger,
    CUDA-graph timed: production picks its launch by N alone, tuned on large M, and a program
    that is alone on its SM may want more warps."""
    lab.time_with_graphs()
    cases = [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16), (128, 257, torch.float32),
             (128, 257, torch.float16)]  # fmt: skip
    for m, n, dtype in cases:
        s = lab.shape(m, n, dtype)
        if not lab.smoke:
            lab.production(s)
            peers(lab, s)
        for rows, warps in itertools.product([1, 2, 4, 8], [1, 2, 4, 8, 16]):
            if rows > 1 and (m == 1 or n > 1024) or rows * triton.next_power_of_2(n) // (32 * warps) < 1:
                continue
            lab.run("fwd", s, f"tile rows {rows} w{warps}", tile_forward_any(s, rows, warps))


def round_launch2(lab: Lab) -> None:
    """What the tile forward's time at the launch-bound shapes is made of: fwd_tile_1d (one row
    per program as a 1-D block) with and without masks and with the correctly rounded or the
    hardware rsqrt, beside production, torch.compile and Liger, CUDA-graph timed. Round launch
    found no launch of the production kernel within 0.1 µs of the peers at 256x4096."""
    lab.time_with_graphs()
    cases = [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16), (128, 257, torch.float32),
             (128, 257, torch.float16)]  # fmt: skip
    for m, n, dtype in cases:
        s = lab.shape(m, n, dtype)
        if not lab.smoke:
            lab.production(s)
            peers(lab, s)
        block = triton.next_power_of_2(n)
        for hw, warps in itertools.product([0, 1], [1, 2, 4, 8] if n < 1024 else [2, 4, 8]):
            args = (s["x"], s["w"], s["y"], s["rstd_out"], n, n, EPS, block, int(n == block), hw)
            lab.run("fwd", s, f"1d tile w{warps} {'hardware rsqrt' if hw else 'rsqrt_rn'}",
                    lambda args=args, warps=warps: fwd_tile_1d[(s["m"],)](*args, num_warps=warps))  # fmt: skip


def round_ahead3(lab: Lab) -> None:
    """backward_ahead_kernel with narrower segments and more programs per SM at the same 128
    registers per thread (sm_90, bf16): 4096-wide with 4 warps (four programs per SM), 2048-wide
    with 2 (eight), and the narrower launches that take fewer registers (4096-wide with 8 warps,
    80, three per SM; 2048-wide with 4 warps, 72, six per SM), beside production's 8192-wide
    with 8 warps (two per SM), CUDA-graph timed. More programs per SM run more exchanges at
    once; round ahead measured 4096-wide segments with one or two programs per SM only."""
    lab.time_with_graphs()
    shapes = [(3, 4096)] if lab.smoke else [(2048, 65536), (4096, 32768), (1024, 131072)]
    for m, n in shapes:
        s = lab.shape(m, n)
        if not lab.smoke:
            lab.production(s)
        for segment, warps, per_sm in [(8192, 8, 2), (4096, 4, 4), (4096, 8, 3), (4096, 4, 3), (2048, 2, 8),
                                       (2048, 4, 6), (2048, 4, 4)]:  # fmt: skip
            if lab.smoke and n > segment:
                continue
            lab.run("bwd", s, f"ahead s{segment} w{warps} p{per_sm} d1 dx evict_first",
                    backward_ahead(lab, s, segment, warps, per_sm, 1, "evict_first"))  # fmt: skip


def forward_ahead(
    lab: Lab, s: dict, segment: int, warps: int, per_sm: int, lookahead: int, store: str, early: int
):
    """forward_ahead_kernel as a cooperative launch over ``per_sm`` programs per SM, writing s["y"]
    and s["rstd_out"]; the sums and the zeroed counter are made per call, as a launcher would."""
    x, m, n = s["x"], s["m"], s["n"]
    segments, groups = launch._wide_grid(m, n, segment, per_sm, lab.sms)
    constexprs = (segment, segments, triton.next_power_of_2(segments), lookahead, store, early, 1 << 22)

    def call():
        sq = torch.empty(m, segments, device=x.device)
        count = torch.zeros(m, dtype=torch.int32, device=x.device)
        args = (x, s["w"], s["y"], s["rstd_out"], sq, count, m, n, groups, n, n, EPS, 0.0)
        forward_ahead_kernel[(groups, segments)](*args, *constexprs, num_warps=warps,
                                                 launch_cooperative_grid=not lab.smoke)  # fmt: skip

    return call


def round_fahead(lab: Lab) -> None:
    """The wide forward in one cooperative launch whose segment sums of squares are posted
    LOOKAHEAD rows ahead of their use (forward_ahead_kernel), over segment widths, warps,
    programs per SM, lookahead, y's store hint and the early L2 load, beside production
    (forward_looped, one program per row), timed as the page times (L2 flushed before each
    call), then the best few again as CUDA-graph replays."""
    shapes = [(3, 4096)] if lab.smoke else [(2048, 65536), (4096, 32768), (8192, 16384)]
    launches = [(4096, 4, 4), (4096, 4, 3), (4096, 8, 2), (8192, 8, 2), (8192, 16, 1), (2048, 2, 8),
                (2048, 4, 4), (16384, 16, 1)]  # fmt: skip
    for graphs in lab.flushed_then_graphs():
        for m, n in shapes:
            s = lab.shape(m, n)
            lab.production_forward(s)
            for (segment, warps, per_sm), lookahead, store, early in itertools.product(
                launches, [1, 2], ["evict_first", ""], [0, 1]
            ):
                if lab.smoke and (n > segment or (per_sm, lookahead, store) != (4, 1, "evict_first")):
                    continue
                if graphs and (lookahead, store) != (1, "evict_first"):
                    continue
                if (m, n) != shapes[0] and (lookahead, store) != (1, "evict_first"):
                    continue
                lab.run("fwd", s, f"ahead s{segment} w{warps} p{per_sm} d{lookahead} st={store or '-'} e{early}",
                        forward_ahead(lab, s, segment, warps, per_sm, lookahead, store, early))  # fmt: skip


def _with_maxnreg(maxnreg: int | None) -> dict:
    """Launch options capping registers per thread (None: the compiler's choice)."""
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def _run_noting_registers(lab: Lab, s: dict, variant: str, launch_fn) -> None:
    """lab.run of a launch that returns its compiled kernel, then the kernel's registers and
    spills per thread (on a GPU)."""
    seen = {}

    def call():
        seen["kernel"] = launch_fn()

    lab.run("fwd", s, variant, call)
    kernel = seen.get("kernel")
    if not lab.smoke and kernel is not None and hasattr(kernel, "n_regs"):
        print(f"    {variant}: {kernel.n_regs} registers, {kernel.n_spills} spilled", flush=True)


def round_maxnreg(lab: Lab) -> None:
    """The forward kernels with registers per thread capped (Triton's ``maxnreg``), so that more
    programs fit on an SM: the tile forward at N = 1024 (production: 2 rows, 4 warps, 47
    registers, ten programs per SM) and 4096 (1 row, 2 warps, 147 registers, six per SM), the
    wide forward at N = 65536 (32 warps, 50 registers: one program per SM, so an SM idles
    between one row's walks and while the next program starts) and the two-walk forward at N =
    16384 (16 warps, 36 registers, three per SM), beside production, first with the L2 flushed
    before each call (as the page times), then as CUDA-graph replays."""
    policies = ("evict_last", "evict_first")
    tile = {1024: [(2, 4, None), (2, 4, 40), (2, 4, 32), (4, 4, None), (4, 4, 48), (4, 4, 32), (4, 8, 40),
                   (4, 8, 32), (2, 2, 32), (1, 4, None), (1, 2, 32), (8, 8, 32)],
            4096: [(1, 2, None), (1, 2, 128), (1, 2, 96), (1, 4, None), (1, 4, 64), (1, 4, 48)]}  # fmt: skip
    # (chunk, warps, unrolled, maxnreg, y's store hint)
    walks = {65536: [(16384, 32, True, None, "evict_first"), (16384, 32, True, 32, "evict_first"),
                     (8192, 32, False, None, "evict_first"), (8192, 32, False, 32, "evict_first"),
                     (8192, 16, False, None, "evict_first"), (8192, 16, False, 64, "evict_first"),
                     (16384, 16, True, 64, "evict_first"), (8192, 8, False, None, "evict_first"),
                     (4096, 8, False, None, "evict_first"), (4096, 16, False, None, "evict_first"),
                     (8192, 32, False, 32, "")],
             16384: [(8192, 16, False, None, ""), (8192, 16, False, 32, ""), (4096, 8, False, None, ""),
                     (8192, 32, False, 32, ""), (16384, 32, False, 32, "")]}  # fmt: skip
    shapes = [(3, 1024), (3, 4096), (3, 16384)] if lab.smoke else [(65536, 1024), (32768, 4096), (2048, 65536),
                                                                   (8192, 16384)]  # fmt: skip
    for s in lab.forward_shapes(shapes):
        n = s["n"]
        x = s["x"]
        for rows, warps, maxnreg in tile.get(n, []):
            args = (x, x, s["w"], s["y"], x, s["rstd_out"], s["m"], n, n, n, n, n, EPS, 0.0)
            grid = (triton.cdiv(s["m"], rows),)
            _run_noting_registers(lab, s, f"tile r{rows} w{warps} maxnreg {maxnreg}",
                    lambda args=args, grid=grid, rows=rows, warps=warps, maxnreg=maxnreg:
                    kernels.forward_tile[grid](*args, True, False, 0, n, rows, num_warps=warps,
                                               **_with_maxnreg(maxnreg)))  # fmt: skip
        for block, warps, unroll, maxnreg, store in walks.get(n, []):
            args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], n, n, EPS, 0.0)
            _run_noting_registers(lab, s, f"walk b{block} w{warps} unroll{int(unroll)} maxnreg {maxnreg} st={store or '-'}",
                    lambda args=args, block=block, warps=warps, unroll=unroll, maxnreg=maxnreg, store=store:
                    kernels.forward_looped[(s["m"],)](*args, True, False, 0, block, *policies, store, unroll, n, True, False,
                                                      num_warps=warps, **_with_maxnreg(maxnreg)))  # fmt: skip


def round_l2prefetch(lab: Lab) -> None:
    """fwd_wide_prefetch at 2048x65536 and 4096x32768: the wide forward with an L2 prefetch of a
    later row, one program per row (prefetching the row 1-3 SM-counts ahead) or persistent (one
    or two programs per SM), the prefetch before or between the walks; beside production and
    fwd_row4 (the same walks without prefetch), with the L2 flushed before each call, then as
    CUDA-graph replays."""
    shapes = [(5, 4096)] if lab.smoke else [(2048, 65536), (4096, 32768)]
    on = 0 if lab.smoke else 1
    for s in lab.forward_shapes(shapes):
        n = s["n"]
        x = s["x"]
        line = 128 // x.element_size()
        if not lab.smoke:
            lab.run("fwd", s, "fwd_row4 w32", row4_forward(s, 32))
        variants = [(0, a, 0, w) for a in (1, 2, 3) for w in (0, 1)] + [
            (1, 0, p, w) for p in (1, 2) for w in (0, 1)
        ]
        for persistent, ahead, per_sm, where in variants:
            programs = min(s["m"], per_sm * lab.sms) if persistent else s["m"]
            name = (
                f"prefetch persistent p{per_sm}" if persistent else f"prefetch ahead {ahead}x SMs"
            ) + f" at {where}"
            args = (x, s["w"], s["y"], s["rstd_out"], s["m"], programs, EPS, n, n // 4, line,
                    ahead * lab.sms, persistent, where, on)  # fmt: skip
            lab.run("fwd", s, name,
                    lambda args=args, programs=programs: fwd_wide_prefetch[(programs,)](*args, num_warps=32))  # fmt: skip


def round_row4gap(lab: Lab) -> None:
    """Where fwd_row4's lead over the production wide forward comes from (the two compile to the
    same memory operations; production adds the weight offset, 64 more FADDs per thread, and
    addresses rows by runtime strides): fwd_row4_v with each difference on and off, beside
    production and fwd_row4, flushed L2, then CUDA-graph replays."""
    shapes = [(3, 4096)] if lab.smoke else [(2048, 65536), (4096, 32768)]
    for s in lab.forward_shapes(shapes):
        n = s["n"]
        x = s["x"]
        if not lab.smoke:
            lab.run("fwd", s, "fwd_row4 w32", row4_forward(s, 32))
        for strided, add_offset, wide_row in itertools.product([0, 1], [0, 1], [0, 1]):
            args = (
                x,
                s["w"],
                s["y"],
                s["rstd_out"],
                n,
                n,
                EPS,
                0.0,
                n,
                n // 4,
                strided,
                add_offset,
                wide_row,
            )
            lab.run("fwd", s, f"row4 strided{strided} offset{add_offset} wide_row{wide_row}",
                    lambda args=args: fwd_row4_v[(s["m"],)](*args, num_warps=32 if not lab.smoke else 4))  # fmt: skip


def round_stride(lab: Lab) -> None:
    """The tile forward with its row stride a compile-time constant and the weight offset
    optional (fwd_tile_s), at production's launch per N, beside production: what the constant
    row stride gained the wide forward (round row4gap), asked of the tile. Flushed L2, then
    CUDA-graph replays."""
    cases = [(3, 1024, torch.bfloat16)] if lab.smoke else [
        (65536, 1024, torch.bfloat16), (32768, 4096, torch.bfloat16), (4096, 4096, torch.float16),
        (4096, 4096, torch.float32), (256, 4096, torch.bfloat16)]  # fmt: skip
    for s in lab.forward_shapes(cases):
        n = s["n"]
        x = s["x"]
        block, rows, warps = launch.forward_config(n)
        for stride, has_offset in itertools.product([0, n], [1, 0]):
            args = (
                x,
                s["w"],
                s["y"],
                s["rstd_out"],
                s["m"],
                n,
                n,
                EPS,
                0.0,
                block,
                rows,
                stride,
                has_offset,
            )
            grid = (triton.cdiv(s["m"], rows),)
            lab.run("fwd", s, f"tile stride {stride or 'runtime'} offset{has_offset}",
                    lambda args=args, grid=grid, warps=warps: fwd_tile_s[grid](*args, num_warps=warps))  # fmt: skip


def _tile_with_and_without_masks(lab: Lab, cases: list, more_warps_up_to: int) -> None:
    """Production's forward, forward_tile with its masks and without (EVEN; only where M is a
    multiple of the rows per program, as a launcher would have to ask), and the peers, at each
    (M, N, dtype); up to ``more_warps_up_to`` rows also with 4 and 8 warps. Flushed L2, then
    CUDA-graph replays."""
    for s in lab.forward_shapes(cases, with_peers=True):
        m, n = s["m"], s["n"]
        block, rows, warps = launch.forward_config(n)
        x = s["x"]
        args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], s["m"], n, n, n, n, n, EPS, 0.0)
        evens = (False, True) if s["m"] % rows == 0 else (False,)
        for even, w in itertools.product(evens, sorted({warps, 4, 8} if m <= more_warps_up_to else {warps})):
            constexprs = (True, False, 0, block, rows, even)
            grid = (triton.cdiv(s["m"], rows),)
            lab.run("fwd", s, f"tile EVEN={even} rows{rows} w{w}",
                    lambda grid=grid, c=constexprs, w=w: kernels.forward_tile[grid](*args, *c, num_warps=w))  # fmt: skip


def round_even(lab: Lab) -> None:
    """Production's forward, which runs forward_tile without masks (EVEN) for launches of at
    most EVEN_MAX_ROWS rows with N the tile width, beside the same kernel with its masks and the
    peers, from 1 to 32768 rows of 4096: where the unmasked tile pays; up to 1024 rows also with
    4 and 8 warps (Liger runs 8 at N = 4096)."""
    cases = [(3, 4096, torch.bfloat16)] if lab.smoke else [
        (1, 4096, torch.bfloat16), (64, 4096, torch.bfloat16), (256, 4096, torch.bfloat16),
        (512, 4096, torch.bfloat16), (1024, 4096, torch.bfloat16), (256, 2048, torch.bfloat16),
        (4096, 4096, torch.bfloat16), (32768, 4096, torch.bfloat16)]  # fmt: skip
    _tile_with_and_without_masks(lab, cases, more_warps_up_to=1024)


def round_even2(lab: Lab) -> None:
    """The same at many rows of 1024 and 2048 (round even measured 4096), production's warps
    only; at N = 1024 a program has two rows."""
    cases = [(4, 1024, torch.bfloat16)] if lab.smoke else [
        (65536, 1024, torch.bfloat16), (16384, 1024, torch.bfloat16), (65536, 2048, torch.bfloat16),
        (8192, 2048, torch.bfloat16)]  # fmt: skip
    _tile_with_and_without_masks(lab, cases, more_warps_up_to=0)


def round_rows1024(lab: Lab) -> None:
    """forward_tile at N = 1024 over rows per program (2, 4, 8) and warps (4, 8), with masks and
    without: Inductor's kernel at 65536x1024 (tools/inductor_code.py) takes 8 rows per program
    with 8 warps and no masks, against production's 2 rows with 4 warps. Flushed L2, then
    CUDA-graph replays."""
    cases = (
        [(8, 1024, torch.bfloat16)]
        if lab.smoke
        else [(65536, 1024, torch.bfloat16), (16384, 1024, torch.bfloat16)]
    )
    for s in lab.forward_shapes(cases, with_peers=True):
        n = s["n"]
        x = s["x"]
        args = (x, x, s["w"], s["y"], s["y"], s["rstd_out"], s["m"], n, n, n, n, n, EPS, 0.0)
        for rows, warps, even in itertools.product((2, 4, 8), (4, 8), (False, True)):
            if even and s["m"] % rows:
                continue
            constexprs = (True, False, 0, n, rows, even)
            grid = (triton.cdiv(s["m"], rows),)
            lab.run("fwd", s, f"tile EVEN={even} rows{rows} w{warps}",
                    lambda grid=grid, c=constexprs, w=warps: kernels.forward_tile[grid](*args, *c, num_warps=w))  # fmt: skip


def round_rsqrt(lab: Lab) -> None:
    """The tile forward's per-row costs that Inductor's kernel does not pay (tools/inductor_code.py
    at 65536x1024): the correctly rounded rsqrt (Inductor: libdevice.rsqrt), the r store (an
    inference kernel has none) and 64-bit row offsets; each switched off alone and all together
    (fwd_tile_r, production's rows and warps), beside production, the peers and a device copy
    of the same shape (y.copy_(x): the bytes of the forward, the ceiling at that size); at the
    walked forward's widths (N > 4096) production, the peers and the copy only. Flushed L2, then
    CUDA-graph replays."""
    cases = (
        [(5, 1024, torch.bfloat16), (3, 4096, torch.bfloat16)]
        if lab.smoke
        else [(65536, 1024, torch.bfloat16), (16384, 1024, torch.bfloat16), (32768, 4096, torch.bfloat16),
              (4096, 4096, torch.float16), (16384, 8192, torch.bfloat16), (8192, 16384, torch.bfloat16),
              (2048, 65536, torch.bfloat16)]
    )  # fmt: skip
    variants = {  # (HW_RSQRT, STORE_RSTD, ADDR32)
        "as production": (False, True, False),
        "hw rsqrt": (True, True, False),
        "no r store": (False, False, False),
        "32-bit rows": (False, True, True),
        "all three": (True, False, True),
    }
    for s in lab.forward_shapes(cases, with_peers=True):
        n = s["n"]
        if not lab.smoke:
            lab.time_reference(s, "device copy (y = x, same bytes)", lambda s=s: s["y"].copy_(s["x"]))
        if n > launch.FORWARD_MAX_TILE:  # the walked forward: the references only
            continue
        block, rows, warps = launch.forward_config(n)
        grid = (triton.cdiv(s["m"], rows),)
        args = (s["x"], s["w"], s["y"], s["rstd_out"], s["m"], n, n, EPS, block, rows)
        for name, switches in variants.items():
            lab.run("fwd", s, f"tile_r {name}",
                    lambda args=args, sw=switches: fwd_tile_r[grid](*args, *sw, num_warps=warps))  # fmt: skip


def round_splitrow(lab: Lab) -> None:
    """The wide forward with a row shared by 2, 4 or 8 programs that each walk the whole row for
    the sum of squares and scale their own part (fwd_split_row: smaller units of work per
    program, for extra reads from L2), chunks of 8192 or 16384, 16 or 32 warps, the first walk
    rotated or not; beside production, the peers and a copy of x. Flushed L2, then CUDA-graph
    replays."""
    cases = (
        [(3, 65536, torch.bfloat16)]
        if lab.smoke
        else [(2048, 65536, torch.bfloat16), (4096, 32768, torch.bfloat16)]
    )
    for s in lab.forward_shapes(cases, with_peers=True):
        n = s["n"]
        if not lab.smoke:
            lab.time_reference(s, "copy of x", s["x"].clone)
        for split, block, warps, rotate in itertools.product(
            (2, 4, 8), (8192, 16384), (16, 32), (True, False)
        ):
            per = n // block // split
            if (
                per < 1
                or per > 4
                or per * split * block != n
                or (lab.smoke and (warps != 16 or block != 8192))
            ):
                continue
            grid = (s["m"] * split,)
            lab.run("fwd", s, f"split{split} chunk{block} w{warps} rotate={rotate}",
                    lambda g=grid, c=(n, block, split, rotate), w=warps: fwd_split_row[g](s["x"], s["w"], s["y"], EPS, *c, num_warps=w))  # fmt: skip


def production_backward_grid(lab: Lab, s: dict) -> tuple:
    """(kernel, programs, num_warps, constexprs) of production's backward at this shape, where
    it runs the tile or the two-walk kernel (N <= launch.TWO_WALK_MAX), weight and dw wanted."""
    n = s["n"]
    tile = n <= launch.BACKWARD_MAX_TILE
    plan = launch._backward_tile_plan if tile else launch._backward_chunked_plan
    rows, warps, per_sm, constexprs = plan(n, True, False, True, 0)
    programs = launch.backward_programs(triton.cdiv(s["m"], rows), per_sm, lab.sms)
    return (kernels.backward_tile if tile else kernels.backward_chunked), programs, warps, constexprs


def round_reduce(lab: Lab) -> None:
    """The dw reduction alone (reduce_columns over production's (programs, N) scratch, just
    written, so read from L2 as in a call) at production's launch and over BLOCK_P, BLOCK_C and
    warps, beside production's backward kernel alone and the whole backward, CUDA-graph timed.
    Production's reduction then ran N / 64 programs of 4 warps (16 at N = 1024), each summing
    its 64 columns down all the scratch rows, 32 at a time: 2.9-7.3 µs, 7.3 at 65536x1024 over
    528 scratch rows. 16-column strips with 8 warps took 2.0-3.1 µs (2.5 there), but were
    slower on the wide backward's short scratch, timed last (launch._reduce_plan has both)."""
    lab.time_with_graphs()
    cases = [(65536, 1024, torch.bfloat16), (32768, 4096, torch.bfloat16), (4096, 4096, torch.bfloat16),
             (4096, 4096, torch.float32), (256, 4096, torch.bfloat16), (16384, 8192, torch.bfloat16),
             (8192, 16384, torch.bfloat16)]  # fmt: skip
    for m, n, dtype in cases:
        s = lab.shape(m, n, dtype)
        lab.production(s)
        kernel, programs, warps, constexprs = production_backward_grid(lab, s)
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

        _grid, reduce_warps, (block_p, block_c) = launch._reduce_plan(n, programs)
        both, _ = with_reduce(block_p, block_c, reduce_warps)
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
        plans = {"production": launch._reduce_plan(n, rows)[1:]}
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
    "wide2": round_wide2,
    "wide3": round_wide3,
    "prefetch": round_prefetch,
    "reorder": round_reorder,
    "reorder2": round_reorder2,
    "tile2": round_tile2,
    "hints3": round_hints3,
    "ahead": round_ahead,
    "ahead2": round_ahead2,
    "carry": round_carry,
    "launch": round_launch,
    "launch2": round_launch2,
    "even": round_even,
    "even2": round_even2,
    "rows1024": round_rows1024,
    "ahead3": round_ahead3,
    "fahead": round_fahead,
    "maxnreg": round_maxnreg,
    "l2prefetch": round_l2prefetch,
    "row4gap": round_row4gap,
    "stride": round_stride,
    "rsqrt": round_rsqrt,
    "splitrow": round_splitrow,
    "reduce": round_reduce,
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
