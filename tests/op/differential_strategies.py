"""Inputs of the layouts torch accepts, torch's own answers for them, and the one comparison rule:
the helpers of tests/op/test_differential.py and tests/op/test_opinfo.py.

A hypothesis case is drawn as a plain description (``Case``: shapes, dtypes, layouts, seeds, eps,
offset), so that a falsifying example prints as code that rebuilds it and a shrunk failure
becomes an ``@example`` as printed; ``Case.build(device)`` makes the tensors.

The rule (its bound is the table's, never widened to fit an observed error):
- y and h are compared with torch at the working precision: y with ``F.rms_norm`` of h, where
  h = (x.float() + residual.float()).to(residual_dtype or x.dtype) with a residual and x without;
  with an offset, with the fp32 composition ``F.rms_norm(h.float(), ns, offset + w.float(),
  eps).to(h.dtype)`` (torch has no offset). Same dtype: torch's, and x's with a residual (the
  documented fused-residual output, docs/features.md); for a channels_last input also the same
  strides (size-1 dims aside, where a stride means nothing).
- Gradients (dx, dw, dresidual and second derivatives) are compared with torch's autograd of the
  same composition in float64 on the same input values (the oracle). torch's own low-precision
  gradient is held to the same bound: inside hypothesis an example where it misses is discarded
  (``assume``: the bound does not hold for that example's conditioning), elsewhere it fails.
  Inside hypothesis, gradients are compared only where every normalised row has a mean square
  (plus eps) of at least 1/16: the table's atol is sized for unit-scale rows, and dx's terms
  grow as rstd (a row of one element 0.04 gives terms of ~60, whose fp32 rounding alone exceeds
  atol where the exact dx is 0). The forward is compared on every example.
- The bound is element-wise |a - b| <= atol + rtol * |b| (torch.testing.assert_close, NaN equal
  to NaN) with ``TOLERANCES[d]``, d the coarsest dtype the result passes through: the dtype of
  the normalised input (h) and the result's own dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st

import rmsnorm_kernel
from rmsnorm_kernel import launch
from rmsnorm_suite.cases import TOLERANCES

Tensor = torch.Tensor
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Examples per property test (the second-order and module tests take half): "ci" is
# derandomized and bounded for the Triton interpreter on two cores; "gpu" is the GPU session's,
# its count bounded by compilation: each new specialisation (dtypes, block, alignment, ints
# equal to 1 or divisible by 16) compiles kernels there, and 1200 examples of the three tests
# reached 471 of them (counted under the interpreter). RMSNORM_HYPOTHESIS_EXAMPLES overrides
# the gpu count; RMSNORM_HYPOTHESIS_PROFILE picks the profile (default "ci").
settings.register_profile(
    "ci", derandomize=True, max_examples=200, deadline=None, database=None, print_blob=True
)
settings.register_profile(
    "gpu",
    max_examples=int(os.environ.get("RMSNORM_HYPOTHESIS_EXAMPLES", "1000")),
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

# Row widths past the interpreter's reach, for the GPU: each side of the widest one-tile row and
# of the widest two-walk backward, and the wide (segmented) paths beyond.
WIDE_COLS = (
    1000,
    launch.FORWARD_MAX_TILE,
    launch.FORWARD_MAX_TILE + 1,
    launch.TWO_WALK_MAX,
    launch.TWO_WALK_MAX + 1,
    65536,
    65537,
)

# eps as users pass it; None is torch's default, finfo(float32).eps for all three dtypes.
EPS_FORMS = (1e-6, None, 1e-5, 0.1, 1, 0, 0.0, -1e-6, np.float32(1e-5), np.float64(1e-3))


def default_eps(eps) -> float:
    """The eps torch uses for fp32, fp16 and bf16 inputs (the opmath type's for None)."""
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


def tolerance(*dtypes: torch.dtype):
    """The table's entry of the coarsest of ``dtypes``."""
    return max((TOLERANCES[d] for d in dtypes), key=lambda t: (t.rtol, t.atol))


def close(actual: Tensor, expected: Tensor, *dtypes: torch.dtype) -> bool:
    t = tolerance(*dtypes)
    a, b = actual.double(), expected.double()
    if a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    return bool((((a - b).abs() <= t.atol + t.rtol * b.abs()) | a.isnan()).all())


def assert_close(actual: Tensor, expected: Tensor, *dtypes: torch.dtype, what: str) -> None:
    """The bound of the table's coarsest entry among ``dtypes``; ``expected`` may be float64."""
    t = tolerance(*dtypes)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=t.atol,
        rtol=t.rtol,
        equal_nan=True,
        check_device=True,
        msg=lambda m: f"{what}: {m}",
    )


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a tensor sits in its storage. ``order``: its dims from the outermost in storage to the
    innermost (transposes, channels_last); ``steps``: each dim's slicing step (strided views);
    ``pads``: elements skipped before each dim starts (storage offsets); ``expanded``: dims
    stored once and expanded (stride 0); ``negative``: a negative view (``torch._neg_view``:
    the storage holds -t, the negative bit says so), as ``x.neg()`` can give under some transforms."""

    order: tuple[int, ...]
    steps: tuple[int, ...]
    pads: tuple[int, ...]
    expanded: tuple[bool, ...]
    negative: bool = False

    @classmethod
    def dense(cls, dims: int) -> Layout:
        return cls(tuple(range(dims)), (1,) * dims, (0,) * dims, (False,) * dims)


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    layout: Layout
    seed: int
    requires_grad: bool = False


def laid_out(shape, spec: TensorSpec, device, scale: float = 1.0) -> Tensor:
    """A tensor of ``shape`` with ``spec``'s layout, standard normal values times ``scale`` drawn
    from ``spec.seed`` on the CPU (the same values on every device)."""
    layout = spec.layout
    stored = [1 if e else s for s, e in zip(shape, layout.expanded)]
    base_shape = [layout.pads[d] + stored[d] * layout.steps[d] for d in layout.order]
    g = torch.Generator().manual_seed(spec.seed)
    base = (torch.randn(base_shape, generator=g) * scale).to(dtype=spec.dtype, device=device)
    if layout.negative:  # the same values, stored negated behind the negative bit
        base = torch._neg_view(-base)
    view = base[
        tuple(
            slice(layout.pads[d], layout.pads[d] + stored[d] * layout.steps[d], layout.steps[d])
            for d in layout.order
        )
    ]
    t = view.permute(tuple(layout.order.index(d) for d in range(len(shape)))).expand(tuple(shape))
    return t.requires_grad_() if spec.requires_grad else t


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------


class Inputs(NamedTuple):
    x: Tensor
    weight: Tensor | None
    residual: Tensor | None
    grad_y: Tensor | None
    grad_h: Tensor | None


@dataclass(frozen=True)
class Case:
    shape: tuple[int, ...]
    normalized_shape: object  # as passed: an int, a tuple, a list or a torch.Size
    x: TensorSpec
    weight: TensorSpec | None = None
    eps: object = 1e-6
    offset: float = 0.0
    residual: TensorSpec | None = None
    residual_dtype: torch.dtype | None = None
    grad_y: TensorSpec | None = None  # None: no gradient is taken
    grad_h: TensorSpec | None = None  # h used downstream too (with a residual)
    scale: float = 1.0

    @property
    def norm_dims(self) -> int:
        ns = self.normalized_shape
        return 1 if isinstance(ns, int) else len(ns)

    def build(self, device) -> Inputs:
        shape = self.shape
        ns = tuple(shape[len(shape) - self.norm_dims :])
        return Inputs(
            laid_out(shape, self.x, device, self.scale),
            laid_out(ns, self.weight, device) if self.weight else None,
            laid_out(shape, self.residual, device, self.scale) if self.residual else None,
            laid_out(shape, self.grad_y, device) if self.grad_y else None,
            laid_out(shape, self.grad_h, device) if self.grad_h else None,
        )


@st.composite
def layouts(draw, dims: int, channels_last: bool = False) -> Layout:
    if channels_last and dims == 4 and draw(st.booleans()):
        order = (0, 2, 3, 1)
    else:
        order = tuple(draw(st.permutations(range(dims))))
    steps = tuple(draw(st.sampled_from((1, 2, 3))) for _ in range(dims))
    pads = tuple(draw(st.sampled_from((0, 1, 3))) for _ in range(dims))
    expanded = tuple(draw(st.booleans()) for _ in range(dims))
    return Layout(order, steps, pads, expanded, draw(st.booleans()))


@st.composite
def tensor_specs(draw, dims: int, dtypes=DTYPES, requires_grad: bool = False, channels_last=False):
    return TensorSpec(
        draw(st.sampled_from(dtypes)),
        draw(layouts(dims, channels_last)),
        draw(st.integers(0, 2**31 - 1)),
        requires_grad,
    )


@st.composite
def cases(draw, second_order: bool = False, wide: bool = False, plain: bool = False) -> Case:
    """x of 1 to 4 dims normalised over 1 to 3 trailing dims of up to 300 elements in all, a few
    rows; every layout, dtype mix and eps form; weight, residual and the gradients each on or
    off. ``second_order``: fp32 throughout, x requires grad (second derivatives). ``wide``: a
    single normalised dim may also be one of WIDE_COLS (x then of at most 3 dims). ``plain``: no
    residual and no offset (what a module's forward takes)."""
    k = draw(st.integers(1, 3))
    n_wide = draw(st.sampled_from(WIDE_COLS)) if wide and k == 1 and draw(st.booleans()) else None
    lead = draw(st.integers(0, 2 if n_wide else 3 if k == 1 else 4 - k))
    if k == 1:
        norm = (n_wide or draw(st.integers(1, 300)),)
    else:
        norm = tuple(draw(st.integers(1, 17 if k == 2 else 7)) for _ in range(k))
    shape = tuple(draw(st.sampled_from((1, 2, 3, 0))) for _ in range(lead)) + norm
    dims = len(shape)
    forms = ("tuple", "list", "size") + (("int",) if k == 1 else ())
    form = draw(st.sampled_from(forms))
    ns = {"tuple": norm, "list": list(norm), "size": torch.Size(norm), "int": norm[0]}[form]
    dtypes = (torch.float32,) if second_order else DTYPES

    x_grad = second_order or draw(st.booleans())
    x = draw(tensor_specs(dims, dtypes, x_grad, channels_last=True))
    weight = None
    if draw(st.booleans()):
        weight = draw(tensor_specs(k, dtypes, draw(st.booleans())))
    offset = draw(st.sampled_from((0.0, 1.0))) if weight and not plain else 0.0
    eps = draw(st.sampled_from(EPS_FORMS))
    residual = residual_dtype = None
    if not plain and draw(st.booleans()):
        residual = draw(tensor_specs(dims, dtypes, draw(st.booleans()), channels_last=True))
        residual_dtype = draw(st.sampled_from((None, *dtypes)))
    h_dtype = (residual_dtype or x.dtype) if residual else x.dtype
    wants_grad = x.requires_grad or (weight and weight.requires_grad) or (residual and residual.requires_grad)
    grad_y = grad_h = None
    if wants_grad:
        grad_y = draw(tensor_specs(dims, (x.dtype,)))  # y's dtype
        if residual and draw(st.booleans()):
            grad_h = draw(tensor_specs(dims, (h_dtype,)))
    # Small activations make eps matter (torch's default eps among them); gradients are
    # compared at unit scale, where the bound of the table holds for torch's own (see the top).
    scale = 1.0 if wants_grad else draw(st.sampled_from((1.0, 0.01)))
    return Case(shape, ns, x, weight, eps, offset, residual, residual_dtype, grad_y, grad_h, scale)


# ---------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------


def run_ours(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    """(y, h): h is None without a residual. Only the arguments given are passed."""
    kwargs = {}
    if residual is not None:
        kwargs["residual"] = residual
        if residual_dtype is not None:
            kwargs["residual_dtype"] = residual_dtype
    if offset:
        kwargs["offset"] = offset
    out = rmsnorm_kernel.rms_norm(x, normalized_shape, weight, eps, **kwargs)
    return out if residual is not None else (out, None)


def run_module(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    """(y, None) from this project's ``RMSNorm`` built for the call, its weight replaced by
    ``weight`` itself (torch.func.functional_call), so that the weight keeps its layout and its
    gradient; no residual or offset."""
    assert residual is None and not offset
    affine = weight is not None
    module = rmsnorm_kernel.RMSNorm(normalized_shape, eps=eps, elementwise_affine=affine, device=x.device)
    return torch.func.functional_call(module, {"weight": weight} if affine else {}, (x,)), None


def run_torch(x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0):
    """The contract in torch ops at the inputs' precision: (y, h), h None without a residual, y
    in x's dtype with one. An int normalized_shape (ours takes one, as nn.RMSNorm does;
    F.rms_norm does not) as (n,)."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    h = None
    if residual is not None:
        h = (x.float() + residual.float()).to(residual_dtype or x.dtype)
    inp = h if h is not None else x
    if offset:
        y = F.rms_norm(inp.float(), normalized_shape, offset + weight.float(), eps).to(inp.dtype)
    else:
        y = F.rms_norm(inp, normalized_shape, weight, eps)
    # With a residual, y in x's dtype (the contract), unless CUDA autocast made torch's y float32.
    return (y.to(x.dtype) if h is not None and y.dtype == h.dtype else y), h


def run_oracle(
    x, normalized_shape, weight, eps, residual=None, residual_dtype=None, offset=0.0, x_dtype=None
):
    """The contract in float64 (inputs already float64): h rounded to its dtype in value only
    (its gradient passes straight through, as the contract's cast does), eps None made explicit."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    h = None
    if residual is not None:
        s = x + residual
        rounded = s.detach().to(residual_dtype or x_dtype).double()
        h = s + (rounded - s.detach())
    inp = h if h is not None else x
    w = offset + weight if weight is not None else None
    return F.rms_norm(inp, normalized_shape, w, default_eps(eps)), h


def unit_scale_rows(t: Tensor, normalized_shape, eps) -> bool:
    """Every normalised row of ``t`` has mean(t^2) + eps >= 1/16 (rstd <= 4)."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    if t.numel() == 0:
        return True
    ms = t.detach().double().pow(2).mean(dim=tuple(range(-k, 0))) + default_eps(eps)
    return bool((ms >= 1 / 16).all())


def _leaves(tensors: dict[str, Tensor | None]) -> tuple[list[str], list[Tensor]]:
    names = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    return names, [tensors[n] for n in names]


def _grads(y, h, grad_y, grad_h, inputs: list[Tensor], create_graph=False) -> tuple[Tensor, ...]:
    """Gradients of the inputs with grad_y for y and grad_h for h (None: h unused downstream)."""
    outs, gouts = [y], [grad_y]
    if grad_h is not None:
        outs.append(h)
        gouts.append(grad_h)
    return torch.autograd.grad(outs, inputs, gouts, create_graph=create_graph)


def _as_float64(t: Tensor | None) -> Tensor | None:
    """A float64 copy of ``t``'s values, a leaf that requires grad where ``t`` does."""
    if t is None:
        return None
    d = t.detach().double()
    return d.requires_grad_() if t.requires_grad else d


def channels_last_format(t: Tensor) -> torch.memory_format | None:
    """The channels_last format ``t`` is laid out in, where that is not also contiguous."""
    for dims, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if t.dim() == dims and t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
            return fmt
    return None


def assert_same_strides(ours: Tensor, theirs: Tensor, what: str) -> None:
    """Strides equal at every dim of size > 1."""
    keep = [d for d in range(ours.dim()) if ours.shape[d] > 1]
    got, want = [ours.stride(d) for d in keep], [theirs.stride(d) for d in keep]
    assert got == want, f"{what}: strides {ours.stride()} where torch gives {theirs.stride()}"


def check_against_torch(
    x: Tensor,
    normalized_shape,
    weight: Tensor | None = None,
    eps=1e-6,
    *,
    residual: Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    offset: float = 0.0,
    grad_y: Tensor | None = None,
    grad_h: Tensor | None = None,
    second_order: Tensor | None = None,
    discard: bool = False,
    run=run_ours,
) -> None:
    """Run ``rms_norm`` and the contract in torch on the same tensors and compare by the rule at
    the top. Gradients are taken with respect to those of x, weight and residual that require
    grad, with ``grad_y`` (and ``grad_h`` for h) as grad_output. ``second_order``: a tensor of
    x's shape, v; then the first gradients are taken with create_graph=True and the gradients
    of sum(dx * v) + sum(dw) are compared too. ``discard``: inside hypothesis, examples where
    torch's own low-precision gradient misses the oracle are discarded rather than failed.
    ``run``: this project's side, ``run_ours`` (rms_norm) or ``run_module`` (RMSNorm)."""
    args = (normalized_shape, weight, eps)
    opts = {"residual": residual, "residual_dtype": residual_dtype, "offset": offset}
    y, h = run(x, *args, **opts)
    y_t, h_t = run_torch(x, *args, **opts)
    h_dtype = h_t.dtype if h_t is not None else x.dtype

    assert y.dtype == y_t.dtype, f"y dtype {y.dtype}, expected {y_t.dtype}"
    assert_close(y, y_t, h_dtype, y_t.dtype, what="y")
    if residual is not None:
        assert h is not None and h.dtype == h_t.dtype, (
            f"h dtype {getattr(h, 'dtype', None)}, expected {h_t.dtype}"
        )
        assert_close(h, h_t, h_dtype, what="h")
    if channels_last_format(x) is not None and (residual is None or channels_last_format(residual)):
        assert_same_strides(y, y_t, "y")
        if residual is not None:
            assert_same_strides(h, h_t, "h")

    names, leaves = _leaves({"x": x, "weight": weight, "residual": residual})
    if grad_y is None or not leaves:
        return
    if discard:
        assume(unit_scale_rows(h_t if h_t is not None else x, normalized_shape, eps))
    create = second_order is not None
    if h_t is None or not h_t.requires_grad:  # h depends on no input that requires grad
        grad_h = None
    ours = _grads(y, h, grad_y, grad_h, leaves, create_graph=create)
    theirs = _grads(y_t, h_t, grad_y, grad_h, leaves, create_graph=create)

    x64, w64, r64 = (_as_float64(t) for t in (x, weight, residual))
    leaves64 = [{"x": x64, "weight": w64, "residual": r64}[n] for n in names]
    y64, h64 = run_oracle(x64, *(normalized_shape, w64, eps), r64, residual_dtype, offset, x_dtype=x.dtype)
    oracle = _grads(y64, h64, _as_float64(grad_y), _as_float64(grad_h), leaves64, create_graph=create)

    firsts = []
    for name, leaf, g, g_t, g64 in zip(names, leaves, ours, theirs, oracle):
        dtypes = (h_dtype, leaf.dtype)
        if discard:
            assume(close(g_t, g64, *dtypes))
        else:
            assert_close(g_t, g64, *dtypes, what=f"torch's own d{name} (the oracle's sanity check)")
        assert g.dtype == leaf.dtype, f"d{name} dtype {g.dtype}, expected {leaf.dtype}"
        assert_close(g, g64, *dtypes, what=f"d{name}")
        if create:
            assert g.grad_fn is not None, (
                f"d{name} has no grad_fn under create_graph=True: no double backward"
            )
        firsts.append((name, g, g_t, g64))
    if not create:
        return

    def penalty(grads: list[Tensor], v: Tensor) -> Tensor:
        total = 0
        for name, g in grads:
            total = total + ((g * v).sum() if name == "x" else g.sum())
        return total

    v64 = second_order.double()
    p = penalty([(n, g) for n, g, _, _ in firsts], second_order)
    p_t = penalty([(n, g) for n, _, g, _ in firsts], second_order)
    p64 = penalty([(n, g) for n, _, _, g in firsts], v64)
    second = torch.autograd.grad(p, leaves, allow_unused=True)
    second_t = torch.autograd.grad(p_t, leaves, allow_unused=True)
    second64 = torch.autograd.grad(p64, leaves64, allow_unused=True)
    for name, leaf, g, g_t, g64 in zip(names, leaves, second, second_t, second64):
        if g64 is None:
            continue
        # None: the penalty does not reach the leaf (allow_unused), a zero gradient; a missing
        # connection where the oracle's is nonzero fails on the values below.
        g_t = torch.zeros_like(leaf) if g_t is None else g_t
        g = torch.zeros_like(leaf) if g is None else g
        dtypes = (h_dtype, leaf.dtype)
        if discard:
            assume(close(g_t, g64, *dtypes))
        else:
            assert_close(g_t, g64, *dtypes, what=f"torch's own second derivative for {name}")
        assert_close(g, g64, *dtypes, what=f"second derivative for {name}")


def check_case(case: Case, device, second_order: bool = False, discard: bool = True, run=run_ours) -> None:
    """``check_against_torch`` on the case's tensors; ``second_order`` adds a random v."""
    t = case.build(device)
    v = None
    if second_order:
        v = torch.randn(case.shape, generator=torch.Generator().manual_seed(case.x.seed + 1)).to(device)
    check_against_torch(
        t.x,
        case.normalized_shape,
        t.weight,
        case.eps,
        residual=t.residual,
        residual_dtype=case.residual_dtype,
        offset=case.offset,
        grad_y=t.grad_y,
        grad_h=t.grad_h,
        second_order=v,
        discard=discard,
        run=run,
    )
