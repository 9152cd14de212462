"""The op in torch ops, and the one decision that sends a call there: what ``rms_norm`` (ops.py)
and its quantised output (quant.py) run where the kernels' raw-pointer launches cannot serve the
call, for every transform, tracer, mode and device torch knows. Below both, importing neither.
"""

from __future__ import annotations

import math

import torch
from torch.autograd import forward_ad

from rmsnorm_kernel.reference import rms_norm_reference

Tensor = torch.Tensor

# The dispatch key of Python dispatch modes and __torch_dispatch__ subclasses (seen_by_python_dispatch),
# and the types that never carry it (a Parameter made from a subclass instance has that type).
PYTHON_KEY = torch._C.DispatchKey.Python
PLAIN = (Tensor, torch.nn.Parameter)
# Memory formats torch's rms_norm keeps for its output (any other layout gives a contiguous one).
_KEPT_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------


def needed(x, *tensors) -> bool:
    """The forward's one decision: calls that cannot take the raw-pointer launches run the
    composite (torch ops, which every transform knows): functorch transforms (vmap, grad, jvp),
    forward-mode AD tangents, the TorchScript tracer, which records torch ops, and a meta x
    (the other tensors share its device), which has no memory to launch on: torch ops give
    torch's meta result. (Subclasses reach the op by __torch_function__ or the custom op,
    negative views are resolved.)"""
    return (
        torch._C._are_functorch_transforms_active()
        or has_tangent(x, *tensors)
        or (not torch.compiler.is_compiling() and torch._C._is_tracing())
        or (isinstance(x, Tensor) and x.is_meta)
    )


def has_tangent(*tensors) -> bool:
    """Whether forward-mode AD is on (inside ``forward_ad.dual_level()``) and one of ``tensors``
    carries a tangent there: the kernels compute none, so such calls take torch ops."""
    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def seen_by_python_dispatch(*tensors) -> bool:
    """Whether a Python dispatch mode is active (FakeTensorMode, FlopCounterMode, a logging mode)
    or one of ``tensors`` is a tensor subclass with __torch_dispatch__ (FakeTensor, DTensor):
    such calls go through the custom op (ops.py; the composite where there is none), which the
    mode or subclass sees and handles (a fake tensor gets the op's fake kernel), as
    ``F.rms_norm``'s ops are seen there. The kernels' own launches are invisible to them."""
    if torch._C._dispatch_tls_is_dispatch_key_included(PYTHON_KEY):
        return True
    return any(
        isinstance(t, Tensor) and type(t) not in PLAIN and torch._C._dispatch_keys(t).has(PYTHON_KEY)
        for t in tensors
    )


# ---------------------------------------------------------------------------------------------
# The composite: torch ops (transforms, tracing, meta tensors, the fallback)
# ---------------------------------------------------------------------------------------------


def keep_format(out: Tensor, x: Tensor) -> Tensor:
    """``out`` (contiguous) in the memory format torch's rms_norm gives for input ``x``:
    channels_last (channels_last_3d) input keeps its format, anything else is contiguous."""
    fmt = _KEPT_FORMATS.get(x.dim())
    if fmt is None or x.is_contiguous() or not x.is_contiguous(memory_format=fmt):
        return out
    return out.contiguous(memory_format=fmt)


def rms_norm(x, shape, weight, eps, residual, residual_dtype, offset, casting, out_dtype):
    """The op in plain torch ops (reference.py's formula), in torch's output layout."""
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
    y = keep_format(y.contiguous(), x)  # torch's layout: contiguous, channels_last kept
    if residual is not None:
        return y, keep_format(h.contiguous(), x)
    return y
