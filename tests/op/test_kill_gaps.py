"""Kill tests for the mutants the first GPU mutation session left alive in launch.py and ops.py,
and for the two-launch wide backward, which a GPU runs only where the one cooperative launch
is refused (so the GPU kill commands never reached it). Each test names the mutant it kills;
docs/mutation.md has the survivors and maintainer/mutation/equivalent.toml the ones argued
equivalent.
"""

import contextlib
import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import rmsnorm_kernel
from rmsnorm_kernel import host, launch, ops, qknorm
from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference

from ..conftest import KERNEL_DEVICES
from ._fixtures import EPS, F32, check_residual_call, close, inputs


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_one_dimensional_input(device):
    """A 1-D x (one row) through forward and backward: launch.as_rows sees a tensor without a
    second dim (`t.dim() == 2` -> `t.dim() < 2` would ask it for stride(1))."""
    x, w, dy, _ = inputs(1, 257, F32, device)
    x, dy = x[0], dy[0]
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS)
    y.backward(dy)
    assert y.shape == x.shape and xg.grad.shape == x.shape
    close(y, rms_norm_reference(x.double(), w.double(), EPS), F32, "y")
    dx_ref, dw_ref = rms_norm_backward_reference(x.double()[None], w.double(), dy.double()[None], EPS)
    close(xg.grad, dx_ref[0], F32, "dx")
    close(wg.grad, dw_ref, F32, "dw")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_double_backward_penalty_three_d(device):
    """A gradient penalty y.sum() + |dL/dx|^2 on a 3-D x (the differentiable backward takes the
    mean over the last dim, not dim 1: `mean(-1)` -> `mean(+1)` is the same only in 2-D), against
    torch's autograd in float64."""
    torch.manual_seed(0)
    shape = (2, 3, 16)
    x0, w0, dy0 = torch.randn(shape), torch.randn(16), torch.randn(shape)

    def penalised(fn, dtype, dev):
        x = x0.to(dtype=dtype, device=dev).clone().requires_grad_()
        w = w0.to(dtype=dtype, device=dev).clone().requires_grad_()
        y = fn(x, (16,), w, 1e-6)
        (dx,) = torch.autograd.grad((y * dy0.to(dtype=dtype, device=dev)).sum(), x, create_graph=True)
        (y.sum() + dx.pow(2).sum()).backward()
        return x.grad, w.grad

    ours = penalised(rmsnorm_kernel.rms_norm, F32, device)
    oracle = penalised(F.rms_norm, torch.float64, "cpu")
    for got, want, what in zip(ours, oracle, ("x.grad", "w.grad")):
        close(got, want, F32, what)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "normalized_shape, error",
    [(4, ValueError), ((4,), ValueError), (8.0, TypeError)],
    ids=["int-not-last-dim", "tuple-not-last-dim", "float"],
)
def test_bad_normalized_shape_on_a_kernel_device(device, normalized_shape, error):
    """rms_norm's fast path (kernel devices only) accepts an int normalized_shape only where it
    is the last dim (`type(ns) is int and ns == n` -> `or` would run these); the slow path then
    refuses them, naming the argument."""
    x = torch.randn(4, 8, device=device)
    with pytest.raises(error, match="normalized_shape"):
        rmsnorm_kernel.rms_norm(x, normalized_shape)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("normalized_shape", [(8, 8), [8, 8], (4, 8, 8)], ids=["tuple", "list", "three-dims"])
def test_normalized_shape_of_several_dims_on_a_kernel_device(device, normalized_shape):
    """A normalized_shape of several dims, its first equal to the last (8, 8): rms_norm's fast
    path takes only the last dim's int or 1-tuple, so these normalise over every dim they name,
    as torch's F.rms_norm (`len(ns) == 1` -> `!= 1` took (8, 8) for the last dim alone)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 8, 8, generator=g)
    y = rmsnorm_kernel.rms_norm(x.to(device), normalized_shape, eps=EPS)
    expected = F.rms_norm(x.double(), tuple(normalized_shape), eps=EPS)
    close(y, expected, F32, "y")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"offset": 1.0}, ValueError, "offset needs a weight"),
        ({"offset": -0.5}, ValueError, "offset needs a weight"),
        ({"offset": math.inf, "weight": "w"}, ValueError, "offset must be finite"),
        ({"normalized_shape": 8, "weight": "w[:4]"}, ValueError, "weight must have shape"),
        ({"residual": "r8x4"}, ValueError, "residual must have x's shape"),
    ],
    ids=[
        "offset-without-weight",
        "negative-offset-without-weight",
        "infinite-offset",
        "short-weight",
        "residual-of-x's-numel",
    ],  # fmt: skip
)
def test_bad_input_on_a_kernel_device(device, kwargs, error, message):
    """Inputs the contract refuses are refused on a kernel device too, where rms_norm first asks
    whether its fast path (which validates nothing itself) may take the call: an offset without
    a weight is for the slow path's validation (`weight is None and offset == 0.0` -> `!=` sent
    it down the fast path, which normalised without the offset); a residual of x's number of
    elements in another shape is refused (a numel check read it as x's rows: wrong numbers)."""
    x = torch.randn(4, 8, device=device)
    w = torch.rand(8, device=device) + 0.5
    given = {"w": w, "w[:4]": w[:4], "r8x4": torch.randn(8, 4, device=device)}
    kwargs = {k: given.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(error, match=message):
        rmsnorm_kernel.rms_norm(x, **kwargs)


# (M, N, strided rows, residual): strided x needs no residual (h would be a fresh contiguous
# tensor), so the two cases take a wrong row stride and a dropped or doubled offset apart.
TWO_LAUNCH_CASES = [
    pytest.param(3, 24577, True, False, id="wide-strided"),
    pytest.param(3, 24577, False, True, id="wide-residual"),
    pytest.param(2, 65537, True, False, id="wide-rolled-strided"),
]


@pytest.fixture
def replanned():
    """The compiled host path replays the plan it recorded for a call's key without asking
    launch.py again: a test that patches launch.py's knobs starts and ends with no plans, so
    that neither an earlier test's plan nor its own outlives the patch."""
    host.clear_plans()
    yield
    host.clear_plans()


@pytest.mark.parametrize("device", [KERNEL_DEVICES[1]])  # the interpreter takes the two launches anyway
@pytest.mark.parametrize(("m", "n", "strided", "with_residual"), TWO_LAUNCH_CASES)
def test_two_launch_wide_backward(monkeypatch, replanned, device, m, n, strided, with_residual):
    """The wide backward's two launches (backward_wide_dot, backward_wide), which a GPU runs only
    where the cooperative grid is refused: forced here (WIDE_FUSED off), with Gemma's offset, and
    every other row of a wider tensor or a residual with a gradient at h, against float64."""
    two_launches = dataclasses.replace(launch.TUNING, WIDE_FUSED=False)
    monkeypatch.setattr(launch, "backward", functools.partial(launch.backward, tuning=two_launches))
    calls = []
    dot = launch._backward_wide_dot

    def spy(*args):
        calls.append(args)
        dot(*args)

    monkeypatch.setattr(launch, "_backward_wide_dot", spy)
    x, w, dy, res = inputs(2 * m if strided else m, n, F32, device)
    if strided:
        x, dy = x[::2], dy[::2]
        assert x.stride(0) == 2 * n
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    if with_residual:
        rg = res.detach().requires_grad_()
        dh = torch.flip(dy, dims=[-1]).contiguous()
        y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, residual=rg, offset=1.0)
        torch.autograd.backward([y, h], [dy, dh])
        hd, extra = x.double() + res.double(), dh.double()
    else:
        y = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, offset=1.0)
        y.backward(dy)
        hd, extra = x.double(), 0.0
    assert len(calls) == 1, "the two-launch wide backward did not run"
    close(y, rms_norm_reference(hd, w.double(), EPS, offset=1.0), F32, "y")
    dx_ref, dw_ref = rms_norm_backward_reference(hd, w.double(), dy.double(), EPS, offset=1.0)
    close(xg.grad, dx_ref + extra, F32, "dx")
    if with_residual:
        close(rg.grad, dx_ref + extra, F32, "dresidual")
    close(wg.grad, dw_ref, F32, "dw")


EXPANDED = {
    "columns": lambda t: t[:, :1].expand_as(t),  # one value along each row: last dim's stride 0
    "rows": lambda t: t[:1].expand_as(t),  # one row repeated: row stride 0
}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("which", ["x", "residual", "dy", "dh"])
@pytest.mark.parametrize("expanded", list(EXPANDED))
def test_expanded_inputs(device, which, expanded):
    """An input expanded along a dim (stride 0) reads as the tensor it shows, against float64:
    launch.as_rows copies a last dim of stride 0, which the kernels' unit column step cannot
    walk (`t.stride(1) == 1` -> `< 1` passed it through), and keeps a row stride of 0."""
    m, n = 3, 257
    x, w, dy, res = inputs(m, n, F32, device)
    given = {"x": x, "residual": res, "dy": dy, "dh": torch.flip(dy, dims=[-1]).contiguous()}
    given[which] = EXPANDED[expanded](given[which])
    x, res, dy, dh = given["x"], given["residual"], given["dy"], given["dh"]
    assert given[which].stride()[0 if expanded == "rows" else 1] == 0
    check_residual_call(x, res, w, dy, dh)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", ["1-D x", "no dw"])
def test_custom_ops_fake_and_real_agree_off_the_common_case(device, case):
    """torch.library.opcheck (fake tensors against the real op, autograd, AOT dispatch) of both
    custom ops where their outputs take another shape than in the common case: a 1-D x (dx and
    y viewed back to x's shape; `dim == 1` -> `not dim == 1` returned dx as (1, N)), and a
    backward without dw (an empty placeholder, the fake's and the real one's both of shape (0,))."""
    x, w, dy, res = inputs(3, 64, F32, device)
    if case == "1-D x":
        x, dy, res = x[0], dy[0], res[0]
    options = (EPS, 0.0, 0, F32, F32)  # eps, offset, casting, out_dtype, residual_dtype
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, res)]
    results = {"forward": torch.library.opcheck(ops.forward_op, (*leaves, *options), raise_exception=False)}
    _, rstd, h = ops.forward_op(x, w, res, *options)
    need_dw = case != "no dw"
    backward = (dy, torch.flip(dy, dims=[-1]).contiguous(), h, w, rstd, 0.0, 0, need_dw, F32)
    results["backward"] = torch.library.opcheck(ops.backward_op, backward, raise_exception=False)
    failed = {f"{op} {test}": v for op, r in results.items() for test, v in r.items() if v != "SUCCESS"}
    assert not failed, failed


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("negative", ["x", "weight", "residual"])
def test_negative_views_read_as_their_values(device, negative):
    """A tensor with the negative bit set (torch._neg_view: its storage holds -t) reads as t in
    the forward and backward, against float64 (rms_norm resolves them before any pointer is
    read: `if not torch.compiler.is_compiling()` -> `if not not` skipped that in eager calls)."""
    x, w, dy, res = inputs(3, 257, F32, device)
    given = {"x": x, "weight": w, "residual": res}
    given[negative] = torch._neg_view(-given[negative])
    assert given[negative].is_neg()
    xg, wg, rg = (t.detach().requires_grad_() for t in (given["x"], given["weight"], given["residual"]))
    y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, residual=rg)
    y.backward(dy)
    hd = x.double() + res.double()
    close(h, hd, F32, "h")
    close(y, rms_norm_reference(hd, w.double(), EPS), F32, "y")
    dx_ref, dw_ref = rms_norm_backward_reference(hd, w.double(), dy.double(), EPS)
    close(xg.grad, dx_ref, F32, "dx")
    close(wg.grad, dw_ref, F32, "dw")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_double_backward_through_a_residual_when_only_y_is_used(device):
    """A gradient penalty through a residual call whose h is not used downstream (no gradient at
    h): the backward builds a graph, so it must take torch ops (the composite), though only dy
    arrives (`needed(dy) or (dh is not None and needed(dh))` -> `and` ran the kernels, whose dx
    carries no graph, and the penalty's second derivative was lost). Against float64 torch."""
    torch.manual_seed(1)
    x0, r0, w0, dy0 = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), torch.randn(3, 16)

    def penalised(fn, dtype, dev):
        x, r, w = (t.to(dtype=dtype, device=dev).clone().requires_grad_() for t in (x0, r0, w0))
        y = fn(x, r, w)
        (dx,) = torch.autograd.grad((y * dy0.to(dtype=dtype, device=dev)).sum(), x, create_graph=True)
        (y.sum() + dx.pow(2).sum()).backward()
        return x.grad, r.grad, w.grad

    ours = penalised(
        lambda x, r, w: rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r)[0], F32, device
    )
    oracle = penalised(lambda x, r, w: F.rms_norm(x + r, (16,), w, EPS), torch.float64, "cpu")
    for got, want, what in zip(ours, oracle, ("x.grad", "residual.grad", "w.grad")):
        close(got, want, F32, what)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_forward_mode_tangents_on_a_kernel_device(device):
    """Forward-mode AD (a dual x, and a dual weight) outside any functorch transform: the
    kernels compute no tangent, so rms_norm takes torch ops and y's tangent is the jvp of
    float64 torch's (`functorch active or has tangent` -> `and` sent it to the kernels)."""
    import torch.autograd.forward_ad as fwAD

    x, w, tx, _ = inputs(3, 64, F32, device)
    tw = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(device)
    with fwAD.dual_level():
        y = rmsnorm_kernel.rms_norm(fwAD.make_dual(x, tx), weight=fwAD.make_dual(w, tw), eps=EPS)
        tangent = fwAD.unpack_dual(y).tangent
    assert tangent is not None, "no tangent: the call ran the kernels"
    _, expected = torch.func.jvp(
        lambda a, b: F.rms_norm(a, (64,), b, EPS),
        (x.double().cpu(), w.double().cpu()),
        (tx.double().cpu(), tw.double().cpu()),
    )
    close(tangent, expected, F32, "tangent")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rows_strided_along_the_normalised_dim(device):
    """A 3-D x whose last dim is strided (every other column of a wider tensor): launch.as_rows
    must copy it, not view it as rows (`t.stride(-1) == 1` -> `>= 1` would hand the kernels rows
    they read as contiguous)."""
    wide, w, dy, _ = inputs(6, 2 * 257, F32, device)
    x = wide.view(2, 3, 2 * 257)[..., ::2]
    assert x.stride(-1) == 2 and x.shape[-1] == 257
    w = w[:257]
    xg = x.detach().requires_grad_()
    y = rmsnorm_kernel.rms_norm(xg, weight=w, eps=EPS)
    close(y, rms_norm_reference(x.double(), w.double(), EPS), F32, "y")
    y.backward(torch.ones_like(y))
    dx_ref, _ = rms_norm_backward_reference(
        x.double().reshape(6, 257), w.double(), torch.ones(6, 257, dtype=torch.float64, device=x.device), EPS
    )
    close(xg.grad.reshape(6, 257), dx_ref, F32, "dx")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_per_head_rows_of_a_fused_projection_are_all_normalised(device):
    """q as heads of a fused qkv projection (rows at unit stride, heads apart): the per-head
    launch reads it in place; every row, the last program's included, is normalised
    (`(m + rows_per - 1) // rows_per` programs; `- rows_per` would leave the last rows unwritten)."""
    t, heads, d = 37, 4, 64
    qkv, _, _, _ = inputs(t, 3 * heads * d, F32, device)
    w = torch.rand(d, device=qkv.device, dtype=F32) + 0.5
    q = qkv[:, : heads * d].view(t, heads, d)
    assert launch.strided_heads(q, d) is not None  # the per-head path, not a copy
    y = rmsnorm_kernel.rms_norm(q, weight=w, eps=EPS)
    close(y, rms_norm_reference(q.double(), w.double(), EPS), F32, "y")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_residual_beside_per_head_rows_is_added(device):
    """x as heads of a fused qkv projection with a residual: the per-head launch (which has no
    residual) is for calls without one; h and y are x + residual's (`residual is None and ...
    and x.numel()` -> `... or x.numel()` sent the call there and dropped the residual)."""
    t, heads, d = 5, 2, 64
    qkv, _, _, _ = inputs(t, 3 * heads * d, F32, device)
    x = qkv[:, : heads * d].view(t, heads, d)
    assert launch.strided_heads(x, d) is not None  # the layout the per-head launch reads
    _, w, dy, res = inputs(t * heads, d, F32, device, seed=1)
    dh = torch.flip(dy, dims=[0]).contiguous()
    check_residual_call(x, res.view(t, heads, d), w, dy.view(t, heads, d), dh.view(t, heads, d))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_qk_norm_fake_outputs_agree_with_the_real_ones(device):
    """torch.library.opcheck of qk_norm's forward op on q and k of three dims: the fake's rstd
    has the heads' shape without the last dim (`q.shape[:-1]` -> `q.shape[:+1]` gave (T,) for
    (T, H); 2-D inputs cannot tell the two apart)."""
    t, heads, d = 5, 2, 32
    qkv, _, _, _ = inputs(t, 3 * heads * d, F32, device)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : 2 * heads * d].view(t, heads, d)
    w = torch.rand(d, device=qkv.device, dtype=F32) + 0.5
    args = (q, k, w, w, EPS, 0.0, 0, F32, F32)
    result = torch.library.opcheck(qknorm.qk_forward_op, args, raise_exception=False)
    failed = {test: v for test, v in result.items() if v != "SUCCESS"}
    assert not failed, failed


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_per_head_gradient_at_y_with_one_at_h(device):
    """A residual call whose y gets a per-head view of a fused tensor as its gradient and whose
    h gets one too: dx (and the residual's gradient) is the norm's backward plus dh. The per-head
    backward reads dy alone, so only calls without dh may take it (`dh is None and n <= ...` ->
    `or` sent this one there, and dh was lost). Against float64."""
    t, heads, d = 5, 4, 64
    x, w, _, r = inputs(t * heads, d, F32, device)
    x, r = x.view(t, heads, d), r.view(t, heads, d)
    fused, _, dh, _ = inputs(t, 3 * heads * d, F32, device, seed=1)
    dy = fused[:, : heads * d].view(t, heads, d)
    assert launch.strided_heads(dy, d) is not None  # a gradient the per-head path reads in place
    dh = dh[:, : heads * d].reshape(t, heads, d).contiguous()
    xg, rg = x.detach().requires_grad_(), r.detach().requires_grad_()
    y, h = rmsnorm_kernel.rms_norm(xg, weight=w, eps=EPS, residual=rg)
    dx, dr = torch.autograd.grad((y, h), (xg, rg), (dy, dh))
    hx = (x.double() + r.double()).reshape(-1, d)
    dx_ref, _ = rms_norm_backward_reference(hx, w.double(), dy.double().reshape(-1, d), EPS)
    want = dx_ref + dh.double().reshape(-1, d)
    close(dx.reshape(-1, d), want, F32, "dx")
    close(dr.reshape(-1, d), want, F32, "residual.grad")


class _NoGradientBack(torch.autograd.Function):
    """Uses its first two inputs and sends them no gradient (None), as a function of the third."""

    @staticmethod
    def forward(ctx, a, b, c):
        return 2 * c

    @staticmethod
    def backward(ctx, g):
        return None, None, 2 * g


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_residual_call_whose_y_and_h_get_no_gradient(device):
    """y and h both used, both given no gradient downstream (None, not zeros): the backward has
    nothing to send and returns none, though x, the residual and the weight require gradients
    (`nothing needed or (dy is None and dh is None)` -> `and` passed it on to read dh, None)."""
    x, w, _, r = inputs(3, 64, F32, device)
    x, w, r = (t.detach().requires_grad_() for t in (x, w, r))
    c = torch.ones(3, 64, device=device, requires_grad=True)
    y, h = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r)
    _NoGradientBack.apply(y, h, c).sum().backward()
    assert torch.equal(c.grad, torch.full_like(c, 2.0))
    for t, what in ((x, "x"), (r, "residual"), (w, "weight")):
        assert t.grad is None or not t.grad.any(), what


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_calls_counts_one_kernel_call_per_direction(device):
    """rmsnorm_kernel.CALLS counts a call that ran the kernels once in each direction: a forward
    and its backward, on rows (a contiguous x) and on per-head views of a fused projection
    (`_COUNTS["backward"] += 1` -> `+= 0` left each row backward uncounted)."""
    t, heads, d = 3, 4, 64
    fused, w, _, _ = inputs(t, 3 * heads * d, F32, device)
    w = w[:d]
    q = fused[:, : heads * d].view(t, heads, d)
    assert launch.strided_heads(q, d) is not None  # the per-head path
    for x in (q.contiguous(), q):
        before = dict(rmsnorm_kernel.CALLS)
        y = rmsnorm_kernel.rms_norm(x.detach().requires_grad_(), weight=w, eps=EPS)
        y.backward(torch.ones_like(y))
        ran = {k: v - before[k] for k, v in rmsnorm_kernel.CALLS.items()}
        assert ran == {"forward": 1, "backward": 1, "fallback": 0}, (x.is_contiguous(), ran)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("m, n", [(16, 200), (24, 1500), (4, 3000)])
def test_a_negative_zero_gradient_gives_the_per_head_paths_bits(device, m, n):
    """dy = -0.0 over positive x and weight, N not a power of two: the row backward's dx has the
    per-head backward's bits (each says -0 where the masked columns add +0 to c; a fill of -1.0
    for x's masked columns makes c -0 and dx +0, which torch.equal would not see). Sign bits read
    as integers."""
    heads = 4
    fused, w, _, _ = inputs(m, 3 * heads * n, F32, device)
    q = (fused.abs() + 0.5)[:, : heads * n].view(m, heads, n)
    w = w[:n].abs() + 0.5
    assert launch.strided_heads(q, n) is not None
    dy = torch.full((m, heads, n), -0.0, device=q.device, dtype=F32)
    grads = []
    for x in (q, q.contiguous()):  # the per-head path, then contiguous rows
        xg = x.detach().requires_grad_()
        rmsnorm_kernel.rms_norm(xg, weight=w, eps=EPS).backward(dy)
        grads.append(xg.grad.reshape(-1, n).view(torch.int32))
    assert torch.equal(grads[0], grads[1])
    assert bool((grads[1] == torch.tensor(-0.0).view(torch.int32).item()).all()), "dx is not -0 everywhere"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_per_head_rows_wider_than_a_backward_tile(device, monkeypatch):
    """Per-head views of a fused projection with rows wider than launch.BACKWARD_MAX_TILE: the
    per-head backward (launch.backward_heads) holds a row in one tile, so such rows take the row
    backward, launch.backward, whose wide path walks them in chunks (`n <= BACKWARD_MAX_TILE` ->
    `n != ...` sent them to the per-head launch). Which launch ran, and dx and dw against
    float64."""
    t, heads, n = 2, 2, launch.BACKWARD_MAX_TILE + 4
    fused, w, _, _ = inputs(t, 3 * heads * n, F32, device)
    w = w[:n]
    x = fused[:, : heads * n].view(t, heads, n)
    dy = inputs(t * heads, n, F32, device, seed=1)[2].view(t, heads, n)
    assert launch.strided_heads(x, n) is not None  # rows the per-head path could read in place
    ran = []
    for name in ("backward", "backward_heads"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS).backward(dy)
    assert ran == ["backward"], ran
    dx_ref, dw_ref = rms_norm_backward_reference(
        x.double().reshape(-1, n), w.double(), dy.double().reshape(-1, n), EPS
    )
    close(xg.grad.reshape(-1, n), dx_ref, F32, "dx")
    close(wg.grad, dw_ref, F32, "dw")


class _FixedGradient(torch.autograd.Function):
    """Passes its input through; its backward sends a fixed gradient (ones), whatever comes in."""

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.ones(g.shape, dtype=g.dtype, device=g.device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("host_path", ["as-installed", "python"])
def test_a_batched_gradient_at_h_alone(device, host_path, monkeypatch):
    """A batched backward (autograd.grad's is_grads_batched) where only h's gradient is batched:
    y's comes from a function whose backward ignores what it is sent. dh has no memory for the
    kernels to read, so the backward runs in torch ops whichever gradient is batched
    (`dh is not None and ...` -> `dh is None` left it to the kernels). Each batch entry equals
    the unbatched backward with that entry's dh. Both host paths: on CUDA the compiled one
    decides where it is built; the Python one serves where it is not."""
    if host_path == "python":  # as host.python_path does, undone after the test: nothing loaded
        monkeypatch.setattr(host, "_extension", None)
        monkeypatch.setattr(host, "entry", None)
    x, w, _, r = inputs(3, 64, F32, device)
    dhs = inputs(3, 64, F32, device, seed=1)[2] * torch.arange(1.0, 3.0, device=device).view(2, 1, 1)
    xg, rg = x.detach().requires_grad_(), r.detach().requires_grad_()
    y, h = rmsnorm_kernel.rms_norm(xg, weight=w, eps=EPS, residual=rg)
    z = _FixedGradient.apply(y)
    ones = torch.ones(2, *y.shape, device=device)
    (batched,) = torch.autograd.grad((z, h), xg, (ones, dhs), retain_graph=True, is_grads_batched=True)
    for i in range(2):
        (want,) = torch.autograd.grad((z, h), xg, (ones[i], dhs[i]), retain_graph=True)
        close(batched[i], want, F32, f"dx[{i}]")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_custom_ops_autograd_with_a_residual(device):
    """The custom op's registered autograd (the road of traced calls and Python dispatch modes)
    saves h with a residual, and the residual's dtype: dx, dw and dresidual equal the eager
    road's. (`has_residual = residual is None` in ops._setup_context saved x and lost dresidual.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):  # sees each aten op; rms_norm then takes ops.forward_op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(7)
    x, res, gy, gh = (torch.randn(6, 96, generator=g).to(device) for _ in range(4))
    w = (1 + 0.2 * torch.randn(96, generator=g)).to(device)
    grads = []
    for mode in (None, Passing):
        xg, wg, rg = (t.detach().requires_grad_() for t in (x, w, res))
        if mode is None:
            y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, residual=rg)
        else:
            with mode():
                y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, residual=rg)
        grads.append(torch.autograd.grad((y * gy).sum() + (h * gh).sum(), (xg, wg, rg)))
    for name, eager, traced in zip(("dx", "dw", "dresidual"), *grads):
        assert torch.equal(eager, traced), name


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_quantised_call_is_told_apart(device):
    """What makes a call quantised (ops.rms_norm's `quantised`): a quantised out_dtype alone (per
    row scales come back), a scale alone, a scale_ub alone. A scale or bound beside a float
    out_dtype, or none, is refused, never dropped. (`or` -> `and` there sent each of these
    calls to the plain road, which raised for fp8 or ran without the scale.)"""
    x = torch.randn(4, 32, device=device)
    with torch.no_grad():
        y_q, scales = rmsnorm_kernel.rms_norm(x, out_dtype=torch.float8_e4m3fn)
        assert y_q.dtype == torch.float8_e4m3fn and scales.shape == (4, 1)
        for kwargs in ({"scale": 0.5}, {"scale_ub": 0.5}, {"out_dtype": torch.float16, "scale": 0.5}):
            with pytest.raises(ValueError, match="quantised out_dtype"):
                rmsnorm_kernel.rms_norm(x, **kwargs)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_quantised_call_with_a_weight_that_requires_grad(device):
    """Quantised outputs are forward only: a weight that requires grad under grad mode is refused
    on the common call's fast path too (`weight is not None` -> `is None` in its grad test ran
    the call and returned y_q with no gradient to anyone)."""
    x, w = torch.randn(4, 32, device=device), torch.ones(32, device=device, requires_grad=True)
    with pytest.raises(ops.contract.ForwardOnly, match="forward only"):
        rmsnorm_kernel.rms_norm(x, weight=w, out_dtype=torch.float8_e4m3fn)
    with torch.no_grad():
        y_q, _ = rmsnorm_kernel.rms_norm(x, weight=w, out_dtype=torch.float8_e4m3fn)
    assert y_q.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_eps_as_a_tensor(device):
    """A 0-dim tensor eps is read as a float, as torch's argument parser reads it; a 1-dim one is
    refused, as torch refuses it (`eps.dim() == 0` -> `< 0` refused the first, `!= 0` took the
    second)."""
    x, w = torch.randn(4, 32, device=device), torch.rand(32, device=device)
    expected = rmsnorm_kernel.rms_norm(x, (32,), w, 1e-3)
    assert torch.equal(
        rmsnorm_kernel.rms_norm(x, (32,), w, torch.tensor(1e-3, dtype=torch.float64)), expected
    )
    with pytest.raises(TypeError, match="eps"):
        rmsnorm_kernel.rms_norm(x, (32,), w, torch.tensor([1e-3]))
    # qk_norm reads it so too (`== 0` -> `== -1` there refused it)
    q, k = x.view(4, 2, 16), x.view(4, 2, 16)[:, :1]
    want = rmsnorm_kernel.qk_norm(q, k, eps=1e-3)
    got = rmsnorm_kernel.qk_norm(q, k, eps=torch.tensor(1e-3, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_complex_x_takes_torchs_own_rms_norm(device):
    """Complex x with allow_fallback: torch's F.rms_norm itself, without a residual or any option
    torch lacks (`residual is not None` -> `is None` in ops._torchs_own refused every such call)."""
    x = torch.randn(3, 16, dtype=torch.complex64, device=device)
    with pytest.warns(RuntimeWarning) if not ops._warned_fallback else contextlib.nullcontext():
        got = rmsnorm_kernel.rms_norm(x, (16,), None, 1e-6, allow_fallback=True)
    assert torch.equal(got, F.rms_norm(x, (16,), None, 1e-6))
    # an out_dtype of x's own dtype is torch's output; any other is refused, not an error of
    # comparing dtypes (`!=` -> `<=` there raised TypeError on both)
    same = rmsnorm_kernel.rms_norm(x, (16,), None, 1e-6, allow_fallback=True, out_dtype=torch.complex64)
    assert torch.equal(same, got)
    with pytest.raises(ops.contract.Refused, match="out_dtype"):
        rmsnorm_kernel.rms_norm(x, (16,), None, 1e-6, allow_fallback=True, out_dtype=torch.float32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_qk_norm_of_the_widest_tile_is_one_launch(device, monkeypatch):
    """q and k rows as wide as a tile (launch.FORWARD_MAX_TILE) still take one launch each way
    (`0 < n <= FORWARD_MAX_TILE` -> `<` sent them to two rms_norm calls)."""
    n = launch.FORWARD_MAX_TILE
    calls = {"forward": 0, "backward": 0}
    real_forward, real_backward = launch.forward_heads, launch.backward_heads

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(launch, "forward_heads", counted("forward", real_forward))
    monkeypatch.setattr(launch, "backward_heads", counted("backward", real_backward))
    q = torch.randn(1, 2, n, device=device, requires_grad=True)
    k = torch.randn(1, 1, n, device=device, requires_grad=True)
    yq, yk = rmsnorm_kernel.qk_norm(q, k, eps=1e-6)
    (yq.sum() + yk.sum()).backward()
    assert calls == {"forward": 1, "backward": 1}
    close(yq, F.rms_norm(q.detach().double(), (n,), None, 1e-6), F32, "yq")
