"""Deliberately broken RMSNorm kernels: the negative cases that prove the suite's checks bite.

A small, correct Triton implementation comes first (one program per row, the whole row in one
block, a dx kernel that also writes per-row partial dw, and a fixed-order column reduction of
those partials, as in the tutorial). Every mutant is that implementation with exactly one bug,
selected by the constexpr ``BUG`` (the empty string is the correct baseline): each ``if BUG ==``
below is one mutation site. These kernels live in the tests and never in the package.

The harness makes out-of-bounds effects observable and deterministic:
* outputs (y, dx, dw) are views at the start of larger buffers pre-filled with
  ``checks.CANARY``, so a store past a row's end changes a canary that ``check_output_bounds``
  inspects;
* the weight is read from a copy followed by NaN, so a read past its N values shows as NaN;
* rstd and the partial-dw scratch start as NaN, so a value never written shows as NaN.

``catalogue(device)`` runs the suite's checks on every mutant and returns, per mutant, the first
check that caught it and the case that exposed it (``tests/test_mutants.py`` writes the report).
"""

from __future__ import annotations

import itertools
import math
import time
from functools import partial

import torch
import triton
import triton.language as tl

from rmsnorm_kernel import cases, checks

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
    buf = torch.full((numel + extra,), checks.CANARY, dtype=dtype, device=device)
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
    for check, fn, kind, kwargs in checks.PROBES:
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


def hunt(name: str, device="cpu") -> dict:
    """Run every probe on one mutant, then, if no probe caught it, the case grids until one case
    fails. The entry names the first check that caught it, the case that exposed it and why, and
    every other probe that also caught it."""
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


def catalogue(device="cpu", *, progress: bool = True) -> list[dict]:
    """Every mutant hunted with the suite's checks: one dict per mutant (mutant, description,
    caught, check, kind, case, reason, also_caught_by, ...). Runs under TRITON_INTERPRET=1 on the
    CPU, or on CUDA."""
    names = list(MUTANTS)
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
