"""The model-ready features against their references: the fused residual add, the weight offset,
the casting modes (against Hugging Face's own formulas), out_dtype, the module's options and
swap_rms_norm. Numeric tests run under the interpreter on CPU (nox -s interpret) and on CUDA
(nox -s gpu); tolerances come from rmsnorm_suite.cases, inputs, the float64 oracle and the
relative L2 error from rmsnorm_suite.numerics.

Tolerance rows, by what a result went through (the same rule as rmsnorm_suite/featurechecks.py):
* default and "gemma" casting round nothing before the result: the result's own dtype;
* "llama" rounds the normalised activations to the normalised input's dtype, where a one-ulp
  difference in r between two correct fp32 computations may flip that rounding: the coarser of
  that dtype and the result's;
* with a residual, the unfused pair's gradient passes through h, a tensor of h's dtype: dx and
  dresidual get the coarser of h's dtype and their own.
"""

import math

import pytest
import torch
from torch import nn

import rmsnorm_kernel
from rmsnorm_kernel import host, launch
from rmsnorm_kernel.reference import rms_norm_reference
from rmsnorm_suite import featurechecks, numerics
from rmsnorm_suite.cases import EPS, TOLERANCES

from ..conftest import INTERPRET, KERNEL_DEVICES
from ._fixtures import HF_MODULES, GemmaRMSNorm, LlamaRMSNorm, hf_module

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def coarser(*dtypes):
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def assert_close(actual, expected, tol_dtype):
    """Same dtype and shape, then |actual - expected| <= atol + rtol |expected| (TOLERANCES row)."""
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype}, expected {expected.dtype}"
    tol = TOLERANCES[tol_dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol.atol, rtol=tol.rtol)


def make(shape, dtype, device, *, seed=0, weight_dtype=None, weight_center=1.0, residual_dtype=None):
    """x of any shape, weight (weight_center + 0.1 N(0, 1)) and residual (None unless
    residual_dtype): numerics.make_inputs' x, weight and dy drawn in fp32 on the CPU (dy as the
    residual, x's leading dimensions as its rows), then cast and moved."""
    x, w, r = numerics.make_inputs(math.prod(shape[:-1]), shape[-1], F32, seed=seed)
    w = w + (weight_center - 1.0)  # make_inputs centres the weight on 1
    res = r.reshape(shape).to(residual_dtype).to(device) if residual_dtype is not None else None
    return x.reshape(shape).to(dtype).to(device), w.to(weight_dtype or dtype).to(device), res


def grads_of(fn, loss, *tensors):
    """Gradients of loss(fn(*leaves)) for each tensor (None for tensors that are None)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    loss(fn(*leaves)).backward()
    return [t.grad if t is not None else None for t in leaves]


# ---------------------------------------------------------------------------------------------
# The feature checks of the mutant catalogue, on the real op
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("check", list(featurechecks.FEATURE_CHECKS))
def test_op_passes_the_feature_checks(device, check):
    """The checks that catch every feature mutant (tests/suite/test_mutants.py) pass on the op."""
    results = featurechecks.FEATURE_CHECKS[check](featurechecks.op_feature_impl, device)
    failed = [f"{r.name} {r.kind}: {r.reason}" for r in results if not r.passed]
    assert results and not failed, failed


# ---------------------------------------------------------------------------------------------
# Fused residual add
# ---------------------------------------------------------------------------------------------

RESIDUAL_FORWARD = [
    # (x dtype, residual dtype, residual_dtype argument, shape)
    (F32, F32, None, (17, 257)),
    (BF16, BF16, None, (17, 257)),
    (BF16, BF16, F32, (17, 257)),  # the residual stream kept in fp32 beside bf16 activations
    (F16, F16, F32, (2, 3, 257)),
    (BF16, F32, BF16, (5, 64)),  # an fp32 residual rounded into a bf16 stream
    (BF16, BF16, F32, (3, 9000)),  # the two-walk path (h written in the first walk, read in the second)
    (F16, F32, F16, (2, 16384)),  # the two-walk path without masks (N a multiple of the chunk)
    (BF16, BF16, F32, (2, 65537)),  # the wide two-walk forward (32 warps, y's stores hinted)
    (F16, F16, None, (2, 131073)),  # the same with a last chunk one element wide
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("x_dtype", "r_dtype", "residual_dtype", "shape"), RESIDUAL_FORWARD)
def test_residual_forward(device, x_dtype, r_dtype, residual_dtype, shape):
    x, w, r = make(shape, x_dtype, device, residual_dtype=r_dtype)
    y, h = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r, residual_dtype=residual_dtype)
    # h: x + r in fp32, rounded once to residual_dtype (x's dtype by default)
    expected_h = (x.float() + r.float()).to(residual_dtype or x_dtype)
    assert h.dtype == expected_h.dtype and h.shape == x.shape
    assert torch.equal(h, expected_h)
    # y is the normalisation of exactly the returned h: the unfused op on h gives the same bits
    assert y.shape == x.shape
    assert torch.equal(y, rmsnorm_kernel.rms_norm(h, weight=w, eps=EPS, out_dtype=y.dtype))
    assert_close(y, rms_norm_reference(h, w, EPS, out_dtype=y.dtype), y.dtype)
    assert y.dtype == x_dtype, "the output takes x's dtype"


DEFAULT_DTYPES = [
    # (x dtype, residual dtype, residual_dtype argument, casting, weight dtype, y dtype, h dtype)
    (BF16, F32, None, "default", BF16, BF16, BF16),  # y in x's dtype, whatever the residual's
    (BF16, BF16, F32, "default", BF16, BF16, F32),
    (BF16, BF16, None, "llama", F32, F32, BF16),  # llama: promote(h's dtype, the weight's)
    (BF16, BF16, F32, "llama", BF16, F32, F32),
    (F32, BF16, BF16, "llama", BF16, BF16, BF16),
]
# The kernels, and the reference fallback (CPU tensors without the interpreter): the same dtypes.
PATHS = [
    *KERNEL_DEVICES,
    pytest.param(
        "fallback",
        marks=pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET=1 CPU tensors run the kernels"),
        id="fallback",
    ),
]


@pytest.mark.filterwarnings("ignore:rmsnorm_kernel.*reference implementation:RuntimeWarning")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("x_dtype", "r_dtype", "residual_dtype", "casting", "w_dtype", "y_dtype", "h_dtype"), DEFAULT_DTYPES
)
def test_default_dtypes_with_a_residual(
    path, x_dtype, r_dtype, residual_dtype, casting, w_dtype, y_dtype, h_dtype
):
    device = "cpu" if path == "fallback" else path
    x, w, r = make((5, 64), x_dtype, device, weight_dtype=w_dtype, residual_dtype=r_dtype)
    y, h = rmsnorm_kernel.rms_norm(
        x,
        weight=w,
        eps=EPS,
        residual=r,
        residual_dtype=residual_dtype,
        casting=casting,
        allow_fallback=path == "fallback",
    )
    assert (y.dtype, h.dtype) == (y_dtype, h_dtype)
    assert torch.equal(h, (x.float() + r.float()).to(h_dtype))
    tol_dtype = coarser(h_dtype, y_dtype) if casting == "llama" else y_dtype
    assert_close(y, rms_norm_reference(h, w, EPS, casting=casting, out_dtype=y_dtype), tol_dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("n", [257, 9000, 24577])  # tile, two-walk, wide forward
def test_residual_with_strided_rows(device, n):
    """A residual whose rows are not n apart (a slice of a wider stream) beside contiguous x: the
    walked forwards then read both by their runtime strides."""
    x, w, _ = make((3, n), BF16, device)
    wide = torch.randn(3, n + 24, generator=torch.Generator().manual_seed(1)).to(BF16).to(device)
    r = wide[:, 24:]
    y, h = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r)
    assert torch.equal(h, (x.float() + r.float()).to(BF16))
    assert_close(y, rms_norm_reference(h, w, EPS), BF16)


RESIDUAL_BACKWARD = [
    # (x dtype, residual dtype, residual_dtype argument, h used downstream, shape)
    (F32, F32, None, False, (17, 257)),
    (F32, F32, None, True, (17, 257)),
    (BF16, BF16, None, True, (17, 257)),
    (BF16, BF16, F32, True, (17, 257)),
    (BF16, BF16, F32, True, (3, 9000)),  # the two-walk backward (3 chunks), with dh
    (F32, F32, None, True, (2, 65537)),  # the segmented backward, with dh
    (BF16, BF16, F32, True, (2, 131073)),  # the same, 17 segments
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("x_dtype", "r_dtype", "residual_dtype", "h_used", "shape"), RESIDUAL_BACKWARD)
def test_residual_backward_matches_the_unfused_pair(device, x_dtype, r_dtype, residual_dtype, h_used, shape):
    """loss = f(y) + g(h): gradients to x, the residual and the weight equal reference autograd
    through h = (x + r) rounded to residual_dtype, then the reference RMSNorm of h."""
    x, w, r = make(shape, x_dtype, device, residual_dtype=r_dtype, weight_dtype=F32)
    g = torch.Generator().manual_seed(1)
    cy = torch.randn(shape, generator=g).to(device)
    ch = torch.randn(shape, generator=g).to(device)

    def loss(out):
        y, h = out
        downstream = (h.float().square() * ch).sum() if h_used else 0.0
        return (y.float() * cy).sum() + downstream

    def ours(x_, w_, r_):
        return rmsnorm_kernel.rms_norm(x_, weight=w_, eps=EPS, residual=r_, residual_dtype=residual_dtype)

    def unfused(x_, w_, r_):
        h = (x_.float() + r_.float()).to(residual_dtype or x_dtype)
        return rms_norm_reference(h, w_, EPS, out_dtype=x_dtype), h

    dx, dw, dr = grads_of(ours, loss, x, w, r)
    dx_ref, dw_ref, dr_ref = grads_of(unfused, loss, x, w, r)
    h_dtype = residual_dtype or x_dtype
    assert_close(dx, dx_ref, coarser(h_dtype, x_dtype))
    assert_close(dr, dr_ref, coarser(h_dtype, r_dtype))
    assert_close(dw, dw_ref, F32)


GRAD_NEEDS = [
    # (x requires grad, residual requires grad)
    (True, False),
    (False, True),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("x_grad", "r_grad"), GRAD_NEEDS)
def test_residual_gradient_only_where_required(device, x_grad, r_grad):
    x, w, r = make((9, 257), F32, device, residual_dtype=F32)
    x.requires_grad_(x_grad)
    r.requires_grad_(r_grad)
    y, h = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r)
    (y.sum() + h.square().sum()).backward()
    xr, rr = x.detach().requires_grad_(), r.detach().requires_grad_()
    h_ref = xr + rr
    (rms_norm_reference(h_ref, w, EPS).sum() + h_ref.square().sum()).backward()
    assert (x.grad is not None) is x_grad and (r.grad is not None) is r_grad
    got = x.grad if x_grad else r.grad
    assert_close(got, xr.grad, F32)


# ---------------------------------------------------------------------------------------------
# Weight offset
# ---------------------------------------------------------------------------------------------

OFFSET_DTYPES = [
    # (x dtype, weight dtype)
    (F32, F32),
    (BF16, F32),
    (BF16, BF16),
    (F16, F16),
]


# Every forward path applies the offset in its own code: the tile, the two-walk forward, the wide
# one unrolled with a masked last chunk, and the wide one rolled.
OFFSET_SHAPES = [(17, 257), (3, 9000), (2, 40000), (2, 65537)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", OFFSET_SHAPES)
@pytest.mark.parametrize(("x_dtype", "w_dtype"), OFFSET_DTYPES)
def test_offset_forward_and_backward(device, shape, x_dtype, w_dtype):
    """y = x r (1 + w) with a Gemma-like weight near 0; dx and dw against reference autograd."""
    x, w, _ = make(shape, x_dtype, device, weight_dtype=w_dtype, weight_center=0.0)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x_dtype).to(device)

    def ours(x_, w_):
        return rmsnorm_kernel.rms_norm(x_, weight=w_, eps=EPS, offset=1.0)

    def reference(x_, w_):
        return rms_norm_reference(x_, w_, EPS, offset=1.0)

    assert_close(ours(x, w), reference(x, w), x_dtype)
    dx, dw = grads_of(ours, lambda y: (y.float() * dy.float()).sum(), x, w)
    dx_ref, dw_ref = grads_of(reference, lambda y: (y.float() * dy.float()).sum(), x, w)
    assert_close(dx, dx_ref, x_dtype)
    assert_close(dw, dw_ref, w_dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("shape", OFFSET_SHAPES)
def test_offset_leaves_dw_alone(device, shape):
    """dw = sum dy x r never sees the weight, so not its offset: bitwise the same dw with offset 0
    and 1; and offset 1 with w is exactly offset 0 with 1 + w (fp32 weight: 1 + w is exact)."""
    x, w, _ = make(shape, BF16, device, weight_dtype=F32, weight_center=0.0)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(BF16).to(device)

    def run(weight, offset):
        xg, wg = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        y = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, offset=offset)
        y.backward(dy)
        return y, xg.grad, wg.grad

    y1, dx1, dw1 = run(w, 1.0)
    y0, dx0, dw0 = run(w, 0.0)
    assert torch.equal(dw1, dw0)
    assert not torch.equal(y1, y0) and not torch.equal(dx1, dx0)
    y_shift, dx_shift, dw_shift = run(1.0 + w, 0.0)
    assert torch.equal(y1, y_shift) and torch.equal(dx1, dx_shift) and torch.equal(dw1, dw_shift)


# ---------------------------------------------------------------------------------------------
# Casting modes against Hugging Face
# ---------------------------------------------------------------------------------------------

HF_CASES = [
    (style, x_dtype, w_dtype) for style in HF_MODULES for x_dtype in (BF16, F16) for w_dtype in (BF16, F32)
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("style", "x_dtype", "w_dtype"), HF_CASES)
def test_casting_mode_matches_hugging_face(device, style, x_dtype, w_dtype):
    """RMSNorm(offset=..., casting=style) against Hugging Face's module of that style: the output
    dtype (Llama: promote(x, weight); Gemma: x's), y and dx. dw against the fp32 autograd of the
    same formula: Hugging Face's Llama multiplies in the weight's dtype, so with a half-precision
    weight its own dw carries one rounding per product, which near-cancelling columns magnify
    beyond the tolerance."""
    _, center, offset = HF_MODULES[style]
    x, w, _ = make((8, 257), x_dtype, device, weight_dtype=w_dtype, weight_center=center)
    theirs = hf_module(style, 257, w, device)
    ours = rmsnorm_kernel.RMSNorm(257, eps=EPS, device=device, dtype=w_dtype, offset=offset, casting=style)
    ours.load_state_dict(theirs.state_dict())

    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    tol_dtype = coarser(x_dtype, y_theirs.dtype)
    assert_close(y_ours, y_theirs, tol_dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(y_theirs.dtype).to(device)
    y_ours.backward(dy)
    y_theirs.backward(dy)
    assert_close(x_ours.grad, x_theirs.grad, tol_dtype)
    (dw_ref,) = grads_of(
        lambda w_: rms_norm_reference(x, w_, EPS, offset=offset, casting=style),
        lambda y: (y.float() * dy.float()).sum(),
        w,
    )
    assert_close(ours.weight.grad, dw_ref, coarser(tol_dtype, w_dtype))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(BF16, BF16), (BF16, F32), (F16, F32)])
def test_llama_rounding_is_hugging_face_and_default_is_more_accurate(device, x_dtype, w_dtype):
    """The rounding Llama adds sits inside the tolerance, so compare distances: casting="llama"
    is nearer Hugging Face's Llama than the default is; and the default (fp32 throughout) is nearer
    the exact float64 result than Llama's rounding: why it is the default."""
    x, w, _ = make((64, 257), x_dtype, device, weight_dtype=w_dtype)
    hf = hf_module("llama", 257, w, device)(x).detach()
    llama = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, casting="llama")
    default = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, out_dtype=llama.dtype)
    assert numerics.relative_l2(llama, hf) < numerics.relative_l2(default, hf)
    exact = numerics.oracle(x, w, None, EPS).y
    assert numerics.relative_l2(default, exact) < numerics.relative_l2(llama, exact)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "shape", [(17, 257), (3, 9000), (2, 16384), (2, 65537), (2, 131073)]
)  # tile, two-walk, wide
def test_llama_casting_gradients_match_the_reference(device, shape):
    """casting="llama" rounds xn before the weight multiply in the forward and for dw: every
    kernel path's y, dx and dw equal reference autograd through that same rounding."""
    x, w, _ = make(shape, BF16, device, weight_dtype=F32)
    cy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device)

    def loss(y):
        return (y.float() * cy).sum()

    def ours(x_, w_):
        return rmsnorm_kernel.rms_norm(x_, weight=w_, eps=EPS, casting="llama")

    def reference(x_, w_):
        return rms_norm_reference(x_, w_, EPS, casting="llama")

    assert_close(ours(x, w), reference(x, w), BF16)
    dx, dw = grads_of(ours, loss, x, w)
    dx_ref, dw_ref = grads_of(reference, loss, x, w)
    assert_close(dx, dx_ref, BF16)
    assert_close(dw, dw_ref, F32)


RESIDUAL_STYLES = [
    # (style, dtype)
    ("llama", BF16),
    ("llama", F16),
    ("gemma", BF16),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("style", "dtype"), RESIDUAL_STYLES)
def test_fused_residual_matches_hugging_face_decoder(device, style, dtype):
    """A Hugging Face decoder layer does `hidden = residual + hidden; normed = norm(hidden)` in
    the model's dtype; the fused call returns the same hidden (bitwise) and normed."""
    _, center, offset = HF_MODULES[style]
    x, w, r = make((8, 257), dtype, device, weight_center=center, residual_dtype=dtype)
    hidden = r + x
    expected = hf_module(style, 257, w, device)(hidden).detach()
    ours = rmsnorm_kernel.RMSNorm(257, eps=EPS, device=device, dtype=dtype, offset=offset, casting=style)
    with torch.no_grad():
        ours.weight.copy_(w)
        y, h = ours(x, residual=r)
    assert torch.equal(h, hidden)
    assert_close(y, expected, dtype)


# ---------------------------------------------------------------------------------------------
# out_dtype
# ---------------------------------------------------------------------------------------------

OUT_DTYPES = [
    # (x dtype, weight dtype, out_dtype)
    (BF16, F32, F32),
    (BF16, BF16, F32),
    (F32, F32, BF16),
    (F16, F32, F32),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("x_dtype", "w_dtype", "out_dtype"), OUT_DTYPES)
def test_out_dtype(device, x_dtype, w_dtype, out_dtype):
    """y in out_dtype with one rounding (so bf16 in, fp32 out is as accurate as fp32); dx in x's
    dtype, dw in the weight's."""
    x, w, _ = make((17, 257), x_dtype, device, weight_dtype=w_dtype)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(out_dtype).to(device)

    def ours(x_, w_):
        return rmsnorm_kernel.rms_norm(x_, weight=w_, eps=EPS, out_dtype=out_dtype)

    def reference(x_, w_):
        return rms_norm_reference(x_, w_, EPS, out_dtype=out_dtype)

    y = ours(x, w)
    assert y.dtype == out_dtype
    assert_close(y, reference(x, w), out_dtype)
    dx, dw = grads_of(ours, lambda y_: (y_.float() * dy.float()).sum(), x, w)
    dx_ref, dw_ref = grads_of(reference, lambda y_: (y_.float() * dy.float()).sum(), x, w)
    assert dx.dtype == x_dtype and dw.dtype == w_dtype
    assert_close(dx, dx_ref, x_dtype)
    assert_close(dw, dw_ref, w_dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_out_dtype_with_residual(device):
    x, w, r = make((5, 257), BF16, device, residual_dtype=BF16)
    y, h = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r, out_dtype=F32)
    assert y.dtype == F32 and h.dtype == BF16
    assert_close(y, rms_norm_reference(h, w, EPS, out_dtype=F32), F32)


# ---------------------------------------------------------------------------------------------
# The common call's own autograd path
# ---------------------------------------------------------------------------------------------

PLAIN_CASES = [((17, 257), F32, 0.0), ((1, 4096), BF16, 0.0), ((2, 3, 257), F16, 1.0)]
GRADS_WANTED = [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("shape", "dtype", "offset"), PLAIN_CASES)
@pytest.mark.parametrize(("x_grad", "w_grad"), GRADS_WANTED)
def test_common_call_matches_the_general_path(device, shape, dtype, offset, x_grad, w_grad):
    """The common call (no residual, no out_dtype) runs an autograd Function of its own; the
    same call through the general path (out_dtype given) runs the same kernels, so y and the
    gradients agree bitwise, each gradient only where it was asked for."""
    x0, w0, _ = make(shape, dtype, device)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    results = []
    for out_dtype in (None, dtype):
        x = x0.detach().clone().requires_grad_(x_grad)
        w = w0.detach().clone().requires_grad_(w_grad)
        y = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, offset=offset, out_dtype=out_dtype)
        y.backward(dy)
        results.append((y.grad_fn.name(), y, x.grad, w.grad))
    (plain, y1, dx1, dw1), (general, y2, dx2, dw2) = results
    # On CUDA the compiled host path's operator takes the common call where it is built.
    compiled = device == "cuda" and host.extension() is not None
    assert plain == ("RmsNormBackward" if compiled else "_EagerFunctionBackward")
    assert general == "_EagerFunctionBackward"
    assert torch.equal(y1, y2)
    assert (dx1 is None, dw1 is None) == (not x_grad, not w_grad) == (dx2 is None, dw2 is None)
    assert dx1 is None or torch.equal(dx1, dx2)
    assert dw1 is None or torch.equal(dw1, dw2)


# (shape, dtype, residual): the tile forward (unmasked at 3x4096), the two-walk and the wide one.
NO_BACKWARD_CASES = [((17, 257), F32, False), ((3, 4096), BF16, False), ((3, 1024), F16, True),
                     ((2, 9000), BF16, False), ((2, 24577), F32, True)]  # fmt: skip


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("shape", "dtype", "with_residual"), NO_BACKWARD_CASES)
def test_forward_without_a_backward_skips_rstd(device, shape, dtype, with_residual, monkeypatch):
    """A call with nothing to differentiate asks the kernels for no r (launch.forward's
    want_rstd), and returns bitwise the y (and h) of the same call with a backward to follow.
    Without r, y stands in for the kernels' r pointer, so a kernel that stored r anyway would
    change y here."""
    x0, w, r = make(shape, dtype, device, residual_dtype=dtype if with_residual else None)
    asked = []
    forward = launch.forward

    def spy(*args):
        asked.append(args[9])  # want_rstd
        return forward(*args)

    monkeypatch.setattr(launch, "forward", spy)
    host.clear_plans()  # the compiled host path runs launch.forward once per key, to record it
    outputs = []
    for grad in (True, False):
        x = x0.detach().clone().requires_grad_(grad)
        out = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS, residual=r)
        outputs.append(out if with_residual else (out,))
    assert asked == [True, False]
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    with torch.no_grad():
        rmsnorm_kernel.rms_norm(x0.detach().requires_grad_(), weight=w, eps=EPS, residual=r)
    assert asked[-1] is False


# ---------------------------------------------------------------------------------------------
# The module's options
# ---------------------------------------------------------------------------------------------

MODULE_OPTIONS = [
    # (offset, casting, weight center)
    (0.0, "default", 1.0),
    (1.0, "gemma", 0.0),
    (0.0, "llama", 1.0),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("offset", "casting", "center"), MODULE_OPTIONS)
def test_module_options_and_residual_forward(device, offset, casting, center):
    """RMSNorm(offset=, casting=) is rms_norm with those options, bitwise, with and without a
    residual; its state_dict is torch.nn.RMSNorm's; the options show in its repr."""
    x, w, r = make((6, 257), BF16, device, weight_center=center, residual_dtype=BF16)
    module = rmsnorm_kernel.RMSNorm(257, eps=EPS, device=device, dtype=BF16, offset=offset, casting=casting)
    with torch.no_grad():
        module.weight.copy_(w)
        y = module(x)
        y_res, h = module(x, residual=r)
    options = dict(eps=EPS, offset=offset, casting=casting)
    assert torch.equal(y, rmsnorm_kernel.rms_norm(x, weight=w, **options))
    y_expected, h_expected = rmsnorm_kernel.rms_norm(x, weight=w, residual=r, **options)
    assert torch.equal(y_res, y_expected) and torch.equal(h, h_expected)
    torch_module = nn.RMSNorm(257, eps=EPS, device=device, dtype=BF16)
    torch_module.load_state_dict(module.state_dict())
    assert ("offset=1.0" in repr(module)) is (offset == 1.0)
    assert (f"casting={casting!r}" in repr(module)) is (casting != "default")


# ---------------------------------------------------------------------------------------------
# swap_rms_norm
# ---------------------------------------------------------------------------------------------


class MistralRMSNorm(LlamaRMSNorm):
    """Another Hugging Face model family, same formula as Llama: recognised by name and fields."""


class Gemma3RMSNorm(GemmaRMSNorm):
    pass


class ScaleRMSNorm(nn.Module):
    """Ends in RMSNorm but has a 2-D weight: not a module swap_rms_norm can stand in for."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 64))
        self.eps = 1e-6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.input_layernorm = LlamaRMSNorm(64, eps=1e-5)
        self.post_attention_layernorm = GemmaRMSNorm(64, eps=1e-6)


def swap_model():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Linear(8, 64)
    model.layers = nn.ModuleList([Block(), Block()])
    model.mistral_norm = MistralRMSNorm(64, eps=1e-6)
    model.gemma3_norm = Gemma3RMSNorm(64, eps=1e-6)
    model.torch_norm = nn.RMSNorm(64, eps=None)
    model.torch_norm_plain = nn.RMSNorm(64, eps=1e-5, elementwise_affine=False)
    model.layer_norm = nn.LayerNorm(64)
    model.scale_norm = ScaleRMSNorm()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LlamaRMSNorm | nn.RMSNorm) and module.weight is not None:
                module.weight.normal_(1.0, 0.1)
            elif isinstance(module, GemmaRMSNorm):
                module.weight.normal_(0.0, 0.1)
    model.layers[1].eval()
    return model


# name: (eps, casting, offset, weight shared, training)
SWAPPED = {
    "layers.0.input_layernorm": (1e-5, "llama", 0.0, True, True),
    "layers.0.post_attention_layernorm": (1e-6, "gemma", 1.0, True, True),
    "layers.1.input_layernorm": (1e-5, "llama", 0.0, True, False),
    "layers.1.post_attention_layernorm": (1e-6, "gemma", 1.0, True, False),
    "mistral_norm": (1e-6, "llama", 0.0, True, True),
    "gemma3_norm": (1e-6, "gemma", 1.0, True, True),
    "torch_norm": (None, "default", 0.0, True, True),
    "torch_norm_plain": (1e-5, "default", 0.0, False, True),
}


@pytest.mark.parametrize("device", KERNEL_DEVICES)  # the swap probes with the kernels
def test_swap_rms_norm_recognises_torch_and_hugging_face_modules(device):
    model = swap_model().to(device)
    before = dict(model.named_modules())
    replaced = rmsnorm_kernel.swap_rms_norm(model)
    assert replaced == list(SWAPPED)
    after = dict(model.named_modules())
    for name, (eps, casting, offset, has_weight, training) in SWAPPED.items():
        new, old = after[name], before[name]
        assert type(new) is rmsnorm_kernel.RMSNorm, name
        assert (new.eps, new.casting, new.offset, new.training) == (eps, casting, offset, training), name
        if has_weight:
            assert new.weight is old.weight, f"{name}: the weight Parameter must be shared, not copied"
        else:
            assert new.weight is None
    for name in ("layer_norm", "scale_norm", "layers.0.proj"):
        assert after[name] is before[name], f"{name} must be left alone"
    assert rmsnorm_kernel.swap_rms_norm(model) == []


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_swapped_modules_compute_what_the_originals_did(device, dtype):
    original = swap_model().to(device=device, dtype=dtype)
    swapped = swap_model().to(device=device, dtype=dtype)
    rmsnorm_kernel.swap_rms_norm(swapped)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    for name in SWAPPED:
        ours, theirs = swapped.get_submodule(name), original.get_submodule(name)
        expected = theirs(x)
        got = ours(x)
        assert_close(got, expected, coarser(dtype, expected.dtype))
