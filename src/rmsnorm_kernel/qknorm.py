"""QK-norm, one file for the op: ``qk_norm`` (q's and k's heads normalised in one launch, views of
a fused qkv read in place), its ``torch.library`` ops ``rmsnorm_kernel::qk_forward`` and
``::qk_backward`` with their fakes and autograd, and ``QKNorm``, the module holding both weights
whose forward is one ``qk_norm`` call (docs/features.md, QK-norm). What it accepts is
contract.validate_qk's; the launches are launch.py's.
"""

from __future__ import annotations

import numbers

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from rmsnorm_kernel import composite, contract, launch
from rmsnorm_kernel.contract import CASTING_CODES, default_eps
from rmsnorm_kernel.module import _check_eps
from rmsnorm_kernel.ops import (
    _COUNTS,
    _DEFAULT_EPS,
    _autocast_float32,
    _backward_composite,
    _composite_backward_needed,
    _resolve_neg,
    _weight_row,
    rms_norm,
)

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# QK-norm: q's heads and k's heads normalised in one launch, views of a fused qkv read in place
# ---------------------------------------------------------------------------------------------


def qk_norm(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float | None = None,
    *,
    offset: float = 0.0,
    casting: str = "default",
    allow_fallback: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(rms_norm(q, (D,), q_weight, eps), rms_norm(k, (D,), k_weight, eps))`` in one launch:
    the per-head norm of Qwen3-, OLMo2- and Gemma3-style attention (Gemma's ``offset=1.0``), q
    (..., Hq, D) and k (..., Hk, D) any views with unit stride along D whose leading dims flatten
    to one stride (``qkv[:, :q_size].view(T, Hq, D)``), read in place; others are copied first.
    A weight is (D,) or per head, (Hq, D) for q and (Hk, D) for k: row h scales head h. Forward
    and backward (one backward launch for both). contract.validate_qk says what it takes; what
    the launch does not run (rows wider than a tile, transforms, allow_fallback) takes two
    ``rms_norm`` calls (``_qk_apart``), whose results these equal."""
    if not torch.compiler.is_compiling() and has_torch_function((q, k, q_weight, k_weight)):
        return handle_torch_function(
            qk_norm, (q, k, q_weight, k_weight), q, k, q_weight, k_weight, eps, offset=offset, casting=casting,
            allow_fallback=allow_fallback,
        )  # fmt: skip
    if isinstance(eps, Tensor) and eps.dim() == 0 and not eps.requires_grad and not eps.is_complex():
        eps = float(eps)
    if eps is None:
        eps = default_eps(q.dtype) if isinstance(q, Tensor) else _DEFAULT_EPS
    transformed = composite.needed(q, k, q_weight, k_weight)
    try:
        contract.validate_qk(q, k, q_weight, k_weight, eps, offset, casting)
        unsupported = False
    except contract.UnsupportedInput:
        if not (allow_fallback or transformed):
            raise
        unsupported = True
    n = q.shape[-1]
    if transformed or unsupported or not 0 < n <= launch.FORWARD_MAX_TILE:
        kw = {"offset": offset, "casting": casting, "allow_fallback": allow_fallback}
        return _qk_apart(q, q_weight, eps, kw), _qk_apart(k, k_weight, eps, kw)
    eps, offset = float(eps), float(offset)
    if not torch.compiler.is_compiling():
        q, k, q_weight, k_weight = (_resolve_neg(t) for t in (q, k, q_weight, k_weight))
    q_out = contract.output_dtype(q.dtype, q_weight, casting, None, _autocast_float32(q))
    k_out = contract.output_dtype(k.dtype, k_weight, casting, None, _autocast_float32(k))
    options = (eps, offset, launch.CASTING_MODES[casting], q_out, k_out)
    if torch.compiler.is_compiling() or composite.seen_by_python_dispatch(q, k, q_weight, k_weight):
        yq, _rq, yk, _rk = qk_forward_op(q, k, q_weight, k_weight, *options)
    elif torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, q_weight, k_weight)
    ):
        yq, yk = _QKFunction.apply(q, k, q_weight, k_weight, options)
    else:  # nothing to differentiate: the launch alone, as rms_norm's eager path, without r
        yq, _rq, yk, _rk = _qk_launch(q, k, q_weight, k_weight, *options, want_rstd=False)
    return yq, yk


def _qk_apart(x: Tensor, weight: Tensor | None, eps, kw: dict) -> Tensor:
    """One of q and k where the launch does not run: ``rms_norm`` over D. With a per-head weight,
    which ``rms_norm`` does not take, x * r comes from ``rms_norm`` without a weight (fp32; x's
    dtype for float64) and the casting mode's weight product follows in torch ops, as the
    kernels compute it."""
    n = x.shape[-1]
    if weight is None or weight.dim() == 1:
        return rms_norm(x, (n,), weight, eps, **kw)
    offset, casting = kw["offset"], kw["casting"]
    wide = None if x.dtype == torch.float64 else torch.float32
    xn = rms_norm(x, (n,), None, eps, out_dtype=wide, allow_fallback=kw["allow_fallback"])
    if casting in contract.PROMOTING_CASTINGS:  # Llama's: x * r rounded to x's dtype first
        xn = xn.to(x.dtype).to(xn.dtype)
    out_dtype = contract.output_dtype(x.dtype, weight, casting, None, _autocast_float32(x))
    return (xn * (offset + weight.to(xn.dtype))).to(out_dtype)


def _head_weight(weight: Tensor | None, n: int) -> Tensor | None:
    """qk_norm's weight as the kernels read it: _weight_row's (n,), or a per-head (H, n) with
    unit stride along n (copied otherwise)."""
    if weight is None or weight.dim() == 1:
        return _weight_row(weight, n)
    return weight if weight.stride(-1) == 1 or n == 1 else weight.contiguous()


def _qk_forward_impl(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    eps: float,
    offset: float,
    casting: int,
    q_out_dtype: torch.dtype,
    k_out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(yq, rq, yk, rk): y contiguous in the input's shape, r fp32 without the last dim."""
    return _qk_launch(q, k, q_weight, k_weight, eps, offset, casting, q_out_dtype, k_out_dtype)


def _qk_launch(q, k, q_weight, k_weight, eps, offset, casting, q_out_dtype, k_out_dtype, want_rstd=True):
    """_qk_forward_impl's launch; without ``want_rstd`` (no backward follows) rq and rk are None."""
    n = q.shape[-1]
    groups = [
        (launch.head_rows_or_copy(q, n), _head_weight(q_weight, n), q_out_dtype, q.shape),
        (launch.head_rows_or_copy(k, n), _head_weight(k_weight, n), k_out_dtype, k.shape),
    ]
    (yq, rq), (yk, rk) = launch.forward_heads(groups, eps, offset, casting, want_rstd)
    _COUNTS["forward"] += 1
    return yq, rq, yk, rk


qk_forward_op = torch.library.custom_op("rmsnorm_kernel::qk_forward", _qk_forward_impl, mutates_args=())


@qk_forward_op.register_fake
def _qk_forward_fake(q, k, q_weight, k_weight, eps, offset, casting, q_out_dtype, k_out_dtype):
    return (
        q.new_empty(q.shape, dtype=q_out_dtype),
        q.new_empty(q.shape[:-1], dtype=torch.float32),
        k.new_empty(k.shape, dtype=k_out_dtype),
        k.new_empty(k.shape[:-1], dtype=torch.float32),
    )


def _qk_backward_impl(
    dyq: Tensor,
    dyk: Tensor,
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None,
    k_weight: Tensor | None,
    rq: Tensor,
    rk: Tensor,
    offset: float,
    casting: int,
    need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dwq, dk, dwk): dq and dk contiguous in q's and k's dtypes; dw empty without need_dw
    or weights."""
    n = q.shape[-1]
    groups = []
    for x, dy, w, r in ((q, dyq, q_weight, rq), (k, dyk, k_weight, rk)):
        dy = _resolve_neg(dy)
        rows = launch.head_rows_or_copy(x, n)
        groups.append((rows, launch.head_rows_or_copy(dy, n), _head_weight(w, n), r.reshape(-1), x.dtype, need_dw,
                       x.shape))  # fmt: skip
    (dq, dwq), (dk, dwk) = launch.backward_heads(groups, offset, casting)
    _COUNTS["backward"] += 1
    empty = q.new_empty((0,), dtype=torch.float32)
    dwq = dwq.view(q_weight.shape) if dwq is not None else empty
    dwk = dwk.view(k_weight.shape) if dwk is not None else empty.clone()
    return dq, dwq, dk, dwk


qk_backward_op = torch.library.custom_op("rmsnorm_kernel::qk_backward", _qk_backward_impl, mutates_args=())


@qk_backward_op.register_fake
def _qk_backward_fake(dyq, dyk, q, k, q_weight, k_weight, rq, rk, offset, casting, need_dw):
    def dw(w):
        return w.new_empty(w.shape) if need_dw and w is not None else q.new_empty((0,), dtype=torch.float32)

    return q.new_empty(q.shape), dw(q_weight), k.new_empty(k.shape), dw(k_weight)


def _qk_setup_context(ctx, inputs, output):
    q, k, q_weight, k_weight, eps, offset, casting, _q_out, _k_out = inputs
    _yq, rq, _yk, rk = output
    ctx.save_for_backward(q, k, q_weight, k_weight, rq, rk)
    ctx.eps, ctx.offset, ctx.casting = eps, offset, casting


def _qk_backward(ctx, dyq, _drq, dyk, _drk):
    return *_qk_grads(ctx, dyq, dyk, qk_backward_op), None, None, None, None, None


def _qk_grads(ctx, dyq, dyk, backward) -> tuple:
    """(dq, dk, dwq, dwk) of the op's autograd (``backward`` the custom op, which a trace
    records) and of _QKFunction (``_qk_backward_impl``, eager) alike."""
    q, k, q_weight, k_weight, rq, rk = ctx.saved_tensors
    need_q, need_k, need_wq, need_wk = ctx.needs_input_grad[:4]
    need_dw = q_weight is not None and (need_wq or need_wk)
    if _composite_backward_needed(dyq) or _composite_backward_needed(dyk):
        dq, dwq = _backward_composite(
            dyq, None, q, q_weight, ctx.eps, ctx.offset, ctx.casting, need_dw, q.dtype
        )
        dk, dwk = _backward_composite(
            dyk, None, k, k_weight, ctx.eps, ctx.offset, ctx.casting, need_dw, k.dtype
        )
    else:
        dq, dwq, dk, dwk = backward(
            dyq, dyk, q, k, q_weight, k_weight, rq, rk, ctx.offset, ctx.casting, need_dw
        )
    return dq if need_q else None, dk if need_k else None, dwq if need_wq else None, dwk if need_wk else None


qk_forward_op.register_autograd(_qk_backward, setup_context=_qk_setup_context)


class _QKFunction(torch.autograd.Function):
    """qk_norm's eager autograd: the op's forward, saved state and backward without the
    dispatcher round trip, as _EagerFunction is rms_norm's (traced calls take the op). The
    options are one tuple: ``(eps, offset, casting, q_out_dtype, k_out_dtype)``."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, options):
        yq, rq, yk, rk = _qk_forward_impl(q, k, q_weight, k_weight, *options)
        ctx.save_for_backward(q, k, q_weight, k_weight, rq, rk)
        ctx.eps, ctx.offset, ctx.casting = options[0], options[1], options[2]
        return yq, yk

    @staticmethod
    def backward(ctx, dyq, dyk):
        return *_qk_grads(ctx, dyq, dyk, _qk_backward_impl), None


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------


def _heads(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


class QKNorm(nn.Module):
    """RMSNorm over the head dim of q (..., Hq, D) and k (..., Hk, D) in one launch:
    ``forward(q, k) -> (q_out, k_out)``. ``q_weight`` is (D,), shared by q's heads, or (q_heads,
    D) where ``q_heads`` is given (one weight row per head); ``k_weight`` likewise. Both are
    initialised to ones, as torch.nn.RMSNorm's; ``elementwise_affine=False`` keeps neither.
    ``offset``, ``casting`` and ``allow_fallback`` are RMSNorm's.
    """

    def __init__(
        self,
        head_dim: int,
        q_heads: int | None = None,
        k_heads: int | None = None,
        eps: float | None = None,
        *,
        offset: float = 0.0,
        casting: str = "default",
        elementwise_affine: bool = True,
        allow_fallback: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = _heads("head_dim", head_dim)
        if self.head_dim is None:
            raise ValueError("head_dim must be a positive int, got None")
        self.q_heads, self.k_heads = _heads("q_heads", q_heads), _heads("k_heads", k_heads)
        self.eps = _check_eps(eps)
        if casting not in CASTING_CODES:
            raise ValueError(f"casting must be one of {sorted(CASTING_CODES)}, got {casting!r}")
        if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or not abs(offset) < float("inf"):
            raise ValueError(f"offset must be a finite float, got {offset!r}")
        if offset and not elementwise_affine:
            raise ValueError("offset needs a weight: y = x * r * (offset + w); elementwise_affine is False")
        self.offset, self.casting = float(offset), casting
        self.elementwise_affine, self.allow_fallback = bool(elementwise_affine), bool(allow_fallback)
        kw = {"device": device, "dtype": dtype}
        if self.elementwise_affine:
            for name, heads in (("q_weight", self.q_heads), ("k_weight", self.k_heads)):
                shape = (heads, self.head_dim) if heads is not None else (self.head_dim,)
                setattr(self, name, nn.Parameter(torch.empty(shape, **kw)))
        else:
            self.register_parameter("q_weight", None)
            self.register_parameter("k_weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.q_weight)
            nn.init.ones_(self.k_weight)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm(
            q, k, self.q_weight, self.k_weight, self.eps, offset=self.offset, casting=self.casting,
            allow_fallback=self.allow_fallback,
        )  # fmt: skip

    def extra_repr(self) -> str:
        extra = f"{self.head_dim}, q_heads={self.q_heads}, k_heads={self.k_heads}, eps={self.eps}"
        if self.offset:
            extra += f", offset={self.offset}"
        if self.casting != "default":
            extra += f", casting={self.casting!r}"
        if not self.elementwise_affine:
            extra += ", elementwise_affine=False"
        if not self.allow_fallback:
            extra += ", allow_fallback=False"
        return extra
