"""Triton kernels of RMSNorm: forward, backward (dx and per-program partial dw), dw reduction.

Why one module of over 750 lines: its eight kernels share the math, the layout contract and the
casting modes written once below, and the @triton.jit helpers between them (_rsqrt_rn in both
forwards, _load_chunk in both two-walk kernels, _wide_segment_dx in both wide backwards). Split by
path, each part would restate the contract or import another's helpers. It holds the kernels and
their derivations only; how they are launched is launch.py's.

The math (see ``reference.py`` for the readable oracle), per row of N values:

    forward    r  = 1 / sqrt(sum(x^2) / N + eps)       squares and sum in fp32, r within an ulp
               xn = x * r
               y  = xn * (offset + w)                  one cast, to y's dtype, at the store
    backward   u  = dy * (offset + w)
               c  = sum(u * xn) / N                    = r * mean(u * x)
               dx = r * (u - xn * c)                   = r*u - x*r^3*mean(u*x)
               dw = sum over rows of dy * xn           never divided by M; offset-free

Layout contract shared by every kernel: rows are addressed as ``base + row * row_stride + col``
(unit stride along the row, any row stride), so a slice or every-other-row view of a wider
tensor is read in place. Masked lanes load 0, which leaves every sum unchanged, and the sums are
divided by the true N, never by the block width.

Paths by row width, same results:
* tile (N <= 4096): the whole row (BLOCK_N >= N) lives in registers; ROWS rows per program for
  narrow rows.
* two-walk (forward N > 4096, backward 4096 < N <= 16384): each row is walked twice, the first
  walk reading from HBM and asking L2 to keep the row, the second reading it back from L2.
  Holding only a chunk at a time frees the registers that a row-wide tile would pin, so more rows
  are in flight per SM. The forward runs one program per row; the backward is persistent and
  keeps its dw share in registers as CHUNKS separate chunk accumulators.
* wide backward (N > 16384): the dw share would not fit in registers. Each row is split into
  segments, each program owning one segment of a group of rows. On a GPU one launch does it all
  (backward_wide_fused): the programs of a group post their segment sums of u * x a row ahead
  and finish each row from the posted sums. Where that launch cannot run (the interpreter, a
  grid too large to be resident at once) two launches do it: one sums u * x per segment
  (backward_wide_dot), a second computes dx per segment (backward_wide).

dw is deterministic: each backward program owns one row of a (programs x N) fp32 scratch and
adds its rows into it in a fixed order; ``reduce_columns`` then sums that scratch over programs
in a fixed order. No value is ever accumulated by atomics (backward_wide_fused counts posted
sums with them, nothing more), and the scratch is bounded by programs x N, not M x N.

Casting modes (``CASTING``): 0 keeps everything in fp32 until the final store (the default and
Gemma's behaviour); 1 rounds xn to the dtype of the normalised input before the weight multiply
(Llama's behaviour), in the forward and for dw.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter is chosen when Triton decorates the kernels below, so it is read once here.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRETED = tl.constexpr(INTERPRET)  # the same, readable inside the kernels


def _interpreter_rounds_bf16_to_nearest_even() -> None:
    """Make the Triton interpreter round fp32 -> bf16 to nearest even, as the GPU does.

    Triton 3.6's interpreter truncates that cast (and its explicit "rtne" mode rounds half up
    without carrying into the exponent), so bf16 results on CPU would carry up to twice the GPU's
    rounding error and fail checks the GPU passes. Only the interpreter's cast is changed;
    compiled kernels are untouched.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_rmsnorm_kernel_rtne", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl  # create_fp_trunc and the other casts dispatch through it
    builder._rmsnorm_kernel_rtne = True


def _interpreter_casts_fp8_as_the_gpu() -> None:
    """Make the Triton interpreter's fp32 -> float8e4nv (torch.float8_e4m3fn) cast the GPU's
    ``cvt.rn.satfinite``: round to nearest even, saturating at +-448, NaN kept.

    Triton 3.6's interpreter drops the carry of a rounding into the exponent (31.6 becomes 16, not
    32) and returns NaN past 448, so fp8 results on CPU would be off by a factor of two where the
    GPU's are exact (tests/op/test_quant.py keeps that as a known difference). Only the
    interpreter's cast is changed; compiled kernels are untouched.
    """
    import numpy as np
    import torch
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_rmsnorm_kernel_fp8", False):
        return
    original = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            data = torch.where(data.isnan(), data, data.clamp(-448.0, 448.0))
            return interpreter.TensorHandle(
                data.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), dst_type.scalar
            )
        return original(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp
    builder._rmsnorm_kernel_fp8 = True


def _interpreter_indexes_with_any_numpy() -> None:
    """Make the Triton interpreter's scalar tensors usable as loop bounds under numpy 2.4.

    Triton 3.6's interpreter turns a scalar into an int with ``int(data)``, where ``data`` is a
    1-element array; numpy 2.4 refuses that for arrays of one or more dims, so every kernel with a
    loop over its program's rows stops with a TypeError. ``.item()`` is what numpy asks for.
    """
    from triton.runtime import interpreter

    if getattr(interpreter, "_rmsnorm_kernel_index", False):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor  # looked up by name at each launch
    interpreter._rmsnorm_kernel_index = True


if INTERPRET:
    _interpreter_rounds_bf16_to_nearest_even()
    _interpreter_casts_fp8_as_the_gpu()
    _interpreter_indexes_with_any_numpy()


@triton.jit
def _rsqrt_rn(v):
    """1 / sqrt(v) from the correctly rounded sqrt and division. The hardware rsqrt is off by up
    to two ulps; r multiplies every element of its row and dw sums r over all rows, so that error
    would grow with M (visible in fp32 dw at M = 2048). One per row: the cost is nil."""
    return tl.div_rn(1.0, tl.sqrt_rn(v))


@triton.jit
def _rsqrt_newton(v):
    """1 / sqrt(v) for launches of few rows where batch invariance is off (launch.BATCH_INVARIANT:
    it rounds some rows differently from _rsqrt_rn, so a row's bits would depend on the batch): the hardware estimate r0 (up to two ulps off) and one
    Newton step in FMAs, r = r0 + r0/2 * (1 - v*r0^2). Within an ulp of 1 / sqrt(v), as
    _rsqrt_rn's two roundings are: what is left is rounding error (of v*r0, half an ulp at most,
    and of the result), not the estimate's own error, which dw would add up over the rows.
    Shorter than _rsqrt_rn where a launch is one memory round trip, slower in large launches
    (measured: docs/performance-notes.md, the Newton step). Where v is 0, inf or NaN,
    v*r0 is NaN and the estimate is already exact (inf, 0, NaN)."""
    if _INTERPRETED:  # numpy's 1 / sqrt
        r0 = tl.math.rsqrt(v)
    else:  # not tl.math.rsqrt, whose .ftz would read a subnormal v as 0
        r0 = tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=f,f", [v], tl.float32, True, 1)
    s = v * r0
    r = tl.fma(0.5 * r0, tl.fma(-s, r0, 1.0), r0)
    return tl.where(s == s, r, r0)


@triton.jit
def forward_tile(
    X,  # input rows, any float dtype                                      [M, N], row stride stride_x
    RES,  # residual rows added to X before normalising (if HAS_RESIDUAL)   [M, N], row stride stride_res
    W,  # weight (if HAS_WEIGHT)                                            [N]
    Y,  # output                                                            [M, N], row stride stride_y
    H,  # x + residual as stored for the next block (if HAS_RESIDUAL)       [M, N], row stride stride_h
    RSTD,  # per-row r in fp32, read by the backward                         [M]
    M,  # number of rows
    N,  # row length: the true denominator of the mean
    stride_x,
    stride_res,
    stride_y,
    stride_h,
    eps,  # added inside the square root
    offset,  # y = xn * (offset + w); Gemma uses 1.0
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr,  # power of two >= N
    ROWS: tl.constexpr,  # rows handled together by one program
    # N == BLOCK_N and ROWS == 1, so every program's tile lies inside the tensors: no masks.
    # Faster for few rows only (measured: docs/performance-notes.md, EVEN_MAX_ROWS).
    EVEN: tl.constexpr = False,
    # Store r for the backward; off where none follows, as its scattered stores cost more than
    # their bytes at narrow rows (measured: docs/performance-notes.md, STORE_RSTD).
    STORE_RSTD: tl.constexpr = True,
    # r by _rsqrt_newton (launches of few rows, batch invariance off) rather than _rsqrt_rn.
    NEWTON_R: tl.constexpr = False,
):
    pid = tl.program_id(0)
    first = pid * ROWS
    local = tl.arange(0, ROWS)
    rows = first + local
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = None if EVEN else row_ok[:, None] & (cols < N)[None, :]
    other = None if EVEN else 0.0
    # Addresses as a scalar 64-bit base for the program's first row, then a 64-bit row offset
    # within the program (zero, folded away, at ROWS = 1) and 32-bit column offsets: not a 64-bit
    # address per element (measured: docs/performance-notes.md, forward_tile's addresses).
    first64 = first.to(tl.int64)
    local64 = local.to(tl.int64)[:, None]
    x_ptrs = (X + first64 * stride_x) + local64 * stride_x
    y_ptrs = (Y + first64 * stride_y) + local64 * stride_y

    x = tl.load(x_ptrs + cols[None, :], mask=mask, other=other).to(tl.float32)
    if HAS_WEIGHT:
        # Issued with x's load, in the weight's own dtype: its latency hides behind x's
        # (measured: docs/performance-notes.md, forward_tile's addresses and weight load).
        w_raw = tl.load(W + cols, mask=None if EVEN else cols < N, other=other)
    if HAS_RESIDUAL:
        res_ptrs = (RES + first64 * stride_res) + local64 * stride_res
        res = tl.load(res_ptrs + cols[None, :], mask=mask, other=other).to(tl.float32)
        # Normalise exactly the h that is returned, so forward, backward and the unfused pair agree.
        h = (x + res).to(H.dtype.element_ty)
        tl.store((H + first64 * stride_h) + local64 * stride_h + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)

    v = tl.sum(x * x, axis=1) / N + eps
    rstd = _rsqrt_newton(v) if NEWTON_R else _rsqrt_rn(v)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=None if EVEN else row_ok)

    xn = x * rstd[:, None]
    if CASTING == 1:
        if HAS_RESIDUAL:
            xn = xn.to(H.dtype.element_ty).to(tl.float32)
        else:
            xn = xn.to(X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        xn = xn * (offset + w_raw.to(tl.float32))[None, :]
    tl.store(y_ptrs + cols[None, :], xn.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_chunk(src_row, c, N, POLICY: tl.constexpr, MASKED: tl.constexpr):
    """One chunk of a row as stored (zeros past N when MASKED): the walks' loads, in
    forward_looped and backward_chunked."""
    if MASKED:
        return tl.load(src_row + c, mask=c < N, other=0.0, eviction_policy=POLICY)
    return tl.load(src_row + c, eviction_policy=POLICY)


@triton.jit
def _chunk_squares(
    x_row, res_row, h_row, c, N, POLICY: tl.constexpr, HAS_RESIDUAL: tl.constexpr, MASKED: tl.constexpr
):  # fmt: skip
    """First walk of forward_looped over one chunk: x^2 (h^2 with a residual, h stored). Without
    MASKED the chunk lies inside the row and nothing is masked."""
    x = _load_chunk(x_row, c, N, POLICY, MASKED).to(tl.float32)
    if HAS_RESIDUAL:
        h = (x + _load_chunk(res_row, c, N, "", MASKED).to(tl.float32)).to(h_row.dtype.element_ty)
        if MASKED:
            tl.store(h_row + c, h, mask=c < N)
        else:
            tl.store(h_row + c, h)
        x = h.to(tl.float32)
    return x * x


@triton.jit
def _looped_rstd(
    x_row, res_row, h_row, cols, eps, N: tl.constexpr, BLOCK_N: tl.constexpr, POLICY: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, UNROLL_WALKS: tl.constexpr,
):  # fmt: skip
    """forward_looped's first walk (h stored with a residual) and its r, written once for it and
    for quant.py's looped kernel: with N a compile-time constant the compiler contracts the
    squares into the chunk's sum (FMAs), so a kernel that walks a runtime N rounds the sum
    differently, and its r with it."""
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if UNROLL_WALKS:
        tl.static_assert(N <= 4 * BLOCK_N, "the unrolled walks hold at most four chunks")
        for start in tl.static_range(0, N, BLOCK_N):
            acc += _chunk_squares(x_row, res_row, h_row, start + cols, N, POLICY, HAS_RESIDUAL,
                                  start + BLOCK_N > N)  # fmt: skip
    else:
        for start in range(0, N, BLOCK_N):
            acc += _chunk_squares(x_row, res_row, h_row, start + cols, N, POLICY, HAS_RESIDUAL, True)
    return _rsqrt_rn(tl.sum(acc, axis=0) / N + eps)


@triton.jit
def _store_scaled(
    x, y_row, W, c, N, rstd, offset, STORE_POLICY: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_OFFSET: tl.constexpr, CASTING: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Second walk of forward_looped: y = x * r * (offset + w) of one loaded chunk, stored (the
    add only with HAS_OFFSET)."""
    xn = x.to(tl.float32) * rstd
    if CASTING == 1:
        xn = xn.to(x.dtype).to(tl.float32)
    if HAS_WEIGHT:
        if MASKED:
            w = tl.load(W + c, mask=c < N, other=0.0)
        else:
            w = tl.load(W + c)
        if HAS_OFFSET:
            xn = xn * (offset + w.to(tl.float32))
        else:
            xn = xn * w.to(tl.float32)
    if MASKED:
        tl.store(y_row + c, xn.to(y_row.dtype.element_ty), mask=c < N, eviction_policy=STORE_POLICY)
    else:
        tl.store(y_row + c, xn.to(y_row.dtype.element_ty), eviction_policy=STORE_POLICY)


@triton.jit
def forward_looped(
    X,
    RES,
    W,
    Y,
    H,
    RSTD,
    stride_x,  # row strides of x and the residual (y and h are contiguous: their stride is N)
    stride_res,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr,  # chunk width; N may be any multiple or not
    FIRST_WALK_POLICY: tl.constexpr,  # L2 eviction hint of the first walk's loads ("" for none)
    SECOND_WALK_POLICY: tl.constexpr,  # and of the second walk's
    STORE_POLICY: tl.constexpr,  # L2 eviction hint of y's stores ("" for none)
    UNROLL_WALKS: tl.constexpr,  # unroll both walks; rows of at most four chunks
    N: tl.constexpr,  # row length, known at compile time (see below)
    CONTIGUOUS: tl.constexpr,  # x's (and the residual's) rows are N apart: strides unused
    HAS_OFFSET: tl.constexpr,  # offset != 0 (Gemma): y = xn * (offset + w); else xn * w
    STORE_RSTD: tl.constexpr = True,  # store r for the backward (off where none follows)
):
    """Rows wider than a tile, walked twice in BLOCK_N chunks by one program per row: the sum of
    squares, then the scale. The first walk's loads ask L2 to keep the row ("evict_last"), the
    second walk's to drop it ("evict_first"), so the second walk reads L2, not HBM. N is a
    compile-time constant (one compilation per row width): the walks' trip counts are then fixed
    and the masks of full chunks fold away. With a residual, h is written once in the first walk
    and read back in the second. Rows wider than 16384 hold more than L2 keeps comfortably
    between the walks (a program per SM, 128 KiB per row at N = 65536 in bf16): there y's stores
    are hinted "evict_first", so that they do not push the rows waiting for their second walk
    out of L2.

    UNROLL_WALKS (rows of two to four chunks) unrolls both walks, masking only a partial last
    chunk, and issues all of the second walk's loads before its first store. The order has to be
    written out: the compiler does not move a chunk's load above the previous chunk's store,
    since y may alias x.

    Every row stride is the constant N where the rows are contiguous (y and h always are; x and
    the residual with CONTIGUOUS), and the offset is added only where it is nonzero.
    Measured: docs/performance-notes.md, Two-walk forward."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    row64 = tl.cast(row, tl.int64)
    if CONTIGUOUS:
        x_row = X + row64 * N
        res_row = RES + row64 * N
    else:
        x_row = X + row64 * stride_x
        res_row = RES + row64 * stride_res
    h_row = H + row64 * N
    rstd = _looped_rstd(
        x_row, res_row, h_row, cols, eps, N, BLOCK_N, FIRST_WALK_POLICY, HAS_RESIDUAL, UNROLL_WALKS
    )
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)

    y_row = Y + row64 * N
    if HAS_RESIDUAL:
        src_row = h_row
    else:
        src_row = x_row
    if UNROLL_WALKS:
        # Chunk k's load, then (below) its scale and store; chunks past the row are never touched.
        x0 = _load_chunk(src_row, cols, N, SECOND_WALK_POLICY, BLOCK_N > N)
        x1 = x0
        x2 = x0
        x3 = x0
        if N > BLOCK_N:
            x1 = _load_chunk(src_row, BLOCK_N + cols, N, SECOND_WALK_POLICY, 2 * BLOCK_N > N)
        if N > 2 * BLOCK_N:
            x2 = _load_chunk(src_row, 2 * BLOCK_N + cols, N, SECOND_WALK_POLICY, 3 * BLOCK_N > N)
        if N > 3 * BLOCK_N:
            x3 = _load_chunk(src_row, 3 * BLOCK_N + cols, N, SECOND_WALK_POLICY, 4 * BLOCK_N > N)
        _store_scaled(
            x0, y_row, W, cols, N, rstd, offset, STORE_POLICY, HAS_WEIGHT, HAS_OFFSET, CASTING, BLOCK_N > N
        )
        if N > BLOCK_N:
            _store_scaled(x1, y_row, W, BLOCK_N + cols, N, rstd, offset, STORE_POLICY, HAS_WEIGHT,
                          HAS_OFFSET, CASTING, 2 * BLOCK_N > N)  # fmt: skip
        if N > 2 * BLOCK_N:
            _store_scaled(x2, y_row, W, 2 * BLOCK_N + cols, N, rstd, offset, STORE_POLICY, HAS_WEIGHT,
                          HAS_OFFSET, CASTING, 3 * BLOCK_N > N)  # fmt: skip
        if N > 3 * BLOCK_N:
            _store_scaled(x3, y_row, W, 3 * BLOCK_N + cols, N, rstd, offset, STORE_POLICY, HAS_WEIGHT,
                          HAS_OFFSET, CASTING, 4 * BLOCK_N > N)  # fmt: skip
    else:
        for start in range(0, N, BLOCK_N):
            c = start + cols
            x = _load_chunk(src_row, c, N, SECOND_WALK_POLICY, True)
            _store_scaled(
                x, y_row, W, c, N, rstd, offset, STORE_POLICY, HAS_WEIGHT, HAS_OFFSET, CASTING, True
            )


@triton.jit
def backward_tile(
    X,  # the normalised input saved by the forward (x, or h with a residual)  [M, N]
    W,  # weight (if HAS_WEIGHT)                                              [N]
    DY,  # gradient of y                                                       [M, N]
    DH,  # gradient arriving at h directly from downstream (if HAS_DH)         [M, N]
    RSTD,  # per-row r from the forward, never recomputed                      [M]
    DX,  # gradient of x (and of the residual)                                 [M, N]
    DW_PARTIAL,  # fp32 scratch, one row per program (if COMPUTE_DW)          [programs, N]
    M,
    N,
    programs,  # number of programs launched (the grid), passed so the loop step is a plain int
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next row block's x and dy before working on this one
):
    """Persistent over rows: program p handles row blocks p, p + P, p + 2P, ... and keeps its
    share of dw in registers, written once at the end to its own scratch row. With PREFETCH the
    loads of the program's next row block are issued before the current block's arithmetic and
    stores, so each program keeps two blocks' loads in flight instead of one."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    step = programs * ROWS
    if PREFETCH:
        rows = pid * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x_next = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        dy_next = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)

    for first in range(pid * ROWS, M, step):
        rows = first + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        if PREFETCH:
            x_raw = x_next
            dy = dy_next.to(tl.float32)
            following = rows + step
            next_mask = (following < M)[:, None] & col_ok[None, :]
            following64 = following.to(tl.int64)[:, None]
            x_next = tl.load(X + following64 * stride_x + cols[None, :], mask=next_mask, other=0.0)
            dy_next = tl.load(DY + following64 * stride_dy + cols[None, :], mask=next_mask, other=0.0)
        else:
            x_raw = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
            dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)

        xn = x_raw.to(tl.float32) * rstd[:, None]
        if HAS_WEIGHT:
            u = dy * scale[None, :]
        else:
            u = dy
        c = tl.sum(u * xn, axis=1) / N
        dx = (u - xn * c[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows64 * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

        if COMPUTE_DW:
            if CASTING == 1:
                xn = xn.to(x_raw.dtype).to(tl.float32)
            dw_acc += dy * xn

    if COMPUTE_DW:
        # With a single program the launcher passes dw itself here: the cast makes it final.
        dw_row = tl.sum(dw_acc, axis=0).to(DW_PARTIAL.dtype.element_ty)
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_row, mask=col_ok)


@triton.jit
def _backward_chunk_dx(
    x_raw,  # one chunk of x and of dy, as loaded
    dy_raw,
    dh_row,  # DH, DX advanced to the start of one row
    dx_row,
    W,
    c,  # the chunk's columns
    N,
    rstd,
    mean_uxn,  # mean(u * xn) over the row, from the first walk
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    CASTING: tl.constexpr,
):
    """Second walk of backward_chunked over one loaded chunk of one row: stores dx and returns
    the chunk's dw terms dy * xn."""
    ok = c < N
    dy = dy_raw.to(tl.float32)
    xn = x_raw.to(tl.float32) * rstd
    if HAS_WEIGHT:
        u = dy * (offset + tl.load(W + c, mask=ok, other=0.0, eviction_policy="evict_last").to(tl.float32))
    else:
        u = dy
    dx = (u - xn * mean_uxn) * rstd
    if HAS_DH:
        dx += tl.load(dh_row + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(dx_row + c, dx.to(dx_row.dtype.element_ty), mask=ok)
    if CASTING == 1:
        xn = xn.to(x_raw.dtype).to(tl.float32)
    return dy * xn


@triton.jit
def backward_chunked(
    X,  # as in backward_tile
    W,
    DY,
    DH,
    RSTD,
    DX,
    DW_PARTIAL,  # fp32 scratch [programs, N], or dw itself when programs == 1
    M,
    N,
    programs,
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    CHUNK: tl.constexpr,  # chunk width
    CHUNKS: tl.constexpr,  # chunks per row, 1 to 4: ceil(N / CHUNK)
):
    """Two-walk backward of rows up to 4 chunks wide. Persistent like backward_tile. Per row the
    first walk sums u * x over the chunks (loads kept in L2), then mean(u * xn) = r * sum / N;
    the second walk re-reads each chunk from L2, stores dx and adds dy * xn to that chunk's own
    register accumulator. Both walks are unrolled, so each chunk position is a compile-time
    constant and dw stays in registers without a row-wide tile of x and dy beside it.

    The second walk issues every chunk's x and dy loads before its first store. The order has to
    be written out: the compiler does not move a load above an earlier store, since dx may alias
    x or dy. Measured: docs/performance-notes.md, Two-walk backward."""
    tl.static_assert(CHUNKS <= 4, "backward_chunked has four chunk accumulators")
    pid = tl.program_id(0)
    cols = tl.arange(0, CHUNK)
    dw0 = tl.zeros((CHUNK,), dtype=tl.float32)
    dw1 = tl.zeros((CHUNK,), dtype=tl.float32)
    dw2 = tl.zeros((CHUNK,), dtype=tl.float32)
    dw3 = tl.zeros((CHUNK,), dtype=tl.float32)
    for row in range(pid, M, programs):
        row64 = tl.cast(row, tl.int64)
        x_row = X + row64 * stride_x
        dy_row = DY + row64 * stride_dy
        rstd = tl.load(RSTD + row)
        dot = tl.zeros((CHUNK,), dtype=tl.float32)
        for k in tl.static_range(CHUNKS):
            c = k * CHUNK + cols
            x = _load_chunk(x_row, c, N, "evict_last", True).to(tl.float32)
            u = _load_chunk(dy_row, c, N, "evict_last", True).to(tl.float32)
            if HAS_WEIGHT:
                u = u * (offset + _load_chunk(W, c, N, "evict_last", True).to(tl.float32))
            dot += u * x
        mean_uxn = tl.sum(dot, axis=0) * rstd / N

        # Every chunk's loads first (chunks past CHUNKS are never loaded), then each chunk's dx.
        x0 = _load_chunk(x_row, cols, N, "evict_first", True)
        d0 = _load_chunk(dy_row, cols, N, "evict_first", True)
        x1 = x0
        d1 = d0
        x2 = x0
        d2 = d0
        x3 = x0
        d3 = d0
        if CHUNKS > 1:
            x1 = _load_chunk(x_row, CHUNK + cols, N, "evict_first", True)
            d1 = _load_chunk(dy_row, CHUNK + cols, N, "evict_first", True)
        if CHUNKS > 2:
            x2 = _load_chunk(x_row, 2 * CHUNK + cols, N, "evict_first", True)
            d2 = _load_chunk(dy_row, 2 * CHUNK + cols, N, "evict_first", True)
        if CHUNKS > 3:
            x3 = _load_chunk(x_row, 3 * CHUNK + cols, N, "evict_first", True)
            d3 = _load_chunk(dy_row, 3 * CHUNK + cols, N, "evict_first", True)
        dh_row = DH + row64 * stride_dh
        dx_row = DX + row64 * stride_dx
        dw0 += _backward_chunk_dx(x0, d0, dh_row, dx_row, W, cols, N, rstd, mean_uxn, offset,
                                  HAS_WEIGHT, HAS_DH, CASTING)  # fmt: skip
        if CHUNKS > 1:
            dw1 += _backward_chunk_dx(x1, d1, dh_row, dx_row, W, CHUNK + cols, N, rstd, mean_uxn, offset,
                                      HAS_WEIGHT, HAS_DH, CASTING)  # fmt: skip
        if CHUNKS > 2:
            dw2 += _backward_chunk_dx(x2, d2, dh_row, dx_row, W, 2 * CHUNK + cols, N, rstd, mean_uxn, offset,
                                      HAS_WEIGHT, HAS_DH, CASTING)  # fmt: skip
        if CHUNKS > 3:
            dw3 += _backward_chunk_dx(x3, d3, dh_row, dx_row, W, 3 * CHUNK + cols, N, rstd, mean_uxn, offset,
                                      HAS_WEIGHT, HAS_DH, CASTING)  # fmt: skip

    if COMPUTE_DW:
        out = DW_PARTIAL + pid.to(tl.int64) * N + cols
        dtype = DW_PARTIAL.dtype.element_ty  # fp32 scratch, or dw's own dtype when programs == 1
        tl.store(out, dw0.to(dtype), mask=cols < N)
        if CHUNKS > 1:
            tl.store(out + CHUNK, dw1.to(dtype), mask=CHUNK + cols < N)
        if CHUNKS > 2:
            tl.store(out + 2 * CHUNK, dw2.to(dtype), mask=2 * CHUNK + cols < N)
        if CHUNKS > 3:
            tl.store(out + 3 * CHUNK, dw3.to(dtype), mask=3 * CHUNK + cols < N)


@triton.jit
def backward_wide_dot(
    X,
    W,
    DY,
    DOT_PARTIAL,  # fp32 [M, SEGMENTS]: sum of u * x over each segment of each row
    N,
    stride_x,
    stride_dy,
    offset,
    SEGMENTS,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_S: tl.constexpr,  # segment width
):
    """Wide rows, step 1 of 2: program (row, segment) writes that segment's sum of u * x."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    c = seg * BLOCK_S + tl.arange(0, BLOCK_S)
    x = tl.load(X + row * stride_x + c, mask=c < N, other=0.0).to(tl.float32)
    u = tl.load(DY + row * stride_dy + c, mask=c < N, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        u = u * (offset + tl.load(W + c, mask=c < N, other=0.0).to(tl.float32))
    tl.store(DOT_PARTIAL + row * SEGMENTS + seg, tl.sum(u * x, axis=0))


@triton.jit
def _wide_segment_dx(
    X,
    DY,
    DH,
    DX,
    row64,
    c,  # this segment's columns
    col_ok,
    scale,  # offset + w over the segment (unused without a weight)
    rstd,
    mean_uxn,
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    CASTING: tl.constexpr,
    POLICY: tl.constexpr,  # L2 hint of x's and dy's loads and dx's stores
):
    """dx of one row's segment, stored; returns the segment's dw terms dy * xn (xn rounded as
    CASTING says). The wide backward's second step, shared by its two-launch and one-launch
    kernels."""
    x_raw = tl.load(X + row64 * stride_x + c, mask=col_ok, other=0.0, eviction_policy=POLICY)
    dy = tl.load(DY + row64 * stride_dy + c, mask=col_ok, other=0.0, eviction_policy=POLICY)
    dy = dy.to(tl.float32)
    xn = x_raw.to(tl.float32) * rstd
    if HAS_WEIGHT:
        u = dy * scale
    else:
        u = dy
    dx = (u - xn * mean_uxn) * rstd
    if HAS_DH:
        dx += tl.load(DH + row64 * stride_dh + c, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(DX + row64 * stride_dx + c, dx.to(DX.dtype.element_ty), mask=col_ok, eviction_policy=POLICY)
    if CASTING == 1:
        xn = xn.to(x_raw.dtype).to(tl.float32)
    return dy * xn


@triton.jit
def backward_wide(
    X,
    W,
    DY,
    DH,
    RSTD,
    DOT_PARTIAL,  # fp32 [M, SEGMENTS] from backward_wide_dot
    DX,
    DW_PARTIAL,  # fp32 [row groups, N]: one row per row group
    M,
    N,
    groups,  # row groups: program (g, segment) handles rows g, g + groups, ...
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    offset,
    SEGMENTS,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SEGMENTS_POW2: tl.constexpr,
):
    """Wide rows, step 2 of 2: program (g, segment) owns one column segment for a group of rows,
    so its share of dw stays in registers; c for each row is the fixed-order sum of the row's
    segment sums from step 1."""
    g = tl.program_id(0)
    seg = tl.program_id(1)
    c = seg * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = c < N
    if HAS_WEIGHT:
        scale = offset + tl.load(W + c, mask=col_ok, other=0.0).to(tl.float32)
    else:
        scale = offset
    segs = tl.arange(0, SEGMENTS_POW2)
    dw_acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for row in range(g, M, groups):
        row64 = tl.cast(row, tl.int64)
        rstd = tl.load(RSTD + row)
        dot = tl.sum(tl.load(DOT_PARTIAL + row64 * SEGMENTS + segs, mask=segs < SEGMENTS, other=0.0), axis=0)
        mean_uxn = dot * rstd / N
        dw_terms = _wide_segment_dx(X, DY, DH, DX, row64, c, col_ok, scale, rstd, mean_uxn,
                                    stride_x, stride_dy, stride_dh, stride_dx, HAS_WEIGHT, HAS_DH, CASTING, "")  # fmt: skip
        if COMPUTE_DW:
            dw_acc += dw_terms
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + g.to(tl.int64) * N + c, dw_acc, mask=col_ok)


@triton.jit
def backward_wide_fused(
    X,
    W,
    DY,
    DH,
    RSTD,
    DOT_PARTIAL,  # fp32 [M, SEGMENTS]: each segment's sum of u * x, posted by this launch
    POSTED,  # int32 [M], zeros at launch: how many segments of each row have posted their sum
    DX,
    DW_PARTIAL,  # fp32 [row groups, N]: one row per row group
    M,
    N,
    groups,  # row groups: program (g, segment) handles rows g, g + groups, ...
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_DH: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_S: tl.constexpr,  # segment width
    SEGMENTS: tl.constexpr,  # segments per row, ceil(N / BLOCK_S) (a compile-time constant: a runtime one
    # costs 64 more registers per thread, and the programs no longer fit FUSED_PER_SM to an SM)
    SEGMENTS_POW2: tl.constexpr,
    LOOKAHEAD: tl.constexpr,  # steps between posting a row's segment sum and using the row's total
):
    """Wide rows in one launch: backward_wide_dot and backward_wide with the exchange between
    them run ahead of its use. Program (g, segment) owns one column segment of a group of rows,
    its share of dw in registers as in backward_wide. At step k it

    1. sums u * x over its segment of row k (of its group), loads hinted to stay in L2, writes
       the sum to DOT_PARTIAL and adds 1 to POSTED[k] (release: the sum is visible first);
    2. finishes the row LOOKAHEAD steps behind: waits until POSTED says all SEGMENTS sums of that
       row are there (acquire), adds them in a fixed order (deterministic; backward_wide forms
       the same sum where its segments are as wide), re-reads its x and dy segment, now from
       L2, and stores dx.

    The group's programs post each row's sums a step before any of them needs the total, so in
    steady state nobody waits, and x and dy come from HBM once: 5 M·N element transfers for
    forward and backward together, where the two launches move 7 (backward_wide_dot's read of x
    and dy has left L2 by the time backward_wide reads them). Measured: docs/performance-notes.md,
    Wide backward.

    Waiting on other programs is safe only if they all run at once: the launcher launches this
    kernel as a cooperative grid, which the driver refuses (rather than hangs) where the grid
    cannot be resident, and falls back to the two launches then and under the interpreter (which
    runs programs one after another)."""
    g = tl.program_id(0)
    seg = tl.program_id(1)
    c = seg * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = c < N
    if HAS_WEIGHT:
        scale = offset + tl.load(W + c, mask=col_ok, other=0.0).to(tl.float32)
    else:
        scale = offset
    segs = tl.arange(0, SEGMENTS_POW2)
    dw_acc = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for k in range(g, M + LOOKAHEAD * groups, groups):
        if k < M:  # 1. post row k's sum over this segment
            k64 = tl.cast(k, tl.int64)
            x = tl.load(X + k64 * stride_x + c, mask=col_ok, other=0.0, eviction_policy="evict_last")
            u = tl.load(DY + k64 * stride_dy + c, mask=col_ok, other=0.0, eviction_policy="evict_last")
            u = u.to(tl.float32)
            if HAS_WEIGHT:
                u = u * scale
            tl.store(DOT_PARTIAL + k64 * SEGMENTS + seg, tl.sum(u * x.to(tl.float32), axis=0))
            tl.debug_barrier()  # every thread's part of the sum is written before the count
            tl.atomic_add(POSTED + k, 1, sem="release", scope="gpu")
        row = k - LOOKAHEAD * groups
        if row >= 0:  # 2. finish the row LOOKAHEAD steps behind
            row64 = tl.cast(row, tl.int64)
            posted = tl.atomic_add(POSTED + row, 0, sem="acquire", scope="gpu")
            while posted < SEGMENTS:
                posted = tl.atomic_add(POSTED + row, 0, sem="acquire", scope="gpu")
            sums = tl.load(
                DOT_PARTIAL + row64 * SEGMENTS + segs, mask=segs < SEGMENTS, other=0.0, cache_modifier=".cg"
            )
            rstd = tl.load(RSTD + row)
            mean_uxn = tl.sum(sums, axis=0) * rstd / N
            dw_terms = _wide_segment_dx(X, DY, DH, DX, row64, c, col_ok, scale, rstd, mean_uxn,
                                        stride_x, stride_dy, stride_dh, stride_dx, HAS_WEIGHT, HAS_DH, CASTING,
                                        "evict_first")  # fmt: skip
            if COMPUTE_DW:
                dw_acc += dw_terms
    if COMPUTE_DW:
        tl.store(DW_PARTIAL + g.to(tl.int64) * N + c, dw_acc, mask=col_ok)


@triton.jit
def reduce_columns(
    PARTIAL,  # fp32 [P, N], contiguous
    OUT,  # [N], any float dtype
    P,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """OUT[c] = sum over p of PARTIAL[p, c], always in the same order: deterministic dw."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & (cols < N)[None, :]
        acc += tl.load(PARTIAL + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cols < N)


# ---------------------------------------------------------------------------------------------
# Per-head rows (QK-norm), one or two tensors per launch
# ---------------------------------------------------------------------------------------------
#
# The heads of q and k sliced out of a fused qkv projection, x of shape (..., H, N): row
# ``token * H + head`` lies at ``token * stride_t + head * stride_h`` (unit stride along the row),
# which no single row stride reaches. Where the leading dims flatten to two strides rather than
# one (Gemma3's q transposed to (batch, heads, tokens, D), every other batch), token is
# ``outer * INNER + inner`` at ``outer * stride_o + inner * stride_t``; with one, INNER is 1. These kernels read such rows in place; the kernels above
# are untouched. The math is forward_tile's and backward_tile's, op for op, with their launch
# plans (BLOCK_N, ROWS, warps), so a row's y, r and dx have the bits the contiguous path gives
# (r always by _rsqrt_rn, as there with batch invariance on). y, r and dx are fresh and
# contiguous. Up to two tensors (q and k, each with its own weight and layout) share a launch:
# the first ``blocks0`` (forward) or ``programs0`` (backward) programs take tensor 0, the rest
# tensor 1. Rows no wider than a tile (launch.FORWARD_MAX_TILE, launch.BACKWARD_MAX_TILE).
#
# A tensor's weight is (N,), shared by every row, or per head (W_HEADS: (H, N), head h's row at
# ``h * stride_w``). With a per-head weight the backward's programs each take one head
# (program p: head p % H, every (programs / H)-th block of that head's tokens), so that a
# program's dw share belongs to one head: its scratch row p is the (p // H, p % H) entry of a
# (programs / H, H * N) scratch, which reduce_columns sums over its first dim into dw (H, N).


@triton.jit
def _head_offsets(rows, HEADS, INNER, stride_o, stride_t, stride_h):
    """Element offsets of rows ``token * HEADS + head`` (64-bit), token = outer * INNER + inner:
    outer * stride_o + inner * stride_t + head * stride_h."""
    token = rows // HEADS
    head = rows - token * HEADS
    outer = token // INNER
    inner = token - outer * INNER
    return outer.to(tl.int64) * stride_o + inner.to(tl.int64) * stride_t + head.to(tl.int64) * stride_h


@triton.jit
def _heads_forward_block(
    X, W, Y, RSTD, block, M, HEADS, INNER, stride_o, stride_t, stride_h, stride_w, N, eps, offset,
    HAS_WEIGHT: tl.constexpr, W_HEADS: tl.constexpr, CASTING: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    """forward_tile's block of ROWS rows, read at per-head offsets, written contiguously."""
    rows = block * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x_offs = _head_offsets(rows, HEADS, INNER, stride_o, stride_t, stride_h)
    x = tl.load(X + x_offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        if W_HEADS:  # each row's own head's weight row
            w_offs = (rows - (rows // HEADS) * HEADS).to(tl.int64) * stride_w
            w_raw = tl.load(W + w_offs[:, None] + cols[None, :], mask=mask, other=0.0)
        else:
            w_raw = tl.load(W + cols, mask=cols < N, other=0.0)
    v = tl.sum(x * x, axis=1) / N + eps
    rstd = _rsqrt_rn(v)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    xn = x * rstd[:, None]
    if CASTING == 1:
        xn = xn.to(X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        if W_HEADS:
            xn = xn * (offset + w_raw.to(tl.float32))
        else:
            xn = xn * (offset + w_raw.to(tl.float32))[None, :]
    y_ptrs = Y + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptrs, xn.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def heads_forward(
    X0,  # tensor 0's rows (q), read at token * stride_t0 + head * stride_h0   [M0 = T0 * HEADS0, N]
    W0,  # its weight (if HAS_WEIGHT)                                 [N], or [HEADS0, N] (W_HEADS0)
    Y0,  # its output, contiguous                                              [M0, N]
    RSTD0,  # its per-row r (if STORE_RSTD)                                     [M0]
    X1,  # tensor 1 (k), the same (unused without TWO)
    W1,
    Y1,
    RSTD1,
    M0,
    HEADS0,
    INNER0,  # tokens of the inner leading dims (1 where they flatten to one stride)
    stride_o0,
    stride_t0,
    stride_h0,
    stride_w0,  # W0's head stride (W_HEADS0)
    M1,
    HEADS1,
    INNER1,
    stride_o1,
    stride_t1,
    stride_h1,
    stride_w1,
    blocks0,  # programs of tensor 0: ceil(M0 / ROWS)
    N,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    W_HEADS0: tl.constexpr,  # W0 is per head
    W_HEADS1: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    STORE_RSTD: tl.constexpr,
    TWO: tl.constexpr,  # tensor 1 is launched too
):
    pid = tl.program_id(0)
    if TWO:
        if pid < blocks0:
            _heads_forward_block(X0, W0, Y0, RSTD0, pid, M0, HEADS0, INNER0, stride_o0, stride_t0, stride_h0,
                                 stride_w0, N, eps, offset, HAS_WEIGHT, W_HEADS0, CASTING, BLOCK_N, ROWS,
                                 STORE_RSTD)  # fmt: skip
        else:
            _heads_forward_block(X1, W1, Y1, RSTD1, pid - blocks0, M1, HEADS1, INNER1, stride_o1, stride_t1,
                                 stride_h1, stride_w1, N, eps, offset, HAS_WEIGHT, W_HEADS1, CASTING, BLOCK_N, ROWS,
                                 STORE_RSTD)  # fmt: skip
    else:
        _heads_forward_block(X0, W0, Y0, RSTD0, pid, M0, HEADS0, INNER0, stride_o0, stride_t0, stride_h0, stride_w0,
                             N, eps, offset, HAS_WEIGHT, W_HEADS0, CASTING, BLOCK_N, ROWS, STORE_RSTD)  # fmt: skip


@triton.jit
def _heads_backward_rows(
    X, DY, RSTD, DX, rows, row_ok, scale, dw_acc, HEADS, x_inner, sx_o, sx_t, sx_h, dy_inner, sdy_o, sdy_t, sdy_h,
    N, HAS_WEIGHT: tl.constexpr, COMPUTE_DW: tl.constexpr, CASTING: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """backward_tile's step over one block of rows: dx stored, the block's dy * xn added to dw_acc."""
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    x_offs = _head_offsets(rows, HEADS, x_inner, sx_o, sx_t, sx_h)
    dy_offs = _head_offsets(rows, HEADS, dy_inner, sdy_o, sdy_t, sdy_h)
    x_raw = tl.load(X + x_offs[:, None] + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + dy_offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    xn = x_raw.to(tl.float32) * rstd[:, None]
    if HAS_WEIGHT:
        u = dy * scale[None, :]
    else:
        u = dy
    c = tl.sum(u * xn, axis=1) / N
    dx = (u - xn * c[:, None]) * rstd[:, None]
    tl.store(DX + rows.to(tl.int64)[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        if CASTING == 1:
            xn = xn.to(x_raw.dtype).to(tl.float32)
        dw_acc += dy * xn
    return dw_acc


@triton.jit
def _heads_backward_program(
    X, W, DY, RSTD, DX, DW_PARTIAL, p, programs, M, HEADS, x_inner, sx_o, sx_t, sx_h, dy_inner, sdy_o, sdy_t, sdy_h,
    stride_w, N, offset, HAS_WEIGHT: tl.constexpr, W_HEADS: tl.constexpr, COMPUTE_DW: tl.constexpr, CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """backward_tile's program ``p`` of ``programs`` (persistent over row blocks, its dw share
    written to its own scratch row), x and dy read at per-head offsets, dx written contiguously.
    With W_HEADS, program p takes head p % HEADS only (``programs`` a multiple of HEADS)."""
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dw_acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    if W_HEADS:
        head = p % HEADS
        tokens = M // HEADS
        w_row = tl.load(W + head.to(tl.int64) * stride_w + cols, mask=col_ok, other=0.0)
        scale = offset + w_row.to(tl.float32)
        for first in range(p // HEADS * ROWS, tokens, programs // HEADS * ROWS):
            token = first + tl.arange(0, ROWS)
            dw_acc = _heads_backward_rows(X, DY, RSTD, DX, token * HEADS + head, token < tokens, scale, dw_acc,
                                          HEADS, x_inner, sx_o, sx_t, sx_h, dy_inner, sdy_o, sdy_t, sdy_h, N,
                                          HAS_WEIGHT, COMPUTE_DW, CASTING, BLOCK_N)  # fmt: skip
    else:
        if HAS_WEIGHT:
            scale = offset + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            scale = offset  # (unused without a weight)
        for first in range(p * ROWS, M, programs * ROWS):
            rows = first + tl.arange(0, ROWS)
            dw_acc = _heads_backward_rows(X, DY, RSTD, DX, rows, rows < M, scale, dw_acc, HEADS, x_inner, sx_o, sx_t,
                                          sx_h, dy_inner, sdy_o, sdy_t, sdy_h, N, HAS_WEIGHT, COMPUTE_DW, CASTING,
                                          BLOCK_N)  # fmt: skip
    if COMPUTE_DW:
        dw_row = tl.sum(dw_acc, axis=0).to(DW_PARTIAL.dtype.element_ty)
        tl.store(DW_PARTIAL + p.to(tl.int64) * N + cols, dw_row, mask=col_ok)


@triton.jit
def heads_backward(
    X0,  # tensor 0's saved input, per-head offsets (sx_t0, sx_h0)             [M0, N]
    W0,  # its weight: [N], or [HEADS0, N] (W_HEADS0)
    DY0,  # gradient of its y, per-head offsets (sdy_t0, sdy_h0)               [M0, N]
    RSTD0,
    DX0,  # contiguous                                                        [M0, N]
    P0,  # fp32 dw scratch, one row per program (or dw itself with one)       [programs0, N]
    X1,  # tensor 1, the same (unused without TWO)
    W1,
    DY1,
    RSTD1,
    DX1,
    P1,
    M0,
    HEADS0,
    x_inner0,  # as heads_forward's INNER, for x and for dy
    sx_o0,
    sx_t0,
    sx_h0,
    dy_inner0,
    sdy_o0,
    sdy_t0,
    sdy_h0,
    sw0,  # W0's head stride (W_HEADS0)
    M1,
    HEADS1,
    x_inner1,
    sx_o1,
    sx_t1,
    sx_h1,
    dy_inner1,
    sdy_o1,
    sdy_t1,
    sdy_h1,
    sw1,
    programs0,  # a multiple of HEADS0 with W_HEADS0 (the same for tensor 1)
    programs1,
    N,
    offset,
    HAS_WEIGHT: tl.constexpr,
    W_HEADS0: tl.constexpr,
    W_HEADS1: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    TWO: tl.constexpr,
):
    pid = tl.program_id(0)
    if TWO:
        if pid < programs0:
            _heads_backward_program(X0, W0, DY0, RSTD0, DX0, P0, pid, programs0, M0, HEADS0, x_inner0, sx_o0, sx_t0,
                                    sx_h0, dy_inner0, sdy_o0, sdy_t0, sdy_h0, sw0, N, offset, HAS_WEIGHT, W_HEADS0,
                                    COMPUTE_DW, CASTING, BLOCK_N, ROWS)  # fmt: skip
        else:
            _heads_backward_program(X1, W1, DY1, RSTD1, DX1, P1, pid - programs0, programs1, M1, HEADS1, x_inner1,
                                    sx_o1, sx_t1, sx_h1, dy_inner1, sdy_o1, sdy_t1, sdy_h1, sw1, N, offset,
                                    HAS_WEIGHT, W_HEADS1, COMPUTE_DW, CASTING, BLOCK_N, ROWS)  # fmt: skip
    else:
        _heads_backward_program(X0, W0, DY0, RSTD0, DX0, P0, pid, programs0, M0, HEADS0, x_inner0, sx_o0, sx_t0, sx_h0,
                                dy_inner0, sdy_o0, sdy_t0, sdy_h0, sw0, N, offset, HAS_WEIGHT, W_HEADS0, COMPUTE_DW,
                                CASTING, BLOCK_N, ROWS)  # fmt: skip
