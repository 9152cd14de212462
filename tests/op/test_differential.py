"""``rms_norm`` and ``RMSNorm`` against torch itself: one regression case per defect
class the issue found, then property-based (hypothesis) tests over layouts, dtypes, eps forms,
residuals and first and second derivatives. The comparison rule (torch at the working precision
for y and h, torch's autograd in float64 for gradients, the one tolerance table) is written out
at the top of tests/op/differential_strategies.py.

Examples per property test: the "ci" profile (derandomized, bounded for the interpreter on two
cores) unless RMSNORM_HYPOTHESIS_PROFILE names another: "gpu" for the GPU session.
"""

import dataclasses
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd import forward_ad as fwAD
from torch.utils._python_dispatch import TorchDispatchMode

import rmsnorm_kernel
from rmsnorm_kernel import contract, host, kernels, ops
from rmsnorm_kernel.launch import UnsupportedInput
from rmsnorm_kernel.module import LastDimRMSNorm

from ..conftest import HAS_CUDA, KERNEL_DEVICES, requires_cuda, requires_interpret
from . import differential_strategies as ds
from .differential_strategies import (
    Case,
    Layout,
    TensorSpec,
    assert_close,
    assert_same_strides,
    cases,
    check_against_torch,
    check_case,
    run_module,
)

PROFILE = settings.get_profile(os.environ.get("RMSNORM_HYPOTHESIS_PROFILE", "ci"))
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def randn(*shape, dtype=F32, device="cpu", scale=1.0, requires_grad=False):
    t = (torch.randn(*shape) * scale).to(dtype=dtype, device=device)
    return t.requires_grad_() if requires_grad else t


# ---------------------------------------------------------------------------------------------
# Regression cases: one per defect class of the torch-semantics review, each from its reproducer
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_noncontiguous_1d(device):
    torch.manual_seed(0)
    x = randn(4, 64, device=device, requires_grad=True)
    w = randn(128, device=device)[::2].requires_grad_()
    check_against_torch(x, (64,), w, 1e-6, grad_y=randn(4, 64, device=device))
    with torch.no_grad():  # the forward that keeps no state for a backward
        check_against_torch(x, (64,), w, 1e-6)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "backward"])
def test_weight_expanded(device, requires_grad):
    torch.manual_seed(0)
    x = randn(4, 64, device=device, requires_grad=requires_grad)
    w = torch.full((1,), 0.5, device=device).expand(64)
    if requires_grad:
        w.requires_grad_()
    check_against_torch(x, (64,), w, 1e-6, grad_y=randn(4, 64, device=device) if requires_grad else None)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_2d_transposed(device):
    torch.manual_seed(0)
    x = randn(3, 4, 8, device=device, requires_grad=True)
    w = randn(8, 4, device=device).t().requires_grad_()
    check_against_torch(x, (4, 8), w, 1e-6, grad_y=randn(3, 4, 8, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_weight_3d_permuted_with_residual(device):
    torch.manual_seed(0)
    x = randn(2, 3, 4, 5, device=device, requires_grad=True)
    r = randn(2, 3, 4, 5, device=device, requires_grad=True)
    w = randn(5, 4, 3, device=device).permute(2, 1, 0).requires_grad_()
    check_against_torch(x, (3, 4, 5), w, 1e-6, residual=r, grad_y=randn(2, 3, 4, 5, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_double_backward_penalty(device):
    """A gradient-penalty loss y.sum() + |dL/dx|^2 backpropagates the penalty term: x.grad and
    w.grad as torch's (fp32), both held to torch's autograd in float64."""
    torch.manual_seed(0)
    x0, w0, dy0 = randn(4, 64, device=device), randn(64, device=device), randn(4, 64, device=device)

    def penalised(fn, dtype):
        x, w = x0.to(dtype).clone().requires_grad_(), w0.to(dtype).clone().requires_grad_()
        y = fn(x, (64,), w, 1e-6)
        (dx,) = torch.autograd.grad((y * dy0.to(dtype)).sum(), x, create_graph=True)
        assert dx.grad_fn is not None, f"{fn.__module__}: create_graph=True gave dx without a grad_fn"
        (y.sum() + dx.pow(2).sum()).backward()
        return x.grad, w.grad

    ours = penalised(rmsnorm_kernel.rms_norm, F32)
    theirs = penalised(F.rms_norm, F32)
    oracle = penalised(F.rms_norm, torch.float64)
    for i, what in enumerate(("x.grad", "w.grad")):
        assert_close(theirs[i], oracle[i], F32, what=f"torch's own {what}")
        assert_close(ours[i], oracle[i], F32, what=what)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_double_backward_with_residual(device):
    """Second derivatives through the fused residual: sum(dx * v) + sum(dw) + sum(dres) differentiated."""
    torch.manual_seed(0)
    x = randn(3, 48, device=device, requires_grad=True)
    r = randn(3, 48, device=device, requires_grad=True)
    w = randn(48, device=device, requires_grad=True)
    check_against_torch(
        x,
        (48,),
        w,
        1e-5,
        residual=r,
        grad_y=randn(3, 48, device=device),
        grad_h=randn(3, 48, device=device),
        second_order=randn(3, 48, device=device),
    )


def _backward_formula():
    """The op's differentiable backward formula (the one a create_graph=True backward runs), in
    a form that takes float64 tensors; None where the op exposes none."""
    return getattr(ops, "differentiable_backward", None) or getattr(ops, "_backward_composite", None)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_double_backward_formula_gradgradcheck(offset):
    """torch.autograd.gradgradcheck in float64 of a Function whose forward is torch's rms_norm
    and whose backward is the op's own differentiable backward formula: checks the formula's
    first derivatives against finite differences of the forward, and its second derivatives
    against finite differences of the formula (the kernels run fp32/fp16/bf16 only, so this is
    the float64 check of the double-backward path; the fp32 one is against torch above)."""
    backward = _backward_formula()
    if backward is None:
        pytest.skip("rmsnorm_kernel.ops exposes no differentiable backward formula to check in float64")
    eps = 1e-6

    class Formula(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return F.rms_norm(x, (x.shape[-1],), offset + w, eps)

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.saved_tensors
            return backward(dy, None, x, w, eps, offset, contract.CAST_FP32, True, x.dtype)

    torch.manual_seed(0)
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(Formula.apply, (x, w))
    torch.autograd.gradgradcheck(Formula.apply, (x, w))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "fp16", "fp32"])
def test_eps_none_matches_torch_bf16(device, dtype):
    """eps=None is torch's default, finfo(float32).eps for all three dtypes (the opmath type):
    small activations show the difference."""
    torch.manual_seed(0)
    x = randn(8, 64, dtype=dtype, device=device, scale=0.01)
    w = randn(64, dtype=dtype, device=device)
    check_against_torch(x, (64,), None, None)
    check_against_torch(x, (64,), w, None)
    ours = rmsnorm_kernel.RMSNorm(64, eps=None, device=device, dtype=dtype)
    theirs = torch.nn.RMSNorm(64, eps=None, device=device, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), dtype, what="RMSNorm(eps=None)")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "eps",
    [np.float32(1e-5), np.float64(1e-3), np.True_, True],
    ids=["float32", "float64", "numpy-bool", "bool"],
)
def test_numpy_eps(device, eps):
    """NumPy scalars and bools for eps, which torch reads as floats: the function and the module."""
    torch.manual_seed(0)
    x = randn(4, 32, device=device, requires_grad=True)
    w = randn(32, device=device, requires_grad=True)
    check_against_torch(x, (32,), w, eps, grad_y=randn(4, 32, device=device))
    with torch.no_grad():
        assert_close(
            rmsnorm_kernel.RMSNorm(32, eps=eps, device=device)(x),
            F.rms_norm(x, (32,), None, eps),
            F32,
            what="RMSNorm",
        )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("eps", [0, 0.0, 1, -1e-6], ids=["int0", "float0", "int1", "negative"])
def test_eps_zero(device, eps):
    """eps = 0 (int or float), an int, a negative eps: torch accepts each, so must we, with
    torch's numbers (NaN where torch gives NaN); RMSNorm(eps=0) as nn.RMSNorm(eps=0)."""
    torch.manual_seed(0)
    x = randn(4, 32, device=device, requires_grad=True)
    w = randn(32, device=device, requires_grad=True)
    check_against_torch(x, (32,), w, eps, grad_y=randn(4, 32, device=device))
    module = rmsnorm_kernel.RMSNorm(32, eps=eps, device=device)
    with torch.no_grad():
        assert_close(
            module(x), torch.nn.RMSNorm(32, eps=eps, device=device)(x), F32, what=f"RMSNorm(eps={eps})"
        )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_eps_negative_nan_rows(device):
    """A negative eps larger than a row's mean square: NaN in that row, as torch gives."""
    x = torch.tensor([[0.1, -0.1, 0.1, 0.1], [1.0, 2.0, -1.0, 0.5]], device=device)
    check_against_torch(x, (4,), None, -0.5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    ("shape", "fmt", "normalized_shape"),
    [
        ((2, 3, 4, 5), torch.channels_last, (5,)),
        ((2, 3, 4, 5), torch.channels_last, (4, 5)),
        ((2, 3, 4, 5), torch.channels_last, (3, 4, 5)),
        ((2, 3, 2, 4, 5), torch.channels_last_3d, (5,)),
    ],
    ids=["cl-1d", "cl-2d", "cl-3d", "cl3d-1d"],
)
def test_channels_last_keeps_format(device, shape, fmt, normalized_shape):
    torch.manual_seed(0)
    x = randn(*shape, device=device).to(memory_format=fmt).requires_grad_()
    w = randn(*normalized_shape, device=device, requires_grad=True)
    check_against_torch(x, normalized_shape, w, 1e-6, grad_y=randn(*shape, device=device))
    y = rmsnorm_kernel.rms_norm(x.detach(), normalized_shape, w.detach(), 1e-6)
    assert y.is_contiguous(memory_format=fmt), f"output strides {y.stride()}: not {fmt}"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_channels_last_with_residual(device):
    torch.manual_seed(0)
    x = randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    r = randn(2, 3, 4, 5, device=device).to(memory_format=torch.channels_last)
    check_against_torch(x, (5,), randn(5, device=device), 1e-6, residual=r)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_vmap(device):
    torch.manual_seed(0)
    x, w = randn(3, 4, 32, device=device), randn(3, 32, device=device)
    got = torch.vmap(lambda xi: rmsnorm_kernel.rms_norm(xi, (32,), w[0], 1e-6))(x)
    assert_close(got, torch.vmap(lambda xi: F.rms_norm(xi, (32,), w[0], 1e-6))(x), F32, what="vmap over x")
    got = torch.vmap(lambda xi, wi: rmsnorm_kernel.rms_norm(xi, (32,), wi, 1e-6))(x, w)
    want = torch.vmap(lambda xi, wi: F.rms_norm(xi, (32,), wi, 1e-6))(x, w)
    assert_close(got, want, F32, what="vmap over x and weight")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_func_grad(device):
    torch.manual_seed(0)
    x, w = randn(4, 32, device=device), randn(32, device=device)

    def loss(fn):
        return lambda a, b: fn(a, (32,), b, 1e-6).pow(2).sum()

    got = torch.func.grad(loss(rmsnorm_kernel.rms_norm), argnums=(0, 1))(x, w)
    want = torch.func.grad(loss(F.rms_norm), argnums=(0, 1))(x, w)
    assert_close(got[0], want[0], F32, what="func.grad dx")
    assert_close(got[1], want[1], F32, what="func.grad dw")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("dual", ["x", "weight", "residual", "all"])
def test_forward_mode_ad_tangents(device, dtype, dual):
    """Dual tensors (torch.autograd.forward_ad): y and h carry torch's tangents. The kernels
    compute none, and a dual input once came back with tangent None and no error. Compared as
    gradients are: with torch's forward AD of the same composition in float64."""
    torch.manual_seed(0)
    x, w, r = randn(4, 64, dtype=dtype, device=device), randn(64, dtype=dtype, device=device), None
    tx, tw, tr = randn(4, 64, dtype=dtype, device=device), randn(64, dtype=dtype, device=device), None
    if dual in ("residual", "all"):
        r, tr = randn(4, 64, dtype=dtype, device=device), randn(4, 64, dtype=dtype, device=device)
    duals = {"x", "weight", "residual"} if dual == "all" else {dual}

    def make(name, t, tangent, double=False):
        """t, with its tangent where ``name`` is dual (float64 for the oracle)."""
        if t is None:
            return None
        if double:
            t, tangent = t.double(), tangent.double()
        return fwAD.make_dual(t, tangent) if name in duals else t

    with fwAD.dual_level():
        out = rmsnorm_kernel.rms_norm(
            make("x", x, tx), 64, make("weight", w, tw), 1e-6, residual=make("residual", r, tr)
        )
        x64, w64, r64 = make("x", x, tx, True), make("weight", w, tw, True), make("residual", r, tr, True)
        h64 = x64 if r is None else x64 + r64
        want = {"y": fwAD.unpack_dual(F.rms_norm(h64, (64,), w64, 1e-6)), "h": fwAD.unpack_dual(h64)}
        got = {"y": fwAD.unpack_dual(out[0] if r is not None else out)}
        if r is not None:
            got["h"] = fwAD.unpack_dual(out[1])
    for name, (primal, tangent) in got.items():
        assert tangent is not None, f"{name} has no tangent"
        assert_close(primal, want[name].primal, dtype, what=name)
        assert_close(tangent, want[name].tangent, dtype, what=f"tangent of {name}")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("residual", [False, True])
def test_cuda_autocast_matches_torch(dtype, residual):
    """Under CUDA autocast, y's dtype and values are torch's under the same autocast: float32 for
    fp16 and bf16 input where this torch lists rms_norm among autocast's float32 ops, x's dtype
    where it does not (2.11). By the rule at the top."""
    torch.manual_seed(0)
    x = randn(4, 64, dtype=dtype, device="cuda", requires_grad=True)
    w = randn(64, dtype=dtype, device="cuda", requires_grad=True)
    r = randn(4, 64, dtype=dtype, device="cuda", requires_grad=True) if residual else None
    with torch.autocast("cuda", dtype=dtype):
        check_against_torch(x, (64,), w, 1e-6, residual=r, grad_y=randn(4, 64, device="cuda"))
        with torch.no_grad():  # the fast path's forward
            check_against_torch(x, (64,), w, 1e-6, residual=r)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("residual", [False, True])
def test_autocast_float32_rule(monkeypatch, device, residual):
    """Where autocast runs rms_norm in float32 (CUDA: test_cuda_autocast_matches_torch), the
    default casting gives y in float32, h in its own dtype, and gradients in the inputs' dtypes,
    equal to torch's float32 rms_norm of the same values; llama and gemma castings, which follow
    model modules, are unchanged. Here the rule is forced, so the interpreter can check it (and
    the compiled host path's entry, which reads autocast's state itself, is off)."""
    monkeypatch.setattr(ops, "_autocast_float32", lambda x: True)
    monkeypatch.setattr(torch._C, "_is_any_autocast_enabled", lambda: True)
    monkeypatch.setattr(host, "entry", None)
    torch.manual_seed(0)
    x = randn(4, 64, dtype=BF16, device=device, requires_grad=True)
    w = randn(64, dtype=BF16, device=device, requires_grad=True)
    r = randn(4, 64, dtype=BF16, device=device) if residual else None
    out = rmsnorm_kernel.rms_norm(x, 64, w, 1e-6, residual=r)
    y, h = out if residual else (out, None)
    hx = (x.detach().float() + r.float()).to(BF16) if residual else x.detach()
    assert y.dtype == F32 and (h is None or h.dtype == BF16)
    assert_close(y, F.rms_norm(hx.float(), (64,), w.detach().float(), 1e-6), F32, what="y")
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == BF16 and w.grad.dtype == BF16
    for casting, dtype in [("llama", BF16), ("gemma", BF16)]:
        assert rmsnorm_kernel.rms_norm(x, 64, w, 1e-6, casting=casting).dtype == dtype


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compile_dynamic_fullgraph(device):
    """torch.compile(fullgraph=True, dynamic=True) of RMSNorm(32) and of rms_norm with the
    default offset: compiles where torch's own op does, and matches eager (forward and grads)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = rmsnorm_kernel.RMSNorm(32, device=device)
    compiled_module = torch.compile(module, fullgraph=True, dynamic=True)
    compiled_fn = torch.compile(
        lambda x, w: rmsnorm_kernel.rms_norm(x, (32,), w, 1e-6), fullgraph=True, dynamic=True
    )
    for rows in (3, 5):
        x = randn(rows, 32, device=device, requires_grad=True)
        got, want = compiled_module(x), module(x)
        assert_close(got, want, F32, what="compiled RMSNorm(32)")
        (dx,) = torch.autograd.grad(got.sum(), x)
        (dx_eager,) = torch.autograd.grad(want.sum(), x)
        assert_close(dx, dx_eager, F32, what="compiled RMSNorm(32) dx")
        w = module.weight.detach()
        assert_close(
            compiled_fn(x, w), rmsnorm_kernel.rms_norm(x, (32,), w, 1e-6), F32, what="compiled rms_norm"
        )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_residual_matches_torch_composition(device):
    torch.manual_seed(0)
    for x_dtype, r_dtype, residual_dtype in ((BF16, F32, None), (F16, BF16, F32), (F32, F16, BF16)):
        x = randn(5, 40, dtype=x_dtype, device=device, requires_grad=True)
        r = randn(5, 40, dtype=r_dtype, device=device, requires_grad=True)
        w = randn(40, dtype=F32, device=device, requires_grad=True)
        check_against_torch(
            x,
            (40,),
            w,
            1e-6,
            residual=r,
            residual_dtype=residual_dtype,
            grad_y=randn(5, 40, dtype=x_dtype, device=device),
            grad_h=randn(5, 40, dtype=residual_dtype or x_dtype, device=device),
        )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_offset_matches_fp32_composition(device, dtype):
    torch.manual_seed(0)
    x = randn(6, 33, dtype=dtype, device=device, requires_grad=True)
    w = randn(33, dtype=dtype, device=device, scale=0.1, requires_grad=True)
    check_against_torch(x, (33,), w, 1e-6, offset=1.0, grad_y=randn(6, 33, dtype=dtype, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_grad_output_expanded(device):
    """y.sum()'s grad_output: a stride-0 tensor of ones."""
    torch.manual_seed(0)
    x = randn(4, 64, dtype=BF16, device=device, requires_grad=True)
    w = randn(64, dtype=BF16, device=device, requires_grad=True)
    check_against_torch(x, (64,), w, 1e-6, grad_y=torch.ones((), dtype=BF16, device=device).expand(4, 64))


# ---------------------------------------------------------------------------------------------
# Bad input: the error names the argument, and nothing is launched
# ---------------------------------------------------------------------------------------------

# (case, make: () -> (x, normalized_shape, weight), error, argument named, torch rejects it too).
# Where torch rejects it too, ours is also an instance of torch's class. What torch computes and
# the op refuses (sparse) is refused by name, as docs/features.md lists; what only torch's own
# rms_norm computes (complex, jagged nested) is test_what_only_torch_computes's.
BAD_INPUT = [
    ("integer x", lambda: (torch.ones(2, 4, dtype=torch.int32), (4,), None), TypeError, "x", True),
    (
        "weight of the wrong shape",
        lambda: (torch.randn(2, 4), (4,), torch.randn(5)),
        ValueError,
        "weight",
        True,
    ),
    (
        "weight of the wrong 2-D shape",
        lambda: (torch.randn(2, 3, 4), (3, 4), torch.randn(4, 3)),
        ValueError,
        "weight",
        True,
    ),
    (
        "weight on another device",
        lambda: (torch.randn(2, 4), (4,), torch.ones(4, device="meta")),
        ValueError,
        "weight",
        True,
    ),
    (
        "normalized_shape not trailing",
        lambda: (torch.randn(2, 4), (2,), None),
        ValueError,
        "normalized_shape",
        True,
    ),
    ("sparse x", lambda: (torch.randn(2, 4).to_sparse(), (4,), None), TypeError, "x must be a dense", True),
    (
        "sparse CSR x",
        lambda: (torch.randn(2, 4).to_sparse_csr(), (4,), None),
        TypeError,
        "x must be a dense",
        True,
    ),
    (
        "sparse weight",
        lambda: (torch.randn(2, 4), (4,), torch.randn(4).to_sparse()),
        TypeError,
        "weight must be a dense",
        True,
    ),
]


@pytest.mark.parametrize(
    ("case", "make", "error", "name", "torch_rejects"), BAD_INPUT, ids=[b[0] for b in BAD_INPUT]
)
def test_bad_input_rejected_before_launch(case, make, error, name, torch_rejects):
    x, ns, w = make()
    torch_error = NotImplementedError  # the class of what torch computes and the op refuses
    if torch_rejects:
        with pytest.raises((RuntimeError, ValueError, TypeError, NotImplementedError)) as theirs:
            F.rms_norm(x, ns, w, 1e-6)
        torch_error = type(theirs.value)
    before = dict(ops.CALLS)
    with pytest.raises(error, match=name) as raised:
        rmsnorm_kernel.rms_norm(x, ns, w, 1e-6)
    assert not isinstance(raised.value, UnsupportedInput), (
        f"{case}: rejected as unsupported, not as bad input"
    )
    assert isinstance(raised.value, torch_error), (
        f"{case}: {type(raised.value).__name__} does not subclass {torch_error.__name__}, torch's class here"
    )
    assert ops.CALLS == before


# Input only torch's own rms_norm computes: (case, make () -> (x, weight)).
TORCH_ONLY = [
    ("complex x", lambda: (torch.randn(3, 8, dtype=torch.complex64), None)),
    ("complex128 x and weight", lambda: (torch.randn(3, 8, dtype=torch.complex128), torch.randn(8, dtype=torch.complex128))),
    ("complex weight", lambda: (torch.randn(3, 8), torch.randn(8, dtype=torch.complex64))),
    ("jagged nested x", lambda: (torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(5, 8)], layout=torch.jagged), torch.randn(8))),
]  # fmt: skip


def _same(a, b):
    if a.is_nested:
        return all(torch.equal(p, q) for p, q in zip(a.unbind(), b.unbind()))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize(("case", "make"), TORCH_ONLY, ids=[c[0] for c in TORCH_ONLY])
def test_what_only_torch_computes(case, make):
    """Complex x or weight and a jagged nested x: refused (TorchOnly: NotImplementedError, the
    argument named) without allow_fallback, nothing launched; with it (the module's default),
    torch's own F.rms_norm: its values, dtype and gradients, counted as a fallback. Options torch
    lacks (an offset, Llama's casting, a residual, an out_dtype, a quantised output) are Refused."""
    x, w = make()
    before = dict(ops.CALLS)
    with pytest.raises(contract.TorchOnly, match="allow_fallback") as raised:
        rmsnorm_kernel.rms_norm(x, (8,), w, 1e-6)
    assert isinstance(raised.value, NotImplementedError) and ops.CALLS == before
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own, for a complex weight; the fallback's once
        expected = F.rms_norm(x, (8,), w, 1e-6)
        assert _same(rmsnorm_kernel.rms_norm(x, (8,), w, 1e-6, allow_fallback=True), expected)
        norm = rmsnorm_kernel.RMSNorm(
            8, eps=1e-6, elementwise_affine=w is not None, dtype=getattr(w, "dtype", None)
        )
        if w is not None:
            with torch.no_grad():
                norm.weight.copy_(w)
        assert _same(norm(x), expected)
        assert ops.CALLS["fallback"] == before["fallback"] + 2
        if not x.is_nested:
            xg, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
            torch.autograd.backward(norm(xg).abs().sum())
            torch.autograd.backward(F.rms_norm(xt, (8,), norm.weight, 1e-6).abs().sum())
            assert torch.equal(xg.grad, xt.grad)
    ones = torch.ones(8, dtype=getattr(w, "dtype", torch.float32))
    for options in (
        {"offset": 1.0, "weight": ones},
        {"casting": "llama"},
        {"residual": x},
        {"out_dtype": torch.float32 if x.dtype != torch.float32 else torch.float16},
        {"out_dtype": torch.float8_e4m3fn},
    ):
        with pytest.raises(contract.Refused):
            rmsnorm_kernel.rms_norm(x, (8,), options.pop("weight", w), 1e-6, allow_fallback=True, **options)
    with pytest.raises(ValueError, match="casting"):
        rmsnorm_kernel.rms_norm(x, (8,), w, 1e-6, allow_fallback=True, casting="nope")


@pytest.mark.parametrize(
    "residual",
    [
        lambda: torch.randn(2, 5),
        lambda: torch.randn(2, 4, device="meta"),
        lambda: torch.ones(2, 4, dtype=torch.int8),
        lambda: torch.randn(2, 4).to_sparse(),
    ],
    ids=["shape", "device", "dtype", "sparse"],
)
def test_bad_residual_rejected_before_launch(residual):
    before = dict(ops.CALLS)
    with pytest.raises((ValueError, TypeError), match="residual") as raised:
        rmsnorm_kernel.rms_norm(torch.randn(2, 4), (4,), None, 1e-6, residual=residual())
    assert not isinstance(raised.value, UnsupportedInput)
    assert ops.CALLS == before


@requires_interpret
@pytest.mark.interpret
def test_float64_needs_allow_fallback():
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        rmsnorm_kernel.rms_norm(x, (8,), None, 1e-6)
    with warnings.catch_warnings():  # the fallback warns once per process (test_contract checks it)
        warnings.simplefilter("ignore", RuntimeWarning)
        y = rmsnorm_kernel.rms_norm(x, (8,), None, 1e-6, allow_fallback=True)
    torch.testing.assert_close(y, F.rms_norm(x, (8,), None, 1e-6))


# ---------------------------------------------------------------------------------------------
# Uses torch computes that gave wrong numbers or raised, one regression case per class
# ---------------------------------------------------------------------------------------------

# (tensor stored negated behind the negative bit, with a residual)
_NEGATIVE = [("x", False), ("x", True), ("weight", False), ("weight", True), ("residual", True),
             ("grad_y", False), ("grad_y", True), ("grad_h", True)]  # fmt: skip


_NEGATIVE_CASES = [
    pytest.param(n, r, g, id=f"{n}-{'res' if r else 'plain'}-{'backward' if g else 'forward'}")
    for n, r in _NEGATIVE
    for g in (False, True)
    if g or not n.startswith("grad")
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("negative", "residual", "requires_grad"), _NEGATIVE_CASES)
def test_negative_views(device, negative, residual, requires_grad):
    """A tensor with the negative bit set (torch._neg_view: the storage holds -t) reads as t:
    the kernels read storage, and gave -y, -dx before the views were resolved."""
    torch.manual_seed(0)

    def make(name, *shape, dtype=F32):
        t = randn(*shape, dtype=dtype, device=device)
        t = torch._neg_view(-t) if name == negative else t
        assert t.is_neg() == (name == negative)
        return t.requires_grad_() if requires_grad and not name.startswith("grad") else t

    x, w = make("x", 4, 64), make("weight", 64)
    r = make("residual", 4, 64, dtype=BF16) if residual else None
    grad_y = make("grad_y", 4, 64) if requires_grad else None
    grad_h = make("grad_h", 4, 64) if requires_grad and residual else None
    check_against_torch(x, (64,), w, 1e-6, residual=r, grad_y=grad_y, grad_h=grad_h)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("residual", [False, True])
def test_batched_gradients(device, residual):
    """autograd.grad(is_grads_batched=True) and jacobian/hessian(vectorize=True) batch the
    backward with autograd's vmap, whose tensors have no storage: they raised "Cannot access
    storage of BatchedTensorImpl". Compared with torch's float64 autograd, by the table."""
    torch.manual_seed(0)
    x, w, r = randn(3, 16, device=device), randn(16, device=device), randn(3, 16, device=device)
    grads = randn(4, 3, 16, device=device)

    def batched(fn, dtype):
        xs, ws = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        if residual:
            rs = r.to(dtype).requires_grad_()
            y, h = fn(xs, ws, rs)
            leaves, outs = (xs, ws, rs), (y, h)
            gouts = (grads.to(dtype), grads.flip(0).to(dtype))
        else:
            leaves, outs, gouts = (xs, ws), fn(xs, ws), grads.to(dtype)
        return torch.autograd.grad(outs, leaves, gouts, is_grads_batched=True)

    def ours(a, b, c=None):
        return rmsnorm_kernel.rms_norm(a, (16,), b, 1e-6, residual=c)

    def theirs(a, b, c=None):
        h = a + c if c is not None else a
        y = F.rms_norm(h, (16,), b, 1e-6)
        return (y, h) if c is not None else y

    for g, g64, what in zip(batched(ours, F32), batched(theirs, torch.float64), ("dx", "dw", "dresidual")):
        assert_close(g, g64, F32, what=f"batched {what}")

    def one(fn, dtype=F32):
        if not residual:
            return lambda a: fn(a, w.to(dtype))
        return lambda a: fn(a, w.to(dtype), r[: a.shape[0]].to(dtype))[0]

    jac = torch.autograd.functional.jacobian(one(ours), x, vectorize=True)
    jac64 = torch.autograd.functional.jacobian(one(theirs, torch.float64), x.double(), vectorize=True)
    assert_close(jac, jac64, F32, what="jacobian(vectorize=True)")
    x1 = x[:1].contiguous()
    hess = torch.autograd.functional.hessian(lambda a: one(ours)(a).pow(2).sum(), x1, vectorize=True)
    hess64 = torch.autograd.functional.hessian(
        lambda a: one(theirs, torch.float64)(a).pow(2).sum(), x1.double(), vectorize=True
    )
    assert_close(hess, hess64, F32, what="hessian(vectorize=True)")


# gradcheck in fp32 (the kernels' widest dtype): central differences at this step err by about
# step^2 times the third derivative plus fp32 rounding over the step, inside this bound for
# unit-scale rows.
_GRADCHECK_FP32 = {"eps": 1e-3, "atol": 1e-2, "rtol": 1e-2}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_gradcheck_batched_grad(device):
    """gradcheck(check_batched_grad=True): the batched backward against the unbatched one."""
    torch.manual_seed(0)
    x = randn(2, 8, device=device, requires_grad=True)
    w = randn(8, device=device, requires_grad=True)
    fn = lambda a, b: rmsnorm_kernel.rms_norm(a, (8,), b, 1e-6)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w), check_batched_grad=True, **_GRADCHECK_FP32)


class _Tagged(torch.Tensor):
    """A __torch_function__ subclass with torch's default handler: results come back tagged."""


def _models(device, eps=1e-6):
    """(ours, torch's): Linear then RMSNorm, the same weights."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16, device=device)
    norm = rmsnorm_kernel.RMSNorm(16, eps=eps, device=device)
    theirs = torch.nn.RMSNorm(16, eps=eps, device=device)
    with torch.no_grad():
        norm.weight.copy_(randn(16, device=device))
        theirs.weight.copy_(norm.weight)
    return torch.nn.Sequential(linear, norm), torch.nn.Sequential(linear, theirs)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("how", ["jit.trace", "jit.script", "fx.symbolic_trace"])
def test_model_traced_or_scripted(device, how):
    """A model holding the module, traced or scripted: it raised (the kernels' launches cannot be
    traced; TorchScript cannot compile the op's Python; fx handed the op a Proxy). The traced
    model is run on a second input, so the recorded graph is what is checked."""
    ours, theirs = _models(device)
    x1, x2 = randn(3, 16, device=device), randn(5, 16, device=device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation and tracer warnings
        if how == "jit.trace":
            made = torch.jit.trace(ours, x1)
        elif how == "jit.script":
            made = torch.jit.script(ours)
        else:
            made = torch.fx.symbolic_trace(ours)
        assert_close(made(x2), theirs(x2), F32, what=how)
    if how == "fx.symbolic_trace":  # the op is one node of the graph, not its inside
        assert any(n.target is rmsnorm_kernel.rms_norm for n in made.graph.nodes)


def test_script_of_a_weightless_swap():
    """LastDimRMSNorm (what swap_rms_norm puts in place of a weightless look-alike) scripts to
    F.rms_norm over the last dim, at any width."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(LastDimRMSNorm(eps=1e-5))
    for width in (8, 24):
        x = randn(3, width)
        torch.testing.assert_close(scripted(x), F.rms_norm(x, (width,), None, 1e-5), rtol=0, atol=0)


# Options torch.nn.RMSNorm lacks, and out_dtype's forms: scripted, the module computes
# composite.py's formula in torch ops, so on CPU (the eager module's fallback is that formula)
# the bits are the eager module's, in every dtype of x and weight.
SCRIPT_OPTIONS = [
    {"offset": 1.0, "casting": "gemma"},
    {"casting": "llama"},
    {"casting": "llama", "out_dtype": "promoted"},
    {"out_dtype": "input"},
    {"out_dtype": torch.float32},
]


@pytest.mark.parametrize("options", SCRIPT_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_script_of_options_torch_lacks(options, shape):
    torch.manual_seed(0)
    for x_dtype, w_dtype in ((BF16, F32), (F16, F16), (F32, BF16), (torch.float64, F32)):
        norm = rmsnorm_kernel.RMSNorm(shape, eps=1e-5, dtype=w_dtype, **options)
        with torch.no_grad():
            norm.weight.copy_(randn(*shape))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(torch.nn.Sequential(norm))
        x = (randn(3, *shape) * 3).to(x_dtype)
        expected = norm(x)
        got = scripted(x)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (options, x_dtype, w_dtype)
        with pytest.raises((RuntimeError, torch.jit.Error), match="normalized_shape"):
            scripted(randn(3, 5).to(x_dtype))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_script_of_options_against_the_kernels(device):
    """Where the kernels run, the eager module launches them: the scripted one agrees within the
    suite's fp32 tolerance, weightless too."""
    torch.manual_seed(0)
    x = randn(5, 16, device=device)
    for norm in (
        rmsnorm_kernel.RMSNorm(16, offset=1.0, casting="gemma", device=device),
        rmsnorm_kernel.RMSNorm(16, casting="llama", elementwise_affine=False, device=device),
    ):
        if norm.weight is not None:
            with torch.no_grad():
                norm.weight.copy_(randn(16, device=device))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(norm)
        assert_close(scripted(x), norm(x), F32, what=str(norm))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_torch_keyword_input(device):
    torch.manual_seed(0)
    x, w = randn(3, 16, device=device), randn(16, device=device)
    got = rmsnorm_kernel.rms_norm(input=x, normalized_shape=(16,), weight=w, eps=1e-6)
    assert_close(got, F.rms_norm(input=x, normalized_shape=(16,), weight=w, eps=1e-6), F32, what="input=")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_torch_function_subclass(device):
    """A __torch_function__ subclass sees the call and gets its type back, as from F.rms_norm."""
    torch.manual_seed(0)
    x, w = randn(3, 16, device=device), randn(16, device=device)
    for a, b in ((x.as_subclass(_Tagged), w), (x, w.as_subclass(_Tagged))):  # x, then the weight
        got, want = rmsnorm_kernel.rms_norm(a, (16,), b, 1e-6), F.rms_norm(a, (16,), b, 1e-6)
        assert type(got) is type(want) is _Tagged
        assert_close(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor), F32, what="subclass y")


@pytest.mark.parametrize("device", [*KERNEL_DEVICES, pytest.param("cpu", id="cpu")])
def test_module_on_float64(device):
    """The module computes what torch.nn.RMSNorm computes on input the kernels do not run
    (float64; CPU without the interpreter): it raised, with no way to reach the fallback."""
    torch.manual_seed(0)
    x = torch.randn(3, 16, dtype=torch.float64, device=device, requires_grad=True)
    ours = rmsnorm_kernel.RMSNorm(16, device=device, dtype=torch.float64)
    theirs = torch.nn.RMSNorm(16, device=device, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fallback's one warning
        got = ours(x)
    want = theirs(x)
    torch.testing.assert_close(got, want)  # float64 torch ops on both sides: torch's default bound
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    strict = rmsnorm_kernel.RMSNorm(16, device=device, dtype=torch.float64, allow_fallback=False)
    assert "allow_fallback=False" in repr(strict) and "allow_fallback" not in repr(ours)
    with pytest.raises(UnsupportedInput):
        strict(x)


@pytest.mark.parametrize("interpret", [False, True])
def test_meta_tensors_give_torchs_meta_result(monkeypatch, interpret):
    """Meta tensors (no memory to launch on) give torch's meta result, shape, dtype and layout,
    with or without allow_fallback, for the function, the module, the residual, qk_norm and a
    backward: under the interpreter they reached the launches ("Cannot copy out of meta
    tensor"), outside it rms_norm refused them (UnsupportedInput)."""
    monkeypatch.setattr(kernels, "INTERPRET", interpret)
    x = torch.empty(2, 3, 16, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(16, device="meta", requires_grad=True)
    r = torch.empty(2, 3, 16, dtype=torch.bfloat16, device="meta")
    want = F.rms_norm(x, (16,), w, 1e-6)
    before = dict(ops.CALLS)
    for kw in ({}, {"allow_fallback": True}, {"casting": "llama"}):
        got = rmsnorm_kernel.rms_norm(x, (16,), w, 1e-6, **kw)
        dtype = torch.float32 if kw.get("casting") == "llama" else want.dtype
        assert (got.device, got.dtype, got.shape, got.stride()) == (
            want.device,
            dtype,
            want.shape,
            want.stride(),
        )
    y, h = rmsnorm_kernel.rms_norm(x, (16,), w, 1e-6, residual=r)
    assert (y.device.type, y.dtype, h.device.type, h.dtype, h.shape) == (
        "meta",
        x.dtype,
        "meta",
        x.dtype,
        x.shape,
    )
    got = rmsnorm_kernel.RMSNorm(16, device="meta")(x)
    assert (got.device, got.dtype, got.shape) == (want.device, want.dtype, want.shape)
    dx, dw = torch.autograd.grad(rmsnorm_kernel.rms_norm(x, (16,), w, 1e-6).sum(), (x, w))
    assert (dx.device.type, dx.dtype, dx.shape, dw.device.type, dw.shape) == (
        "meta",
        x.dtype,
        x.shape,
        "meta",
        w.shape,
    )
    q, k = rmsnorm_kernel.qk_norm(x.view(2, 3, 2, 8), x.view(2, 3, 2, 8)[:, :, :1], None, None, 1e-6)
    assert (q.device.type, q.shape, k.device.type, k.shape) == ("meta", (2, 3, 2, 8), "meta", (2, 3, 1, 8))
    assert ops.CALLS == before  # nothing launched, no fallback counted


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_integer_weight_falls_back_to_torch(device):
    """An integer or bool weight torch promotes: valid input the kernels do not run."""
    x = randn(3, 8, device=device)
    for w in (torch.arange(8, device=device), torch.ones(8, dtype=torch.bool, device=device)):
        with pytest.raises(UnsupportedInput, match="allow_fallback"):
            rmsnorm_kernel.rms_norm(x, (8,), w, 1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = rmsnorm_kernel.rms_norm(x, (8,), w, 1e-6, allow_fallback=True)
            want = F.rms_norm(x, (8,), w, 1e-6)
        assert got.dtype == want.dtype
        assert_close(got, want, F32, what=f"{w.dtype} weight")


_STRIDE_LAYOUTS = {
    "transposed": lambda d: torch.randn(16, 4, device=d).t(),
    "permuted 3-D": lambda d: torch.randn(5, 3, 4, device=d).permute(1, 0, 2),
    "channels_last": lambda d: torch.randn(2, 3, 4, 5, device=d).to(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("path", ["fallback", "forward-mode AD"])
@pytest.mark.parametrize("layout", list(_STRIDE_LAYOUTS))
def test_torch_ops_paths_give_torchs_strides(device, path, layout):
    """The paths that run torch ops (the fallback, forward-mode AD) gave y the input's strides;
    torch's y is contiguous (channels_last kept), as the kernels' is."""
    torch.manual_seed(0)
    x = _STRIDE_LAYOUTS[layout](device)
    n = x.shape[-1]
    w = torch.randn(n, device=device)
    if path == "fallback":
        x, w = x.double(), w.double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = rmsnorm_kernel.rms_norm(x, (n,), w, 1e-6, allow_fallback=True)
        want = F.rms_norm(x, (n,), w, 1e-6)
        assert_same_strides(got, want, "fallback y")
        return
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        got = fwAD.unpack_dual(rmsnorm_kernel.rms_norm(dual, (n,), w, 1e-6))
        want = fwAD.unpack_dual(F.rms_norm(dual, (n,), w, 1e-6))
    assert_same_strides(got.primal, want.primal, "y under forward-mode AD")
    assert_same_strides(got.tangent, want.tangent, "y's tangent")


def test_compile_fullgraph_when_the_first_call_falls_back(monkeypatch):
    """torch.compile(fullgraph=True) of a call that takes the fallback, the process's first: its
    one-time warning broke the graph. (CPU float64; the eager backend: dynamo's trace is the test.)"""
    monkeypatch.setattr(ops, "_warned_fallback", False)
    torch._dynamo.reset()
    x = torch.randn(3, 8, dtype=torch.float64)
    fn = torch.compile(
        lambda a: rmsnorm_kernel.rms_norm(a, (8,), None, 1e-6, allow_fallback=True),
        fullgraph=True,
        backend="eager",
    )
    torch.testing.assert_close(fn(x), F.rms_norm(x, (8,), None, 1e-6))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------

# Failures hypothesis found and shrank against the op before the torch-semantics fixes (commit 7b0c08e),
# kept as explicit examples: a weight stored with an offset in a 3-D normalized_shape (an unclear
# RuntimeError from a .view), a stride-0 weight (wrong y), a numpy float32 eps and eps = 0
# (rejected where torch takes them), and the eps=None reproducer (bf16, small x).
_DENSE = {dims: Layout.dense(dims) for dims in (1, 2, 3, 4)}
_X1 = TensorSpec(F32, _DENSE[1], 0)
_SHRUNK = [
    Case(
        (1, 2, 2),
        (1, 2, 2),
        TensorSpec(F32, _DENSE[3], 0),
        TensorSpec(F32, Layout((0, 1, 2), (1, 1, 1), (0, 0, 1), (False,) * 3), 0),
    ),
    Case((2,), (2,), _X1, TensorSpec(F32, Layout((0,), (1,), (0,), (True,)), 0)),
    Case((1,), (1,), _X1, eps=np.float32(1e-5)),
    Case((1,), (1,), _X1, eps=0),
    Case((8, 64), (64,), TensorSpec(BF16, _DENSE[2], 0), eps=None, scale=0.01),
    # an empty 4-D x whose rows no single stride reaches took the per-head path, and its backward
    # a head view of a grad_y that copying cannot make (empty tensors are already "contiguous")
    Case(
        (1, 2, 0, 2),
        (2,),
        TensorSpec(F32, Layout((0, 1, 2, 3), (1, 1, 1, 2), (0,) * 4, (False,) * 4), 0, True),
        grad_y=TensorSpec(F32, _DENSE[4], 0),
    ),
]
# create_graph=True gave a dx without a grad_fn.
_SHRUNK_SECOND = [Case((1,), (1,), TensorSpec(F32, _DENSE[1], 0, True), grad_y=TensorSpec(F32, _DENSE[1], 0))]


def _examples(cases_):
    def decorate(test):
        for case in reversed(cases_):
            test = example(case=case)(test)
        return test

    return decorate


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(PROFILE)
@given(case=cases(wide=HAS_CUDA))  # wide rows where the kernels are compiled, not interpreted
@_examples(_SHRUNK)
def test_matches_torch(device, case):
    check_case(case, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(PROFILE, max_examples=max(PROFILE.max_examples // 2, 1))
@given(case=cases(second_order=True, wide=HAS_CUDA))
@_examples(_SHRUNK_SECOND)
def test_second_derivatives_match_torch(device, case):
    check_case(case, device, second_order=True)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(PROFILE, max_examples=max(PROFILE.max_examples // 2, 1))
@given(case=cases(plain=True, wide=HAS_CUDA))
def test_module_matches_torch(device, case):
    """RMSNorm (its weight any layout, through functional_call) as F.rms_norm, as nn.RMSNorm is."""
    check_case(case, device, run=run_module)


# The classes above as properties over the same cases: torch's keyword, a __torch_function__
# subclass, the TorchScript tracer (each through check_case's comparison), and batched gradients
# (against the float64 oracle's batched gradients, by the same rule).


def run_input_keyword(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    kwargs = {"residual": residual, "residual_dtype": residual_dtype} if residual is not None else {}
    out = rmsnorm_kernel.rms_norm(
        input=x, normalized_shape=normalized_shape, weight=weight, eps=eps, offset=offset, **kwargs
    )
    return out if residual is not None else (out, None)


def run_subclass(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    """x as a __torch_function__ subclass: y comes back tagged, then compared as a Tensor."""
    y, h = run_input_keyword(
        x.as_subclass(_Tagged), normalized_shape, weight, eps, residual, residual_dtype, offset
    )
    assert type(y) is _Tagged, f"y is {type(y).__name__}"
    return y.as_subclass(torch.Tensor), h.as_subclass(torch.Tensor) if h is not None else None


def run_traced(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    """The call recorded by torch.jit.trace, then the recording run (on the same inputs)."""
    args = [t for t in (x, weight, residual) if t is not None]

    def call(*tensors):
        it = iter(tensors)
        a, b = next(it), next(it) if weight is not None else None
        c = next(it) if residual is not None else None
        return run_input_keyword(a, normalized_shape, b, eps, c, residual_dtype, offset)[
            : 2 if c is not None else 1
        ]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(call, tuple(args), check_trace=False)
        out = traced(*args)
    return (out[0], out[1]) if residual is not None else (out[0], None)


class _Calls(torch.nn.Module):
    """A model whose forward calls rms_norm, for torch.fx.symbolic_trace."""

    def __init__(self, normalized_shape, eps, residual_dtype, offset):
        super().__init__()
        self.options = (normalized_shape, eps, residual_dtype, offset)

    def forward(self, x, weight, residual):
        ns, eps, residual_dtype, offset = self.options
        return run_input_keyword(x, ns, weight, eps, residual, residual_dtype, offset)


def run_fx(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    """The call recorded by torch.fx.symbolic_trace as one node, then the graph run."""
    absent = {name: None for name, t in (("weight", weight), ("residual", residual)) if t is None}
    traced = torch.fx.symbolic_trace(
        _Calls(normalized_shape, eps, residual_dtype, offset), concrete_args=absent
    )
    assert any(n.target is rmsnorm_kernel.rms_norm for n in traced.graph.nodes), traced.graph
    return traced(x, weight, residual)


_RUNS = {
    "input=": run_input_keyword,
    "__torch_function__ subclass": run_subclass,
    "jit.trace": run_traced,
    "fx.symbolic_trace": run_fx,
}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("how", list(_RUNS))
@settings(PROFILE, max_examples=max(PROFILE.max_examples // 8, 1))
@given(case=cases())
def test_torch_call_forms_match_torch(device, how, case):
    if how == "jit.trace":  # a trace records no autograd graph to compare gradients through
        case = dataclasses.replace(case, grad_y=None, grad_h=None)
    if how == "fx.symbolic_trace":  # fx cannot hold a NumPy scalar in a graph (F.rms_norm's neither)
        assume(not isinstance(case.eps, np.generic))
    check_case(case, device, run=_RUNS[how])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(PROFILE, max_examples=max(PROFILE.max_examples // 4, 1))
@given(case=cases())
def test_batched_gradients_match_torch(device, case):
    """autograd.grad(is_grads_batched=True) over two grad_outputs (v and -2v) for y (and h), as
    the float64 oracle's batched gradients, by the rule at the top of differential_strategies."""
    t = case.build(device)
    names, leaves = ds._leaves({"x": t.x, "weight": t.weight, "residual": t.residual})
    assume(t.grad_y is not None and leaves)
    ns, eps = case.normalized_shape, case.eps
    y, h = ds.run_ours(t.x, ns, t.weight, eps, t.residual, case.residual_dtype, case.offset)
    h_dtype = h.dtype if h is not None else t.x.dtype
    x64, w64, r64 = (ds._as_float64(v) for v in (t.x, t.weight, t.residual))
    leaves64 = [{"x": x64, "weight": w64, "residual": r64}[n] for n in names]
    y64, h64 = ds.run_oracle(x64, ns, w64, eps, r64, case.residual_dtype, case.offset, x_dtype=t.x.dtype)
    assume(ds.unit_scale_rows(h64 if h64 is not None else x64, ns, eps))

    def batched(outs, v):
        stack = torch.stack([v, -2 * v])
        return [stack.to(o.dtype) for o in outs]

    outs, outs64 = [y], [y64]
    if t.grad_h is not None and h64 is not None and h64.requires_grad:  # h depends on a leaf
        outs, outs64 = [y, h], [y64, h64]
    vs = [t.grad_y, t.grad_h][: len(outs)]
    got = torch.autograd.grad(
        outs, leaves, [batched([o], v)[0] for o, v in zip(outs, vs)], is_grads_batched=True
    )
    want = torch.autograd.grad(
        outs64, leaves64, [batched([o], v.double())[0] for o, v in zip(outs64, vs)], is_grads_batched=True
    )
    for name, leaf, g, g64 in zip(names, leaves, got, want):
        assert_close(g, g64, h_dtype, leaf.dtype, what=f"batched d{name}")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("residual", [False, True])
def test_rows_of_no_elements_match_torch(device, residual):
    """A normalized shape of no elements (N = 0), which F.rms_norm takes: torch's empty y (its
    shape and dtype) and empty gradients, with no launch; trailing dims (3, 0) too."""
    torch.manual_seed(0)
    for lead, shape in (((4,), (0,)), ((2,), (3, 0))):
        x = randn(*lead, *shape, dtype=BF16, device=device, requires_grad=True)
        w = randn(*shape, dtype=BF16, device=device, requires_grad=True)
        r = randn(*lead, *shape, dtype=BF16, device=device, requires_grad=True) if residual else None
        check_against_torch(x, shape, w, 1e-6, residual=r, grad_y=randn(*lead, *shape, device=device))
        check_against_torch(x, shape, None, None, residual=r, grad_y=randn(*lead, *shape, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_tensor_eps_as_torch_reads_it(device):
    """F.rms_norm takes a 0-dim tensor without grad for eps (float, integer or bool): the same
    numbers here. A 1-dim one or one that requires grad, which torch refuses, is refused by name."""
    torch.manual_seed(0)
    x = randn(4, 64, device=device, requires_grad=True)
    w = randn(64, device=device, requires_grad=True)
    for eps in (
        torch.tensor(0.5),
        torch.tensor(2),
        torch.tensor(0.25, dtype=torch.float64),
        torch.tensor(True),
    ):
        check_against_torch(x, (64,), w, eps, grad_y=randn(4, 64, device=device))
    for eps in (torch.tensor([0.5]), torch.tensor(0.5, requires_grad=True)):
        with pytest.raises(TypeError, match="eps"):
            F.rms_norm(x, (64,), w, eps)
        with pytest.raises(TypeError, match="eps"):
            rmsnorm_kernel.rms_norm(x, (64,), w, eps)


class _Seen(TorchDispatchMode):
    """A Python dispatch mode that lists the ops it sees and runs them."""

    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_dispatch_modes_and_fake_tensors_see_the_op(device):
    """F.rms_norm runs under FakeTensorMode and shows its ops to a dispatch mode. Here: fake
    inputs give fake outputs of torch's shapes and dtypes (the custom op's fake kernel, no
    launch), with gradients; a mode sees the custom op's forward and backward, and the numbers
    and gradients are those of the same call without it."""
    with FakeTensorMode():
        x = torch.randn(3, 4, 64, dtype=BF16, device=device, requires_grad=True)
        w = torch.randn(64, device=device, requires_grad=True)
        r = torch.randn(3, 4, 64, dtype=BF16, device=device)
        y, y_t = rmsnorm_kernel.rms_norm(x, (64,), w, 1e-6), F.rms_norm(x, (64,), w, 1e-6)
        assert isinstance(y, FakeTensor) and (y.shape, y.dtype) == (y_t.shape, y_t.dtype)
        y.sum().backward()
        assert isinstance(w.grad, FakeTensor) and w.grad.shape == w.shape
        y, h = rmsnorm_kernel.rms_norm(x, (64,), w, 1e-6, residual=r)
        assert (y.shape, y.dtype, h.shape, h.dtype) == (x.shape, BF16, x.shape, BF16)
    torch.manual_seed(0)
    x = randn(4, 64, device=device, requires_grad=True)
    w = randn(64, device=device, requires_grad=True)
    dy = randn(4, 64, device=device)
    y = rmsnorm_kernel.rms_norm(x, (64,), w, 1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    with _Seen() as mode:
        y_m = rmsnorm_kernel.rms_norm(x, (64,), w, 1e-6)
        dx_m, dw_m = torch.autograd.grad(y_m, (x, w), dy)
    assert {"rmsnorm_kernel.forward.default", "rmsnorm_kernel.backward.default"} <= set(mode.funcs)
    assert torch.equal(y_m, y) and torch.equal(dx_m, dx) and torch.equal(dw_m, dw)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_argument_forms_as_torch_parses_them(device):
    """What torch's argument parser reads as ints in normalized_shape (NumPy integers, a 0-dim
    NumPy integer array, an integer tensor of one element) and as a float for eps (a bool, a
    NumPy bool or integer): the same numbers here. The elements it refuses (a bool, a float, a
    float or bool tensor, a tensor or array of two elements) are refused by name."""
    torch.manual_seed(0)
    x = randn(4, 64, device=device, requires_grad=True)
    w = randn(64, device=device, requires_grad=True)
    for ns in ([np.int64(64)], (np.int32(64),), [np.uint8(64)], [np.array(64)], [torch.tensor(64)],
               [torch.tensor([[64]], dtype=torch.int32)]):  # fmt: skip
        check_against_torch(x, ns, w, 1e-6, grad_y=randn(4, 64, device=device))
    for eps in (True, False, np.True_, np.int64(0)):
        check_against_torch(x, (64,), w, eps, grad_y=randn(4, 64, device=device))
    for ns in ([True], [64.0], [torch.tensor(64.0)], [np.True_], [torch.tensor(True)], [torch.tensor([64, 64])],
               [np.array([64])]):  # fmt: skip
        with pytest.raises((TypeError, RuntimeError)):
            F.rms_norm(x, ns, w)
        with pytest.raises(TypeError, match="normalized_shape"):
            rmsnorm_kernel.rms_norm(x, ns, w)
