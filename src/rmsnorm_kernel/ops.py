"""The op as PyTorch sees it: ``torch.library`` custom ops, their fake (meta) kernels, autograd,
and the public ``rms_norm`` function.

Two custom ops, ``rmsnorm_kernel::forward`` and ``rmsnorm_kernel::backward``, each opaque to
``torch.compile`` (no graph break, no recompilation per batch size: the fake kernels only read
shapes) and each callable inside a CUDA graph (no host synchronisation, no allocation that
depends on values). Autograd is registered on the forward op, so the op composes with
``torch.compile``'s AOT autograd and passes ``torch.library.opcheck``.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch.autograd import forward_ad
from torch.overrides import handle_torch_function, has_torch_function

from rmsnorm_kernel import contract, host, kernels, launch
from rmsnorm_kernel.contract import InvalidArgument, InvalidDtype, Refused, default_eps, default_out_dtype
from rmsnorm_kernel.reference import rms_norm_reference

Tensor = torch.Tensor

# Calls that went through the kernels (counted by the op implementations themselves, so a run
# that silently stayed on another path shows zero) and fallbacks to the reference: those of the
# Python host path here, those of the compiled one (host.py) in its extension. CALLS shows both.
_COUNTS: dict[str, int] = {"forward": 0, "backward": 0, "fallback": 0}
_warned_fallback = False


class _Calls(Mapping):
    """Read-only counts of kernel calls by direction, and of fallbacks: both host paths'."""

    def __getitem__(self, key: str) -> int:
        compiled = host.counts()
        return _COUNTS[key] + {"forward": compiled[0], "backward": compiled[1]}.get(key, 0)

    def __iter__(self):
        return iter(_COUNTS)

    def __len__(self) -> int:
        return len(_COUNTS)

    def __repr__(self) -> str:
        return repr(dict(self))


CALLS = _Calls()


def reset_counters() -> None:
    for key in _COUNTS:
        _COUNTS[key] = 0
    host.reset_counts()


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


def _weight_row(weight: Tensor | None, n: int) -> Tensor | None:
    """The weight as the kernels read it: n contiguous elements. Any other layout torch accepts
    (strided, expanded, a transposed 2-D weight) is copied: it is only n elements."""
    if weight is None or (weight.dim() == 1 and weight.is_contiguous()):
        return weight
    return weight.contiguous().view(n)


def _run_forward(
    x: Tensor,
    weight: Tensor | None,
    residual: Tensor | None,
    eps: float,
    offset: float,
    casting: int,
    out_dtype: torch.dtype,
    residual_dtype: torch.dtype,
    want_rstd: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Normalise over the last dim. Returns (y, rstd, h) with x's shape (rstd without the last
    dim; None without ``want_rstd``, where no backward will follow); h = x + residual, None
    without one."""
    n = x.shape[-1]
    dim = x.dim()
    x2 = launch.as_rows(x, n)
    r2 = launch.as_rows(residual, n) if residual is not None else None
    w = _weight_row(weight, n)
    # Outputs of more than two dims are allocated in x's shape rather than viewed into it.
    shape = x.shape if dim > 2 else None
    y, rstd, h = launch.forward(x2, w, r2, eps, offset, casting, out_dtype, residual_dtype, shape, want_rstd)
    _COUNTS["forward"] += 1
    if dim == 1:
        y = y.view(x.shape)
        rstd = rstd.view(()) if rstd is not None else None
        h = h.view(x.shape) if h is not None else None
    return y, rstd, h


def _forward_impl(
    x: Tensor,
    weight: Tensor | None,
    residual: Tensor | None,
    eps: float,
    offset: float,
    casting: int,
    out_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Normalise over the last dim. Returns (y, rstd, h); h = x + residual, or empty without one."""
    y, rstd, h = _run_forward(x, weight, residual, eps, offset, casting, out_dtype, residual_dtype)
    if h is None:
        h = x.new_empty((0,), dtype=residual_dtype)
    return y, rstd, h


forward_op = torch.library.custom_op("rmsnorm_kernel::forward", _forward_impl, mutates_args=())


@forward_op.register_fake
def _forward_fake(x, weight, residual, eps, offset, casting, out_dtype, residual_dtype):
    y = x.new_empty(x.shape, dtype=out_dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    h = x.new_empty(x.shape if residual is not None else (0,), dtype=residual_dtype)
    return y, rstd, h


def _run_backward(
    dy: Tensor,
    dh: Tensor | None,
    xh: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    offset: float,
    casting: int,
    need_dw: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """Returns (dx, dw): dx in dx_dtype with xh's shape; dw in the weight's shape and dtype, None
    when need_dw is false or there is no weight."""
    n = xh.shape[-1]
    dim = xh.dim()
    w = _weight_row(weight, n)
    if dy.is_neg():  # a negative view's memory holds -dy: the kernels read memory
        dy = dy.resolve_neg()
    if dh is not None and dh.is_neg():
        dh = dh.resolve_neg()
    dx, dw = launch.backward(
        launch.as_rows(dy, n),
        launch.as_rows(dh, n) if dh is not None else None,
        launch.as_rows(xh, n),
        w,
        rstd.view(-1) if rstd.dim() != 1 else rstd,
        offset,
        casting,
        need_dw,
        dx_dtype,
        xh.shape if dim > 2 else None,  # as in _run_forward
    )
    _COUNTS["backward"] += 1
    if dim == 1:
        dx = dx.view(xh.shape)
    if dw is not None and w is not weight:
        dw = dw.view(weight.shape)
    return dx, dw


def _backward_impl(
    dy: Tensor,
    dh: Tensor | None,
    xh: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    offset: float,
    casting: int,
    need_dw: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Returns (dx, dw): dx in dx_dtype with xh's shape; dw in the weight's dtype (empty when
    need_dw is false or there is no weight)."""
    dx, dw = _run_backward(dy, dh, xh, weight, rstd, offset, casting, need_dw, dx_dtype)
    if dw is None:
        dw = xh.new_empty((0,), dtype=torch.float32)
    return dx, dw


backward_op = torch.library.custom_op("rmsnorm_kernel::backward", _backward_impl, mutates_args=())


@backward_op.register_fake
def _backward_fake(dy, dh, xh, weight, rstd, offset, casting, need_dw, dx_dtype):
    dx = xh.new_empty(xh.shape, dtype=dx_dtype)
    if need_dw and weight is not None:
        return dx, weight.new_empty(weight.shape)
    return dx, xh.new_empty((0,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, weight, residual, eps, offset, casting, out_dtype, residual_dtype = inputs
    y, rstd, h = output
    has_residual = residual is not None
    ctx.save_for_backward(h if has_residual else x, weight, rstd)
    ctx.eps, ctx.offset, ctx.casting, ctx.has_residual = eps, offset, casting, has_residual
    ctx.x_dtype = x.dtype
    ctx.residual_in_dtype = residual.dtype if has_residual else None


def _backward_composite(
    dy: Tensor,
    dh: Tensor | None,
    xh: Tensor,
    weight: Tensor | None,
    eps: float,
    offset: float,
    casting: int,
    need_dw: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """The backward of the kernels (reference.py's formula) in differentiable torch ops, for a
    backward that builds a graph (``create_graph=True``: second derivatives). r is recomputed
    from xh, since the kernels' saved r carries no graph. Computes in fp32 (float64 for float64
    input), as the kernels do; Llama's casting rounds x * r before the dw product, as they do.
    reference.rms_norm_backward_reference is the same formula, kept apart because it differs in
    more than options: it groups dx as r * u - x * r^3 * mean(u * x) (other fp32 roundings), and
    has no dh, no Llama rounding, no dx_dtype and no skipping of dw."""
    n = xh.shape[-1]
    cdt = torch.float64 if xh.dtype == torch.float64 else torch.float32
    xf, dyf = xh.to(cdt), dy.to(cdt)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xn = xf * r
    u = dyf * (offset + weight.reshape(n).to(cdt)) if weight is not None else dyf
    dx = (u - xn * (u * xn).mean(-1, keepdim=True)) * r
    if dh is not None:
        dx = dx + dh.to(cdt)
    dw = None
    if need_dw and weight is not None:
        if casting == contract.CAST_LLAMA:
            xn = xn.to(xh.dtype).to(cdt)
        dw = (dyf * xn).reshape(-1, n).sum(0).to(weight.dtype).reshape(weight.shape)
    return dx.to(dx_dtype), dw


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor  # autograd's own vmap's tensors


def _composite_backward_needed(dy: Tensor | None) -> bool:
    """The backward's one decision: torch ops (_backward_composite) where the kernels cannot run
    it, a backward that builds a graph (create_graph=True: second derivatives) or a batched one
    (a functorch transform, or autograd's vmap: is_grads_batched, jacobian(vectorize=True)),
    whose gradient has no memory to point at. host.cpp's composite_backward_needed is the same."""
    return (
        torch.is_grad_enabled()
        or torch._C._are_functorch_transforms_active()
        or (dy is not None and _legacy_batched(dy))
    )


def _grads(ctx, dy, dh, backward) -> tuple:
    """(dx, dw, dresidual) from the state saved by the forward, each None where not needed:
    ``backward`` where the kernels run it, else _backward_composite."""
    xh, weight, rstd = ctx.saved_tensors
    need_x, need_w, need_res = ctx.needs_input_grad[:3]
    need_dw = weight is not None and need_w
    x_dtype = ctx.x_dtype
    if ctx.has_residual:
        res_dtype = ctx.residual_in_dtype
        dx_dtype = torch.promote_types(x_dtype, res_dtype)
        dh = dh if dh is not None and dh.numel() else None
    else:
        dx_dtype, dh = x_dtype, None
    if not (need_x or need_res or need_dw) or (dy is None and dh is None):
        return None, None, None
    if dy is None:  # only h was used downstream: its gradient passes straight to x and residual
        dxh, dw, need_dw = dh.to(dx_dtype), None, False
    elif _composite_backward_needed(dy) or (dh is not None and _composite_backward_needed(dh)):
        dxh, dw = _backward_composite(dy, dh, xh, weight, ctx.eps, ctx.offset, ctx.casting, need_dw, dx_dtype)
    else:
        dxh, dw = backward(dy, dh, xh, weight, rstd, ctx.offset, ctx.casting, need_dw, dx_dtype)
    # dxh has dx_dtype: a cast only where the dtype differs (a same-dtype .to() returns dxh too).
    dx = (dxh if dx_dtype == x_dtype else dxh.to(x_dtype)) if need_x else None
    dres = None
    if ctx.has_residual and need_res:
        dres = dxh if dx_dtype == res_dtype else dxh.to(res_dtype)
    return dx, dw if need_dw else None, dres


def _backward(ctx, dy, _drstd, dh):
    return *_grads(ctx, dy, dh, backward_op), None, None, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFunction(torch.autograd.Function):
    """The same forward, backward and saved state as the custom op's autograd, without the
    dispatcher round trip: eager calls take this path (except the common call, which takes
    ``_PlainFunction``), traced ones (torch.compile) the op.

    Leaner than the op where autograd's per-call cost shows: the arguments other than the
    tensors come as one tuple, ``options = (eps, offset, casting, out_dtype, residual_dtype)``
    (``Function.apply`` walks every argument), and it returns only what ``rms_norm`` returns,
    y or (y, h), keeping rstd as a saved intermediate: no empty h is allocated without a
    residual, and autograd tracks one output fewer."""

    @staticmethod
    def forward(ctx, x, weight, residual, options):
        y, rstd, h = _run_forward(x, weight, residual, *options)
        ctx.eps, ctx.offset, ctx.casting, ctx.x_dtype = options[0], options[1], options[2], x.dtype
        ctx.set_materialize_grads(False)  # no zero-filled gradient for an unused h
        if residual is None:
            ctx.has_residual, ctx.residual_in_dtype = False, None
            ctx.save_for_backward(x, weight, rstd)
            return y
        ctx.has_residual, ctx.residual_in_dtype = True, residual.dtype
        ctx.save_for_backward(h, weight, rstd)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh=None):
        return *_grads(ctx, dy, dh, _run_backward), None


class _PlainFunction(torch.autograd.Function):
    """The eager path of the common call, the one ``rms_norm``'s fast path accepts (no residual,
    a 1-D weight or none): ``_EagerFunction`` less what only a residual needs. One output, so
    its gradient always arrives; the options are one saved attribute."""

    @staticmethod
    def forward(ctx, x, weight, options):
        y, rstd, _ = _run_forward(x, weight, None, *options)
        ctx.save_for_backward(x, weight, rstd)
        ctx.options = options
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        eps, offset, casting = ctx.options[:3]
        need_dw = need_w and weight is not None
        if _composite_backward_needed(dy):
            dx, dw = _backward_composite(dy, None, x, weight, eps, offset, casting, need_dw, x.dtype)
        else:
            dx, dw = _run_backward(dy, None, x, weight, rstd, offset, casting, need_dw, x.dtype)
        return dx if need_x else None, dw, None


# ``_PlainFunction.apply`` is a Python classmethod around the C one (``_FunctionBase.apply``):
# it binds default arguments where a Function defines setup_context (this one does not), routes
# calls under functorch transforms elsewhere, and otherwise unwraps dead functorch wrappers and
# calls the C one. ``_apply_plain`` does the last two itself, in less host time per call
# (measured: docs/performance-notes.md, ops._apply_plain); under functorch transforms it calls
# ``_PlainFunction.apply``.
# A torch without these internals gets ``_PlainFunction.apply`` throughout.
try:
    _c_apply_plain = torch._C._FunctionBase.__dict__["apply"].__get__(None, _PlainFunction)
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
except (AttributeError, KeyError):
    _c_apply_plain = None


def _apply_plain(x: Tensor, weight: Tensor | None, options: tuple) -> Tensor:
    if _c_apply_plain is None or torch._C._are_functorch_transforms_active():
        return _PlainFunction.apply(x, weight, options)
    if weight is not None:
        weight = _unwrap_if_dead(weight)
    return _c_apply_plain(_unwrap_if_dead(x), weight, options)


# ---------------------------------------------------------------------------------------------
# Validation: what rms_norm accepts, and the fast path's share of it
# ---------------------------------------------------------------------------------------------

# The rules, written once: the dtypes and casting modes the kernels run (launch.SUPPORTED_DTYPES,
# launch.CASTING_MODES); CUDA tensors, or any under the Triton interpreter (``x.is_cuda or
# kernels.INTERPRET``); a weight of the normalized shape and a residual of x's shape, both on
# x's device. _normalized_size and validate check every argument against them and raise a
# TypeError/ValueError naming it (launch.UnsupportedInput for valid input the kernels do not
# run); _takes_fast_path, the common call's few cheap tests, accepts a subset of what they accept.
_SUPPORTED = frozenset(launch.SUPPORTED_DTYPES)  # for the fast path's membership tests
_HALF = (torch.float16, torch.bfloat16)
# The dispatch key of Python dispatch modes and __torch_dispatch__ subclasses (_seen_by_python_dispatch),
# and the types that never carry it (a Parameter made from a subclass instance has that type).
_PYTHON_KEY = torch._C.DispatchKey.Python
_PLAIN = (Tensor, torch.nn.Parameter)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dim(d) -> int | None:
    """One normalized_shape element as torch's argument parser reads it: an int or anything with
    __index__ (NumPy integers), or an integer tensor of one element; None for what torch refuses
    (a bool, a float, a float or bool tensor)."""
    if isinstance(d, torch.SymInt):  # a traced size
        return d
    if isinstance(d, bool):
        return None
    if isinstance(d, Tensor):
        integer = not (d.dtype.is_floating_point or d.dtype.is_complex or d.dtype == torch.bool)
        return int(d.item()) if integer and d.numel() == 1 else None
    try:
        return operator.index(d)
    except TypeError:
        return None


def _normalized_size(x: Tensor, normalized_shape, weight: Tensor | None) -> tuple[int, tuple[int, ...]]:
    """(N, the normalized shape as a tuple of ints), N the product of its dims. normalized_shape
    None means the weight's shape, else x's last dim. Raises TypeError/ValueError naming it."""
    if normalized_shape is None:
        if weight is not None:
            normalized_shape = tuple(weight.shape)
        elif isinstance(x, torch.Tensor) and x.dim() >= 1:
            normalized_shape = (x.shape[-1],)
        else:
            normalized_shape = ()
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    dims = [_dim(d) for d in normalized_shape] if isinstance(normalized_shape, Sequence) else [None]
    if any(d is None for d in dims):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    shape = tuple(dims)
    if isinstance(x, torch.Tensor) and tuple(x.shape[x.dim() - len(shape) :]) != shape or len(shape) == 0:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise InvalidArgument(
            f"normalized_shape {shape} must be non-empty and match the trailing dims of x {got}"
        )
    if weight is not None and isinstance(weight, torch.Tensor) and tuple(weight.shape) != shape:
        raise InvalidArgument(f"weight must have shape normalized_shape {shape}, got {tuple(weight.shape)}")
    return math.prod(shape), shape


def _check_dense(t: Tensor, name: str) -> None:
    """The kernels read strided memory and compute real numbers: a nested or sparse tensor, or a
    complex one, is refused by name (docs/features.md: what torch does with them)."""
    if t.is_nested or t.layout != torch.strided:
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise Refused(
            f"{name} must be a dense tensor (layout torch.strided), got {got}: the kernels read strided rows"
        )
    if t.is_complex():
        raise Refused(
            f"{name} is {_dtype_name(t.dtype)}: the kernels compute real numbers (torch returns complex "
            "values for complex x and drops the imaginary part of a complex weight)"
        )


def _real_number(v) -> bool:
    """Whether torch's argument parser reads ``v`` as a float: a real number (bools included) or a
    NumPy scalar (np.bool_ is not a numbers.Real). rms_norm's eps and RMSNorm's share this rule."""
    return isinstance(v, numbers.Real) or (type(v).__module__ == "numpy" and hasattr(v, "__float__"))


def validate(
    x: Tensor,
    weight: Tensor | None,
    residual: Tensor | None,
    eps: float,
    offset: float,
    casting: str,
    out_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
    n: int,
) -> None:
    """Raise TypeError/ValueError for invalid arguments, launch.UnsupportedInput for valid ones the
    kernels do not run. ``n`` is the normalised size (product of normalized_shape)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_dense(x, "x")
    if not x.dtype.is_floating_point:  # torch: NotImplementedError
        raise InvalidDtype(f"x must be float32, float16 or bfloat16, got {_dtype_name(x.dtype)}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
        _check_dense(weight, "weight")  # integer and bool weights: UnsupportedInput below
        if weight.numel() != n:
            raise InvalidArgument(
                f"weight must have {n} elements (the normalized shape), got shape {tuple(weight.shape)}"
            )
        if weight.device != x.device:
            raise InvalidArgument(f"weight must be on x's device {x.device}, got {weight.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        _check_dense(residual, "residual")
        if not residual.dtype.is_floating_point:
            raise TypeError(f"residual must be a float tensor, got {_dtype_name(residual.dtype)}")
        if residual.shape != x.shape:
            raise InvalidArgument(
                f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.device != x.device:
            raise InvalidArgument(f"residual must be on x's device {x.device}, got {residual.device}")
    elif residual_dtype is not None:
        raise ValueError("residual_dtype is only meaningful with a residual")
    for name, value in (("out_dtype", out_dtype), ("residual_dtype", residual_dtype)):
        if value is not None and value not in launch.SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16, bfloat16 or None, got {value}")
    # Any real eps, as torch takes it (0 and negative values, bools and NumPy scalars included).
    if not (_real_number(eps) or isinstance(eps, (torch.SymFloat, torch.SymInt))):
        raise TypeError(f"eps must be a real number or None, got {type(eps).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"offset must be a real number, got {type(offset).__name__}")
    # (A traced offset may be symbolic, which math.isfinite cannot take: eager calls check it.)
    if not torch.compiler.is_compiling() and not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    if offset != 0.0 and weight is None:
        raise ValueError("offset needs a weight: y = x * r * (offset + weight)")
    if not isinstance(casting, str) or casting not in launch.CASTING_MODES:
        raise ValueError(f"casting must be one of {sorted(launch.CASTING_MODES)}, got {casting!r}")
    if x.dim() == 0:
        raise InvalidArgument("x must have at least one dimension")
    # Valid, but possibly not runnable by the kernels.
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.dtype not in launch.SUPPORTED_DTYPES:
            raise launch.UnsupportedInput(
                f"{name} has dtype {_dtype_name(t.dtype)}; the kernels run float32, float16 and bfloat16 "
                "(pass allow_fallback=True to run the reference instead)"
            )
    if not (x.is_cuda or kernels.INTERPRET):
        raise launch.UnsupportedInput(
            f"x is on {x.device}; the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 "
            "(pass allow_fallback=True to run the reference instead)"
        )


def _takes_fast_path(
    x: Tensor,
    normalized_shape,
    weight: Tensor | None,
    eps,
    residual: Tensor | None,
    residual_dtype: torch.dtype | None,
    offset,
    casting,
    out_dtype: torch.dtype | None,
) -> bool:
    """Whether ``rms_norm`` (same arguments) takes its fast path, which skips ``_normalized_size``
    and ``validate``: their rules in the cheapest form, exact types only (no bool, numpy scalar
    or other sequence), so it accepts a subset of what they accept (tests/test_validation.py
    checks this), plus the conditions that only choose the route. Inline tests, no calls but
    torch's: the common call's host time is a few microseconds."""
    # Route: not while tracing (torch.compile sees the general path; tested first, so that
    # tracing reads nothing below), no residual, no out_dtype.
    if (
        torch.compiler.is_compiling()
        or residual is not None
        or residual_dtype is not None
        or out_dtype is not None
        or type(x) is not Tensor
    ):
        return False
    try:  # sizes or strides a tensor lacks (nested, sparse) raise: validate names that tensor
        shape = x.shape
        n = shape[-1] if shape else 0
        ns = normalized_shape
        if ns is not None:  # _normalized_size: an int or a 1-tuple (nn.RMSNorm's form) of the last dim
            if type(ns) is tuple and len(ns) == 1:
                ns = ns[0]
            if type(ns) is not int or ns != n:
                return False
        return (
            n >= 1
            and x.dtype in _SUPPORTED
            and (eps is None or type(eps) is float)
            and type(offset) is float
            and -math.inf < offset < math.inf
            and type(casting) is str
            and casting in launch.CASTING_MODES
            and (x.is_cuda or kernels.INTERPRET)
            and (
                (weight is None and offset == 0.0)
                or (
                    isinstance(weight, Tensor)
                    and weight.shape == (n,)
                    and weight.dtype in _SUPPORTED
                    and weight.device == x.device
                    and weight.is_contiguous()  # route
                    and not weight.is_neg()  # route
                    and (type(weight) in _PLAIN or not torch._C._dispatch_keys(weight).has(_PYTHON_KEY))
                )
            )
            # Route: contiguous x, no negative view (resolved first), no functorch transform, no
            # forward-mode AD level and no TorchScript tracer (those take torch ops), no autocast (which may change the output dtype: _autocast_float32), no
            # Python dispatch mode (the custom op: _seen_by_python_dispatch).
            and x.is_contiguous()
            and not x.is_neg()
            and not torch._C._are_functorch_transforms_active()
            and not torch._C._is_tracing()
            and forward_ad._current_level < 0
            and not torch._C._is_any_autocast_enabled()
            and not torch._C._dispatch_tls_is_dispatch_key_included(_PYTHON_KEY)
        )
    except RuntimeError:
        return False


# Whether this torch's CUDA autocast has a rule for rms_norm: later releases list it among their
# float32 ops (fp16 and bf16 inputs cast to float32, y float32); 2.11 does not (y keeps x's
# dtype). CPU autocast has none. Read from the dispatcher, so the answer is the installed torch's.
_CUDA_AUTOCAST_RMS_NORM = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")


def _autocast_float32(x: Tensor) -> bool:
    """Whether torch's autocast runs ``F.rms_norm`` on x in float32 (_CUDA_AUTOCAST_RMS_NORM)."""
    return _CUDA_AUTOCAST_RMS_NORM and x.is_cuda and torch.is_autocast_enabled("cuda")


def _resolve_neg(t: Tensor | None) -> Tensor | None:
    return t.resolve_neg() if t is not None and t.is_neg() else t


def _composite_needed(*tensors) -> bool:
    """The forward's one decision: calls that cannot take the raw-pointer launches run the
    composite (torch ops, which every transform knows): functorch transforms (vmap, grad, jvp),
    forward-mode AD tangents, and the TorchScript tracer, which records torch ops. (Subclasses
    reach the op by __torch_function__ or the custom op, negative views are resolved.)"""
    return (
        torch._C._are_functorch_transforms_active()
        or _has_tangent(*tensors)
        or (not torch.compiler.is_compiling() and torch._C._is_tracing())
    )


def _has_tangent(*tensors) -> bool:
    """Whether forward-mode AD is on (inside ``forward_ad.dual_level()``) and one of ``tensors``
    carries a tangent there: the kernels compute none, so such calls take torch ops."""
    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _seen_by_python_dispatch(*tensors) -> bool:
    """Whether a Python dispatch mode is active (FakeTensorMode, FlopCounterMode, a logging mode)
    or one of ``tensors`` is a tensor subclass with __torch_dispatch__ (FakeTensor, DTensor):
    such calls go through the custom op, which the mode or subclass sees and handles (a fake
    tensor gets the op's fake kernel), as ``F.rms_norm``'s ops are seen there. The kernels'
    own launches are invisible to them."""
    if torch._C._dispatch_tls_is_dispatch_key_included(_PYTHON_KEY):
        return True
    return any(
        isinstance(t, Tensor) and type(t) not in _PLAIN and torch._C._dispatch_keys(t).has(_PYTHON_KEY)
        for t in tensors
    )


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------


_DEFAULT_EPS = contract.FLOAT32_EPS  # torch's eps=None for every kernel dtype
# Memory formats torch's rms_norm keeps for its output (any other layout gives a contiguous one).
_KEPT_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def _keep_format(out: Tensor, x: Tensor) -> Tensor:
    """``out`` (contiguous) in the memory format torch's rms_norm gives for input ``x``:
    channels_last (channels_last_3d) input keeps its format, anything else is contiguous."""
    fmt = _KEPT_FORMATS.get(x.dim())
    if fmt is None or x.is_contiguous() or not x.is_contiguous(memory_format=fmt):
        return out
    return out.contiguous(memory_format=fmt)


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int] | None = None,
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    residual: Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    offset: float = 0.0,
    casting: str = "default",
    out_dtype: torch.dtype | None = None,
    allow_fallback: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the trailing ``normalized_shape`` dims of ``x``:
    ``y = x * rsqrt(mean(x^2) + eps) * (offset + weight)``, squares and sums in fp32.

    Argument order follows ``torch.nn.functional.rms_norm``; ``normalized_shape`` defaults to the
    weight's shape, else the last dim. ``eps`` is any real number; ``eps=None`` means torch's
    default, the epsilon of the opmath type (``torch.finfo(torch.float32).eps`` for fp32, fp16 and
    bf16 input). Any layout torch accepts gives torch's numbers; channels_last input keeps its
    memory format, as torch's does.

    With ``residual``, computes ``h = x + residual`` (in fp32, stored in ``residual_dtype``,
    default x's dtype), normalises h and returns ``(y, h)``. ``casting`` is "default" (fp32
    throughout, one cast at the end), "gemma" (the same rounding; Gemma modules also use
    offset=1.0) or "llama" (normalised activations cast to the input dtype before the weight
    multiply; the output then takes the promoted dtype of input and weight). ``out_dtype``
    overrides the output dtype.

    Second derivatives (``create_graph=True``), functorch transforms (``torch.func.grad``,
    ``vmap``) and forward-mode AD (dual tensors of ``torch.autograd.forward_ad``) run the same
    formula in differentiable torch ops instead of the kernels. Under CUDA autocast the default
    casting gives y the dtype ``F.rms_norm`` gives there (float32 for fp16 and bf16 input where
    this torch's autocast lists rms_norm among its float32 ops).

    fp64 inputs, integer or bool weights and CPU tensors (without ``TRITON_INTERPRET=1``) raise
    ``UnsupportedInput`` unless ``allow_fallback=True``, which runs torch ops instead, counts it in
    ``CALLS["fallback"]`` and warns once. Errors subclass torch's class for the same input
    (contract.py); docs/features.md lists what torch computes and this op refuses.
    """
    x = input
    # Fast path for the common call: contiguous x, a contiguous 1-D weight or none,
    # normalized_shape unset or the last dim, no residual, no out_dtype. The host cost of a call
    # at small shapes exceeds the kernel's time, so _takes_fast_path makes the checks of
    # _normalized_size and validate in a few cheap tests that accept valid, runnable input only;
    # anything else (every invalid input included) takes the general path below, which raises
    # the errors. Where the compiled host path has loaded (a process's first CUDA call loads it),
    # its common_call makes the same tests in C++ and runs the call (and a call with a contiguous
    # residual of x's shape, which the Python fast path leaves); where it returns None, the call
    # goes on to the general path.
    entry = host.entry
    if (
        entry is None
        and host.unloaded()
        and isinstance(x, Tensor)
        and x.is_cuda
        and not torch.compiler.is_compiling()
    ):
        entry = host.entry_after_load()
    if entry is not None and not torch.compiler.is_compiling():
        y = entry(x, normalized_shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)
        if y is not None:
            return y
    elif _takes_fast_path(
        x, normalized_shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype
    ):
        x_dtype = x.dtype
        e = _DEFAULT_EPS if eps is None else eps
        options = (
            e,
            offset,
            launch.CASTING_MODES[casting],
            default_out_dtype(x_dtype, weight, casting),
            x_dtype,
        )
        if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
            return _apply_plain(x, weight, options)
        return _run_forward(x, weight, None, *options, want_rstd=False)[0]

    if (
        has_torch_function((x, weight, residual))
        and not torch.compiler.is_compiling()
        and not (isinstance(x, Tensor) and x.is_nested)  # refused below, by name
    ):
        # a __torch_function__ subclass or an fx Proxy sees the call, as F.rms_norm's callers do
        return handle_torch_function(
            rms_norm, (x, weight, residual), x, normalized_shape, weight, eps, residual=residual,
            residual_dtype=residual_dtype, offset=offset, casting=casting, out_dtype=out_dtype,
            allow_fallback=allow_fallback,
        )  # fmt: skip
    n, shape = _normalized_size(x, normalized_shape, weight)
    if isinstance(eps, Tensor) and eps.dim() == 0 and not eps.requires_grad and not eps.is_complex():
        eps = float(eps)  # as torch's argument parser reads a 0-dim tensor given for a float
    if eps is None:
        eps = default_eps(x.dtype) if isinstance(x, torch.Tensor) else _DEFAULT_EPS
    transformed = _composite_needed(x, weight, residual)
    try:
        validate(x, weight, residual, eps, offset, casting, out_dtype, residual_dtype, n)
        unsupported = False
    except launch.UnsupportedInput:
        if not (allow_fallback or transformed):
            raise
        unsupported = True
    eps, offset = float(eps), float(offset)
    if residual_dtype is None and residual is not None:
        residual_dtype = x.dtype
    if out_dtype is None:
        if casting == "llama":  # Llama's output: weight x activations of the normalised input's dtype
            out_dtype = default_out_dtype(
                residual_dtype if residual is not None else x.dtype, weight, casting
            )
        elif casting == "default" and x.dtype in _HALF and _autocast_float32(x):
            # torch's semantics under autocast; the kernels compute in fp32 anyway, so the inputs
            # need no cast, and the gradients come back in their dtypes, as through autocast's
            # casts. The other castings follow model modules, whose ops autocast leaves as they are.
            out_dtype = torch.float32
        else:
            out_dtype = x.dtype
    # vmap, grad, jvp, dual tensors: torch ops, which autograd knows how to transform; rows of no
    # elements (N = 0, which torch takes: an empty y) launch nothing either.
    if transformed or (n == 0 and not unsupported):
        return _composite(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)
    if unsupported:
        return _fallback(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)
    k = len(shape)
    if k > 1:  # collapse the normalised dims into one (a view when the layout allows)
        x_in = x.reshape(*x.shape[:-k], n)
        res_in = residual.reshape(*x.shape[:-k], n) if residual is not None else None
    else:
        x_in, res_in = x, residual
    if not torch.compiler.is_compiling():  # (a trace's custom op gets them resolved by torch)
        # A negative view's memory holds -x: resolved (differentiably) before any pointer is read.
        x_in, weight, res_in = _resolve_neg(x_in), _resolve_neg(weight), _resolve_neg(res_in)
    options = (eps, offset, launch.CASTING_MODES[casting], out_dtype, residual_dtype or x.dtype)
    if torch.compiler.is_compiling() or _seen_by_python_dispatch(x, weight, residual):
        y, _rstd, h = forward_op(x_in, weight, res_in, *options)
    elif torch.is_grad_enabled() and (
        x.requires_grad
        or (weight is not None and weight.requires_grad)
        or (residual is not None and residual.requires_grad)
    ):
        out = _EagerFunction.apply(x_in, weight, res_in, options)
        y, h = out if residual is not None else (out, None)
    else:  # nothing to differentiate: skip autograd's bookkeeping, and r
        y, _rstd, h = _run_forward(x_in, weight, res_in, *options, want_rstd=False)
    if k > 1:
        y = y.view(x.shape)
        h = h.view(x.shape) if residual is not None else h
    y = _keep_format(y, x)
    if residual is not None:
        return y, _keep_format(h, x)
    return y


def _composite(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype):
    """The op in plain torch ops (reference.py's formula): the fallback's computation, and the
    path under functorch transforms."""
    k = len(shape)
    h = None
    if residual is not None:
        h = (x.to(torch.float64 if x.dtype == torch.float64 else torch.float32) + residual).to(
            residual_dtype or x.dtype
        )
        inp = h
    else:
        inp = x
    lead = inp.shape[: inp.dim() - k]
    flat = inp.reshape(*lead, math.prod(shape))
    w = weight.reshape(-1) if weight is not None else None
    y = rms_norm_reference(flat, w, eps, offset=offset, casting=casting, out_dtype=out_dtype).view(inp.shape)
    y = _keep_format(y.contiguous(), x)  # torch's layout: contiguous, channels_last kept
    if residual is not None:
        return y, _keep_format(h.contiguous(), x)
    return y


# The C++ side's planners and composite backward: this module's functions, handed downward.
host.install(_run_forward, _run_backward, _backward_composite)


def _fallback(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype):
    global _warned_fallback
    if torch.compiler.is_compiling():  # a trace records torch ops, not a count or a warning
        return _composite(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)
    _COUNTS["fallback"] += 1
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"rmsnorm_kernel: input on {x.device} with dtype {x.dtype} is not run by the kernels; "
            "using the reference implementation (allow_fallback=True). CALLS['fallback'] counts these.",
            RuntimeWarning,
            stacklevel=3,
        )
    return _composite(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)
