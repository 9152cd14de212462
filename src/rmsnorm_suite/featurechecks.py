"""The feature checks: the model-ready features of any implementation against the unfused pair.

A ``FeatureImpl`` is a forward and a backward with the op's feature options (residual, offset,
casting, residual_dtype, out_dtype). ``FEATURE_CHECKS`` runs one per feature over its table of
cases (``cases.Case.feature``) and judges each result (inputs unmodified, h bitwise, y, dx, dw
and dresidual within tolerance, Llama's rounding against Hugging Face's formula).
tests/op/test_features.py runs them on the op (``op_feature_impl``); the feature mutants of
:mod:`rmsnorm_suite.mutants` must each fail one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rmsnorm_suite import cases, checks, numerics
from rmsnorm_suite.cases import Case


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


def feature_inputs(case: Case, device):
    """x, weight, residual (None without one), dy and dh as float32 (cast per result later),
    drawn on the CPU from case.seed; the weight near case.weight_center."""
    g = torch.Generator(device="cpu").manual_seed(case.seed)
    x = torch.randn(case.m, case.n, generator=g)
    w = case.weight_center + 0.1 * torch.randn(case.n, generator=g)
    r = torch.randn(case.m, case.n, generator=g)
    dy = torch.randn(case.m, case.n, generator=g)
    dh = torch.randn(case.m, case.n, generator=g)
    res = r.to(case.r_dtype).to(device) if case.r_dtype is not None else None
    return x.to(case.dtype).to(device), w.to(case.wdtype).to(device), res, dy.to(device), dh.to(device)


def _coarser(*dtypes: torch.dtype) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _result(check, kind, case: Case, tol_dtype, *, passed, reason="", max_abs=math.nan, max_rel=math.nan):
    tol = cases.TOLERANCES[tol_dtype]
    return checks.CaseResult(
        name=case.name,
        kind=kind,
        m=case.m,
        n=case.n,
        dtype=cases.dtype_name(case.dtype),
        max_abs=max_abs,
        max_rel=max_rel,
        atol=tol.atol,
        rtol=tol.rtol,
        oracle_error=math.nan,
        baseline_error=math.nan,
        passed=passed,
        reason=reason,
        check=check,
        weight_dtype=cases.dtype_name(case.wdtype),
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
    return [_result(check, "inputs", case, case.dtype, passed=False, reason=reason)]


def _tolerance_dtype(case: Case, kind: str, dtype: torch.dtype) -> torch.dtype:
    """The TOLERANCES row for one result of a case.

    * default/gemma casting round nothing before the result (h is rounded identically by the
      reference), so the result's own dtype applies;
    * "llama" rounds xn to the normalised input's dtype (x's, or h's with a residual), where a
      one-ulp difference in r may flip a rounding: the coarser of that dtype and the result's;
    * with a residual, dx and dresidual of the unfused pair pass through h, whose gradient is a
      tensor of h's dtype there: the coarser of h's dtype and the result's.
    """
    h_dtype = case.opts.get("residual_dtype") or case.dtype
    if case.opts.get("casting") == "llama":
        return _coarser(h_dtype if case.r_dtype is not None else case.dtype, dtype)
    if case.r_dtype is not None and kind in ("dx", "dresidual"):
        return _coarser(h_dtype, dtype)
    return dtype


def run_feature_case(impl: FeatureImpl, case: Case, device="cpu", check="case") -> list[checks.CaseResult]:
    """Forward and backward of ``impl`` on one case against the reference (the unfused pair):
    inputs left unmodified; y, dx and dw (and h bitwise and dresidual with a residual) with the
    tolerance of :func:`_tolerance_dtype`. With "llama" casting also y against the Hugging Face
    formula, and y and dw nearer the llama reference than the fp32-throughout one (the rounding
    differences sit inside the tolerance, so closeness alone would not tell the modes apart)."""
    x, w, r, dy32, dh32 = feature_inputs(case, device)
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
        return [_result(check, "run", case, case.dtype, passed=False, reason=reason)]
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
    Case.feature(
        "x bf16 + r bf16 -> h fp32, h used",
        _BF16,
        _F32,
        r_dtype=_BF16,
        options=(("residual_dtype", _F32), ("out_dtype", _BF16)),
        with_dh=True,
    ),
    # an fp32 residual stream rounded to the activations' dtype
    Case.feature(
        "x bf16 + r fp32 -> h bf16",
        _BF16,
        _BF16,
        r_dtype=_F32,
        options=(("residual_dtype", _BF16), ("out_dtype", _F32)),
    ),
    Case.feature(
        "x fp16 + r fp16 -> h fp16, h used",
        _F16,
        _F16,
        r_dtype=_F16,
        options=(("out_dtype", _F32),),
        with_dh=True,
    ),
    Case.feature(
        "x fp32 + r fp32 -> h fp32, h used",
        _F32,
        _F32,
        r_dtype=_F32,
        options=(("out_dtype", _F32),),
        with_dh=True,
    ),
)

OFFSET_CASES = (
    Case.feature("offset 1, fp32", _F32, _F32, options=(("offset", 1.0),), weight_center=0.0),
    Case.feature(
        "offset 1, gemma, bf16, bf16 weight, fp32 out",
        _BF16,
        _BF16,
        options=(("offset", 1.0), ("casting", "gemma"), ("out_dtype", _F32)),
        weight_center=0.0,
    ),
)

OUT_DTYPE_CASES = (
    Case.feature("bf16 in, fp32 out", _BF16, _F32, options=(("out_dtype", _F32),)),
    Case.feature("fp32 in, bf16 out", _F32, _F32, options=(("out_dtype", _BF16),)),
)

LLAMA_CASES = (
    Case.feature("llama, bf16, fp32 weight", _BF16, _F32, options=(("casting", "llama"),)),
    Case.feature("llama, fp16, bf16 weight", _F16, _BF16, options=(("casting", "llama"),)),
    Case.feature("llama, bf16, bf16 weight", _BF16, _BF16, options=(("casting", "llama"),)),
    # a decoder layer's `hidden = residual + hidden; norm(hidden)`, fused
    Case.feature(
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
