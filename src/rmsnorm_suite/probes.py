"""Probe checks: each aimed at one failure mode of an RMSNorm implementation.

Where the grids (:mod:`rmsnorm_suite.checks`) cover shapes and dtypes with ordinary inputs, a
probe builds the inputs that expose one mistake: a denominator of BLOCK instead of N, squares
that overflow fp16, eps in the wrong place, a mean subtracted, reads or writes outside the rows,
a nondeterministic dw, a dw divided by M, a low-precision rstd, a mixed weight dtype. Each is
judged as a grid case is (:func:`rmsnorm_suite.checks.run_and_judge`); :data:`PROBES` lists them
in the order :func:`run_probes` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rmsnorm_suite import console
from rmsnorm_suite.cases import PROBE_N, PROBE_ROWS, Case
from rmsnorm_suite.checks import (
    CaseResult,
    Impl,
    backward_fn,
    forward_fn,
    make_inputs,
    run_and_judge,
    same_bits,
)

# Written outside an output's rows by harnesses that allocate their outputs inside a larger buffer
# (see check_output_bounds). Exactly representable in fp32, fp16 and bf16, and never a value that
# RMSNorm of the probe's inputs can produce.
CANARY = -4096.0


def _probe_case(device, *, m=PROBE_ROWS, n=PROBE_N, dtype=torch.float32, seed=0, weight_dtype=None) -> Case:
    return Case(m, n, dtype, device, seed, weight_dtype)


def _probe(impl, case: Case, kind: str, x, w, dy, *, check: str, label: str, tolerances=None) -> CaseResult:
    return run_and_judge(
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
    if not (same_bits(wide_x, wide_before[0]) and same_bits(wide_dy, wide_before[1])):
        result.passed, result.reason = False, "wrote into the padding of its row-sliced inputs"
        return result
    # Call again to inspect the output's storage (the judged call above does not keep the tensor).
    if kind == "forward":
        outs = {"y": forward_fn(impl)(x, w, case.eps)}
    else:
        dx, dw = backward_fn(impl)(x, w, dy, case.eps)
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
    runs = [backward_fn(impl)(x, w, dy, case.eps) for _ in range(repeats)]
    for i, (dx, dw) in enumerate(runs[1:], start=2):
        if not (same_bits(dw, runs[0][1]) and same_bits(dx, runs[0][0])):
            which = "dw" if not same_bits(dw, runs[0][1]) else "dx"
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
