"""What ``rms_norm`` accepts and returns, declared once: the dtypes and casting modes the kernels
run, torch's default eps, the output dtype, and the errors. ops, module, reference, launch and
the compiled host path (handed ``table()`` at load) read it; none of them restates it.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch

from rmsnorm_kernel import kernels

Tensor = torch.Tensor

# Dtypes the kernels run (x, weight, residual; out_dtype and residual_dtype name one of them).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Casting modes by name: the kernels' code (0 rounds once at the end, 1 rounds x * r to the
# input dtype before the weight product, as Llama does) and whether y takes the promoted dtype
# of the input and the weight (Llama's).
CAST_FP32, CAST_LLAMA = 0, 1
CASTINGS = {"default": (CAST_FP32, False), "gemma": (CAST_FP32, False), "llama": (CAST_LLAMA, True)}
CASTING_CODES = {name: code for name, (code, _) in CASTINGS.items()}
PROMOTING_CASTINGS = tuple(name for name, (_, promotes) in CASTINGS.items() if promotes)

# Quantised output (quant.py; forward only): out_dtype float8_e4m3fn or int8, with a static
# ``scale`` (y_q = saturate(y / scale)) or per row (dynamic, ``scale=None``: scale = amax(|y|) /
# QMAX as torch computes it on the device (on CUDA, amax * float32(1 / QMAX)), at least
# MIN_SCALE, at most ``scale_ub``). Saturating to [-QMAX, QMAX] for fp8 and to
# [-128, 127] for int8, which rounds to nearest even. y is the fp32 y of out_dtype=float32.
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8)
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
QMIN = {torch.float8_e4m3fn: -448.0, torch.int8: -128.0}


def min_scale(dtype: torch.dtype) -> float:
    """The smallest per-row scale (a row of zeros gets it rather than 0): 1 / (QMAX * 512) in
    fp32, as vLLM's per-token kernels bound theirs."""
    return float(torch.tensor(1.0 / (QMAX[dtype] * 512.0), dtype=torch.float32))


# torch's eps for eps=None: the epsilon of the opmath type (float32 for every kernel dtype).
FLOAT32_EPS = torch.finfo(torch.float32).eps


def default_eps(dtype: torch.dtype) -> float:
    return torch.finfo(torch.float64).eps if dtype == torch.float64 else FLOAT32_EPS


def default_out_dtype(x_dtype: torch.dtype, weight, casting: str) -> torch.dtype:
    """y's dtype: x's, except where the casting promotes (Llama multiplies a weight of its own
    dtype by activations of the input dtype: fp32 weight x bf16 activations gives fp32)."""
    if casting in PROMOTING_CASTINGS and weight is not None:
        return torch.promote_types(x_dtype, weight.dtype)
    return x_dtype


# out_dtype rules, resolved at each call (RMSNorm's out_dtype, and rms_norm's, where a trace or a
# subclass records the call before x's dtype is known): "input" is x's dtype, "promoted" the
# promoted dtype of x and the weight (Llama's output).
OUT_DTYPE_RULES = ("input", "promoted")


def rule_dtype(rule: str, x_dtype: torch.dtype, weight) -> torch.dtype:
    """The dtype an OUT_DTYPE_RULES rule names for x's dtype and the weight (x's without one)."""
    if rule == "input" or not isinstance(weight, Tensor):
        return x_dtype
    return torch.promote_types(x_dtype, weight.dtype)


def output_dtype(x_dtype, weight, casting: str, h_dtype=None, autocast_float32: bool = False) -> torch.dtype:
    """y's dtype where out_dtype is None: default_out_dtype of the normalised input (h's dtype
    with a residual, under a promoting casting); under CUDA autocast where torch runs rms_norm in
    float32, float32 for half inputs of the default casting, as F.rms_norm's (the kernels compute
    in fp32 anyway; the other castings follow model modules, which autocast leaves as they are)."""
    if casting in PROMOTING_CASTINGS:
        return default_out_dtype(h_dtype or x_dtype, weight, casting)
    if casting == "default" and autocast_float32 and x_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return x_dtype


# Errors. Each subclasses the class torch raises for the same input, so code written against
# F.rms_norm still catches it, as well as ValueError/TypeError.
class InvalidArgument(ValueError, RuntimeError):
    """A value torch refuses with RuntimeError: a shape, a device, a 0-dim input."""


class InvalidDtype(TypeError, NotImplementedError):
    """An input dtype torch refuses with NotImplementedError (integer x)."""


class UnsupportedInput(ValueError, NotImplementedError):
    """Valid input that the kernels do not run (fp64, CPU tensors without the interpreter, an
    integer or bool weight). ``rms_norm(..., allow_fallback=True)`` runs torch ops instead."""


class TorchOnly(UnsupportedInput):
    """Input torch's own rms_norm computes and the kernels cannot (complex x or weight, a jagged
    nested x): ``allow_fallback=True`` calls ``torch.nn.functional.rms_norm`` itself where the call
    asks for nothing torch lacks; docs/features.md says what torch returns."""


class ForwardOnly(RuntimeError):
    """A quantised output asked for where autograd would record the call (an input that requires
    grad, under grad mode): quantised outputs are forward only. torch raises RuntimeError for a
    graph it cannot differentiate; call under torch.no_grad() or torch.inference_mode()."""


class Refused(TypeError, NotImplementedError):
    """Input this op does not compute at all (sparse tensors, a nested weight or residual; complex
    or nested input with options torch lacks); the message says why. docs/features.md lists them
    beside torch's behaviour."""


# ---------------------------------------------------------------------------------------------
# The validator: every argument checked against the above, before any launch
# ---------------------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
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


def normalized_size(x: Tensor, normalized_shape, weight: Tensor | None) -> tuple[int, tuple[int, ...]]:
    """(N, the normalized shape as a tuple of ints), N the product of its dims. normalized_shape
    None means the weight's shape, else x's last dim. Raises TypeError/ValueError naming it."""
    if normalized_shape is None:
        if weight is not None:
            normalized_shape = tuple(weight.shape)
        elif isinstance(x, Tensor) and x.dim() >= 1:
            normalized_shape = (x.shape[-1],)
        else:
            normalized_shape = ()
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    dims = [_dim(d) for d in normalized_shape] if isinstance(normalized_shape, Sequence) else [None]
    if any(d is None for d in dims):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    shape = tuple(dims)
    if isinstance(x, Tensor) and tuple(x.shape[x.dim() - len(shape) :]) != shape or len(shape) == 0:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise InvalidArgument(
            f"normalized_shape {shape} must be non-empty and match the trailing dims of x {got}"
        )
    if weight is not None and isinstance(weight, Tensor) and tuple(weight.shape) != shape:
        raise InvalidArgument(f"weight must have shape normalized_shape {shape}, got {tuple(weight.shape)}")
    return math.prod(shape), shape


def _check_dense(t: Tensor, name: str) -> None:
    """The kernels read strided memory and compute real numbers: a jagged nested x, or a complex
    tensor, is TorchOnly (torch's rms_norm computes it); any other nested or sparse tensor is
    refused by name (docs/features.md: what torch does with them)."""
    if name == "x" and t.is_nested and t.layout == torch.jagged:
        raise TorchOnly(
            "x is a jagged nested tensor: the kernels read strided rows "
            "(pass allow_fallback=True to run torch's rms_norm on it)"
        )
    if t.is_nested or t.layout != torch.strided:
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise Refused(
            f"{name} must be a dense tensor (layout torch.strided), got {got}: the kernels read strided rows"
        )
    if t.is_complex():
        raise TorchOnly(
            f"{name} is {dtype_name(t.dtype)}: the kernels compute real numbers (pass allow_fallback=True to "
            "run torch's rms_norm: complex values for complex x, a complex weight's imaginary part dropped)"
        )


def real_number(v) -> bool:
    """Whether torch's argument parser reads ``v`` as a float: a real number (bools included) or a
    NumPy scalar (np.bool_ is not a numbers.Real). rms_norm's eps and RMSNorm's share this rule."""
    return isinstance(v, numbers.Real) or (type(v).__module__ == "numpy" and hasattr(v, "__float__"))


def check_options(weight, eps, offset, casting: str) -> None:
    """eps, offset and casting (validate's checks of them, which TorchOnly input gets too)."""
    # Any real eps, as torch takes it (0 and negative values, bools and NumPy scalars included).
    if not (real_number(eps) or isinstance(eps, (torch.SymFloat, torch.SymInt))):
        raise TypeError(f"eps must be a real number or None, got {type(eps).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"offset must be a real number, got {type(offset).__name__}")
    # (A traced offset may be symbolic, which math.isfinite cannot take: eager calls check it.)
    if not torch.compiler.is_compiling() and not math.isfinite(offset):
        raise ValueError(f"offset must be finite, got {offset!r}")
    if offset != 0.0 and weight is None:
        raise ValueError("offset needs a weight: y = x * r * (offset + weight)")
    if not isinstance(casting, str) or casting not in CASTING_CODES:
        raise ValueError(f"casting must be one of {sorted(CASTING_CODES)}, got {casting!r}")


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
    """Raise TypeError/ValueError for invalid arguments, UnsupportedInput for valid ones the
    kernels do not run. ``n`` is the normalised size (product of normalized_shape)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_dense(x, "x")
    if not x.dtype.is_floating_point:  # torch: NotImplementedError
        raise InvalidDtype(f"x must be float32, float16 or bfloat16, got {dtype_name(x.dtype)}")
    if weight is not None:
        if not isinstance(weight, Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
        _check_dense(weight, "weight")  # integer and bool weights: UnsupportedInput below
        if weight.numel() != n:
            raise InvalidArgument(
                f"weight must have {n} elements (the normalized shape), got shape {tuple(weight.shape)}"
            )
        if weight.device != x.device:
            raise InvalidArgument(f"weight must be on x's device {x.device}, got {weight.device}")
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        _check_dense(residual, "residual")
        if not residual.dtype.is_floating_point:
            raise TypeError(f"residual must be a float tensor, got {dtype_name(residual.dtype)}")
        if residual.shape != x.shape:
            raise InvalidArgument(
                f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if residual.device != x.device:
            raise InvalidArgument(f"residual must be on x's device {x.device}, got {residual.device}")
    elif residual_dtype is not None:
        raise ValueError("residual_dtype is only meaningful with a residual")
    for name, value in (("out_dtype", out_dtype), ("residual_dtype", residual_dtype)):
        if value is not None and value not in KERNEL_DTYPES:
            rules = " or the rule 'input' or 'promoted'" if name == "out_dtype" else ""
            raise TypeError(f"{name} must be float32, float16, bfloat16{rules} or None, got {value!r}")
    check_options(weight, eps, offset, casting)
    if x.dim() == 0:
        raise InvalidArgument("x must have at least one dimension")
    # Valid, but possibly not runnable by the kernels.
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise UnsupportedInput(
                f"{name} has dtype {dtype_name(t.dtype)}; the kernels run float32, float16 and bfloat16 "
                "(pass allow_fallback=True to run the reference instead)"
            )
    if not (x.is_cuda or (kernels.INTERPRET and x.device.type == "cpu")):
        raise UnsupportedInput(
            f"x is on {x.device}; the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 "
            "(pass allow_fallback=True to run the reference instead)"
        )


def table() -> dict:
    """The contract as the compiled host path takes it at load: c10 ScalarType codes of the
    kernel dtypes, and the casting modes as (name, code, promotes)."""
    codes = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}
    return {
        "dtypes": [codes[d] for d in KERNEL_DTYPES],
        "castings": [(name, code, promotes) for name, (code, promotes) in CASTINGS.items()],
        "default_eps": FLOAT32_EPS,
    }


def validate_quant(x: Tensor, out_dtype, scale, scale_ub) -> bool:
    """The quantised output's own arguments (the rest are ``validate``'s), before any launch.
    Returns whether the scale is dynamic (per row). TypeError for a wrong type or dtype,
    ValueError for a combination that means nothing, InvalidArgument for a device."""
    if out_dtype not in QUANT_DTYPES:
        if isinstance(out_dtype, torch.dtype) and (out_dtype.is_floating_point and out_dtype.itemsize == 1):
            raise TypeError(
                f"out_dtype {dtype_name(out_dtype)}: the quantised output is float8_e4m3fn or int8"
            )
        raise ValueError(
            f"scale and scale_ub need a quantised out_dtype (float8_e4m3fn or int8), got out_dtype={out_dtype}"
        )
    dynamic = scale is None
    if not dynamic:
        if scale_ub is not None:
            raise ValueError("scale_ub bounds a per-row (dynamic) scale: pass scale=None with it")
        if isinstance(scale, Tensor):
            if scale.numel() != 1 or scale.dtype != torch.float32:
                raise TypeError(
                    f"scale must be a float or a float32 tensor of one element, got "
                    f"{dtype_name(scale.dtype)} of shape {tuple(scale.shape)}"
                )
            if isinstance(x, Tensor) and scale.device != x.device:
                raise InvalidArgument(f"scale must be on x's device {x.device}, got {scale.device}")
        elif not real_number(scale) or isinstance(scale, bool):
            raise TypeError(
                f"scale must be a float, a float32 tensor of one element or None, got {type(scale).__name__}"
            )
        elif not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and positive, got {scale!r}")
    if scale_ub is not None:
        if not real_number(scale_ub) or isinstance(scale_ub, bool):
            raise TypeError(f"scale_ub must be a float or None, got {type(scale_ub).__name__}")
        if not (math.isfinite(scale_ub) and scale_ub > 0):
            raise ValueError(f"scale_ub must be finite and positive, got {scale_ub!r}")
    return dynamic


# ---------------------------------------------------------------------------------------------
# QK-norm: q and k normalised per head in one call (qknorm.qk_norm)
# ---------------------------------------------------------------------------------------------


def validate_qk(q: Tensor, k: Tensor, q_weight, k_weight, eps, offset, casting: str) -> None:
    """``qk_norm(q, k, q_weight, k_weight, eps)``: q (..., Hq, D) and k (..., Hk, D) share the head
    dim D, the device and the dtype; the weights are both given or both None (one launch serves
    both with or without), each (D,), shared by the heads, or per head, (Hq, D) for q and (Hk, D)
    for k (q and k of at least two dims). Each of q and k is then checked as ``rms_norm(t, (D,),
    weight, eps, offset=offset, casting=casting)`` checks it: the same errors, UnsupportedInput
    included. A weight of another shape raises InvalidArgument."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0:
            raise InvalidArgument(f"{name} must have at least one dimension (..., heads, head_dim)")
    if q.shape[-1] != k.shape[-1]:
        raise InvalidArgument(f"q and k must share the head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.device != k.device:
        raise InvalidArgument(f"k must be on q's device {q.device}, got {k.device}")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must share a dtype, got {dtype_name(q.dtype)} and {dtype_name(k.dtype)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight: pass both or neither")
    n = q.shape[-1]
    numels = []  # validate's element count: the weight's (n, or H * n per head)
    for t, name, w in ((q, "q", q_weight), (k, "k", k_weight)):
        numels.append(n)
        if isinstance(w, Tensor) and tuple(w.shape) != (n,):
            heads = tuple(t.shape[-2:-1])  # () for a 1-D t, which has no heads
            if not heads or tuple(w.shape) != (*heads, n):
                per_head = f" or (heads, head_dim) = ({heads[0]}, {n})" if heads else ""
                raise InvalidArgument(
                    f"{name}_weight must have shape (head_dim,) = ({n},){per_head}, got {tuple(w.shape)}"
                )
            numels[-1] = w.numel()
    validate(q, q_weight, None, eps, offset, casting, None, None, numels[0])
    validate(k, k_weight, None, eps, offset, casting, None, None, numels[1])
