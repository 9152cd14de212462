"""The suite's checks (rmsnorm_suite.checks and .probes) judged on pure-PyTorch implementations:
the reference passes every grid and probe; deliberately wrong implementations fail the check aimed
at them, for the stated reason. Runs on the CPU without the Triton interpreter, except the last
test, which runs the kernel adapter where the real kernels can run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rmsnorm_kernel.reference import rms_norm_reference
from rmsnorm_suite import cases, checkreport, checks, probes
from rmsnorm_suite.cases import Tolerance

from ..conftest import KERNEL_DEVICES

ref_fwd = checks.reference_impl.forward
ref_bwd = checks.reference_impl.backward

# ---------------------------------------------------------------------------------------------
# The reference passes
# ---------------------------------------------------------------------------------------------


# The interpreter grid without its N above one tile: that width exercises the kernel's looped
# path, which the reference does not have, and costs seconds per case on a small CPU.
REFERENCE_GRID = [(m, n, d) for (m, n, d) in cases.interpret_grid() if n <= 4097]


@pytest.mark.parametrize("kind", checks.KINDS)
def test_reference_passes_the_interpreter_grid(kind):
    results = checks.run_grid(kind, checks.reference_impl, REFERENCE_GRID)
    assert len(results) == len(REFERENCE_GRID) > 0
    failed = [r for r in results if not r.passed]
    assert not failed, checkreport.format_table(failed)


def test_reference_passes_every_probe():
    results = probes.run_probes(checks.reference_impl)
    assert len(results) == len(probes.PROBES)
    failed = [r for r in results if not r.passed]
    assert not failed, checkreport.format_table(failed)


def test_reference_passes_with_a_mixed_weight_dtype():
    case = cases.Case(17, 257, torch.bfloat16, weight_dtype=torch.float32)
    for check in checks.GRID_CHECKS.values():
        result = check(checks.reference_impl, case)
        assert result.passed, result.reason


# ---------------------------------------------------------------------------------------------
# Wrong implementations fail, for the right reason
# ---------------------------------------------------------------------------------------------


def _y_times_1_01(x, w, eps):
    return ref_fwd(x, w, eps) * 1.01


def _weight_ignored(x, w, eps):
    return rms_norm_reference(x, None, eps)


def _nan_at_first(x, w, eps):
    y = ref_fwd(x, w, eps).clone()
    y.view(-1)[0] = math.nan
    return y


def _inplace_forward(x, w, eps):
    y = ref_fwd(x, w, eps)
    x.mul_(2)
    return y


def _raises(x, w, eps):
    raise RuntimeError("kernel launch failed")


def _dw_mean(x, w, dy, eps):
    dx, dw = ref_bwd(x, w, dy, eps)
    return dx, dw / max(x.shape[0], 1)


def _dw_scalar(x, w, dy, eps):
    dx, dw = ref_bwd(x, w, dy, eps)
    return dx, dw.sum()


def _dx_times(factor):
    """dx scaled in fp32, before the one rounding to x's dtype."""

    def backward(x, w, dy, eps):
        dx, dw = ref_bwd(x.float(), w.float(), dy.float(), eps)
        return (dx * factor).to(x.dtype), dw.to(w.dtype)

    return backward


CASE_32 = cases.Case(17, 257, torch.float32)
CASE_16 = cases.Case(17, 257, torch.float16)

WRONG = [
    # (label, grid check, impl, case, expected words in the reason)
    ("y*1.01", checks.check_forward, lambda x, w, e: ref_fwd(x, w, e) * 1.01, CASE_32, "outside atol+rtol"),
    (
        "y*1.01 fp16",
        checks.check_forward,
        lambda x, w, e: ref_fwd(x, w, e) * 1.01,
        CASE_16,
        "outside atol+rtol",
    ),
    ("one NaN", checks.check_forward, _nan_at_first, CASE_32, "1/4369 elements"),
    ("y in fp32", checks.check_forward, lambda x, w, e: ref_fwd(x, w, e).float(), CASE_16, "dtype float32"),
    ("y transposed", checks.check_forward, lambda x, w, e: ref_fwd(x, w, e).t(), CASE_32, "shape"),
    ("x modified", checks.check_forward, _inplace_forward, CASE_32, "modified its input(s) ['x']"),
    ("raises", checks.check_forward, _raises, CASE_32, "raised RuntimeError"),
    (
        "weight ignored",
        checks.check_forward,
        lambda x, w, e: rms_norm_reference(x, None, e),
        CASE_32,
        "outside",
    ),
    ("dx*1.01", checks.check_backward, _dx_times(1.01), CASE_32, "outside atol+rtol"),
    ("dw mean", checks.check_gamma, _dw_mean, CASE_32, "outside atol+rtol"),
    ("dw scalar", checks.check_gamma, _dw_scalar, CASE_32, "shape ()"),
]


@pytest.mark.parametrize(("label", "check", "impl", "case", "words"), WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_implementation_fails(label, check, impl, case, words):
    result = check(impl, case)
    assert not result.passed
    assert words in result.reason, result.reason


def test_a_perturbation_within_tolerance_still_fails_the_oracle():
    """fp16 dx scaled by 1 + 1e-3 stays inside atol = rtol = 3e-3 everywhere (the element-wise
    rule is judged first and passes), so only the float64 oracle comparison (1.05x the
    fp32-compute path's error) rejects it."""
    assert checks.check_backward(_dx_times(1.0), CASE_16).passed
    result = checks.check_backward(_dx_times(1 + 1e-3), CASE_16)
    assert not result.passed and "float64 oracle" in result.reason, result.reason


# ---------------------------------------------------------------------------------------------
# Probes bite on pure-PyTorch mutants
# ---------------------------------------------------------------------------------------------


def _torch_forward(x, w, eps, *, denominator=None, fp16_squares=False, eps_outside=False, center=False):
    xf = x.float()
    if center:
        xf = xf - xf.mean(-1, keepdim=True)
    sq = xf.half().square().sum(-1, keepdim=True, dtype=torch.float16).float() if fp16_squares else None
    if sq is None:
        sq = xf.square().sum(-1, keepdim=True)
    ms = sq / (denominator(x.shape[-1]) if denominator else x.shape[-1])
    r = 1.0 / (ms.sqrt() + eps) if eps_outside else torch.rsqrt(ms + eps)
    return (xf * r * w.float()).to(x.dtype)


def _block(n):
    return 1 << (n - 1).bit_length()


def _with_forward(forward) -> checks.Impl:
    return checks.Impl("mutant", forward, ref_bwd)


def _with_backward(backward) -> checks.Impl:
    return checks.Impl("mutant", ref_fwd, backward)


def _canary_forward(overrun: int):
    """The reference's y copied into a CANARY-filled buffer, writing ``overrun`` values past the
    end, as an unmasked store of the last row would."""

    def forward(x, w, eps):
        y = ref_fwd(x, w, eps)
        buf = torch.full((y.numel() + 64,), probes.CANARY, dtype=y.dtype)
        buf[: y.numel() + overrun] = torch.cat([y.reshape(-1), torch.zeros(overrun, dtype=y.dtype)])
        return buf[: y.numel()].view(y.shape)

    return forward


def _dw_in_x_dtype(x, w, dy, eps):
    dx, dw = ref_bwd(x, w, dy, eps)
    return dx, dw.to(x.dtype)


def _noisy_dw(x, w, dy, eps):
    dx, dw = ref_bwd(x, w, dy, eps)
    return dx, dw + torch.rand(dw.shape, dtype=dw.dtype) * 1e-7 * dw.abs()  # unseeded: differs per call


def _rstd_fp16(x, w, dy, eps):
    """dx with r rounded to fp16 (as if recomputed in half precision)."""
    xf, dyf, wf = x.float(), dy.float(), w.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps).half().float()
    u = dyf * wf
    dx = r * u - xf * r.pow(3) * (u * xf).mean(-1, keepdim=True)
    return dx.to(x.dtype), ref_bwd(x, w, dy, eps)[1]


PROBE_CASES = [
    # (label, probe, kind, impl, probe kwargs, passes)
    ("BLOCK denominator at 257", probes.check_denominator, "forward",
     _with_forward(lambda x, w, e: _torch_forward(x, w, e, denominator=_block)), {"n": 257}, False),
    ("BLOCK denominator at 256", probes.check_denominator, "forward",
     _with_forward(lambda x, w, e: _torch_forward(x, w, e, denominator=_block)), {"n": 256}, True),
    ("fp16 squares", probes.check_large_magnitude, "forward",
     _with_forward(lambda x, w, e: _torch_forward(x, w, e, fp16_squares=True)), {}, False),
    ("eps outside the sqrt", probes.check_small_magnitude, "forward",
     _with_forward(lambda x, w, e: _torch_forward(x, w, e, eps_outside=True)), {}, False),
    ("mean subtracted", probes.check_nonzero_mean, "forward",
     _with_forward(lambda x, w, e: _torch_forward(x, w, e, center=True)), {}, False),
    ("store past the rows", probes.check_output_bounds, "forward",
     _with_forward(_canary_forward(3)), {}, False),
    ("canary intact", probes.check_output_bounds, "forward", _with_forward(_canary_forward(0)), {}, True),
    ("dw changes per call", probes.check_determinism, "gamma", _with_backward(_noisy_dw), {}, False),
    ("dw mean over rows", probes.check_m_variants, "gamma", _with_backward(_dw_mean), {}, False),
    ("rstd in fp16", probes.check_rstd_precision, "backward", _with_backward(_rstd_fp16), {}, False),
    ("dw in x's dtype", probes.check_mixed_weight_dtype, "gamma", _with_backward(_dw_in_x_dtype), {}, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("label", "probe", "kind", "impl", "kwargs", "passes"), PROBE_CASES, ids=[p[0] for p in PROBE_CASES]
)
def test_probe_catches_its_failure_mode(label, probe, kind, impl, kwargs, passes):
    result = probe(impl, "cpu", kind=kind, **kwargs)
    assert result.passed is passes, result.reason
    assert result.check == probe.__name__.removeprefix("check_")


# ---------------------------------------------------------------------------------------------
# Tolerances and limits come from rmsnorm_suite.cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", cases.DTYPES, ids=cases.dtype_name)
def test_tolerance_is_the_declared_one(dtype):
    result = checks.check_forward(ref_fwd, cases.Case(3, 64, dtype))
    declared = cases.TOLERANCES[dtype]
    assert (result.atol, result.rtol) == (declared.atol, declared.rtol)
    assert result.oracle_limit >= cases.ORACLE_ERROR_FACTOR[dtype] * result.baseline_error


def test_tolerance_is_read_when_the_check_runs(monkeypatch):
    """A perturbation inside the declared fp32 tolerance fails once cases declares a tighter one."""
    impl = lambda x, w, e: ref_fwd(x, w, e) * (1 + 5e-5)  # noqa: E731
    monkeypatch.setitem(cases.ORACLE_ERROR_FACTOR, torch.float32, math.inf)  # isolate the allclose rule
    assert checks.check_forward(impl, CASE_32).passed
    monkeypatch.setitem(cases.TOLERANCES, torch.float32, Tolerance(atol=1e-6, rtol=1e-5))
    result = checks.check_forward(impl, CASE_32)
    assert not result.passed and (result.atol, result.rtol) == (1e-6, 1e-5)


def test_oracle_factor_is_read_from_cases(monkeypatch):
    """With a factor below 1 even the fp32-compute path itself exceeds its limit: the oracle
    comparison is live."""
    monkeypatch.setitem(cases.ORACLE_ERROR_FACTOR, torch.float16, 0.5)
    result = checks.check_forward(checks.reference_impl, CASE_16)
    assert not result.passed and "float64 oracle" in result.reason


def test_a_tighter_tolerance_is_accepted_a_looser_one_refused():
    tight = {torch.float32: Tolerance(atol=1e-7, rtol=1e-6)}
    assert checks.check_forward(ref_fwd, CASE_32, tolerances=tight).atol == 1e-7
    loose = {torch.float32: Tolerance(atol=1e-3, rtol=1e-4)}
    with pytest.raises(ValueError, match="looser than the declared"):
        checks.check_forward(ref_fwd, CASE_32, tolerances=loose)


def test_oracle_limit_floors():
    # no floor below the baseline on an ordinary case
    assert checks.oracle_limit(torch.float16, 1e-3, 10_000) == pytest.approx(1.05e-3, rel=1e-6)
    # an exact fp32-compute path (baseline 0) still leaves one ulp in one element
    assert checks.oracle_limit(torch.float16, 0.0, 4) == pytest.approx(1.05 * 2**-10 / 2)
    # an ill-conditioned result is allowed fp32 noise in proportion to its conditioning
    noise = math.sqrt(checks.CANCELLING_ROUNDINGS) * 2**-24 * 1e6
    assert checks.oracle_limit(torch.float32, 0.0, 10**8, conditioning=1e6) == pytest.approx(2 * noise)


# ---------------------------------------------------------------------------------------------
# Cases, inputs, results
# ---------------------------------------------------------------------------------------------


def test_inputs_are_deterministic_random_and_not_degenerate():
    case = cases.Case(17, 257, torch.bfloat16, seed=3)
    a, b = checks.make_inputs(case), checks.make_inputs(case)
    for t, u in zip(a, b):
        assert torch.equal(t, u)
    x, w, dy = a
    assert (x != 0).all() and (dy != 0).all()
    assert not torch.equal(w, torch.ones_like(w)) and (w - 1).abs().max() < 1
    assert x.dtype == dy.dtype == w.dtype == torch.bfloat16
    other = checks.make_inputs(cases.Case(17, 257, torch.bfloat16, seed=4))[0]
    assert not torch.equal(x, other)


BAD_CASES = [
    (dict(m=-1, n=8, dtype=torch.float32), ValueError, "Case.m"),
    (dict(m=1, n=0, dtype=torch.float32), ValueError, "Case.n"),
    (dict(m=1, n=8, dtype=torch.int32), TypeError, "Case.dtype"),
    (dict(m=1, n=8, dtype=torch.float32, weight_dtype=torch.float64), TypeError, "Case.weight_dtype"),
    (dict(m=1, n=8, dtype=torch.float32, eps=0.0), ValueError, "Case.eps"),
    (dict(m=1, n=8, dtype=torch.float32, eps=math.nan), ValueError, "Case.eps"),
]


@pytest.mark.parametrize(("kwargs", "error", "words"), BAD_CASES, ids=[c[2] for c in BAD_CASES])
def test_bad_case_is_refused(kwargs, error, words):
    with pytest.raises(error, match=words):
        cases.Case(**kwargs)


def test_bad_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        checks.run_grid("sideways", ref_fwd, [(1, 8, torch.float32)])
    with pytest.raises(TypeError, match="impl must be an Impl"):
        probes.run_probes(ref_fwd)


def test_results_serialise_and_summarise():
    results = [checks.check_forward(ref_fwd, CASE_32), checks.check_forward(_nan_at_first, CASE_32)]
    text = json.dumps([r.to_dict() for r in results], allow_nan=False)
    assert '"max_abs": "inf"' in text  # the NaN element: its error is reported as infinite
    summary = checkreport.summarize(results)
    assert (summary["cases"], summary["failures"], summary["passed"]) == (2, 1, False)
    assert summary["tolerance"]["float32"] == {"atol": 1e-5, "rtol": 1e-4}
    json.dumps(summary, allow_nan=False)
    table = checkreport.format_table(results)
    assert "| forward | float32 | 2 | 1 |" in table and "FAIL" in table and "Failures:" in table


# ---------------------------------------------------------------------------------------------
# The kernel adapter, where the real kernels run (interpreter or CUDA)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("kind", checks.KINDS)
def test_kernel_adapter_passes_a_small_grid(kind, device):
    grid = [(m, n, d) for d in (torch.float32, torch.float16) for m in (1, 17) for n in (1, 257)]
    results = checks.run_grid(kind, checks.kernel_impl, grid, device)
    failed = [r for r in results if not r.passed]
    assert not failed, checkreport.format_table(failed)
