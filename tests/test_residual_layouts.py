"""Two blind spots of the residual call, as properties (interpreter on CPU, kernels on CUDA):

- a residual with x's number of elements but another shape is refused before any launch, with
  an error that is torch's class for it (RuntimeError) as well as a ValueError;
- incoming gradients at y *and* at h in every layout torch accepts (row-strided, column-stepped,
  offset into a larger storage, expanded rows) give dx, dresidual and dw of float64 torch.

Tolerances are declared here, before any comparison: fp32 results within RTOL/ATOL of the float64
oracle, on rows whose mean square is about 1 (randn), eps = 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rmsnorm_kernel import rms_norm
from tests.conftest import KERNEL_DEVICES

RTOL, ATOL = 1e-4, 1e-4
EPS = 1e-6
LAYOUTS = ("contiguous", "row-strided", "column-stepped", "offset", "expanded")


def laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (m, n) as a view of the given layout, with the same values."""
    m, n = values.shape
    if layout == "row-strided":
        base = torch.full((m, n + 5), float("nan"), dtype=values.dtype, device=values.device)
        base[:, :n] = values
        return base[:, :n]
    if layout == "column-stepped":
        base = torch.full((m, 2 * n), float("nan"), dtype=values.dtype, device=values.device)
        base[:, ::2] = values
        return base[:, ::2]
    if layout == "offset":
        flat = torch.full((m * n + 3,), float("nan"), dtype=values.dtype, device=values.device)
        flat[3:] = values.reshape(-1)
        return flat[3:].view(m, n)
    if layout == "expanded":
        return values[:1].expand(m, n)
    return values.contiguous()


def wrong_shapes(m: int, n: int) -> list[tuple[int, ...]]:
    """Every shape with m * n elements other than (m, n), as 1-D, 2-D and 3-D."""
    total = m * n
    shapes = [(total,)]
    shapes += [(a, total // a) for a in range(1, total + 1) if total % a == 0 and (a, total // a) != (m, n)]
    shapes += [(1, m, n), (m, 1, n)]
    return shapes


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("m, n", [(4, 6), (3, 8), (1, 12)])
def test_a_residual_of_another_shape_is_refused_before_any_launch(device, m, n):
    x, w = torch.randn(m, n, device=device), torch.ones(n, device=device)
    for shape in wrong_shapes(m, n):
        r = torch.randn(shape, device=device)
        with pytest.raises(RuntimeError, match="residual") as caught:
            rms_norm(x, weight=w, residual=r)
        assert isinstance(caught.value, ValueError), shape


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 6),
    n=st.sampled_from([1, 7, 33, 130]),
    gy_layout=st.sampled_from(LAYOUTS),
    gh_layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_gradients_at_y_and_h_in_every_layout(device, m, n, gy_layout, gh_layout, seed):
    g = torch.Generator().manual_seed(seed)
    x0, r0 = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    w0, gy0, gh0 = torch.randn(n, generator=g), torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    x, r, w = (t.to(device).requires_grad_() for t in (x0, r0, w0))
    gy, gh = laid_out(gy0.to(device), gy_layout), laid_out(gh0.to(device), gh_layout)
    y, h = rms_norm(x, weight=w, eps=EPS, residual=r)
    grads = torch.autograd.grad((y, h), (x, r, w), (gy, gh))
    xd, rd, wd = (t.double().requires_grad_() for t in (x0, r0, w0))
    hd = xd + rd
    yd = F.rms_norm(hd, (n,), wd, eps=EPS)
    want = torch.autograd.grad((yd, hd), (xd, rd, wd), (gy.cpu().double(), gh.cpu().double()))
    assert math.isfinite(sum(float(t.abs().sum()) for t in want))
    for name, got, exp in zip(("dx", "dresidual", "dw"), grads, want):
        torch.testing.assert_close(got.cpu().double(), exp, rtol=RTOL, atol=ATOL * max(1.0, m), msg=name)
