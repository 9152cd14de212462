"""The inference features' checks: batch invariance, quantised output and QK-norm.

An ``InferenceImpl`` is the op's entry points these features use. Each check measures figures
(named as the keys of regression.toml's ``[features]`` table, which holds their limits) over its
cases: the verdict judges them (:func:`judge`), pr-verdict's worker reports them in its results
(:func:`gate_figures`) and the gate judges base and head with the trusted table. Nothing of the op
is imported at import time; the quantisation constants are the formats', not the op's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rmsnorm_suite import cases

FP8, I8 = torch.float8_e4m3fn, torch.int8
QMAX = {FP8: 448.0, I8: 127.0}
QMIN = {FP8: -448.0, I8: -128.0}


# The smallest per-row scale (a row of zeros gets it): float32(1 / (QMAX * 512)), a constant so
# that torch.compile of torch's sequence (the benchmark's peer) traces it without a graph break.
MIN_SCALE = {dtype: float(torch.tensor(1.0 / (q * 512.0), dtype=torch.float32)) for dtype, q in QMAX.items()}


def min_scale(dtype: torch.dtype) -> float:
    return MIN_SCALE[dtype]


@dataclass(frozen=True)
class InferenceImpl:
    """The entry points under check, each without autograd unless said:

    * ``forward(x, weight, residual, eps)`` -> ``(y, h)``, h None without a residual;
    * ``norm(x, weight, residual, eps)`` -> y, differentiable (the batch check's dx);
    * ``quantise(x, weight, residual, eps, out_dtype)`` -> ``(y_q, scales)``, per-row scales;
    * ``norm32(x, weight, residual, eps)`` -> y in fp32 (``out_dtype=torch.float32``);
    * ``qk(q, k, q_weight, k_weight, eps)`` -> ``(yq, yk)`` and ``rms_norm(x, weight, eps)`` -> y,
      both differentiable: the per-head path and the contiguous one.
    """

    name: str
    forward: Callable
    norm: Callable
    quantise: Callable
    norm32: Callable
    qk: Callable
    rms_norm: Callable


def _op():
    import rmsnorm_kernel

    return rmsnorm_kernel


def _op_norm(x, weight, residual, eps):
    out = _op().rms_norm(
        x, weight=weight, eps=eps, **({"residual": residual} if residual is not None else {})
    )
    return out[0] if residual is not None else out


def _op_forward(x, weight, residual, eps):
    with torch.no_grad():
        if residual is None:
            return _op().rms_norm(x, weight=weight, eps=eps), None
        return tuple(_op().rms_norm(x, weight=weight, eps=eps, residual=residual))


def _op_quantise(x, weight, residual, eps, out_dtype):
    extra = {"residual": residual} if residual is not None else {}
    out = _op().rms_norm(x, weight=weight, eps=eps, out_dtype=out_dtype, **extra)
    return out[0], out[1]


def _op_norm32(x, weight, residual, eps):
    extra = {"residual": residual} if residual is not None else {}
    out = _op().rms_norm(x, weight=weight, eps=eps, out_dtype=torch.float32, **extra)
    return out[0] if residual is not None else out


op_impl = InferenceImpl(
    "op",
    _op_forward,
    _op_norm,
    _op_quantise,
    _op_norm32,
    lambda q, k, wq, wk, eps: _op().qk_norm(q, k, wq, wk, eps),
    lambda x, w, eps: _op().rms_norm(x, weight=w, eps=eps),
)
"""rmsnorm_kernel.rms_norm and qk_norm; gradients through autograd."""


@dataclass
class Finding:
    """One check's outcome: its figures (worst over the cases), why any case failed outright (a
    crash, a wrong dtype or shape) and which parts the implementation does not have."""

    check: str
    figures: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def worst(self, key: str, value: float) -> None:
        value = float(value)
        old = self.figures.get(key, -math.inf)
        self.figures[key] = value if math.isnan(value) or math.isnan(old) else max(old, value)


def unsupported(exc: BaseException) -> bool:
    """An option or entry point the implementation does not have (an older op), not a failure."""
    if isinstance(exc, AttributeError | ImportError):
        return True
    return isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc)


def _attempt(finding: Finding, part: str, fn: Callable, *args):
    """fn(*args), or None with the reason recorded as unsupported or failed."""
    try:
        return fn(*args)
    except Exception as exc:  # a crash fails the check; a missing option is reported as such
        where = finding.unsupported if unsupported(exc) else finding.failures
        where.append(f"{part}: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def _differing(a, b) -> int:
    """Elements whose bits differ (a shape or dtype mismatch: all of them)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return b.numel()
    size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(size) != b.contiguous().view(size)).sum())


def _draw(shape, dtype, device, gen, scaled=False):
    t = torch.randn(*shape, generator=gen)
    if scaled:  # rows of different scales: the norm matters
        t = t * torch.rand(shape[0], 1, generator=gen).add(0.05) * 4
    return t.to(dtype).to(device)


# ---------------------------------------------------------------------------------------------
# Batch invariance
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchCase:
    """Rows of a batch of 1 and of 7 taken from across a batch of ``m`` rows of ``n``."""

    m: int
    n: int
    dtype: torch.dtype
    residual: bool
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.m}x{self.n}-{cases.dtype_name(self.dtype)}{' residual' if self.residual else ''}"

    def picks(self) -> tuple[list[int], list[int]]:
        """The middle row alone, and 7 rows spread over the batch, its first and last included."""
        return [self.m // 2], sorted({round(i * (self.m - 1) / 6) for i in range(7)})


def batch_invariance(impl: InferenceImpl, device, batch_cases: Sequence[BatchCase], eps=cases.EPS) -> Finding:
    """``differing``: elements of y, h and dx of the small batches whose bits differ from the same
    rows of the large batch (dw sums over rows and is exempt)."""
    finding = Finding("batch invariance")
    for case in batch_cases:
        g = torch.Generator().manual_seed(case.seed)
        x = _draw((case.m, case.n), case.dtype, device, g, scaled=True)
        r = _draw((case.m, case.n), case.dtype, device, g) if case.residual else None
        w = (1 + 0.1 * torch.randn(case.n, generator=g)).to(case.dtype).to(device)
        dy = _draw((case.m, case.n), case.dtype, device, g)
        big = _attempt(finding, case.label, _outputs, impl, x, w, r, dy, eps)
        if big is None:
            continue
        for rows in case.picks():
            idx = torch.tensor(rows, device=device)
            sub = r[idx] if r is not None else None
            small = _attempt(finding, case.label, _outputs, impl, x[idx], w, sub, dy[idx], eps)
            if small is None:
                continue
            differing = sum(_differing(s, b[idx]) for s, b in zip(small, big) if b is not None)
            finding.worst("batch_invariance", finding.figures.get("batch_invariance", 0) + differing)
    return finding


def _outputs(impl, x, w, r, dy, eps):
    """(y, h, dx) of one call: dx the gradient of <y, dy> (with a residual, dx = dresidual)."""
    y, h = impl.forward(x, w, r, eps)
    xg = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (dx,) = torch.autograd.grad(impl.norm(xg, w, r, eps), (xg,), dy)
    return y, h, dx


# ---------------------------------------------------------------------------------------------
# Quantised output
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantCase:
    """Per-row dynamic quantisation of ``m`` x ``n`` rows of ``dtype`` to ``out_dtype``."""

    m: int
    n: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    residual: bool
    seed: int = 0

    @property
    def label(self) -> str:
        res = " residual" if self.residual else ""
        return f"{self.m}x{self.n}-{cases.dtype_name(self.dtype)} -> {cases.dtype_name(self.out_dtype)}{res}"


def torch_quantise(y32: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's unfused per-row sequence on an fp32 y: amax, scale, divide, clamp (int8: round), cast."""
    scales = (y32.abs().amax(-1, keepdim=True) / QMAX[out_dtype]).clamp(min=min_scale(out_dtype))
    v = y32 / scales
    if out_dtype == I8:
        v = torch.round(v)
    return v.clamp(QMIN[out_dtype], QMAX[out_dtype]).to(out_dtype), scales


def torch_norm32(x, w, r, eps) -> torch.Tensor:
    """Torch's own fp32 norm: h = x + r rounded to x's dtype, then F.rms_norm in fp32."""
    h = (x.float() + r.float()).to(x.dtype) if r is not None else x
    return F.rms_norm(h.float(), (x.shape[-1],), w.float(), eps)


def codes_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable values between a and b of one dtype (fp8 codes order as sign-magnitude)."""
    if a.dtype == I8:
        return (a.int() - b.int()).abs()

    def ordered(t):
        bits = t.view(torch.uint8).int()
        return torch.where(bits & 0x80 != 0, -(bits & 0x7F), bits & 0x7F)

    return (ordered(a) - ordered(b)).abs()


def quantised_output(impl: InferenceImpl, device, quant_cases: Sequence[QuantCase], eps=cases.EPS) -> Finding:
    """``quant_bits``: codes and scales whose bits differ from torch's sequence on the op's own fp32
    y; ``quant_quanta``: the most codes apart from torch's sequence on torch's norm; ``quant_scales``:
    the largest relative difference of a scale from that sequence's."""
    finding = Finding("quantised output")
    for case in quant_cases:
        g = torch.Generator().manual_seed(case.seed)
        x = _draw((case.m, case.n), case.dtype, device, g, scaled=True)
        r = _draw((case.m, case.n), case.dtype, device, g) if case.residual else None
        w = (1 + 0.2 * torch.randn(case.n, generator=g)).to(case.dtype).to(device)
        got = _attempt(finding, case.label, impl.quantise, x, w, r, eps, case.out_dtype)
        y32 = _attempt(finding, case.label, impl.norm32, x, w, r, eps)
        if got is None or y32 is None:
            continue
        y_q, scales = got
        own_q, own_s = torch_quantise(y32, case.out_dtype)
        ref_q, ref_s = torch_quantise(torch_norm32(x, w, r, eps), case.out_dtype)
        if not isinstance(y_q, torch.Tensor) or y_q.dtype != case.out_dtype or y_q.shape != own_q.shape:
            finding.failures.append(
                f"{case.label}: y_q is not {cases.dtype_name(case.out_dtype)} {tuple(x.shape)}"
            )
            continue
        scales = scales.reshape(own_s.shape) if isinstance(scales, torch.Tensor) else scales
        finding.worst("quant_bits", _differing(y_q, own_q) + _differing(scales, own_s))
        finding.worst("quant_quanta", codes_apart(y_q, ref_q).max().item())
        if isinstance(scales, torch.Tensor) and scales.shape == ref_s.shape:
            rel = ((scales.double() - ref_s.double()).abs() / ref_s.double()).nan_to_num(nan=math.inf)
            finding.worst("quant_scales", rel.max().item())
        else:
            finding.worst("quant_scales", math.inf)
    return finding


# ---------------------------------------------------------------------------------------------
# QK-norm
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QKCase:
    """q and k heads viewed in place in a fused qkv of ``tokens`` x (hq + 2 hk) x ``d``."""

    tokens: int
    hq: int
    hk: int
    d: int
    dtype: torch.dtype
    seed: int = 0

    @property
    def label(self) -> str:
        return f"qkv {self.tokens}x({self.hq}+{self.hk}+{self.hk})x{self.d}-{cases.dtype_name(self.dtype)}"


def qkv_views(qkv: torch.Tensor, hq: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as per-head views of a fused qkv (tokens, (hq + 2 hk) d): no copy."""
    t = qkv.shape[0]
    return qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)


def qk_norm_check(impl: InferenceImpl, device, qk_cases: Sequence[QKCase], eps=cases.EPS) -> Finding:
    """``qk_bits``: elements of yq, yk, dq and dk whose bits differ from two rms_norm calls on
    contiguous copies of the heads; ``qk_tolerance``: the worst |err| / (atol + rtol |ref|) of y
    against torch's F.rms_norm in fp32 and of dw against the copies' (cases.TOLERANCES)."""
    finding = Finding("QK-norm")
    for case in qk_cases:
        g = torch.Generator().manual_seed(case.seed)
        width = (case.hq + 2 * case.hk) * case.d
        qkv = _draw((case.tokens, width), case.dtype, device, g).requires_grad_()
        wq, wk = ((1 + 0.1 * torch.randn(case.d, generator=g)).to(case.dtype).to(device) for _ in "qk")
        q, k = qkv_views(qkv, case.hq, case.hk, case.d)
        gq, gk = (_draw(t.shape, case.dtype, device, g) for t in (q, k))

        got = _attempt(finding, case.label, _per_head, impl, q, k, wq, wk, gq, gk, eps)
        ref = _attempt(finding, case.label, _copies, impl, ((q, wq, gq), (k, wk, gk)), eps)
        if got is None or ref is None:
            continue
        yq, yk, dq, dk, dwq, dwk = got
        (yqc, dqc, dwqc), (ykc, dkc, dwkc) = ref
        finding.worst(
            "qk_bits", sum(_differing(a, b) for a, b in ((yq, yqc), (yk, ykc), (dq, dqc), (dk, dkc)))
        )
        tol = cases.TOLERANCES[case.dtype]
        fractions = [
            _fraction(y, F.rms_norm(x.detach().float(), (case.d,), w.float(), eps).to(case.dtype), tol)
            for y, x, w in ((yq, q, wq), (yk, k, wk))
        ]
        fractions += [_fraction(dwq, dwqc, tol), _fraction(dwk, dwkc, tol)]
        finding.worst("qk_tolerance", max(fractions))
    return finding


def _per_head(impl, q, k, wq, wk, gq, gk, eps):
    """yq, yk, dq, dk, dwq, dwk of the per-head path on the views."""
    wqg, wkg = wq.detach().requires_grad_(), wk.detach().requires_grad_()
    with torch.enable_grad():
        yq, yk = impl.qk(q, k, wqg, wkg, eps)
        return (yq, yk, *torch.autograd.grad((yq, yk), (q, k, wqg, wkg), (gq, gk)))


def _copies(impl, heads, eps):
    """Per (x, w, dy) of q and of k: y, dx, dw of rms_norm on a contiguous copy."""
    out = []
    for x, w, gy in heads:
        xc, wc = x.detach().contiguous().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.enable_grad():
            yc = impl.rms_norm(xc, wc, eps)
            out.append((yc, *torch.autograd.grad(yc, (xc, wc), gy)))
    return out


def _fraction(value, ref, tol: cases.Tolerance) -> float:
    """The worst element's |value - ref| / (atol + rtol |ref|): within tolerance at <= 1."""
    if not isinstance(value, torch.Tensor) or value.shape != ref.shape:
        return math.inf
    v, r = value.detach().double(), ref.detach().double()
    return ((v - r).abs() / (tol.atol + tol.rtol * r.abs())).nan_to_num(nan=math.inf).max().item()


# ---------------------------------------------------------------------------------------------
# The cases, the verdict's judgement and the gate's figures
# ---------------------------------------------------------------------------------------------

_F32, _BF16 = torch.float32, torch.bfloat16
# Per where the op runs: the interpreter's cases stay small (CPU time); a batch of 257 is the
# first that launches the op's many-row plan there (tests/op/test_batch_invariance.py).
CASES: dict[str, dict[str, tuple]] = {
    "cpu": {
        "batch": (BatchCase(257, 1024, _F32, False), BatchCase(257, 257, _BF16, True)),
        "quant": (QuantCase(16, 257, _BF16, FP8, False), QuantCase(16, 64, _F32, I8, True)),
        "qk": (QKCase(3, 4, 2, 64, _F32), QKCase(2, 4, 1, 16, _BF16)),
    },
    "cuda": {
        "batch": tuple(
            BatchCase(512, n, d, r) for n in (4096, 5000) for d in (_F32, _BF16) for r in (False, True)
        ),
        "quant": tuple(QuantCase(256, 4096, _BF16, o, r) for o in (FP8, I8) for r in (False, True)),
        "qk": (QKCase(256, 32, 8, 128, _BF16), QKCase(1, 32, 8, 128, _BF16), QKCase(17, 4, 2, 64, _F32)),
    },
}
# The host stand-in of pr-verdict's worker (CPU tensors, any op): small, fp32.
HOST_CASES: dict[str, tuple] = {
    "batch": (BatchCase(257, 64, _F32, False), BatchCase(257, 64, _F32, True)),
    "quant": (QuantCase(8, 64, _F32, FP8, False),),
    "qk": (QKCase(3, 4, 2, 16, _F32),),
}

CHECKS: dict[str, Callable] = {"batch": batch_invariance, "quant": quantised_output, "qk": qk_norm_check}


def run(impl: InferenceImpl, device, which: str, case_table: Mapping[str, tuple] | None = None) -> Finding:
    """One check ("batch", "quant" or "qk") of ``impl`` on its cases for ``device``."""
    table = (
        case_table if case_table is not None else CASES["cuda" if str(device).startswith("cuda") else "cpu"]
    )
    return CHECKS[which](impl, device, table[which])


def judge(finding: Finding, limits: Mapping[str, float]) -> tuple[bool, str]:
    """(passed, key figure): every figure measured and within its limit, nothing failed, and at
    least one case supported."""
    bad = [k for k, v in finding.figures.items() if not v <= limits[k]]
    figure = ", ".join(f"{k} {v:.3g} (limit {limits[k]:g})" for k, v in finding.figures.items())
    if finding.unsupported:
        figure += f"; not supported: {finding.unsupported[0]}"
    if finding.failures:
        figure += f"; {len(finding.failures)} failed, first: {finding.failures[0]}"
    passed = not bad and not finding.failures and bool(finding.figures)
    return passed, figure or "nothing measured"


def gate_figures(device, impl: InferenceImpl = op_impl, case_table=None) -> dict[str, dict]:
    """Every figure of every check, as pr-verdict's worker reports them (results.Feature's JSON):
    ``ok`` with its value, ``failed`` with why, or ``unsupported`` where nothing of the check ran."""
    out: dict[str, dict] = {}
    for which, keys in FIGURES.items():
        finding = run(impl, device, which, case_table)
        for key in keys:
            if finding.failures:
                out[key] = {"status": "failed", "note": finding.failures[0][:300]}
            elif key in finding.figures:
                note = f"not supported: {finding.unsupported[0]}"[:300] if finding.unsupported else None
                out[key] = {"status": "ok", "value": finding.figures[key], "note": note}
            else:
                note = (finding.unsupported or ["nothing measured"])[0][:300]
                out[key] = {"status": "unsupported", "note": note}
    return out


# the figures of each check, in the gate's order (regression.toml [features] holds their limits)
FIGURES: dict[str, tuple[str, ...]] = {
    "batch": ("batch_invariance",),
    "quant": ("quant_bits", "quant_quanta", "quant_scales"),
    "qk": ("qk_bits", "qk_tolerance"),
}
