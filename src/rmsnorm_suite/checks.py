"""The suite's own numeric checks, usable with any RMSNorm implementation.

An implementation is an :class:`Impl` bundle or plain callables: ``forward(x, weight, eps) -> y``
and ``backward(x, weight, dy, eps) -> (dx, dw)``. Every check draws seeded inputs, calls the
implementation and holds the result both element-wise to the fp32-compute reference
(``cases.TOLERANCES``) and to the float64 oracle (relative L2 error at most
``cases.ORACLE_ERROR_FACTOR`` times the reference's own), with dtype, shape, device and untouched
inputs checked too. Beside the case grids, :data:`PROBES` target single failure modes and
:func:`run_probes` runs them. docs/walkthrough.md ("How a check compares") gives the details.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from rmsnorm_suite import cases, console, numerics
from rmsnorm_suite.cases import Tolerance, dtype_name
from rmsnorm_suite.console import markdown_table
from rmsnorm_suite.numerics import relative_l2

KINDS: tuple[str, ...] = ("forward", "backward", "gamma")
_CHECKED = {"forward": "y", "backward": "dx", "gamma": "dw"}

ForwardFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
BackwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]

# Written outside an output's rows by harnesses that allocate their outputs inside a larger buffer
# (see check_output_bounds). Exactly representable in fp32, fp16 and bf16, and never a value that
# RMSNorm of the probe's inputs can produce.
CANARY = -4096.0


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


def _forward_fn(impl: Impl | ForwardFn) -> ForwardFn:
    return impl.forward if isinstance(impl, Impl) else impl


def _backward_fn(impl: Impl | BackwardFn) -> BackwardFn:
    return impl.backward if isinstance(impl, Impl) else impl


# ---------------------------------------------------------------------------------------------
# Cases and inputs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One input: M rows of N values of ``dtype``; the weight in ``weight_dtype`` (None: x's)."""

    m: int
    n: int
    dtype: torch.dtype
    device: str | torch.device = "cpu"
    seed: int = 0
    weight_dtype: torch.dtype | None = None
    eps: float = cases.EPS

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 0:
            raise ValueError(f"Case.m must be an int >= 0, got {self.m!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"Case.n must be an int >= 1, got {self.n!r}")
        for label, value in (("dtype", self.dtype), ("weight_dtype", self.weight_dtype or self.dtype)):
            if value not in cases.TOLERANCES:
                raise TypeError(
                    f"Case.{label} must be one of {[dtype_name(d) for d in cases.DTYPES]}, got {value}"
                )
        if not (isinstance(self.eps, float | int) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"Case.eps must be a finite number > 0, got {self.eps!r}")

    @property
    def wdtype(self) -> torch.dtype:
        return self.weight_dtype or self.dtype

    @property
    def name(self) -> str:
        w = "" if self.weight_dtype in (None, self.dtype) else f" w={dtype_name(self.weight_dtype)}"
        return f"{self.m}x{self.n} {dtype_name(self.dtype)}{w}"


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


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
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


def _run_and_judge(
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
            value = _forward_fn(impl)(x, w, case.eps)
        else:
            value = _backward_fn(impl)(x, w, dy, case.eps)
            if not (isinstance(value, tuple | list) and len(value) == 2):
                return _failed(
                    case, name=name, kind=kind, check=check, reason="backward must return (dx, dw)"
                )
            value = value[0] if kind == "backward" else value[1]
    except Exception as exc:  # the implementation crashing is a failure of the check, reported as such
        return _failed(case, name=name, kind=kind, check=check, reason=f"raised {type(exc).__name__}: {exc}")
    changed = [
        label for label, a, b in zip(("x", "weight", "dy"), (x, w, dy), before) if not _same_bits(a, b)
    ]
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
    return _run_and_judge(impl, case, "forward", x, w, dy, check="grid", tolerances=tolerances)


def check_backward(impl: Impl | BackwardFn, case: Case, *, tolerances=None) -> CaseResult:
    """dx from impl(x, weight, dy, eps) against the reference and the oracle."""
    x, w, dy = make_inputs(case)
    return _run_and_judge(impl, case, "backward", x, w, dy, check="grid", tolerances=tolerances)


def check_gamma(impl: Impl | BackwardFn, case: Case, *, tolerances=None) -> CaseResult:
    """dw from impl(x, weight, dy, eps) against the reference and the oracle."""
    x, w, dy = make_inputs(case)
    return _run_and_judge(impl, case, "gamma", x, w, dy, check="grid", tolerances=tolerances)


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


# ---------------------------------------------------------------------------------------------
# Probe checks: one failure mode each
# ---------------------------------------------------------------------------------------------

# Shapes of the probes. 257 is the tutorial's: next_power_of_2(257) = 512, so a BLOCK-for-N
# confusion shows; at 256 it hides (the control).
PROBE_N = 257
PROBE_ROWS = 5


def _probe_case(device, *, m=PROBE_ROWS, n=PROBE_N, dtype=torch.float32, seed=0, weight_dtype=None) -> Case:
    return Case(m, n, dtype, device, seed, weight_dtype)


def _probe(impl, case: Case, kind: str, x, w, dy, *, check: str, label: str, tolerances=None) -> CaseResult:
    return _run_and_judge(
        impl, case, kind, x, w, dy, check=check, name=f"{label} {case.name}", tolerances=tolerances
    )


def check_denominator(
    impl, device="cpu", *, kind: str = "forward", n: int = PROBE_N, dtype=torch.float32, tolerances=None
) -> CaseResult:
    """Rows of N ones with a weight of ones: y must be 1/sqrt(1 + eps) everywhere (the tutorial's
    exercise). Dividing the sum of squares by BLOCK = next_power_of_2(N) instead of N shows at
    N = 257 and hides at N = 256. kind="backward" checks dx on the same rows (mean(u x) over N)."""
    case = _probe_case(device, n=n, dtype=dtype)
    _, _, dy = make_inputs(case)
    x = torch.ones(case.m, n, dtype=dtype, device=device)
    w = torch.ones(n, dtype=dtype, device=device)
    result = _probe(impl, case, kind, x, w, dy, check="denominator", label="ones", tolerances=tolerances)
    if kind == "forward":
        result.extra["expected_y"] = 1.0 / math.sqrt(1.0 + case.eps)
    return result


def check_large_magnitude(impl, device="cpu", *, kind: str = "forward", tolerances=None) -> CaseResult:
    """fp16 rows with |x| in [300, 1000]: each square exceeds fp16's largest value (65504), so
    squares formed or summed in fp16 overflow. The result must be finite and correct."""
    case = _probe_case(device, dtype=torch.float16, seed=1)
    _, w, dy = make_inputs(case)
    g = torch.Generator(device="cpu").manual_seed(case.seed + 1000)
    mag = 300.0 + 700.0 * torch.rand(case.m, case.n, generator=g)
    sign = torch.where(torch.rand(case.m, case.n, generator=g) < 0.5, -1.0, 1.0)
    x = (sign * mag).to(torch.float16).to(device)
    return _probe(
        impl, case, kind, x, w, dy, check="large_magnitude", label="|x|~300-1000", tolerances=tolerances
    )


def check_small_magnitude(impl, device="cpu", *, kind: str = "forward", tolerances=None) -> CaseResult:
    """fp32 rows scaled so that mean(x^2) is comparable to eps (|x| ~ 1e-3), plus one all-zero
    row: eps placed outside the sqrt, or dropped, changes these outputs by orders of magnitude."""
    case = _probe_case(device, seed=2)
    x, w, dy = make_inputs(case)
    scale = torch.tensor([1e-3, 3e-3, 1e-2, 3e-4, 0.0], dtype=torch.float32)[: case.m, None]
    x = (x.float().cpu() * scale).to(device)
    return _probe(
        impl, case, kind, x, w, dy, check="small_magnitude", label="|x|~1e-3,zero-row", tolerances=tolerances
    )


def check_nonzero_mean(impl, device="cpu", *, kind: str = "forward", tolerances=None) -> CaseResult:
    """Rows with a large common offset (x = 4 + 0.5 N(0, 1)): RMSNorm does not subtract the mean,
    LayerNorm does, and the two differ by far more than any tolerance here."""
    case = _probe_case(device, seed=3)
    x, w, dy = make_inputs(case)
    x = (4.0 + 0.5 * x.float().cpu()).to(case.dtype).to(device)
    return _probe(impl, case, kind, x, w, dy, check="nonzero_mean", label="offset 4", tolerances=tolerances)


def _outside_view(t: torch.Tensor) -> torch.Tensor:
    """The elements of t's storage that t's own view does not cover, as a 1-D tensor."""
    storage = t.untyped_storage()
    total = storage.nbytes() // t.element_size()
    whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (total,), (1,))
    covered = torch.zeros(total, dtype=torch.bool, device=t.device)
    if t.numel():
        idx = torch.arange(total, device=t.device).as_strided(t.shape, t.stride(), t.storage_offset())
        covered[idx.reshape(-1)] = True
    return whole[~covered]


def check_output_bounds(impl, device="cpu", *, kind: str = "forward", tolerances=None) -> CaseResult:
    """Nothing may be read or written outside the rows.

    * Inputs: x and dy are row slices of wider tensors whose extra columns hold NaN, so a read past
      a row's end shows as NaN in the result; the wider tensors must come back unmodified.
    * Outputs: an implementation (a test harness) may allocate its outputs inside a larger buffer
      pre-filled with :data:`CANARY`; every element of the output's storage outside the output's
      view must still hold CANARY afterwards, so a store without its mask is seen. Outputs in
      storage of their own have nothing outside the view and pass that part.
    """
    case = _probe_case(device, seed=4, m=3)
    x0, w, dy0 = make_inputs(case)
    pad = 64
    wide_x = torch.full((case.m, case.n + pad), math.nan, dtype=case.dtype, device=device)
    wide_dy = torch.full_like(wide_x, math.nan)
    wide_x[:, : case.n] = x0
    wide_dy[:, : case.n] = dy0
    x, dy = wide_x[:, : case.n], wide_dy[:, : case.n]
    wide_before = (wide_x.clone(), wide_dy.clone())
    label = f"row-slices(stride {case.n + pad})"
    result = _probe(impl, case, kind, x, w, dy, check="output_bounds", label=label, tolerances=tolerances)
    if not result.passed:
        return result
    if not (_same_bits(wide_x, wide_before[0]) and _same_bits(wide_dy, wide_before[1])):
        result.passed, result.reason = False, "wrote into the padding of its row-sliced inputs"
        return result
    # Call again to inspect the output's storage (the judged call above does not keep the tensor).
    if kind == "forward":
        outs = {"y": _forward_fn(impl)(x, w, case.eps)}
    else:
        dx, dw = _backward_fn(impl)(x, w, dy, case.eps)
        outs = {"dx": dx, "dw": dw}
    inspected = 0
    for label_out, out in outs.items():
        outside = _outside_view(out)
        inspected += outside.numel()
        canary = torch.tensor(CANARY, dtype=out.dtype, device=out.device)
        clobbered = int((outside != canary).sum()) if outside.numel() else 0
        if clobbered:
            result.passed = False
            result.reason = (
                f"{clobbered} element(s) outside {label_out}'s rows were overwritten (canary changed)"
            )
            return result
    result.extra["canary_elements_inspected"] = inspected
    return result


def check_determinism(
    impl, device="cpu", *, kind: str = "gamma", repeats: int = 3, tolerances=None
) -> CaseResult:
    """The backward run ``repeats`` times on the same input tensors: dw (and dx) must be bitwise
    identical every time (fixed-order reduction, no atomics; dy not modified in place)."""
    case = _probe_case(device, seed=5, m=17)
    x, w, dy = make_inputs(case)
    label = f"{repeats} runs"
    result = _probe(impl, case, kind, x, w, dy, check="determinism", label=label, tolerances=tolerances)
    if not result.passed:
        return result
    runs = [_backward_fn(impl)(x, w, dy, case.eps) for _ in range(repeats)]
    for i, (dx, dw) in enumerate(runs[1:], start=2):
        if not (_same_bits(dw, runs[0][1]) and _same_bits(dx, runs[0][0])):
            which = "dw" if not _same_bits(dw, runs[0][1]) else "dx"
            result.passed, result.reason = False, f"{which} of run {i} differs bitwise from run 1"
            return result
    return result


def check_m_variants(impl, device="cpu", *, kind: str = "gamma", tolerances=None) -> CaseResult:
    """dw at M = 1 and M = 17: a sum over rows equals a mean only at M = 1, so a dw divided by M
    passes the first and fails the second. Returns the first failing result, else the M = 17 one."""
    result = None
    for m in (1, 17):
        case = _probe_case(device, seed=6, m=m)
        x, w, dy = make_inputs(case)
        result = _probe(impl, case, kind, x, w, dy, check="m_variants", label=f"M={m}", tolerances=tolerances)
        if not result.passed:
            return result
    return result


def check_rstd_precision(impl, device="cpu", *, kind: str = "backward", tolerances=None) -> CaseResult:
    """fp32 rows at scales 1e-2 to 3e2: r = 1/rms then spans 1e2 to 3e-3. An r rounded to fp16,
    recomputed from fp16 squares (which overflow above 256 and lose precision below 1e-2), or a
    wrong power of r in dx's second term (equal to the right one only when r = 1) all show."""
    case = _probe_case(device, seed=7)
    x, w, dy = make_inputs(case)
    scale = torch.tensor([1e-2, 1.0, 3e2, 0.1, 30.0], dtype=torch.float32)[: case.m, None]
    x = (x.float().cpu() * scale).to(device)
    return _probe(
        impl, case, kind, x, w, dy, check="rstd_precision", label="scales 1e-2..3e2", tolerances=tolerances
    )


def check_mixed_weight_dtype(impl, device="cpu", *, kind: str = "gamma", tolerances=None) -> CaseResult:
    """bf16 activations with an fp32 weight (the usual mixed-precision case): y and dx in bf16, dw
    in fp32, each at its own dtype's tolerance."""
    case = _probe_case(device, seed=8, dtype=torch.bfloat16, weight_dtype=torch.float32)
    x, w, dy = make_inputs(case)
    return _probe(
        impl, case, kind, x, w, dy, check="mixed_weight_dtype", label="w fp32", tolerances=tolerances
    )


# (check, function, kind, keyword arguments), in the order they run: the probes aimed at one
# failure mode each first, the broader ones after.
PROBES: tuple[tuple[str, Callable[..., CaseResult], str, dict], ...] = (
    ("denominator", check_denominator, "forward", {"n": 257}),
    ("denominator", check_denominator, "forward", {"n": 256}),
    ("denominator", check_denominator, "backward", {"n": 257}),
    ("large_magnitude", check_large_magnitude, "forward", {}),
    ("large_magnitude", check_large_magnitude, "backward", {}),
    ("small_magnitude", check_small_magnitude, "forward", {}),
    ("small_magnitude", check_small_magnitude, "backward", {}),
    ("nonzero_mean", check_nonzero_mean, "forward", {}),
    ("rstd_precision", check_rstd_precision, "forward", {}),
    ("rstd_precision", check_rstd_precision, "backward", {}),
    ("m_variants", check_m_variants, "gamma", {}),
    ("mixed_weight_dtype", check_mixed_weight_dtype, "forward", {}),
    ("mixed_weight_dtype", check_mixed_weight_dtype, "backward", {}),
    ("mixed_weight_dtype", check_mixed_weight_dtype, "gamma", {}),
    ("output_bounds", check_output_bounds, "forward", {}),
    ("output_bounds", check_output_bounds, "backward", {}),
    ("determinism", check_determinism, "gamma", {}),
)


def run_probes(
    impl: Impl, device="cpu", *, tolerances=None, progress: bool = False, stop_at_first_failure: bool = False
) -> list[CaseResult]:
    """Every probe in :data:`PROBES` on ``impl`` (an :class:`Impl`: probes need both passes)."""
    if not isinstance(impl, Impl):
        raise TypeError(f"impl must be an Impl (forward and backward), got {type(impl).__name__}")
    probes = PROBES
    if progress:
        probes = console.progress(probes, "probes", len(probes))
    results = []
    for _, fn, kind, kwargs in probes:
        results.append(fn(impl, device, kind=kind, tolerances=tolerances, **kwargs))
        if stop_at_first_failure and not results[-1].passed:
            break
    return results


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


# what decides a case, printed under every table of results
CRITERION = (
    "A case passes when every element has |err| <= atol + rtol·|ref| + 2u·envelope (fp32 rounding of\n"
    "the terms) and its relative L2 error against the float64 oracle is within its limit. 'of bound'\n"
    "and 'of oracle limit': the worst case's share of each; at most 1 (100%) passes. 'max rel' is\n"
    "|err|/|ref|, large where |ref| is near 0: shown, not judged."
)


def _finite_max(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


def summarize(results: Sequence[CaseResult]) -> dict:
    """cases, failures, max abs and rel error, the tolerance per dtype, and the failing cases."""
    failures = [r for r in results if not r.passed]
    # keyed by the dtype of the checked tensor: the weight's for dw, x's otherwise
    tolerance = {
        (r.weight_dtype if r.kind == "gamma" else r.dtype): {"atol": r.atol, "rtol": r.rtol} for r in results
    }
    worst_fraction = _finite_max(
        r.oracle_error / r.oracle_limit for r in results if r.oracle_limit and not math.isnan(r.oracle_limit)
    )
    summary = {
        "cases": len(results),
        "failures": len(failures),
        "passed": not failures,
        "max_abs": _finite_max(r.max_abs for r in results),
        "max_rel": _finite_max(r.max_rel for r in results),
        # largest oracle error as a fraction of its allowed limit (<= 1 passes)
        "worst_oracle_fraction": worst_fraction,
        # worst element's |err| / (atol + rtol*|ref| + 2u*envelope) (<= 1 passes)
        "worst_bound_fraction": _finite_max(r.bound_fraction for r in results),
        "tolerance": tolerance,
        "failed": [{"name": r.name, "kind": r.kind, "check": r.check, "reason": r.reason} for r in failures],
    }
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}


def _fmt(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def format_table(results: Sequence[CaseResult]) -> str:
    """A markdown table, one row per (kind, dtype): cases, failures, max abs and rel error, the
    tolerance, the fractions of the two deciding bounds used, and pass; then the rule; the failing
    cases follow, one line each."""
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for r in results:
        # dw is judged in the weight's dtype: a mixed case gets its own row
        label = (
            r.dtype
            if r.kind != "gamma" or r.weight_dtype in ("", r.dtype)
            else f"{r.dtype}, dw {r.weight_dtype}"
        )
        groups.setdefault((r.kind, label), []).append(r)
    headers = ["kind", "dtype", "cases", "failures", "max abs", "max rel", "atol", "rtol", "of bound"]
    headers += ["of oracle limit", "pass"]
    rows = []
    for (kind, label), rs in groups.items():
        fails = sum(not r.passed for r in rs)
        rows.append(
            [kind, label, len(rs), fails, _fmt(_finite_max(r.max_abs for r in rs))]
            + [_fmt(_finite_max(r.max_rel for r in rs)), f"{rs[0].atol:g}", f"{rs[0].rtol:g}"]
            + [_fmt(_finite_max(r.bound_fraction for r in rs))]
            + [_fmt(_finite_max(r.oracle_error / r.oracle_limit for r in rs if r.oracle_limit))]
            + ["pass" if not fails else "FAIL"]
        )
    lines = [markdown_table(headers, rows, right=range(2, 10)), "", CRITERION]
    failed = [r for r in results if not r.passed]
    if failed:
        lines.append("")
        lines.append("Failures:")
        lines += [f"- {r.check} {r.kind} {r.name}: {r.reason}" for r in failed]
    return "\n".join(lines)
