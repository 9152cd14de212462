"""The kernel against the declared tolerances and the float64 oracle on the case grids of
rmsnorm_suite.cases, with the suite's own checks (rmsnorm_suite.checks): element-wise within
the dtype's tolerance, and no more than ORACLE_ERROR_FACTOR x the error of torch's fp32-compute
path. On CUDA: the tutorial's 72-case grid extended to bf16, and widths up to 262144. Under the
interpreter: the small odd-size grid. Plus the targeted probes on both."""

import pytest

from rmsnorm_suite import cases, checks, probes
from rmsnorm_suite.cases import dtype_name

from ..conftest import HAS_CUDA, INTERPRET

CHECKS = {"forward": checks.check_forward, "backward": checks.check_backward, "gamma": checks.check_gamma}


gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (nox -s gpu)")]
interpret = [
    pytest.mark.interpret,
    pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1"),
]


def _params(grid, device, marks):
    return [
        pytest.param(device, m, n, d, kind, marks=marks, id=f"{device}-{kind}-{m}x{n}-{dtype_name(d)}")
        for (m, n, d) in grid
        for kind in CHECKS
    ]


GRID = (
    _params(cases.gpu_grid(), "cuda", gpu)
    + _params(cases.gpu_wide_grid(), "cuda", gpu)
    + _params([c for c in cases.interpret_grid() if c[0] > 0], "cpu", interpret)
)


@pytest.mark.parametrize(("device", "m", "n", "dtype", "kind"), GRID)
def test_grid_case(device, m, n, dtype, kind):
    result = CHECKS[kind](checks.kernel_impl, cases.Case(m, n, dtype, device=device, seed=m * 7919 + n))
    assert result.passed, result.reason


PROBES = [pytest.param("cuda", marks=gpu, id="cuda"), pytest.param("cpu", marks=interpret, id="interpret")]


@pytest.mark.parametrize("device", PROBES)
def test_probes(device):
    failures = [r for r in probes.run_probes(checks.kernel_impl, device) if not r.passed]
    assert not failures, "\n".join(f"{r.name}: {r.reason}" for r in failures)
