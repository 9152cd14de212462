"""The suite's own numeric checks, usable with any RMSNorm implementation.

An implementation is an :class:`Impl` bundle or plain callables: ``forward(x, weight, eps) -> y``
and ``backward(x, weight, dy, eps) -> (dx, dw)``. Every check draws seeded inputs, calls the
implementation and holds the result both element-wise to the fp32-compute reference
(``cases.TOLERANCES``) and to the float64 oracle (relative L2 error at most
``cases.ORACLE_ERROR_FACTOR`` times the reference's own), with dtype, shape, device and untouched
inputs checked too. Here: the implementations, a case's inputs (:class:`cases.Case`), that
judgement and the grid checks; the probes aimed at single failure modes are
:mod:`rmsnorm_suite.probes`, the summaries :mod:`rmsnorm_suite.checkreport`.
docs/walkthrough.md ("How a check compares") gives the details.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import torch

from rmsnorm_suite import cases, console, numerics
from rmsnorm_suite.cases import Case, Tolerance, dtype_name
from rmsnorm_suite.numerics import relative_l2

KINDS: tuple[str, ...] = ("forward", "backward", "gamma")
_CHECKED = {"forward": "y", "backward": "dx", "gamma": "dw"}

ForwardFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
BackwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Impl:
    """An implementation under check: a forward and a backward callable."""

    name: str
    forward: ForwardFn
    backward: BackwardFn


def _kernel_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import rmsnorm_kernel

    with torch.no_grad():
        return rmsnorm_kernel.rms_norm(x, weight=weight, eps=eps)


def _autograd_backward(fn: Callable[..., torch.Tensor]) -> BackwardFn:
    def backward(x, weight, dy, eps):
        # detach() keeps x's strides (a row slice stays a row slice) and shares its storage, so the
        # implementation sees exactly the tensor the check built.
        xg = x.detach().requires_grad_(True)
        wg = weight.detach().requires_grad_(True)
        with torch.enable_grad():
            y = fn(xg, weight=wg, eps=eps)
            y.backward(dy)
        return xg.grad, wg.grad

    return backward


def _kernel_backward(x, weight, dy, eps):
    import rmsnorm_kernel

    return _autograd_backward(rmsnorm_kernel.rms_norm)(x, weight, dy, eps)


def _reference_forward(x, weight, eps):
    from rmsnorm_kernel.reference import rms_norm_reference

    return rms_norm_reference(x, weight, eps)


def _reference_backward(x, weight, dy, eps):
    from rmsnorm_kernel.reference import rms_norm_reference

    return _autograd_backward(rms_norm_reference)(x, weight, dy, eps)


kernel_impl = Impl("kernel", _kernel_forward, _kernel_backward)
"""rmsnorm_kernel.rms_norm; the backward runs through autograd (the kernel's registered backward)."""

reference_impl = Impl("reference", _reference_forward, _reference_backward)
"""rmsnorm_kernel.reference.rms_norm_reference; the backward is autograd through the reference."""


def forward_fn(impl: Impl | ForwardFn) -> ForwardFn:
    return impl.forward if isinstance(impl, Impl) else impl


def backward_fn(impl: Impl | BackwardFn) -> BackwardFn:
    return impl.backward if isinstance(impl, Impl) else impl


# ---------------------------------------------------------------------------------------------
# A case's inputs
# ---------------------------------------------------------------------------------------------


def make_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, weight, dy for a case (:func:`numerics.make_inputs`, drawn on the CPU from case.seed):
    the same case gives the same numbers on every device."""
    return numerics.make_inputs(
        case.m, case.n, case.dtype, device=case.device, seed=case.seed, weight_dtype=case.wdtype
    )


# ---------------------------------------------------------------------------------------------
# The fp32-compute path (the oracle is numerics.oracle)
# ---------------------------------------------------------------------------------------------


def fp32_forward(x, weight, eps) -> torch.Tensor:
    """The package reference (fp32 compute), returned in x's dtype."""
    from rmsnorm_kernel.reference import rms_norm_reference

    return rms_norm_reference(x, weight, eps)


def fp32_backward(x, weight, dy, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The package's explicit backward formula computed in fp32, dx cast to x's dtype, dw to the
    weight's: torch's own fp32-compute path for the gradients."""
    from rmsnorm_kernel.reference import rms_norm_backward_reference

    dx, dw = rms_norm_backward_reference(x.float(), weight.float(), dy.float(), eps)
    return dx.to(x.dtype), dw.to(weight.dtype)


FP32_UNIT_ROUNDOFF = 2.0**-24
# fp32 roundings that reach the larger of two cancelling terms of dx = r * (u - xn * c): r, x * r,
# u * xn, the division by N, xn * c and (through xn) x * r again. Independent roundings add in
# quadrature: the noise of any fp32 evaluation is about sqrt(6) unit roundoffs of the envelope.
# (First set to one rounding; the interpreter's 17x1 bf16 dx at seed 0, conditioning 7.9e4, showed
# two correct fp32 evaluations 1.5x apart there: 0.011 against the reference's 0.0072.)
CANCELLING_ROUNDINGS = 6


def oracle_limit(dtype: torch.dtype, baseline_error: float, numel: int, conditioning: float = 1.0) -> float:
    """Largest relative L2 error allowed against the float64 oracle:
    ``ORACLE_ERROR_FACTOR[dtype] x sqrt(max(baseline, ulp_floor)^2 + fp32_noise^2)``.

    * baseline: the fp32-compute path's own error on the case (the declared rule);
    * ulp_floor, ``finfo(dtype).eps / sqrt(numel)``: one ulp of ``dtype`` in one element, spread
      over the tensor. It matters only where the fp32 path happens to be exact or nearly so (tiny
      tensors whose few values all round the same way, e.g. N = 1), where a correct but different
      operation order may still land one ulp away;
    * fp32_noise, ``sqrt(6) x 2^-24 x conditioning``: the fp32 roundings of every term of the
      result (see CANCELLING_ROUNDINGS), with
      ``conditioning = ||envelope|| / ||oracle||`` (the envelope sums the terms' absolute values).
      Any fp32 implementation carries rounding noise of this size of its own, independent of the
      fp32 path's, so it is added in quadrature. It matters only for ill-conditioned results:
      dx at N = 1 is the difference of two nearly equal terms (dx = u r eps / (x^2 + eps)), so
      fp32 arithmetic leaves it few correct digits and two correct implementations differ there by
      far more than the factor.

    On ordinary cases both floors sit far below the baseline of fp16/bf16 results and at about
    the baseline of fp32 results (both are fp32 rounding noise there).
    """
    ulp_floor = torch.finfo(dtype).eps / math.sqrt(max(numel, 1))
    fp32_noise = math.sqrt(CANCELLING_ROUNDINGS) * FP32_UNIT_ROUNDOFF * conditioning
    return cases.ORACLE_ERROR_FACTOR[dtype] * math.hypot(max(baseline_error, ulp_floor), fp32_noise)


def conditioning(envelope: torch.Tensor, oracle: torch.Tensor) -> float:
    """||envelope|| / ||oracle||: 1 for a product, large where the result's terms cancel."""
    num = torch.linalg.vector_norm(envelope.double()).item()
    den = torch.linalg.vector_norm(oracle.double()).item()
    if num == 0.0:
        return 1.0
    return math.inf if den == 0.0 else num / den


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    """The outcome of one check on one case. ``kind`` names the tensor checked: forward (y),
    backward (dx) or gamma (dw); ``check`` names the check (grid or probe)."""

    name: str
    kind: str
    m: int
    n: int
    dtype: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    oracle_error: float
    baseline_error: float
    passed: bool
    reason: str = ""
    check: str = "grid"
    oracle_limit: float = math.nan
    weight_dtype: str = ""
    seed: int = 0
    extra: dict = field(default_factory=dict)
    # what decides the elementwise check: the worst element's |err| / (atol + rtol*|ref| + 2u*envelope),
    # passing at <= 1 (max_rel can be large where |ref| is near 0 and still pass)
    bound_fraction: float = math.nan

    def to_dict(self) -> dict:
        """JSON-ready: non-finite floats become the strings "nan", "inf", "-inf"."""

        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        return {k: clean(v) for k, v in asdict(self).items()}


def _resolve_tolerance(dtype: torch.dtype, tolerances: Mapping[torch.dtype, Tolerance] | None) -> Tolerance:
    """cases.TOLERANCES[dtype], or a caller's tighter one; a looser one is refused."""
    declared = cases.TOLERANCES[dtype]
    if tolerances is None or dtype not in tolerances:
        return declared
    tol = tolerances[dtype]
    if tol.atol > declared.atol or tol.rtol > declared.rtol:
        raise ValueError(
            f"tolerances[{dtype_name(dtype)}] = {tol} is looser than the declared {declared}; "
            "a tolerance may be tightened, never loosened"
        )
    return tol


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.view(ints), b.view(ints)))


def _compare(
    value,
    ref: torch.Tensor,
    oracle: torch.Tensor,
    envelope: torch.Tensor,
    *,
    name: str,
    kind: str,
    check: str,
    case: Case,
    tolerances: Mapping[torch.dtype, Tolerance] | None = None,
) -> CaseResult:
    """Judge one result tensor against the fp32-compute reference (already in the expected dtype)
    and the float64 oracle."""
    dtype = ref.dtype
    tol = _resolve_tolerance(dtype, tolerances)
    baseline = relative_l2(ref, oracle)
    cond = conditioning(envelope, oracle)
    limit = oracle_limit(dtype, baseline, ref.numel(), cond)
    result = _unjudged(
        case, name=name, kind=kind, check=check, tol=tol, baseline_error=baseline, oracle_limit=limit,
        extra={"conditioning": cond},
    )  # fmt: skip
    what = _CHECKED.get(kind, kind)
    if not isinstance(value, torch.Tensor):
        result.reason = f"{what} is {type(value).__name__}, expected a tensor"
        return result
    if value.shape != ref.shape:
        result.reason = f"{what} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}"
        return result
    if value.dtype != dtype:
        result.reason = f"{what} has dtype {dtype_name(value.dtype)}, expected {dtype_name(dtype)}"
        return result
    if value.device != ref.device:
        result.reason = f"{what} is on {value.device}, expected {ref.device}"
        return result
    v, r = value.detach().double(), ref.double()
    diff = (v - r).abs()
    # NaN in diff fails the comparison below, as in torch.allclose with equal_nan=False.
    # The declared atol + rtol*|ref| bound, plus the rounding noise that any fp32 evaluation of the
    # element carries (the reference's included): two fp32 roundings of its envelope, the sum of its
    # terms' absolute values. That term is nil for y and dx (envelope ~ |ref|), but dw sums M rows
    # with cancellation (at M = 2048, |dw| ~ 0.02 from terms summing to ~1300 in absolute value),
    # where fp32 summation in two different orders differs by more than atol.
    bound = tol.atol + tol.rtol * r.abs() + 2 * FP32_UNIT_ROUNDOFF * envelope.double().reshape(r.shape)
    ok = diff <= bound
    if diff.numel():
        result.max_abs = diff.nan_to_num(nan=math.inf).max().item()
        result.bound_fraction = (diff / bound).nan_to_num(nan=math.inf).max().item()
        nz = r != 0
        result.max_rel = (diff[nz] / r[nz].abs()).nan_to_num(nan=math.inf).max().item() if nz.any() else 0.0
    else:
        result.max_abs = result.max_rel = 0.0
    result.oracle_error = relative_l2(v, oracle)
    bad = int((~ok).sum())
    if bad:
        first = tuple(int(i) for i in (~ok).nonzero()[0])
        result.reason = (
            f"{bad}/{ok.numel()} elements of {what} outside atol+rtol*|ref|+2u*envelope "
            f"(first at {first}: {v[first].item():.6g} vs {r[first].item():.6g})"
        )
    elif not result.oracle_error <= limit:
        result.reason = (
            f"{what} error vs float64 oracle {result.oracle_error:.3g} > {limit:.3g} "
            f"({cases.ORACLE_ERROR_FACTOR[dtype]}x the fp32-compute path's {baseline:.3g})"
        )
    else:
        result.passed = True
    return result


def _unjudged(case: Case, *, name: str, kind: str, check: str, tol: Tolerance, **fields) -> CaseResult:
    """A failing result with no figures yet: ``_compare`` fills it in, ``_failed`` keeps it."""
    return CaseResult(
        name=name,
        kind=kind,
        m=case.m,
        n=case.n,
        dtype=dtype_name(case.dtype),
        max_abs=math.nan,
        max_rel=math.nan,
        atol=tol.atol,
        rtol=tol.rtol,
        oracle_error=math.nan,
        passed=False,
        check=check,
        weight_dtype=dtype_name(case.wdtype),
        seed=case.seed,
        **fields,
    )


def _failed(case: Case, *, name: str, kind: str, check: str, reason: str) -> CaseResult:
    """A result for a check that could not compare (the implementation raised, inputs changed)."""
    tol = cases.TOLERANCES[case.wdtype if kind == "gamma" else case.dtype]
    return _unjudged(case, name=name, kind=kind, check=check, tol=tol, baseline_error=math.nan, reason=reason)


def run_and_judge(
    impl,
    case: Case,
    kind: str,
    x: torch.Tensor,
    w: torch.Tensor,
    dy: torch.Tensor,
    *,
    check: str,
    name: str | None = None,
    tolerances=None,
) -> CaseResult:
    """Call the implementation on (x, w[, dy]) and judge the tensor that ``kind`` names."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    name = name or case.name
    before = [t.clone() for t in (x, w, dy)]
    try:
        if kind == "forward":
            value = forward_fn(impl)(x, w, case.eps)
        else:
            value = backward_fn(impl)(x, w, dy, case.eps)
            if not (isinstance(value, tuple | list) and len(value) == 2):
                return _failed(
                    case, name=name, kind=kind, check=check, reason="backward must return (dx, dw)"
                )
            value = value[0] if kind == "backward" else value[1]
    except Exception as exc:  # the implementation crashing is a failure of the check, reported as such
        return _failed(case, name=name, kind=kind, check=check, reason=f"raised {type(exc).__name__}: {exc}")
    changed = [label for label, a, b in zip(("x", "weight", "dy"), (x, w, dy), before) if not same_bits(a, b)]
    if changed:
        return _failed(
            case, name=name, kind=kind, check=check, reason=f"modified its input(s) {changed} in place"
        )
    y, dx, dw = numerics.oracle(x, w, dy, case.eps)
    y_env, dx_env, dw_env = numerics.envelopes(x, w, dy, case.eps)
    if kind == "forward":
        ref, oracle, envelope = fp32_forward(x, w, case.eps), y, y_env
    else:
        dx_ref, dw_ref = fp32_backward(x, w, dy, case.eps)
        ref, oracle, envelope = (dx_ref, dx, dx_env) if kind == "backward" else (dw_ref, dw, dw_env)
    return _compare(
        value, ref, oracle, envelope, name=name, kind=kind, check=check, case=case, tolerances=tolerances
    )


# ---------------------------------------------------------------------------------------------
# Grid checks
# ---------------------------------------------------------------------------------------------


def check_forward(impl: Impl | ForwardFn, case: Case, *, tolerances=None) -> CaseResult:
    """y = impl(x, weight, eps) against the reference and the oracle."""
    x, w, dy = make_inputs(case)
    return run_and_judge(impl, case, "forward", x, w, dy, check="grid", tolerances=tolerances)


def check_backward(impl: Impl | BackwardFn, case: Case, *, tolerances=None) -> CaseResult:
    """dx from impl(x, weight, dy, eps) against the reference and the oracle."""
    x, w, dy = make_inputs(case)
    return run_and_judge(impl, case, "backward", x, w, dy, check="grid", tolerances=tolerances)


def check_gamma(impl: Impl | BackwardFn, case: Case, *, tolerances=None) -> CaseResult:
    """dw from impl(x, weight, dy, eps) against the reference and the oracle."""
    x, w, dy = make_inputs(case)
    return run_and_judge(impl, case, "gamma", x, w, dy, check="grid", tolerances=tolerances)


GRID_CHECKS: dict[str, Callable[..., CaseResult]] = {
    "forward": check_forward,
    "backward": check_backward,
    "gamma": check_gamma,
}


def run_grid(
    kind: str,
    impl: Impl | ForwardFn | BackwardFn,
    grid: Iterable[Case | tuple[int, int, torch.dtype]],
    device: str | torch.device = "cpu",
    *,
    seed: int = 0,
    weight_dtype: torch.dtype | None = None,
    tolerances: Mapping[torch.dtype, Tolerance] | None = None,
    progress: bool = False,
) -> list[CaseResult]:
    """Run one grid check (``kind``: forward, backward or gamma) over ``grid``, whose items are
    Cases or (M, N, dtype) triples (those get ``device``, ``seed`` and ``weight_dtype``)."""
    if kind not in GRID_CHECKS:
        raise ValueError(f"kind must be one of {tuple(GRID_CHECKS)}, got {kind!r}")
    items = [
        item if isinstance(item, Case) else Case(item[0], item[1], item[2], device, seed, weight_dtype)
        for item in grid
    ]
    if progress:
        items = console.progress(items, f"check-{kind}", len(items))
    return [GRID_CHECKS[kind](impl, case, tolerances=tolerances) for case in items]
