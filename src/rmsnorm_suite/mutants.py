"""Deliberately broken RMSNorm kernels: the negative cases that prove the suite's checks bite.

Two small, correct Triton implementations, plain RMSNorm and the model-ready features (fused
residual add, weight offset, casting modes, out_dtype), each with its mutation sites: every
mutant is a baseline with exactly one bug, selected by the constexpr ``BUG`` (the empty string
is the correct baseline). ``MUTANTS`` and ``FEATURE_MUTANTS`` name them; the checks that judge
the feature half live in :mod:`rmsnorm_suite.featurechecks`, and :mod:`rmsnorm_suite.mutanthunt`
runs the checks on every mutant. These kernels never ship in the op's package.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import torch
import triton
import triton.language as tl

from rmsnorm_suite import checks, probes
from rmsnorm_suite.featurechecks import FeatureImpl

# ---------------------------------------------------------------------------------------------
# Kernels (baseline and mutation sites)
# ---------------------------------------------------------------------------------------------
#
# One program per row, the whole row in one block, a dx kernel that also writes per-row partial
# dw, and a fixed-order column reduction of those partials, as in the tutorial. Each ``if BUG ==``
# below is one mutation site.


@triton.jit
def _store_cast(ptrs, v, mask, USE_MASK: tl.constexpr):
    """Store fp32 v into ptrs' dtype with round-to-nearest-even. The Triton interpreter truncates
    fp32 -> bf16 conversions, so bf16 is rounded here by integer arithmetic (the same result a
    GPU's conversion gives for finite values)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(ptrs.dtype.element_ty)
    if USE_MASK:
        tl.store(ptrs, out, mask=mask)
    else:
        tl.store(ptrs, out)


@triton.jit
def forward_kernel(X, W, Y, R, N, eps, BLOCK: tl.constexpr, BUG: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if BUG == "load_other_one":
        x = tl.load(X + row * N + cols, mask=mask, other=1.0).to(tl.float32)
    else:
        x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == "weight_row_offset":
        w = tl.load(W + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == "mean_subtracted":
        x = tl.where(mask, x - tl.sum(x, 0) / N, 0.0)
    if BUG == "squares_in_fp16":
        xh = x.to(tl.float16)
        sum_sq = tl.sum(xh * xh, 0).to(tl.float32)
    else:
        sum_sq = tl.sum(x * x, 0)
    if BUG == "denominator_block":
        mean_sq = sum_sq / BLOCK
    else:
        mean_sq = sum_sq / N
    if BUG == "eps_outside_sqrt":
        r = 1.0 / (tl.sqrt(mean_sq) + eps)
    elif BUG == "eps_dropped":
        r = 1.0 / tl.sqrt(mean_sq)
    else:
        r = 1.0 / tl.sqrt(mean_sq + eps)
    if BUG == "weight_ignored":
        y = x * r
    else:
        y = x * r * w
    _store_cast(Y + row * N + cols, y, mask, BUG != "store_without_mask")
    if BUG == "rstd_stored_in_x_dtype":
        r = r.to(X.dtype.element_ty).to(tl.float32)
    if BUG != "rstd_not_stored":
        tl.store(R + row, r)


@triton.jit
def dx_kernel(X, W, DY, R, DX, PARTIAL, N, eps, BLOCK: tl.constexpr, BUG: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == "rstd_recomputed_in_fp16":
        xh = x.to(tl.float16)
        mean_sq = (tl.sum(xh * xh, 0) / N).to(tl.float16)
        r = (1.0 / tl.sqrt(mean_sq.to(tl.float32) + eps)).to(tl.float16).to(tl.float32)
    elif BUG == "rstd_of_row_0":
        r = tl.load(R)
    else:
        r = tl.load(R + row)
    u = dy * w
    if BUG == "dx_denominator_block":
        mean_ux = tl.sum(u * x, 0) / BLOCK
    else:
        mean_ux = tl.sum(u * x, 0) / N
    if BUG == "dx_without_r3_term":
        dx = r * u
    elif BUG == "dx_r2_instead_of_r3":
        dx = r * u - x * r * r * mean_ux
    else:
        dx = r * u - x * r * r * r * mean_ux
    _store_cast(DX + row * N + cols, dx, mask, BUG != "dx_store_without_mask")
    if BUG == "dw_partial_without_r":
        tl.store(PARTIAL + row * N + cols, dy * x, mask=mask)
    else:
        tl.store(PARTIAL + row * N + cols, dy * x * r, mask=mask)
    if BUG == "dy_modified_in_place":
        # u = dy * w written back over dy, as a kernel reusing dy's buffer for scratch would
        _store_cast(DY + row * N + cols, u, mask, True)


@triton.jit
def dw_kernel(PARTIAL, DW, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
    """dw[c] = sum over rows of PARTIAL[:, c], rows taken in the same order on every run."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        tile_mask = (rows < M)[:, None] & col_ok[None, :]
        p = tl.load(PARTIAL + rows[:, None] * N + cols[None, :], mask=tile_mask, other=0.0)
        acc += tl.sum(p, axis=0)
    if BUG == "dw_mean_over_rows":
        acc = acc / M
    if BUG == "dw_wrong_axis":
        # also summed across this program's columns: one number broadcast to all of them
        acc = tl.zeros([BLOCK_N], dtype=tl.float32) + tl.sum(acc, axis=0)
    _store_cast(DW + cols, acc, col_ok, True)


# ---------------------------------------------------------------------------------------------
# Launchers (the harness)
# ---------------------------------------------------------------------------------------------

# The harness makes out-of-bounds effects observable and deterministic:
# * outputs (y, dx, dw) are views at the start of larger buffers pre-filled with
#   ``probes.CANARY``, so a store past a row's end changes a canary that ``check_output_bounds``
#   inspects;
# * the weight is read from a copy followed by NaN, so a read past its N values shows as NaN;
# * rstd and the partial-dw scratch start as NaN, so a value never written shows as NaN.

DW_BLOCK_M = 16
DW_BLOCK_N = 128
# For the "dw_order_varies" mutant: a row-block size that changes from call to call.
_CALLS = itertools.count()


def _in_canary_buffer(shape, dtype, device, extra: int) -> torch.Tensor:
    """A tensor of ``shape`` at the start of a buffer ``extra`` elements longer, all CANARY."""
    numel = math.prod(shape)
    buf = torch.full((numel + extra,), probes.CANARY, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _nan_padded(t: torch.Tensor, extra: int) -> torch.Tensor:
    """A contiguous copy of t followed by ``extra`` NaNs in the same buffer."""
    buf = torch.full((t.numel() + extra,), math.nan, dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.reshape(-1)
    return buf[: t.numel()].view(t.shape)


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, bug: str = ""):
    """y and the fp32 rstd per row. Rows must be contiguous here (strided rows are the real op's
    business, not this harness's), so row slices are copied first."""
    x = x.contiguous()
    m, n = x.shape
    block = triton.next_power_of_2(n)
    out_dtype = torch.float32 if bug == "output_in_fp32" else x.dtype
    y = _in_canary_buffer((m, n), out_dtype, x.device, extra=block)
    rstd = torch.full((m,), math.nan, dtype=torch.float32, device=x.device)
    w = _nan_padded(weight, extra=m * n + block)
    if m:
        forward_kernel[(m,)](x, w, y, rstd, n, eps, BLOCK=block, BUG=bug)
    return y, rstd


def _backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float, bug: str = ""):
    """dx and dw, reading the rstd the forward stored (as autograd would save it)."""
    x, dy = x.contiguous(), dy.contiguous()
    m, n = x.shape
    block = triton.next_power_of_2(n)
    _, rstd = _forward(x, weight, eps, bug)
    dx = _in_canary_buffer((m, n), x.dtype, x.device, extra=block)
    scratch = torch.full((m, n), math.nan, dtype=torch.float32, device=x.device)
    w = _nan_padded(weight, extra=block)
    if m:
        dx_kernel[(m,)](x, w, dy, rstd, dx, scratch, n, eps, BLOCK=block, BUG=bug)
    dw_dtype = x.dtype if bug == "dw_in_x_dtype" else weight.dtype
    dw = _in_canary_buffer((n,), dw_dtype, x.device, extra=DW_BLOCK_N)
    block_m = (2, 4, 8)[next(_CALLS) % 3] if bug == "dw_order_varies" else DW_BLOCK_M
    dw_kernel[(triton.cdiv(n, DW_BLOCK_N),)](scratch, dw, m, n, BLOCK_M=block_m, BLOCK_N=DW_BLOCK_N, BUG=bug)
    return dx, dw


def forward_impl(bug: str = ""):
    """impl(x, weight, eps) -> y for the baseline ("") or one mutant."""

    def forward(x, weight, eps):
        return _forward(x, weight, eps, bug)[0]

    forward.__name__ = f"forward_{bug or 'baseline'}"
    return forward


def backward_impl(bug: str = ""):
    """impl(x, weight, dy, eps) -> (dx, dw) for the baseline ("") or one mutant."""
    return partial(_backward, bug=bug)


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------

_DESCRIPTIONS: dict[str, str] = {
    "denominator_block": "forward: mean(x^2) divided by BLOCK (next power of two) instead of N",
    "dx_denominator_block": "backward: mean(u*x) in dx divided by BLOCK instead of N",
    "eps_outside_sqrt": "forward: r = 1/(sqrt(mean(x^2)) + eps) instead of 1/sqrt(mean(x^2) + eps)",
    "eps_dropped": "forward: r = 1/sqrt(mean(x^2)), eps left out",
    "squares_in_fp16": "forward: x cast to fp16 before squaring and summing (overflows above 256)",
    "store_without_mask": "forward: y stored without its mask (writes past the row's end)",
    "dx_store_without_mask": "backward: dx stored without its mask",
    "weight_row_offset": "forward: weight read at row*N + col instead of col",
    "weight_ignored": "forward: y = x*r, the weight never applied",
    "mean_subtracted": "forward: the row mean subtracted first (LayerNorm, not RMSNorm)",
    "load_other_one": "forward: masked lanes of x loaded as 1.0 instead of 0 (padding enters the sum)",
    "output_in_fp32": "forward: y returned in fp32 instead of x's dtype",
    "rstd_not_stored": "forward: rstd never stored, the backward reads an unwritten buffer",
    "rstd_stored_in_x_dtype": "forward: rstd rounded to x's dtype before it is saved for the backward",
    "rstd_recomputed_in_fp16": "backward: rstd recomputed from fp16 squares instead of read from the forward",
    "rstd_of_row_0": "backward: every row reads row 0's rstd",
    "dx_without_r3_term": "backward: dx = r*u, the -x*r^3*mean(u*x) term missing",
    "dx_r2_instead_of_r3": "backward: dx's second term uses r^2 instead of r^3",
    "dw_partial_without_r": "backward: partial dw = dy*x, the factor r missing",
    "dy_modified_in_place": "backward: dy overwritten with dy*w (dy used as scratch)",
    "dw_mean_over_rows": "backward: dw divided by M (a mean over rows instead of a sum)",
    "dw_wrong_axis": "backward: dw also summed across columns, one scalar broadcast per block",
    "dw_in_x_dtype": "backward: dw returned in x's dtype instead of the weight's",
    "dw_order_varies": (
        "backward: the dw reduction's row blocking changes from call to call (as a launch "
        "configuration chosen at run time would), so the fp32 sum is taken in another order"
    ),
}

BASELINE = ("the correct implementation every mutant starts from", forward_impl(""), backward_impl(""))

# name -> (description, forward_impl, backward_impl)
MUTANTS: dict[str, tuple[str, object, object]] = {
    name: (description, forward_impl(name), backward_impl(name))
    for name, description in _DESCRIPTIONS.items()
}


def as_impl(name: str = "") -> checks.Impl:
    """The baseline ("") or a mutant as a checks.Impl."""
    _, fwd, bwd = BASELINE if name == "" else MUTANTS[name]
    return checks.Impl(name or "baseline", fwd, bwd)


# ---------------------------------------------------------------------------------------------
# Model-ready features: fused residual add, weight offset, casting modes, out_dtype
# ---------------------------------------------------------------------------------------------
#
# A second small, correct implementation, of the features the op offers beyond plain RMSNorm
# (h = x + residual computed in fp32 and stored in residual_dtype, then normalised; y = xn *
# (offset + w); "llama" casting rounds xn to the normalised input's dtype before the weight
# multiply and for dw; y stored in out_dtype), with its own mutation sites. The feature checks
# (featurechecks.py) judge any implementation of the same interface; tests/op/test_features.py
# runs them on the real op, tests/suite/test_mutants.py on this baseline and every feature mutant.


@triton.jit
def feature_forward_kernel(
    X,
    RES,
    W,
    Y,
    H,
    RSTD,
    N,
    eps,
    offset,
    HAS_RESIDUAL: tl.constexpr,
    LLAMA: tl.constexpr,
    BLOCK: tl.constexpr,
    BUG: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(RES + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        if BUG == "residual_added_in_x_dtype":
            total = (x + res.to(X.dtype.element_ty).to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        else:
            total = x + res
        h = total.to(H.dtype.element_ty)
        if BUG != "h_not_stored":
            tl.store(H + row * N + cols, h, mask=mask)
        if BUG == "normalises_unrounded_sum":
            x = total
        elif BUG != "normalises_x_not_h":
            x = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(RSTD + row, r)
    xn = x * r
    if LLAMA and BUG != "llama_rounding_skipped":
        if HAS_RESIDUAL:
            xn = xn.to(H.dtype.element_ty).to(tl.float32)
        else:
            xn = xn.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if BUG == "offset_ignored":
        scale = w
    elif BUG == "offset_in_weight_dtype":
        scale = (offset + w).to(W.dtype.element_ty).to(tl.float32)
    else:
        scale = offset + w
    y = xn * scale
    if BUG == "out_dtype_double_rounding":
        y = y.to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * N + cols, y, mask=mask)


@triton.jit
def feature_backward_kernel(
    XH,
    W,
    DY,
    DH,
    RSTD,
    DX,
    PARTIAL,
    N,
    offset,
    HAS_DH: tl.constexpr,
    LLAMA: tl.constexpr,
    BLOCK: tl.constexpr,
    BUG: tl.constexpr,
):
    """XH is the normalised input the forward saw (x, or the stored h); DX is fp32."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x_raw = tl.load(XH + row * N + cols, mask=mask, other=0.0)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(RSTD + row)
    xn = x_raw.to(tl.float32) * r
    u = dy * (offset + w)
    c = tl.sum(u * xn, 0) / N
    dx = (u - xn * c) * r
    if HAS_DH and BUG != "dh_dropped":
        dx += tl.load(DH + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * N + cols, dx, mask=mask)
    if LLAMA and BUG != "llama_dw_unrounded":
        xn = xn.to(XH.dtype.element_ty).to(tl.float32)
    if BUG == "offset_in_dw":
        tl.store(PARTIAL + row * N + cols, u * xn, mask=mask)
    else:
        tl.store(PARTIAL + row * N + cols, dy * xn, mask=mask)


def _feature_launch(x, weight, residual, *, eps, offset, casting, residual_dtype, out_dtype, bug):
    """y, h (None without a residual) and rstd from the feature forward kernel."""
    x = x.contiguous()
    m, n = x.shape
    block = triton.next_power_of_2(n)
    h_dtype = (residual_dtype or x.dtype) if residual is not None else x.dtype
    if out_dtype is None:
        out_dtype = x.dtype
        if casting == "llama" and bug != "llama_output_in_x_dtype":
            out_dtype = torch.promote_types(h_dtype, weight.dtype)
    y = torch.full((m, n), math.nan, dtype=out_dtype, device=x.device)
    rstd = torch.full((m,), math.nan, dtype=torch.float32, device=x.device)
    h = torch.full((m, n), math.nan, dtype=h_dtype, device=x.device) if residual is not None else None
    res = residual.contiguous() if residual is not None else x
    feature_forward_kernel[(m,)](
        x,
        res,
        weight.contiguous(),
        y,
        h if h is not None else y,
        rstd,
        n,
        eps,
        float(offset),
        HAS_RESIDUAL=residual is not None,
        LLAMA=casting == "llama",
        BLOCK=block,
        BUG=bug,
    )
    return y, h, rstd


def feature_forward_impl(bug: str = ""):
    """forward(x, weight, residual, **options) -> (y, h or None) for the baseline or a mutant."""

    def forward(
        x, weight, residual, *, eps, offset=0.0, casting="default", residual_dtype=None, out_dtype=None
    ):
        y, h, _ = _feature_launch(
            x,
            weight,
            residual,
            eps=eps,
            offset=offset,
            casting=casting,
            residual_dtype=residual_dtype,
            out_dtype=out_dtype,
            bug=bug,
        )
        return y, h

    return forward


def feature_backward_impl(bug: str = ""):
    """backward(x, weight, residual, dy, dh, **options) -> (dx, dresidual or None, dw)."""

    def backward(
        x,
        weight,
        residual,
        dy,
        dh,
        *,
        eps,
        offset=0.0,
        casting="default",
        residual_dtype=None,
        out_dtype=None,
    ):
        _, h, rstd = _feature_launch(
            x,
            weight,
            residual,
            eps=eps,
            offset=offset,
            casting=casting,
            residual_dtype=residual_dtype,
            out_dtype=out_dtype,
            bug=bug,
        )
        xh = h if h is not None else x.contiguous()
        m, n = xh.shape
        block = triton.next_power_of_2(n)
        dx = torch.full((m, n), math.nan, dtype=torch.float32, device=x.device)
        scratch = torch.full((m, n), math.nan, dtype=torch.float32, device=x.device)
        dy = dy.contiguous()
        dh = dh.contiguous() if dh is not None else None
        feature_backward_kernel[(m,)](
            xh,
            weight.contiguous(),
            dy,
            dh if dh is not None else dy,
            rstd,
            dx,
            scratch,
            n,
            float(offset),
            HAS_DH=dh is not None,
            LLAMA=casting == "llama",
            BLOCK=block,
            BUG=bug,
        )
        dw = torch.empty((n,), dtype=weight.dtype, device=x.device)
        dw_kernel[(triton.cdiv(n, DW_BLOCK_N),)](
            scratch, dw, m, n, BLOCK_M=DW_BLOCK_M, BLOCK_N=DW_BLOCK_N, BUG=""
        )
        dres = dx.to(residual.dtype) if residual is not None else None
        return dx.to(x.dtype), dres, dw

    return backward


FEATURE_BASELINE = FeatureImpl("feature baseline", feature_forward_impl(""), feature_backward_impl(""))

_FEATURE_DESCRIPTIONS: dict[str, str] = {
    "residual_added_in_x_dtype": "residual: x + r rounded to x's dtype (a low-precision add) before h is stored",
    "h_not_stored": "residual: h never written, the caller gets an unwritten buffer",
    "normalises_x_not_h": "residual: h stored but x normalised instead of h",
    "normalises_unrounded_sum": "residual: the fp32 sum normalised instead of the h returned in residual_dtype",
    "dh_dropped": "residual backward: the gradient reaching h from downstream not added to dx and dresidual",
    "offset_ignored": "offset: y = xn * w, the offset never added",
    "offset_in_weight_dtype": "offset: offset + w rounded to the weight's dtype instead of kept in fp32",
    "offset_in_dw": "offset backward: dw summed from u = dy * (offset + w) instead of dy, the offset leaks into dw",
    "llama_rounding_skipped": "llama casting: xn not rounded to the input dtype before the weight multiply",
    "llama_dw_unrounded": "llama casting backward: dw summed from the unrounded xn",
    "llama_output_in_x_dtype": "llama casting: y in x's dtype instead of promote(x, weight)",
    "out_dtype_double_rounding": "out_dtype: y rounded to x's dtype before it is stored in out_dtype",
}

# name -> (description, FeatureImpl)
FEATURE_MUTANTS: dict[str, tuple[str, FeatureImpl]] = {
    name: (description, FeatureImpl(name, feature_forward_impl(name), feature_backward_impl(name)))
    for name, description in _FEATURE_DESCRIPTIONS.items()
}
