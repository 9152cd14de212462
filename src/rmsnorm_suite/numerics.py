"""The suite's numeric core: the float64 oracle, the relative L2 error, the synthetic inputs.

:func:`oracle` gives y, dx and dw in float64 (:func:`envelopes` the same sums over absolute
values, how much a result cancels), :func:`relative_l2` is ``||value - ref|| / ||ref||`` and
:func:`make_inputs` draws seeded x, weight and dy. The oracle restates the formulas of
``rmsnorm_kernel.reference`` instead of calling them: pr-verdict's worker imports the commit's
op beside this trusted suite, and an oracle taken from the commit would judge the commit by its
own formulas (tests/suite/test_numerics.py holds the two together). Nothing of the op is imported here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Oracle(NamedTuple):
    """y, dx, dw in float64; dx and dw are None when no dy was given."""

    y: torch.Tensor
    dx: torch.Tensor | None
    dw: torch.Tensor | None


def oracle(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor | None, eps: float) -> Oracle:
    """RMSNorm over the last dimension in float64: y = x r w with r = 1 / sqrt(mean(x^2) + eps);
    given dy, u = dy w, dx = r u - x r^3 mean(u x) and dw = the sum over rows of dy x r."""
    xd, wd = x.detach().double(), weight.detach().double()
    r = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    y = xd * r * wd
    if dy is None:
        return Oracle(y, None, None)
    dyd = dy.detach().double()
    u = dyd * wd
    dx = r * u - xd * r.pow(3) * (u * xd).mean(-1, keepdim=True)
    dw = (dyd * xd * r).reshape(-1, x.shape[-1]).sum(0)
    return Oracle(y, dx, dw)


def envelopes(
    x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """|y|, and the envelopes of dx and dw: the oracle's sums taken over the terms' absolute
    values, in float64. ``||envelope|| / ||oracle||`` is the result's conditioning."""
    xd, wd, dyd = x.detach().double(), weight.detach().double(), dy.detach().double()
    r = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    u = dyd * wd
    y_env = (xd * r * wd).abs()
    dx_env = r * u.abs() + xd.abs() * r.pow(3) * (u * xd).abs().mean(-1, keepdim=True)
    dw_env = (dyd * xd * r).abs().reshape(-1, x.shape[-1]).sum(0)
    return y_env, dx_env, dw_env


def relative_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||`` in float64.

    Against a zero (or empty) reference: 0 where the value is zero too, ``inf`` otherwise (no
    relative error exists, and the gate and the checks count a non-finite error as a failure)."""
    diff = torch.linalg.vector_norm(value.detach().double() - reference.detach().double()).item()
    norm = torch.linalg.vector_norm(reference.detach().double()).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def make_inputs(
    m: int,
    n: int,
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    weight_dtype: torch.dtype | None = None,
    draw_on: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ~ N(0, 1) of shape (m, n), weight = 1 + 0.1 N(0, 1) of shape (n,) (not all ones, so a
    wrong weight index shows), dy ~ N(0, 1): drawn in float32 in that order from a generator on
    ``draw_on`` seeded with ``seed``, then cast to ``dtype`` (the weight to ``weight_dtype``,
    default ``dtype``) and moved to ``device``. Drawn on the CPU (the default) the same seed gives
    the same numbers on every device; large benchmark inputs are drawn on their device instead."""
    g = torch.Generator(device=draw_on).manual_seed(seed)
    x = torch.randn(m, n, device=draw_on, generator=g)
    w = 1.0 + 0.1 * torch.randn(n, device=draw_on, generator=g)
    dy = torch.randn(m, n, device=draw_on, generator=g)
    return (
        x.to(dtype).to(device),
        w.to(weight_dtype or dtype).to(device),
        dy.to(dtype).to(device),
    )
