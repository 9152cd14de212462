"""Blind spots the suite had, as properties (interpreter on CPU, kernels on CUDA):

- a residual with x's number of elements but another shape is refused before any launch, with
  an error that is torch's class for it (RuntimeError) as well as a ValueError;
- incoming gradients at y *and* at h in every layout torch accepts (row-strided, column-stepped,
  offset into a larger storage, expanded rows) give dx, dresidual and dw of float64 torch;
- values users meet besides randn: rows whose mean square is comparable to eps (eps's place in
  the formula shows), near the half types' overflow and underflow, one outlier per row, constant.

Tolerances are declared here, before any comparison: fp32 results within RTOL/ATOL of the float64
oracle, on rows whose mean square is about 1 (randn), eps = 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
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


# Rows whose mean square is comparable to eps (where eps's place in the formula shows) and rows
# near the half types' overflow and underflow. Declared bounds: fp32 1e-5 relative to the float64
# oracle; fp16 and bf16 one rounding of the output (2**-10 and 2**-7 relative) plus the input's.
VALUE_BOUNDS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(list(VALUE_BOUNDS)),
    kind=st.sampled_from(["near-eps", "huge", "tiny", "outlier", "constant"]),
    n=st.sampled_from([1, 8, 67, 300, 5000, 9000, 24577]),  # tile; two-walk 2 and 3 chunks; wide
    seed=st.integers(0, 2**16),
)
@example(dtype=torch.float16, kind="huge", n=5000, seed=1)  # an element past fp16's range: inf
def test_values_users_meet_match_torch(device, dtype, kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(3, n, generator=g, dtype=torch.float64)
    eps = 1e-2 if kind == "near-eps" else 1e-6
    # fp16 near its own overflow; bf16 and fp32 near where an fp32 square (sum of n) overflows
    big = 6e4 if dtype == torch.float16 else 1e17
    scale = {"near-eps": 0.1, "huge": big / 4, "tiny": 1e-4 if dtype == torch.float16 else 1e-30}.get(
        kind, 1.0
    )
    values = base * scale
    if kind == "outlier":
        values[:, 0] = 1e4 if dtype == torch.float16 else 1e17
    if kind == "constant":
        values = torch.full_like(values, 3.0)
    x = values.to(dtype).to(device).requires_grad_()
    w = torch.randn(n, generator=g).to(device).requires_grad_()
    y = rms_norm(x, weight=w, eps=eps)
    xd, wd = x.detach().cpu().double().requires_grad_(), w.detach().cpu().double().requires_grad_()
    yd = F.rms_norm(xd, (n,), wd, eps=eps)
    bound = VALUE_BOUNDS[dtype]
    # fp16 "huge" draws can pass fp16's range and round to inf: torch's result is then NaN where
    # x is inf (and 0 elsewhere in that row); the op must give NaN at exactly those places.
    torch.testing.assert_close(
        y.detach().cpu().double(), yd.detach(), rtol=bound, atol=bound * float(wd.abs().max()), equal_nan=True
    )
    if kind == "near-eps" and dtype == torch.float32:  # eps inside the root shows in every gradient
        dy = torch.randn(3, n, generator=g)
        got = torch.autograd.grad(y, (x, w), dy.to(device))
        want = torch.autograd.grad(yd, (xd, wd), dy.double())
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu().double(), b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
