"""The op as PyTorch sees it, in the order a call meets it: ``rms_norm`` and its one decision
(the kernels, or composite.py's torch ops, which every transform knows), the kernels' runs,
one autograd path, and the ``torch.library`` ops ``rmsnorm_kernel::forward`` and ``::backward``
with their fakes, which ``torch.compile`` traces (no graph break, no recompilation per batch
size) and CUDA graphs capture. What the op accepts and returns is contract.py's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch.autograd import forward_ad
from torch.overrides import handle_torch_function, has_torch_function

from rmsnorm_kernel import composite, contract, host, kernels, launch, quant
from rmsnorm_kernel.composite import keep_format as _keep_format
from rmsnorm_kernel.contract import default_eps, default_out_dtype, validate
from rmsnorm_kernel.contract import normalized_size as _normalized_size

Tensor = torch.Tensor

# Calls that went through the kernels (counted by the op implementations themselves, so a run
# that silently stayed on another path shows zero) and fallbacks to the reference: those of the
# Python host path here, those of the compiled one (host/) in its extension. CALLS shows both.
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
# The public function
# ---------------------------------------------------------------------------------------------

_DEFAULT_EPS = contract.FLOAT32_EPS  # torch's eps=None for every kernel dtype
_QUANT_DTYPES = contract.QUANT_DTYPES  # out_dtypes quant.py serves


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
    out_dtype: torch.dtype | str | None = None,
    allow_fallback: bool = False,
    scale: Tensor | float | None = None,
    scale_ub: float | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """RMSNorm over the trailing ``normalized_shape`` dims of ``input`` (x), torch's arguments first:
    ``y = x * rsqrt(mean(x^2) + eps) * (offset + weight)``, squares and sums in fp32. With
    ``residual``, normalises ``h = x + residual`` (stored in ``residual_dtype``) and returns
    ``(y, h)``. ``casting`` is "default", "gemma" or "llama"; ``out_dtype`` overrides y's dtype
    (a dtype, or the rule "input" or "promoted", contract.rule_dtype).
    Input the kernels do not run raises ``UnsupportedInput`` unless ``allow_fallback=True``.
    ``out_dtype`` torch.float8_e4m3fn or torch.int8 quantises y (forward only): with ``scale``
    static, without it per row, returning ``(y_q, scales)`` (``scale_ub`` bounds the scales);
    quant.py says how. docs/features.md gives torch's semantics on every input, and what is refused.
    """
    x = input
    quantised = (
        (out_dtype is not None and out_dtype in _QUANT_DTYPES) or scale is not None or scale_ub is not None
    )
    # (a quantised call a __torch_function__ subclass or Proxy sees, which no fast path takes, goes below)
    if quantised and (torch.compiler.is_compiling() or not has_torch_function((x, weight, residual))):
        # The common quantised call (no residual; a float scale, or none) skips the validators
        # as the plain one does: _takes_fast_path's tests and quant.takes_fast_scale's.
        if (
            quant.takes_fast_scale(out_dtype, scale, scale_ub)
            and _takes_fast_path(
                x, normalized_shape, weight, eps, residual, residual_dtype, offset, casting, None
            )
            and not (
                torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))
            )
        ):
            e = _DEFAULT_EPS if eps is None else eps
            return quant.forward_rows(x, weight, e, offset, casting, out_dtype, scale, scale_ub)
        return quant.rms_norm_quant(
            x, normalized_shape, weight, eps, residual=residual, residual_dtype=residual_dtype, offset=offset,
            casting=casting, out_dtype=out_dtype, scale=scale, scale_ub=scale_ub, allow_fallback=allow_fallback,
        )  # fmt: skip
    # The common call's fast path: the host cost of a call at small shapes exceeds the kernel's,
    # so a few cheap tests take valid, runnable input only (_takes_fast_path; in C++, the compiled
    # host path's common_call, loaded by a process's first CUDA call, which also takes a plain
    # residual). Anything else goes on to the general path, which raises the errors.
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
        not torch.compiler.is_compiling()
        and has_torch_function((x, weight, residual))
        and not (isinstance(x, Tensor) and x.is_nested)  # refused below, by name
    ):
        # a __torch_function__ subclass or an fx Proxy sees the call, as F.rms_norm's callers do
        return handle_torch_function(
            rms_norm, (x, weight, residual), x, normalized_shape, weight, eps, residual=residual,
            residual_dtype=residual_dtype, offset=offset, casting=casting, out_dtype=out_dtype,
            allow_fallback=allow_fallback, scale=scale, scale_ub=scale_ub,
        )  # fmt: skip
    n, shape = _normalized_size(x, normalized_shape, weight)
    if isinstance(eps, Tensor) and eps.dim() == 0 and not eps.requires_grad and not eps.is_complex():
        eps = float(eps)  # as torch's argument parser reads a 0-dim tensor given for a float
    given_eps = eps  # (torch's own rms_norm takes it as given: _torchs_own)
    if eps is None:
        eps = default_eps(x.dtype) if isinstance(x, torch.Tensor) else _DEFAULT_EPS
    if type(out_dtype) is str and out_dtype in contract.OUT_DTYPE_RULES and isinstance(x, Tensor):
        out_dtype = contract.rule_dtype(out_dtype, x.dtype, weight)  # RMSNorm's rule, as a trace records it
    transformed = composite.needed(x, weight, residual)
    try:
        validate(x, weight, residual, eps, offset, casting, out_dtype, residual_dtype, n)
        unsupported = False
    except contract.UnsupportedInput as exc:
        if not (allow_fallback or transformed):
            raise
        if isinstance(exc, contract.TorchOnly):
            return _torchs_own(
                x, shape, weight, given_eps, residual, residual_dtype, offset, casting, out_dtype, exc
            )
        unsupported = True
    eps, offset = float(eps), float(offset)
    if residual_dtype is None and residual is not None:
        residual_dtype = x.dtype
    if out_dtype is None:
        out_dtype = contract.output_dtype(x.dtype, weight, casting, residual_dtype, _autocast_float32(x))
    # Rows of no elements (N = 0, which torch takes: an empty y) launch nothing either.
    if transformed or (n == 0 and not unsupported):
        return composite.rms_norm(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)
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
    if torch.compiler.is_compiling() or composite.seen_by_python_dispatch(x, weight, residual):
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


# ---------------------------------------------------------------------------------------------
# The decision: kernels or composite
# ---------------------------------------------------------------------------------------------

_SUPPORTED = frozenset(launch.SUPPORTED_DTYPES)  # for the fast path's membership tests
# composite.py's dispatch key of Python modes and subclasses, and the types that never carry it
_PYTHON_KEY, _PLAIN = composite.PYTHON_KEY, composite.PLAIN


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
    """Whether ``rms_norm`` (same arguments) takes its fast path, which skips contract.py's
    validator: its rules in the cheapest form, exact types only (no bool, numpy scalar
    or other sequence), so it accepts a subset of what it accepts (tests/op/test_validation.py
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
        if ns is not None:  # normalized_size: an int or a 1-tuple (nn.RMSNorm's form) of the last dim
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
            and (x.is_cuda or (kernels.INTERPRET and x.is_cpu))
            and (
                (weight is None and offset == 0.0)
                or (
                    type(weight) in _PLAIN  # route: subclasses see the call (__torch_function__, dispatch)
                    and weight.shape == (n,)
                    and weight.dtype in _SUPPORTED
                    and weight.device == x.device
                    and weight.is_contiguous()  # route
                    and not weight.is_neg()  # route
                )
            )
            # Route: contiguous x, no negative view (resolved first), no functorch transform, no
            # forward-mode AD level and no TorchScript tracer (those take torch ops), no autocast (which may change the output dtype: _autocast_float32), no
            # Python dispatch mode (the custom op: composite.seen_by_python_dispatch).
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


# ---------------------------------------------------------------------------------------------
# The fallback: composite.py's torch ops, for input the kernels do not run
# ---------------------------------------------------------------------------------------------


def _note_fallback(x: Tensor) -> None:
    """A call the kernels do not run (allow_fallback=True): counted, and warned about once per
    process, outside a torch.compile trace (which records torch ops only)."""
    global _warned_fallback
    if not torch.compiler.is_compiling():
        _COUNTS["fallback"] += 1
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                f"rmsnorm_kernel: input on {x.device} with dtype {x.dtype} is not run by the kernels; "
                "using the reference implementation (allow_fallback=True). CALLS['fallback'] counts these.",
                RuntimeWarning,
                stacklevel=4,
            )


def _fallback(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype):
    """The composite for input the kernels do not run (allow_fallback=True)."""
    _note_fallback(x)
    return composite.rms_norm(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype)


def _torchs_own(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype, why):
    """Input only torch computes (contract.TorchOnly: complex, jagged nested): torch's own
    F.rms_norm, counted as a fallback, where the call asks for nothing torch lacks; else Refused."""
    contract.check_options(weight, _DEFAULT_EPS if eps is None else eps, offset, casting)
    lacks = [name for name, asked in (
        ("a residual", residual is not None or residual_dtype is not None),
        ("an offset", offset != 0),
        ("Llama's casting", casting in contract.PROMOTING_CASTINGS),
        ("an out_dtype", out_dtype is not None and out_dtype != getattr(x, "dtype", None)),
    ) if asked]  # fmt: skip
    if lacks:
        what = str(why).split(":")[0]  # "x is complex64", "x is a jagged nested tensor"
        raise contract.Refused(
            f"{what}: torch's rms_norm computes it, but the call asks for {' and '.join(lacks)}, which torch's "
            "rms_norm lacks, and the kernels compute real numbers from strided rows"
        )
    _note_fallback(x)
    return torch.nn.functional.rms_norm(x, shape, weight, eps)


# ---------------------------------------------------------------------------------------------
# The kernels' runs
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
    if residual is None and n <= launch.FORWARD_MAX_TILE and x.numel():  # (empty: the row path)
        heads = launch.strided_heads(x, n)  # per-head views of a fused qkv tensor: read in place
        if heads is not None:
            groups = [(heads, _weight_row(weight, n), out_dtype, x.shape)]
            ((y, rstd),) = launch.forward_heads(groups, eps, offset, casting, want_rstd)
            _COUNTS["forward"] += 1
            return y, rstd, None
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
    if dh is None and n <= launch.BACKWARD_MAX_TILE and xh.numel():  # (empty: the row path)
        x_heads, dy_heads = launch.strided_heads(xh, n), launch.strided_heads(dy, n)
        if x_heads is not None or dy_heads is not None:  # per-head views: read in place
            group = (
                x_heads or launch.head_rows_or_copy(xh, n),
                dy_heads or launch.head_rows_or_copy(dy, n),
                w, rstd.reshape(-1), dx_dtype, need_dw, xh.shape,
            )  # fmt: skip
            ((dx, dw),) = launch.backward_heads([group], offset, casting)
            _COUNTS["backward"] += 1
            if dw is not None and w is not weight:
                dw = dw.view(weight.shape)
            return dx, dw
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


# ---------------------------------------------------------------------------------------------
# Autograd: one backward, the kernels' or the composite formula
# ---------------------------------------------------------------------------------------------


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
    """The kernels' backward (reference.py's formula) in differentiable torch ops, for backwards
    the kernels cannot run (_composite_backward_needed). r is recomputed from xh (the saved r has
    no graph); fp32 (float64 for float64 input), with Llama's rounding of x * r before dw, as the
    kernels compute. reference.rms_norm_backward_reference is the oracle's grouping of it."""
    n = xh.shape[-1]
    cdt = torch.float64 if xh.dtype == torch.float64 else torch.float32
    xf, dyf = xh.to(cdt), dy.to(cdt)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xn = xf * r
    # qk_norm's per-head (H, n) weight broadcasts over the heads; any other weight is n elements
    w_shape = (n,) if weight is None or weight.numel() == n else tuple(weight.shape)
    u = dyf * (offset + weight.reshape(w_shape).to(cdt)) if weight is not None else dyf
    dx = (u - xn * (u * xn).mean(-1, keepdim=True)) * r
    if dh is not None:
        dx = dx + dh.to(cdt)
    dw = None
    if need_dw and weight is not None:
        if casting == contract.CAST_LLAMA:
            xn = xn.to(xh.dtype).to(cdt)
        dw = (dyf * xn).reshape(-1, *w_shape).sum(0).to(weight.dtype).reshape(weight.shape)
    dx = dx.to(dx_dtype)
    if hasattr(xh, "device_mesh") and hasattr(dx, "device_mesh"):  # DTensors
        dx, dw = _placed_as_torch(xh, dx, dw)
    return dx, dw


def _placed_as_torch(xh, dx, dw):
    """DTensor gradients placed as torch's F.rms_norm backward places them: dx as x, with the
    normalised dimension whole; dw the sum over the ranks (Partial) where x's rows are sharded,
    else replicated. On mesh dimensions of several ranks the ops above land there already; on one
    of a single rank every placement holds the same data, and DTensor may choose another."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if any(isinstance(p, Partial) for p in xh.placements):
        return dx, dw
    last = xh.ndim - 1
    rows = [isinstance(p, Shard) and p.dim % xh.ndim < last for p in xh.placements]
    want_dx = [p if row or not isinstance(p, Shard) else Replicate() for p, row in zip(xh.placements, rows)]
    want_dw = [Partial("sum") if row else Replicate() for row in rows]
    mesh = xh.device_mesh

    def relabel(t, want):  # only the mesh dimensions of one rank: no data moves
        if t is None or not hasattr(t, "device_mesh") or tuple(t.placements) == tuple(want):
            return t
        placed = [w if mesh.size(i) == 1 else p for i, (p, w) in enumerate(zip(t.placements, want))]
        return DTensor.from_local(
            t.to_local(), mesh, placed, run_check=False, shape=t.shape, stride=t.stride()
        )

    return relabel(dx, want_dx), relabel(dw, want_dw)


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
    ``backward`` where the kernels run it, else _backward_composite. ``ctx.state`` is
    ``(eps, offset, casting, out_dtype, x's dtype)``, then the residual's dtype where there is
    one: without one, the options of the call as they are (their last is x's dtype there), one
    attribute set in the least host time."""
    xh, weight, rstd = ctx.saved_tensors
    need_x, need_w, need_res = ctx.needs_input_grad[:3]
    need_dw = weight is not None and need_w
    state = ctx.state
    eps, offset, casting, x_dtype = state[0], state[1], state[2], state[4]
    res_dtype = state[5] if len(state) > 5 else None
    if res_dtype is not None:
        dx_dtype = torch.promote_types(x_dtype, res_dtype)
        dh = dh if dh is not None and dh.numel() else None
    else:
        dx_dtype, dh = x_dtype, None
    if not (need_x or need_res or need_dw) or (dy is None and dh is None):
        return None, None, None
    if dy is None:  # only h was used downstream: its gradient passes straight to x and residual
        dxh, dw, need_dw = dh.to(dx_dtype), None, False
    elif _composite_backward_needed(dy) or (dh is not None and _composite_backward_needed(dh)):
        dxh, dw = _backward_composite(dy, dh, xh, weight, eps, offset, casting, need_dw, dx_dtype)
    else:
        dxh, dw = backward(dy, dh, xh, weight, rstd, offset, casting, need_dw, dx_dtype)
    # dxh has dx_dtype: a cast only where the dtype differs (a same-dtype .to() returns dxh too).
    dx = (dxh if dx_dtype == x_dtype else dxh.to(x_dtype)) if need_x else None
    dres = None
    if res_dtype is not None and need_res:
        dres = dxh if dx_dtype == res_dtype else dxh.to(res_dtype)
    return dx, dw if need_dw else None, dres


class _EagerFunction(torch.autograd.Function):
    """The same forward, backward and saved state as the custom op's autograd, without the
    dispatcher round trip: eager calls take this path (the common call through ``_apply_plain``),
    traced ones (torch.compile) the op.

    Leaner than the op where autograd's per-call cost shows: the arguments other than the
    tensors come as one tuple, ``options = (eps, offset, casting, out_dtype, residual_dtype)``
    (``Function.apply`` walks every argument), and it returns only what ``rms_norm`` returns,
    y or (y, h), keeping rstd as a saved intermediate: no empty h is allocated without a
    residual, and autograd tracks one output fewer."""

    @staticmethod
    def forward(ctx, x, weight, residual, options):
        y, rstd, h = _run_forward(x, weight, residual, *options)
        if residual is None:
            ctx.state = options
            ctx.save_for_backward(x, weight, rstd)
            return y
        ctx.state = (*options[:4], x.dtype, residual.dtype)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for an unused h
        ctx.save_for_backward(h, weight, rstd)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh=None):
        return *_grads(ctx, dy, dh, _run_backward), None


# ``_EagerFunction.apply`` is a Python classmethod around the C one (``_FunctionBase.apply``):
# it binds default arguments where a Function defines setup_context (this one does not), routes
# calls under functorch transforms elsewhere, and otherwise unwraps dead functorch wrappers and
# calls the C one. ``_apply_plain``, the common call's (no residual), does the last two itself, in
# less host time per call (measured: docs/performance-notes.md, ops._apply_plain); under
# functorch transforms it calls ``_EagerFunction.apply``.
# A torch without these internals gets ``_EagerFunction.apply`` throughout.
try:
    _c_apply_plain = torch._C._FunctionBase.__dict__["apply"].__get__(None, _EagerFunction)
    _unwrap_if_dead = torch._C._functorch.unwrap_if_dead
except (AttributeError, KeyError):
    _c_apply_plain = None


def _apply_plain(x: Tensor, weight: Tensor | None, options: tuple) -> Tensor:
    if _c_apply_plain is None or torch._C._are_functorch_transforms_active():
        return _EagerFunction.apply(x, weight, None, options)
    if weight is not None:
        weight = _unwrap_if_dead(weight)
    return _c_apply_plain(_unwrap_if_dead(x), weight, None, options)


# ---------------------------------------------------------------------------------------------
# torch.library ops and their fakes (torch.compile, dispatch modes)
# ---------------------------------------------------------------------------------------------


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
    ctx.state = (eps, offset, casting, out_dtype, x.dtype) + ((residual.dtype,) if has_residual else ())


def _backward(ctx, dy, _drstd, dh):
    return *_grads(ctx, dy, dh, backward_op), None, None, None, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)

# The C++ side's planners and composite backward: this module's functions, handed downward.
host.install(_run_forward, _run_backward, _backward_composite)
