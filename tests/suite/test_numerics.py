"""The suite's numeric core: the float64 oracle, the relative L2 error and the input maker."""

from __future__ import annotations

import math

import pytest
import torch

from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference
from rmsnorm_suite import cases, numerics

# (value, reference, relative L2 error)
REL_L2 = [
    ([3.0, 4.0], [3.0, 4.0], 0.0),
    ([3.0, 4.5], [3.0, 4.0], 0.1),  # |(0, 0.5)| / |(3, 4)|
    ([0.0, 0.0], [3.0, 4.0], 1.0),
    ([0.0, 0.0], [0.0, 0.0], 0.0),  # zero reference, zero value: no error
    ([1.0, 0.0], [0.0, 0.0], math.inf),  # zero reference, nonzero value: no finite relative error
    ([], [], 0.0),
]


@pytest.mark.parametrize("value, reference, expected", REL_L2)
def test_relative_l2(value, reference, expected):
    got = numerics.relative_l2(torch.tensor(value, dtype=torch.bfloat16 if expected == 0.1 else torch.float32),
                               torch.tensor(reference, dtype=torch.float64))  # fmt: skip
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("m, n", [(1, 1), (3, 8), (17, 257)])
def test_oracle_is_the_reference_in_float64(m, n):
    """The oracle restates rmsnorm_kernel.reference (see numerics' docstring): in float64 the two
    agree to rounding, and dx, dw are autograd's gradients of y."""
    x, w, dy = numerics.make_inputs(m, n, torch.float64, seed=1)
    y, dx, dw = numerics.oracle(x, w, dy, cases.EPS)
    assert y.dtype == dx.dtype == dw.dtype == torch.float64
    torch.testing.assert_close(y, rms_norm_reference(x, w, cases.EPS), rtol=1e-15, atol=1e-15)
    ref_dx, ref_dw = rms_norm_backward_reference(x, w, dy, cases.EPS)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-13, atol=1e-13)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ax, aw = torch.autograd.grad(rms_norm_reference(xg, wg, cases.EPS), (xg, wg), dy)
    torch.testing.assert_close(dx, ax)
    torch.testing.assert_close(dw, aw)


def test_oracle_without_dy_is_the_forward_only():
    x, w, _ = numerics.make_inputs(4, 33, torch.bfloat16)
    y, dx, dw = numerics.oracle(x, w, None, cases.EPS)
    assert dx is None and dw is None
    assert torch.equal(y, numerics.oracle(x, w, torch.ones_like(x), cases.EPS).y)


def test_envelopes_bound_the_oracle():
    x, w, dy = numerics.make_inputs(5, 64, torch.float32, seed=2)
    y, dx, dw = numerics.oracle(x, w, dy, cases.EPS)
    y_env, dx_env, dw_env = numerics.envelopes(x, w, dy, cases.EPS)
    assert torch.equal(y_env, y.abs())
    assert (dx_env >= dx.abs()).all() and (dx_env > dx.abs()).any()  # dx's terms cancel
    assert (dw_env >= dw.abs()).all() and (dw_env > dw.abs()).any()


def test_inputs_are_seeded_cast_and_placed():
    a = numerics.make_inputs(6, 40, torch.float16, seed=5, weight_dtype=torch.float32)
    b = numerics.make_inputs(6, 40, torch.float16, seed=5, weight_dtype=torch.float32)
    assert all(torch.equal(s, t) for s, t in zip(a, b))
    x, w, dy = a
    assert (x.shape, w.shape, dy.shape) == ((6, 40), (40,), (6, 40))
    assert (x.dtype, w.dtype, dy.dtype) == (torch.float16, torch.float32, torch.float16)
    assert not torch.equal(w, torch.ones_like(w)) and (w - 1).abs().max() < 1
    assert not torch.equal(x, numerics.make_inputs(6, 40, torch.float16, seed=6)[0])
    # the same float32 draws whatever the dtype: the float16 inputs are the float32 ones rounded
    x32, w32, dy32 = numerics.make_inputs(6, 40, torch.float32, seed=5)
    assert torch.equal(x, x32.half()) and torch.equal(w, w32) and torch.equal(dy, dy32.half())
