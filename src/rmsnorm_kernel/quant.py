"""Quantised output, forward only: RMSNorm written straight into the dtype the next GEMM reads.

``rms_norm(x, ..., out_dtype=torch.float8_e4m3fn or torch.int8, scale=...)`` (ops hands such
calls here) computes y exactly as ``out_dtype=torch.float32`` does, in fp32, then

    static  (``scale`` a float or a float32 tensor of one element):
            y_q = saturate(y / scale)
    dynamic (``scale=None``), per row:
            scale = min(max(amax(|y|) / QMAX, MIN_SCALE), scale_ub)    ``scale_ub`` optional
            y_q   = saturate(y / scale)                                returns (y_q, scales)

with ``y / scale`` correctly rounded and ``amax / QMAX`` as torch computes it on the device (on
CUDA torch multiplies by the float32 reciprocal of a Python-number divisor, on CPU it divides),
``saturate`` clamping to [-448, 448] (fp8, then rounding
to nearest even) or [-128, 127] (int8, rounding to nearest even), as torch's sequence
``(y / scale).clamp(lo, hi).to(fp8)`` and ``torch.round(y / scale).clamp(lo, hi).to(int8)``
does. ``scales`` has x's shape with the normalised dims set to 1, in fp32. With a residual,
h = x + residual is returned after them, as rms_norm returns it: ``(y_q, h)`` or
``(y_q, scales, h)``. contract.py declares the dtypes, QMAX, MIN_SCALE and the errors.

Forward only: a call that autograd would record (an input requiring grad, grad mode on) raises
contract.ForwardOnly. Where rms_norm's own call takes torch ops (composite.needed: functorch
transforms, forward-mode AD tangents, the TorchScript tracer, meta tensors) or its custom op
(torch.compile, Python dispatch modes and subclasses), and with ``allow_fallback`` for input the
kernels do not run, the same sequence runs in torch ops (``_composite``); a ``__torch_function__``
subclass or an fx Proxy sees the call first, as rms_norm's.

The kernels repeat forward_tile's and forward_looped's arithmetic and launch plans (rows per
program, warps, chunks), and on the GPU the order of each row's sum of squares too (quant_tile
says why that takes more than the same source: the layout), so y before quantisation is the bits
``out_dtype=torch.float32`` gives on the same device: a quantised row is torch's sequence applied
to the op's fp32 row.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from rmsnorm_kernel import composite, contract, kernels, launch

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _quantise(y, scale, QMIN: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr):
    """saturate(y / scale) in fp32, ready for the cast to fp8 (which rounds to nearest even) or,
    for int8, already rounded to nearest even (1.5 * 2^23 added and taken away: exact for
    |v| <= 2^22, and v is clamped first). NaN stays NaN for fp8."""
    v = tl.div_rn(y, scale)
    q = tl.minimum(tl.maximum(v, QMIN), QMAX)
    if INT8:
        q = (q + 12582912.0) - 12582912.0
    else:
        q = tl.where(v == v, q, v)
    return q


@triton.jit
def _row_scale(amax, qmax_inv, scale_ub, min_scale, QMAX: tl.constexpr, HAS_UB: tl.constexpr,
               RECIPROCAL: tl.constexpr):  # fmt: skip
    """A row's dynamic scale from its amax(|y|): amax / QMAX as torch computes it on the device
    (RECIPROCAL, CUDA: torch multiplies by the float32 reciprocal of a Python-number divisor,
    ``qmax_inv``; on CPU it divides)."""
    if RECIPROCAL:
        s = amax * qmax_inv
    else:
        s = tl.div_rn(amax, QMAX)
    s = tl.maximum(s, min_scale)
    if HAS_UB:
        s = tl.minimum(s, scale_ub)
    return s


@triton.jit
def quant_tile(
    X,  # [M, N] rows, row stride stride_x
    RES,  # residual rows (if HAS_RESIDUAL), row stride stride_res
    W,  # weight (if HAS_WEIGHT) [N]
    Y,  # y_q [M, N], contiguous
    H,  # h = x + residual (if HAS_RESIDUAL) [M, N], contiguous
    SCALE,  # static scale as a float32 tensor of one element (if SCALE_PTR)
    SCALES,  # per-row scales [M] (if DYNAMIC)
    M,
    N,
    stride_x,
    stride_res,
    eps,
    offset,
    scale_value,  # static scale as a float (unless SCALE_PTR)
    qmax_inv,  # float32 1 / QMAX (if RECIPROCAL)
    scale_ub,
    min_scale,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    DYNAMIC: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    HAS_UB: tl.constexpr,
    INT8: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    STORE_VEC: tl.constexpr,  # elements per thread of forward_tile's fp32 store: 4, or BLOCK_N if less
):
    """forward_tile's y (same arithmetic, same plan, same layout), quantised at the store.

    The layout: Triton gives every value of a kernel one layout, chosen among its loads' and
    stores' (16-byte vectors), and the layout fixes which elements each thread sums first, so
    it fixes the order, and the bits, of a row's sum of squares. forward_tile's y store is fp32
    (4 elements a vector); a 1-byte y_q store would be 16, and y before quantisation would round
    differently from out_dtype=torch.float32's. y_q's column offsets are therefore declared
    contiguous in runs of STORE_VEC only: its store then asks for the fp32 store's layout."""
    pid = tl.program_id(0)
    first = pid * ROWS
    local = tl.arange(0, ROWS)
    rows = first + local
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    first64 = first.to(tl.int64)
    local64 = local.to(tl.int64)[:, None]
    x = tl.load((X + first64 * stride_x) + local64 * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_WEIGHT:
        w_raw = tl.load(W + cols, mask=cols < N, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(
            (RES + first64 * stride_res) + local64 * stride_res + cols[None, :], mask=mask, other=0.0
        )
        h = (x + res.to(tl.float32)).to(H.dtype.element_ty)
        tl.store((H + first64 * N) + local64 * N + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    v = tl.sum(x * x, axis=1) / N + eps
    rstd = kernels._rsqrt_rn(v)
    xn = x * rstd[:, None]
    if CASTING == 1:
        if HAS_RESIDUAL:
            xn = xn.to(H.dtype.element_ty).to(tl.float32)
        else:
            xn = xn.to(X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        xn = xn * (offset + w_raw.to(tl.float32))[None, :]
    if DYNAMIC:
        scale = _row_scale(
            tl.max(tl.abs(xn), axis=1), qmax_inv, scale_ub, min_scale, QMAX, HAS_UB, RECIPROCAL
        )
        tl.store(SCALES + rows, scale, mask=row_ok)
        q = _quantise(xn, scale[:, None], QMIN, QMAX, INT8)
    else:
        if SCALE_PTR:
            scale = tl.load(SCALE)
        else:
            scale = scale_value
        q = _quantise(xn, scale, QMIN, QMAX, INT8)
    q_cols = tl.max_contiguous(tl.arange(0, BLOCK_N), STORE_VEC)
    q_mask = row_ok[:, None] & (q_cols < N)[None, :]
    tl.store((Y + first64 * N) + local64 * N + q_cols[None, :], q.to(Y.dtype.element_ty), mask=q_mask)


@triton.jit
def _chunk_y(src_row, W, c, N, rstd, offset, HAS_WEIGHT: tl.constexpr, HAS_OFFSET: tl.constexpr,
             CASTING: tl.constexpr):  # fmt: skip
    """y of one chunk of a normalised row (x, or h as stored): kernels._store_scaled's
    arithmetic (the offset added only with HAS_OFFSET, as there)."""
    x = tl.load(src_row + c, mask=c < N, other=0.0)
    xn = x.to(tl.float32) * rstd
    if CASTING == 1:
        xn = xn.to(x.dtype).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + c, mask=c < N, other=0.0)
        if HAS_OFFSET:
            xn = xn * (offset + w.to(tl.float32))
        else:
            xn = xn * w.to(tl.float32)
    return xn


@triton.jit
def quant_looped(
    X, RES, W, Y, H, SCALE, SCALES,
    stride_x, stride_res, eps, offset, scale_value, qmax_inv, scale_ub, min_scale,
    HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr, BLOCK_N: tl.constexpr,
    FIRST_WALK_POLICY: tl.constexpr, UNROLL_WALKS: tl.constexpr, N: tl.constexpr, CONTIGUOUS: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    DYNAMIC: tl.constexpr, SCALE_PTR: tl.constexpr, HAS_UB: tl.constexpr, INT8: tl.constexpr,
    QMIN: tl.constexpr, QMAX: tl.constexpr, RECIPROCAL: tl.constexpr, STORE_VEC: tl.constexpr,
):  # fmt: skip
    """Rows wider than a tile, one program per row, in BLOCK_N chunks: forward_looped's first
    walk itself (kernels._looped_rstd, with forward_looped's plan: N a compile-time constant,
    its chunk, warps and unrolling), then (DYNAMIC) a walk for amax(|y|), then the walk that
    stores y_q. y_q's offsets are declared contiguous in runs of STORE_VEC, as in quant_tile.
    Other parameters as quant_tile's."""
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
    rstd = kernels._looped_rstd(
        x_row, res_row, h_row, cols, eps, N, BLOCK_N, FIRST_WALK_POLICY, HAS_RESIDUAL, UNROLL_WALKS
    )
    if HAS_RESIDUAL:
        src_row = h_row
    else:
        src_row = x_row
    if DYNAMIC:
        amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            y = _chunk_y(src_row, W, start + cols, N, rstd, offset, HAS_WEIGHT, HAS_OFFSET, CASTING)
            amax = tl.maximum(amax, tl.abs(y))
        scale = _row_scale(tl.max(amax, axis=0), qmax_inv, scale_ub, min_scale, QMAX, HAS_UB, RECIPROCAL)
        tl.store(SCALES + row, scale)
    elif SCALE_PTR:
        scale = tl.load(SCALE)
    else:
        scale = scale_value
    y_row = Y + row64 * N
    q_cols = tl.max_contiguous(tl.arange(0, BLOCK_N), STORE_VEC)
    for start in range(0, N, BLOCK_N):
        y = _chunk_y(src_row, W, start + cols, N, rstd, offset, HAS_WEIGHT, HAS_OFFSET, CASTING)
        c = start + q_cols
        tl.store(y_row + c, _quantise(y, scale, QMIN, QMAX, INT8).to(Y.dtype.element_ty), mask=c < N)


# ---------------------------------------------------------------------------------------------
# Launch: the plain forward's plans (launch.forward_config, forward_looped's chunk and warps)
# ---------------------------------------------------------------------------------------------

_quant_tile = launch.Launcher(quant_tile, 7)
_quant_looped = launch.Launcher(quant_looped, 7)


class QuantPlan(NamedTuple):
    looped: bool
    grid_rows: int  # rows per program
    num_warps: int
    constexprs: tuple


# torch's float32 reciprocal of QMAX, by which it multiplies on CUDA for ``amax / QMAX``.
QMAX_INV = {dtype: float(np.float32(1.0) / np.float32(q)) for dtype, q in contract.QMAX.items()}
_MIN_SCALE = {dtype: contract.min_scale(dtype) for dtype in contract.QUANT_DTYPES}


@functools.cache
def _plan(
    n,
    has_weight,
    has_residual,
    casting,
    dynamic,
    scale_ptr,
    has_ub,
    out_dtype,
    reciprocal,
    contiguous,
    has_offset,
) -> QuantPlan:
    """The plain forward's plan at this width (launch._forward_tile_plan's many-row plan, batch
    invariant; launch._forward_looped_plan's), with the quantisation's constexprs after it."""
    quant = (
        dynamic,
        scale_ptr,
        has_ub,
        out_dtype == torch.int8,
        contract.QMIN[out_dtype],
        contract.QMAX[out_dtype],
        reciprocal,
    )
    if n <= launch.FORWARD_MAX_TILE:
        block_n, rows, num_warps = launch.forward_config(n)
        store_vec = min(4, block_n)
        return QuantPlan(
            False, rows, num_warps, (has_weight, has_residual, casting, block_n, rows, *quant, store_vec)
        )
    num_warps, plain = launch._forward_looped_plan(
        n, has_weight, has_residual, casting, contiguous, has_offset, False
    )
    (_, _, _, block_n, first_walk_policy, _, _, unroll_walks, _, _, _, _) = plain
    looped = (
        has_weight,
        has_residual,
        casting,
        block_n,
        first_walk_policy,
        unroll_walks,
        n,
        contiguous,
        has_offset,
    )
    return QuantPlan(True, 1, num_warps, (*looped, *quant, min(4, block_n)))


def forward(x2, weight, res2, eps, offset, casting, out_dtype, residual_dtype, scale, scale_ub, shape):
    """x2, res2: (M, N) with unit row stride; weight contiguous (N,) or None. Returns (y_q,
    scales or None, h or None): y_q and h of ``shape``, scales of shape[:-1] + (1,)."""
    m, n = x2.shape
    device = x2.device
    dynamic = scale is None
    scale_ptr = isinstance(scale, Tensor)
    y = torch.empty(*shape, dtype=out_dtype, device=device)
    h = torch.empty(*shape, dtype=residual_dtype, device=device) if res2 is not None else None
    scales = torch.empty(*shape[:-1], 1, dtype=torch.float32, device=device) if dynamic else None
    if m == 0:
        return y, scales, h
    stride_x = x2.stride(0)
    stride_r = res2.stride(0) if res2 is not None else stride_x
    plan = _plan(
        n, weight is not None, res2 is not None, casting, dynamic, scale_ptr, scale_ub is not None, out_dtype,
        device.type == "cuda", stride_x == n and stride_r == n, offset != 0.0,
    )  # fmt: skip
    # Pointers a launch does not use get x2.
    pointers = (
        x2, res2 if res2 is not None else x2, weight if weight is not None else x2, y,
        h if h is not None else x2, scale if scale_ptr else x2, scales if dynamic else x2,
    )  # fmt: skip
    scalars = (
        stride_x, stride_r, eps, offset,
        float(scale) if not (dynamic or scale_ptr) else 1.0,
        QMAX_INV[out_dtype],
        float(scale_ub) if scale_ub is not None else 1.0,
        _MIN_SCALE[out_dtype],
    )  # fmt: skip
    if plan.looped:
        _quant_looped((m, 1, 1), (*pointers, *scalars), plan.num_warps, plan.constexprs)
    else:
        grid = ((m + plan.grid_rows - 1) // plan.grid_rows, 1, 1)
        _quant_tile(grid, (*pointers, m, n, *scalars), plan.num_warps, plan.constexprs)
    return y, scales, h


def takes_fast_scale(out_dtype, scale, scale_ub) -> bool:
    """Whether ops.rms_norm's fast path may take these quantisation arguments (the rest are
    ops._takes_fast_path's): a quantised out_dtype, and a finite positive float scale or none,
    with a finite positive float bound only without one. Anything else goes to rms_norm_quant,
    which raises the errors."""
    return (
        (out_dtype is torch.float8_e4m3fn or out_dtype is torch.int8)
        and (scale is None or (type(scale) is float and 0.0 < scale < math.inf))
        and (scale_ub is None or (scale is None and type(scale_ub) is float and 0.0 < scale_ub < math.inf))
    )


def forward_rows(x: Tensor, weight, eps: float, offset: float, casting: str, out_dtype, scale, scale_ub):
    """The fast path's run (ops.rms_norm's tests passed: x contiguous, a contiguous (N,) weight
    or none, no residual): rms_norm_quant's result for the same call."""
    n = x.shape[-1]
    m = x.numel() // n
    y, scales, _ = forward(
        x.view(m, n), weight, None, eps, offset, contract.CASTING_CODES[casting], out_dtype, x.dtype, scale,
        scale_ub, (m, n),
    )  # fmt: skip
    if scales is None:
        return y.view(x.shape)
    return y.view(x.shape), scales.view(*x.shape[:-1], 1)


# ---------------------------------------------------------------------------------------------
# The composite: the same sequence in torch ops
# ---------------------------------------------------------------------------------------------


def quantise(y: Tensor, out_dtype: torch.dtype, scale, scale_ub, k: int) -> tuple[Tensor, Tensor | None]:
    """Torch's sequence on an fp32 y normalised over its last ``k`` dims: (y_q, scales or None)."""
    lo, hi = contract.QMIN[out_dtype], contract.QMAX[out_dtype]
    dims = tuple(range(y.dim() - k, y.dim()))
    scales = None
    if scale is None:
        amax = (
            y.abs().amax(dim=dims, keepdim=True)
            if y.numel()
            else y.new_zeros(*y.shape[: y.dim() - k], *([1] * k))
        )
        scales = (amax / hi).clamp(min=contract.min_scale(out_dtype))
        if scale_ub is not None:
            scales = scales.clamp(max=torch.tensor(scale_ub, dtype=torch.float32).item())
        s = scales
    elif isinstance(scale, Tensor):
        s = scale.reshape(())
    else:
        s = torch.tensor(scale, dtype=torch.float32, device=y.device)
    v = y / s
    if out_dtype == torch.int8:
        return torch.round(v).clamp(lo, hi).to(torch.int8), scales
    return v.clamp(lo, hi).to(out_dtype), scales


def _composite(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype, scale, scale_ub):
    """The quantised call in torch ops (rms_norm's composite for y, then ``quantise``)."""
    out = composite.rms_norm(x, shape, weight, eps, residual, residual_dtype, offset, casting, torch.float32)
    y, h = out if residual is not None else (out, None)
    y_q, scales = quantise(y, out_dtype, scale, scale_ub, len(shape))
    return _result(y_q, scales, h)


def _result(y_q, scales, h):
    out = (y_q,) if scales is None else (y_q, scales)
    if h is not None:
        out += (h,)
    return out[0] if len(out) == 1 else out


# ---------------------------------------------------------------------------------------------
# The public function
# ---------------------------------------------------------------------------------------------


def rms_norm_quant(
    x: Tensor,
    normalized_shape=None,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    residual: Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    offset: float = 0.0,
    casting: str = "default",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    scale=None,
    scale_ub: float | None = None,
    allow_fallback: bool = False,
):
    """RMSNorm with a quantised output (module docstring), forward only. Every argument is
    checked before any launch (contract.validate and contract.validate_quant)."""
    n, shape = contract.normalized_size(x, normalized_shape, weight)
    contract.validate_quant(x, out_dtype, scale, scale_ub)
    if isinstance(eps, Tensor) and eps.dim() == 0 and not eps.requires_grad and not eps.is_complex():
        eps = float(eps)
    if eps is None:
        eps = contract.default_eps(x.dtype) if isinstance(x, Tensor) else contract.FLOAT32_EPS
    transformed = composite.needed(x, weight, residual, scale)
    try:
        contract.validate(x, weight, residual, eps, offset, casting, None, residual_dtype, n)
        unsupported = False
    except contract.UnsupportedInput as exc:
        if isinstance(exc, contract.TorchOnly):  # torch's rms_norm has no quantised output either
            raise contract.Refused(f"{str(exc).split(':')[0]}: the quantised output is of real rows") from exc
        if not (allow_fallback or transformed):
            raise
        unsupported = True
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (x, weight, residual, scale if isinstance(scale, Tensor) else None)
    ):
        raise contract.ForwardOnly(
            "a quantised out_dtype is forward only: an input requires grad under grad mode; call it under "
            "torch.no_grad() or torch.inference_mode()"
        )
    eps, offset = float(eps), float(offset)
    if residual is not None and residual_dtype is None:
        residual_dtype = x.dtype
    args = (x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype, scale, scale_ub)
    # rms_norm's decision (composite.needed); a trace or a Python dispatch mode, where rms_norm
    # calls its custom op, sees torch ops here
    if (
        unsupported
        or n == 0
        or transformed
        or torch.compiler.is_compiling()
        or composite.seen_by_python_dispatch(x, weight, residual, scale)
    ):
        return _composite(*args)
    k = len(shape)
    lead = x.shape[: x.dim() - k]
    x2 = launch.as_rows(x.reshape(*lead, n).resolve_neg(), n)
    r2 = launch.as_rows(residual.reshape(*lead, n).resolve_neg(), n) if residual is not None else None
    w = weight.resolve_neg().reshape(n).contiguous() if weight is not None else None
    if x2.dim() != 2 or x2.shape[0] != math.prod(lead):  # a 1-D x
        x2 = x2.view(-1, n)
    y, scales, h = forward(
        x2, w, r2, eps, offset, contract.CASTING_CODES[casting], out_dtype, residual_dtype, scale, scale_ub,
        (math.prod(lead), n),
    )  # fmt: skip
    y = y.view(x.shape)
    h = h.view(x.shape) if h is not None else None
    if scales is not None:
        scales = scales.view(*lead, *([1] * k))
    return _result(y, scales, h)
