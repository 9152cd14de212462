"""What ``rms_norm`` accepts and returns, declared once: the dtypes and casting modes the kernels
run, torch's default eps, the output dtype, and the errors. ops, module, reference, launch and
the compiled host path (handed ``table()`` at load) read it; none of them restates it.
"""

from __future__ import annotations

import torch

# Dtypes the kernels run (x, weight, residual; out_dtype and residual_dtype name one of them).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Casting modes by name: the kernels' code (0 rounds once at the end, 1 rounds x * r to the
# input dtype before the weight product, as Llama does) and whether y takes the promoted dtype
# of the input and the weight (Llama's).
CAST_FP32, CAST_LLAMA = 0, 1
CASTINGS = {"default": (CAST_FP32, False), "gemma": (CAST_FP32, False), "llama": (CAST_LLAMA, True)}
CASTING_CODES = {name: code for name, (code, _) in CASTINGS.items()}
PROMOTING_CASTINGS = tuple(name for name, (_, promotes) in CASTINGS.items() if promotes)

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


# Errors. Each subclasses the class torch raises for the same input, so code written against
# F.rms_norm still catches it, as well as ValueError/TypeError.
class InvalidArgument(ValueError, RuntimeError):
    """A value torch refuses with RuntimeError: a shape, a device, a 0-dim input."""


class InvalidDtype(TypeError, NotImplementedError):
    """An input dtype torch refuses with NotImplementedError (integer x)."""


class UnsupportedInput(ValueError, NotImplementedError):
    """Valid input that the kernels do not run (fp64, CPU tensors without the interpreter, an
    integer or bool weight). ``rms_norm(..., allow_fallback=True)`` runs torch ops instead."""


class Refused(TypeError, NotImplementedError):
    """Input torch computes and this op does not, at all (complex x or weight, nested or sparse
    tensors); the message says why. docs/features.md lists them beside torch's behaviour."""


def table() -> dict:
    """The contract as the compiled host path takes it at load: c10 ScalarType codes of the
    kernel dtypes, and the casting modes as (name, code, promotes)."""
    codes = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}
    return {
        "dtypes": [codes[d] for d in KERNEL_DTYPES],
        "castings": [(name, code, promotes) for name, (code, promotes) in CASTINGS.items()],
        "default_eps": FLOAT32_EPS,
    }
