"""Deliberately broken RMSNorm kernels: the negative cases that prove the suite's checks bite.

A small, correct Triton implementation comes first (one program per row, the whole row in one
block, a dx kernel that also writes per-row partial dw, and a fixed-order column reduction of
those partials, as in the tutorial). Every mutant is that implementation with exactly one bug,
selected by the constexpr ``BUG`` (the empty string is the correct baseline): each ``if BUG ==``
below is one mutation site. These kernels live in the tests and never in the package.

The harness makes out-of-bounds effects observable and deterministic:
* outputs (y, dx, dw) are views at the start of larger buffers pre-filled with
  ``probes.CANARY``, so a store past a row's end changes a canary that ``check_output_bounds``
  inspects;
* the weight is read from a copy followed by NaN, so a read past its N values shows as NaN;
* rstd and the partial-dw scratch start as NaN, so a value never written shows as NaN.

``catalogue(device)`` runs the suite's checks on every mutant and returns, per mutant, the first
check that caught it and the case that exposed it (``tests/suite/test_mutants.py`` writes the report).

Why one module of ~1K lines: each mutant is a ``BUG`` site in a kernel and a name in the
catalogue beside it, so a kernel and the list that drives it change together. The two halves
(plain RMSNorm, then the model-ready features from "Model-ready features" on) use each other:
the feature backward reduces dw with the plain half's ``dw_kernel`` and records its entry with
``_entry``, while ``hunt`` and ``catalogue`` (which the verdict calls as ``mutants.catalogue``)
run the feature mutants too. Split in two, the halves would import each other.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import triton
import triton.language as tl

from rmsnorm_suite import cases, checks, numerics, probes

# ---------------------------------------------------------------------------------------------
# Kernels (baseline and mutation sites)
# ---------------------------------------------------------------------------------------------


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


# The grid the catalogue runs: the interpreter grid of cases, without the N above a single tile
# (this harness has no looped path) and without M = 0 (nothing to compute, nothing to catch).
GRID: list[tuple[int, int, torch.dtype]] = [
    (m, n, d) for (m, n, d) in cases.interpret_grid() if m > 0 and n <= 4097
]


def _probe_steps(device):
    for check, fn, kind, kwargs in probes.PROBES:
        yield check, kind, lambda impl, fn=fn, kind=kind, kw=kwargs: [fn(impl, device, kind=kind, **kw)]


def _grid_steps(device):
    for kind in checks.KINDS:
        yield "grid", kind, lambda impl, kind=kind: checks.run_grid(kind, impl, GRID, device)


def run_suite(impl: checks.Impl, device="cpu") -> list[checks.CaseResult]:
    """Every check of the suite on ``impl``: the probes, then the case grids over GRID."""
    results: list[checks.CaseResult] = []
    for _, _, run in [*_probe_steps(device), *_grid_steps(device)]:
        results += run(impl)
    return results


def _entry(name: str, description: str, failed: list[checks.CaseResult], start: float) -> dict:
    """A catalogue entry: the first check that caught the mutant, the case that exposed it and
    why, and every other check that also caught it."""
    entry = {
        "mutant": name,
        "description": description,
        "caught": bool(failed),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if failed:
        first = failed[0]
        entry.update(
            check=first.check,
            kind=first.kind,
            case=first.name,
            reason=first.reason,
            result=first.to_dict(),
            also_caught_by=sorted(
                {f"{r.check}/{r.kind}" for r in failed[1:]} - {f"{first.check}/{first.kind}"}
            ),
        )
    return entry


def hunt(name: str, device="cpu") -> dict:
    """Run every probe on one mutant, then, if no probe caught it, the case grids until one case
    fails. The entry names the first check that caught it, the case that exposed it and why, and
    every other probe that also caught it. Feature mutants are hunted by the feature checks."""
    if name in FEATURE_MUTANTS:
        return hunt_feature(name, device)
    description = MUTANTS[name][0]
    impl = as_impl(name)
    start = time.perf_counter()
    failed: list[checks.CaseResult] = []
    for _, _, run in _probe_steps(device):
        failed += [r for r in run(impl) if not r.passed]
    if not failed:
        for _, _, run in _grid_steps(device):
            failed += [r for r in run(impl) if not r.passed]
            if failed:
                break
    return _entry(name, description, failed, start)


def catalogue(device="cpu", *, progress: bool = True) -> list[dict]:
    """Every mutant hunted with the suite's checks: one dict per mutant (mutant, description,
    caught, check, kind, case, reason, also_caught_by, ...). Runs under TRITON_INTERPRET=1 on the
    CPU, or on CUDA."""
    names = [*MUTANTS, *FEATURE_MUTANTS]
    if progress:
        from tqdm import tqdm

        names = tqdm(names, desc="mutants", unit="mutant")
    return [hunt(name, device) for name in names]


def format_report(entries: list[dict]) -> str:
    """The catalogue as markdown: one row per mutant, the check that caught it and the case."""
    survived = [e["mutant"] for e in entries if not e["caught"]]
    lines = [
        "# Mutant catalogue",
        "",
        f"{len(entries) - len(survived)} of {len(entries)} mutants caught by the suite's checks"
        + (f"; SURVIVED: {', '.join(survived)}" if survived else "."),
        "",
        "| mutant | bug | caught by | case | why | also caught by |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        if e["caught"]:
            reason = e["reason"].replace("|", "\\|")
            case = e["case"].replace("|", "\\|")
            also = ", ".join(e["also_caught_by"]) or "-"
            caught_by = f"{e['check']}/{e['kind']}"
            lines.append(f"| {e['mutant']} | {e['description']} | {caught_by} | {case} | {reason} | {also} |")
        else:
            lines.append(f"| {e['mutant']} | {e['description']} | SURVIVED | - | - | - |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Model-ready features: fused residual add, weight offset, casting modes, out_dtype
# ---------------------------------------------------------------------------------------------
#
# A second small, correct implementation, of the features the op offers beyond plain RMSNorm
# (h = x + residual computed in fp32 and stored in residual_dtype, then normalised; y = xn *
# (offset + w); "llama" casting rounds xn to the normalised input's dtype before the weight
# multiply and for dw; y stored in out_dtype), with its own mutation sites. The feature checks
# below judge any implementation of the same interface; tests/op/test_features.py runs them on the
# real op, tests/suite/test_mutants.py on this baseline and every feature mutant.


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


@dataclass(frozen=True)
class FeatureImpl:
    """An implementation of the features under check.

    * ``forward(x, weight, residual, *, eps, offset, casting, residual_dtype, out_dtype)`` returns
      ``(y, h)``, h None without a residual;
    * ``backward(x, weight, residual, dy, dh, **same options)`` returns ``(dx, dresidual, dw)``:
      the gradients of ``<y, dy> + <h, dh>`` (dh None: h not used downstream).
    """

    name: str
    forward: Callable
    backward: Callable


def _op_forward(x, weight, residual, **options):
    import rmsnorm_kernel

    with torch.no_grad():
        out = rmsnorm_kernel.rms_norm(x, weight=weight, residual=residual, **options)
    return out if residual is not None else (out, None)


def _autograd_backward(fn):
    """backward(...) of a FeatureImpl from a differentiable forward fn(x, weight, residual, **opts)."""

    def backward(x, weight, residual, dy, dh, **options):
        xg = x.detach().requires_grad_(True)
        wg = weight.detach().requires_grad_(True)
        rg = residual.detach().requires_grad_(True) if residual is not None else None
        with torch.enable_grad():
            y, h = fn(xg, wg, rg, **options)
            outputs, grads = [y], [dy]
            if dh is not None:
                outputs.append(h)
                grads.append(dh)
            torch.autograd.backward(outputs, grads)
        return xg.grad, rg.grad if rg is not None else None, wg.grad

    return backward


def _op_differentiable(x, weight, residual, **options):
    import rmsnorm_kernel

    out = rmsnorm_kernel.rms_norm(x, weight=weight, residual=residual, **options)
    return out if residual is not None else (out, None)


def feature_reference(
    x, weight, residual, *, eps, offset=0.0, casting="default", residual_dtype=None, out_dtype=None
):
    """The unfused pair, written to be read: h = (x + residual) in fp32, rounded to residual_dtype
    (default x's dtype); then the package's fp32-compute reference normalises h (or x)."""
    from rmsnorm_kernel.reference import rms_norm_reference

    h = None
    normalised = x
    if residual is not None:
        h = (x.float() + residual.float()).to(residual_dtype or x.dtype)
        normalised = h
    y = rms_norm_reference(normalised, weight, eps, offset=offset, casting=casting, out_dtype=out_dtype)
    return y, h


def hf_llama_rms_norm(x, weight, eps):
    """Hugging Face's LlamaRMSNorm.forward, as written there."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def hf_gemma_rms_norm(x, weight, eps):
    """Hugging Face's GemmaRMSNorm.forward (its weight is stored as an offset from 1)."""
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.type_as(x)


op_feature_impl = FeatureImpl("op", _op_forward, _autograd_backward(_op_differentiable))
"""rmsnorm_kernel.rms_norm with its features; the backward runs through autograd."""

reference_feature_impl = FeatureImpl("reference", feature_reference, _autograd_backward(feature_reference))
FEATURE_BASELINE = FeatureImpl("feature baseline", feature_forward_impl(""), feature_backward_impl(""))


@dataclass(frozen=True)
class FeatureCase:
    """One input of a feature check. ``weight_center`` 1.0 gives a Llama-like weight near 1, 0.0
    a Gemma-like one near 0 (used with offset=1.0). ``options`` go to the implementation."""

    label: str
    x_dtype: torch.dtype
    w_dtype: torch.dtype
    r_dtype: torch.dtype | None = None
    options: tuple[tuple[str, object], ...] = ()
    with_dh: bool = False
    weight_center: float = 1.0
    m: int = probes.PROBE_ROWS
    n: int = probes.PROBE_N
    seed: int = 0

    @property
    def opts(self) -> dict:
        return {"eps": cases.EPS, **dict(self.options)}

    def inputs(self, device):
        """x, weight, residual (None without one), dy and dh as float32 (cast per result later)."""
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        x = torch.randn(self.m, self.n, generator=g)
        w = self.weight_center + 0.1 * torch.randn(self.n, generator=g)
        r = torch.randn(self.m, self.n, generator=g)
        dy = torch.randn(self.m, self.n, generator=g)
        dh = torch.randn(self.m, self.n, generator=g)
        res = r.to(self.r_dtype).to(device) if self.r_dtype is not None else None
        return x.to(self.x_dtype).to(device), w.to(self.w_dtype).to(device), res, dy.to(device), dh.to(device)


def _coarser(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _result(
    check, kind, case: FeatureCase, tol_dtype, *, passed, reason="", max_abs=math.nan, max_rel=math.nan
):
    tol = cases.TOLERANCES[tol_dtype]
    return checks.CaseResult(
        name=case.label,
        kind=kind,
        m=case.m,
        n=case.n,
        dtype=cases.dtype_name(case.x_dtype),
        max_abs=max_abs,
        max_rel=max_rel,
        atol=tol.atol,
        rtol=tol.rtol,
        oracle_error=math.nan,
        baseline_error=math.nan,
        passed=passed,
        reason=reason,
        check=check,
        weight_dtype=cases.dtype_name(case.w_dtype),
        seed=case.seed,
    )


def _judge_close(check, kind, case, value, expected, tol_dtype) -> checks.CaseResult:
    """dtype, shape, then |value - expected| <= atol + rtol |expected| with TOLERANCES[tol_dtype]."""
    if not isinstance(value, torch.Tensor):
        return _result(check, kind, case, tol_dtype, passed=False, reason=f"{kind} not returned")
    if value.dtype != expected.dtype or value.shape != expected.shape:
        reason = (
            f"{kind} is {cases.dtype_name(value.dtype)} {tuple(value.shape)}, "
            f"expected {cases.dtype_name(expected.dtype)} {tuple(expected.shape)}"
        )
        return _result(check, kind, case, tol_dtype, passed=False, reason=reason)
    tol = cases.TOLERANCES[tol_dtype]
    v, e = value.detach().double(), expected.detach().double()
    diff = (v - e).abs()
    ok = diff <= tol.atol + tol.rtol * e.abs()
    max_abs = diff.nan_to_num(nan=math.inf).max().item()
    max_rel = (diff / e.abs().clamp_min(1e-30)).nan_to_num(nan=math.inf).max().item()
    bad = int((~ok).sum())
    reason = ""
    if bad:
        first = tuple(int(i) for i in (~ok).nonzero()[0])
        reason = (
            f"{bad}/{ok.numel()} elements of {kind} outside atol+rtol*|ref| "
            f"(first at {first}: {v[first].item():.6g} vs {e[first].item():.6g})"
        )
    return _result(
        check, kind, case, tol_dtype, passed=not bad, reason=reason, max_abs=max_abs, max_rel=max_rel
    )


def _judge_bits(check, kind, case, value, expected) -> checks.CaseResult:
    """Bitwise equality (NaN, an unwritten value, is never equal)."""
    if not isinstance(value, torch.Tensor):
        return _result(check, kind, case, expected.dtype, passed=False, reason=f"{kind} not returned")
    if value.dtype != expected.dtype or value.shape != expected.shape:
        reason = (
            f"{kind} is {cases.dtype_name(value.dtype)} {tuple(value.shape)}, "
            f"expected {cases.dtype_name(expected.dtype)} {tuple(expected.shape)}"
        )
        return _result(check, kind, case, expected.dtype, passed=False, reason=reason)
    same = value == expected
    bad = int((~same).sum())
    reason = f"{bad}/{same.numel()} elements of {kind} differ bitwise from the expected values" if bad else ""
    return _result(check, kind, case, expected.dtype, passed=not bad, reason=reason)


def _judge_closer(check, kind, case, value, target, other, tol_dtype, target_name, other_name):
    """value nearer (relative L2) to ``target`` than to ``other``: which rounding it reproduces."""
    if not isinstance(value, torch.Tensor) or value.shape != target.shape:
        return _result(check, kind, case, tol_dtype, passed=False, reason=f"{kind} missing or misshapen")
    to_target, to_other = numerics.relative_l2(value, target), numerics.relative_l2(value, other)
    passed = to_target < to_other
    reason = ""
    if not passed:
        reason = (
            f"{kind}: relative L2 distance to the {other_name} reference {to_other:.3g} <= "
            f"to the {target_name} reference {to_target:.3g}"
        )
    return _result(check, kind, case, tol_dtype, passed=passed, reason=reason)


def _unchanged(check, case, before, after) -> list[checks.CaseResult]:
    changed = [
        name
        for name, a, b in zip(("x", "weight", "residual", "dy", "dh"), before, after)
        if a is not None and not torch.equal(a, b)
    ]
    if not changed:
        return []
    reason = f"modified its input(s) {changed} in place"
    return [_result(check, "inputs", case, case.x_dtype, passed=False, reason=reason)]


def _tolerance_dtype(case: FeatureCase, kind: str, dtype: torch.dtype) -> torch.dtype:
    """The TOLERANCES row for one result of a case.

    * default/gemma casting round nothing before the result (h is rounded identically by the
      reference), so the result's own dtype applies;
    * "llama" rounds xn to the normalised input's dtype (x's, or h's with a residual), where a
      one-ulp difference in r may flip a rounding: the coarser of that dtype and the result's;
    * with a residual, dx and dresidual of the unfused pair pass through h, whose gradient is a
      tensor of h's dtype there: the coarser of h's dtype and the result's.
    """
    h_dtype = case.opts.get("residual_dtype") or case.x_dtype
    if case.opts.get("casting") == "llama":
        return _coarser(h_dtype if case.r_dtype is not None else case.x_dtype, dtype)
    if case.r_dtype is not None and kind in ("dx", "dresidual"):
        return _coarser(h_dtype, dtype)
    return dtype


def run_feature_case(
    impl: FeatureImpl, case: FeatureCase, device="cpu", check="case"
) -> list[checks.CaseResult]:
    """Forward and backward of ``impl`` on one case against the reference (the unfused pair):
    inputs left unmodified; y, dx and dw (and h bitwise and dresidual with a residual) with the
    tolerance of :func:`_tolerance_dtype`. With "llama" casting also y against the Hugging Face
    formula, and y and dw nearer the llama reference than the fp32-throughout one (the rounding
    differences sit inside the tolerance, so closeness alone would not tell the modes apart)."""
    x, w, r, dy32, dh32 = case.inputs(device)
    opts = case.opts
    ref_y, ref_h = reference_feature_impl.forward(x, w, r, **opts)
    dy = dy32.to(ref_y.dtype)
    dh = dh32.to(ref_h.dtype) if case.with_dh else None
    inputs = (x, w, r, dy, dh)
    before = [t.clone() if t is not None else None for t in inputs]
    try:
        y, h = impl.forward(x, w, r, **opts)
        dx, dres, dw = impl.backward(x, w, r, dy, dh, **opts)
    except Exception as exc:  # a crash fails the check, reported as such
        reason = f"raised {type(exc).__name__}: {exc}"
        return [_result(check, "run", case, case.x_dtype, passed=False, reason=reason)]
    ref_dx, ref_dres, ref_dw = reference_feature_impl.backward(x, w, r, dy, dh, **opts)
    expected = {"y": ref_y, "dx": ref_dx, "dw": ref_dw}
    got = {"y": y, "dx": dx, "dw": dw}
    if r is not None:
        expected["dresidual"], got["dresidual"] = ref_dres, dres
    results = _unchanged(check, case, before, inputs)
    if r is not None:
        results.append(_judge_bits(check, "h", case, h, ref_h))
    for kind, ref in expected.items():
        results.append(
            _judge_close(check, kind, case, got[kind], ref, _tolerance_dtype(case, kind, ref.dtype))
        )
    if opts.get("casting") == "llama":
        tol_dtype = _tolerance_dtype(case, "y", ref_y.dtype)
        hf = hf_llama_rms_norm(ref_h if r is not None else x, w, opts["eps"])
        results.append(_judge_close(check, "y vs Hugging Face", case, y, hf, tol_dtype))
        fp32_opts = {**opts, "casting": "default", "out_dtype": ref_y.dtype}
        fp32_y = reference_feature_impl.forward(x, w, r, **fp32_opts)[0]
        fp32_dw = reference_feature_impl.backward(x, w, r, dy, dh, **fp32_opts)[2]
        results.append(_judge_closer(check, "y rounding", case, y, hf, fp32_y, tol_dtype, "llama", "fp32"))
        results.append(
            _judge_closer(check, "dw rounding", case, dw, ref_dw, fp32_dw, tol_dtype, "llama", "fp32")
        )
    return results


_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16

RESIDUAL_CASES = (
    # the residual stream kept in fp32 beside bf16 activations, h used downstream
    FeatureCase(
        "x bf16 + r bf16 -> h fp32, h used",
        _BF16,
        _F32,
        r_dtype=_BF16,
        options=(("residual_dtype", _F32), ("out_dtype", _BF16)),
        with_dh=True,
    ),
    # an fp32 residual stream rounded to the activations' dtype
    FeatureCase(
        "x bf16 + r fp32 -> h bf16",
        _BF16,
        _BF16,
        r_dtype=_F32,
        options=(("residual_dtype", _BF16), ("out_dtype", _F32)),
    ),
    FeatureCase(
        "x fp16 + r fp16 -> h fp16, h used",
        _F16,
        _F16,
        r_dtype=_F16,
        options=(("out_dtype", _F32),),
        with_dh=True,
    ),
    FeatureCase(
        "x fp32 + r fp32 -> h fp32, h used",
        _F32,
        _F32,
        r_dtype=_F32,
        options=(("out_dtype", _F32),),
        with_dh=True,
    ),
)

OFFSET_CASES = (
    FeatureCase("offset 1, fp32", _F32, _F32, options=(("offset", 1.0),), weight_center=0.0),
    FeatureCase(
        "offset 1, gemma, bf16, bf16 weight, fp32 out",
        _BF16,
        _BF16,
        options=(("offset", 1.0), ("casting", "gemma"), ("out_dtype", _F32)),
        weight_center=0.0,
    ),
)

OUT_DTYPE_CASES = (
    FeatureCase("bf16 in, fp32 out", _BF16, _F32, options=(("out_dtype", _F32),)),
    FeatureCase("fp32 in, bf16 out", _F32, _F32, options=(("out_dtype", _BF16),)),
)

LLAMA_CASES = (
    FeatureCase("llama, bf16, fp32 weight", _BF16, _F32, options=(("casting", "llama"),)),
    FeatureCase("llama, fp16, bf16 weight", _F16, _BF16, options=(("casting", "llama"),)),
    FeatureCase("llama, bf16, bf16 weight", _BF16, _BF16, options=(("casting", "llama"),)),
    # a decoder layer's `hidden = residual + hidden; norm(hidden)`, fused
    FeatureCase(
        "llama, x bf16 + r bf16 -> h bf16, h used, fp32 weight",
        _BF16,
        _F32,
        r_dtype=_BF16,
        options=(("casting", "llama"),),
        with_dh=True,
    ),
)


def check_residual(impl: FeatureImpl, device="cpu") -> list[checks.CaseResult]:
    """h bitwise (x + r in fp32, rounded to residual_dtype), y of that h, and the gradients of
    <y, dy> + <h, dh> against the unfused pair."""
    return [r for case in RESIDUAL_CASES for r in run_feature_case(impl, case, device, "residual")]


def check_offset(impl: FeatureImpl, device="cpu") -> list[checks.CaseResult]:
    """y = xn (offset + w) with the offset in fp32 (a Gemma-like weight near 0); dw free of it."""
    return [r for case in OFFSET_CASES for r in run_feature_case(impl, case, device, "offset")]


def check_out_dtype(impl: FeatureImpl, device="cpu") -> list[checks.CaseResult]:
    """y stored in out_dtype with one rounding; dx in x's dtype."""
    return [r for case in OUT_DTYPE_CASES for r in run_feature_case(impl, case, device, "out_dtype")]


def check_llama_casting(impl: FeatureImpl, device="cpu") -> list[checks.CaseResult]:
    """Hugging Face Llama's rounding: y in promote(x, weight), equal to the Hugging Face formula
    within tolerance, and y and dw nearer the llama reference than the fp32-throughout one."""
    return [r for case in LLAMA_CASES for r in run_feature_case(impl, case, device, "llama")]


# name -> check(impl, device) -> list of CaseResult
FEATURE_CHECKS: dict[str, Callable[..., list[checks.CaseResult]]] = {
    "residual": check_residual,
    "offset": check_offset,
    "out_dtype": check_out_dtype,
    "llama": check_llama_casting,
}


def run_feature_suite(impl: FeatureImpl, device="cpu") -> list[checks.CaseResult]:
    results = []
    for check in FEATURE_CHECKS.values():
        results += check(impl, device)
    return results


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


def hunt_feature(name: str, device="cpu") -> dict:
    """Every feature check on one feature mutant; the entry has hunt()'s fields."""
    description, impl = FEATURE_MUTANTS[name]
    start = time.perf_counter()
    failed = [r for r in run_feature_suite(impl, device) if not r.passed]
    return _entry(name, description, failed, start)
