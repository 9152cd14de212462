"""The readable float oracle the kernels are checked against, and the explicit backward formula.

Forward, per row of N values (the last dimension):

    r = 1 / sqrt(mean(x^2) + eps)          one float per row ("rstd")
    y = x * r * (offset + w)               elementwise; w is shared by every row

Backward, with u = dy * (offset + w):

    dx = r * u - x * r^3 * mean(u * x)     the second term is the effect of x on r
    dw = sum over rows of (dy * x * r)     a sum, never a mean; the offset does not appear

Derivation of the r^3 term: with s = mean(x^2) + eps and r = s^(-1/2), dr/ds = -r^3 / 2 and
ds/dx_i = 2 x_i / N, so dr/dx_i = -x_i r^3 / N. Summing the contributions of every output
y_j = x_j r u_j / dy_j gives -x_i r^3 mean(u * x).

Everything here is plain PyTorch and deliberately unfused: it is the oracle, not the fast path.
Inputs in fp16/bf16/fp32 are computed in fp32; float64 inputs are computed in float64.
"""

from __future__ import annotations

import torch

from rmsnorm_kernel.contract import PROMOTING_CASTINGS, default_out_dtype  # noqa: F401 - read here too

Tensor = torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(
    x: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "default",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """RMSNorm over the last dimension, written to be read.

    ``casting`` follows the module's modes: "default" and "gemma" compute everything in fp32
    and cast once at the end; "llama" casts the normalised activations to the input dtype
    before the weight multiply, as Hugging Face's LlamaRMSNorm does.
    """
    dtype = compute_dtype(x.dtype)
    xf = x.to(dtype)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    normalized = xf * r
    if casting == "llama":
        normalized = normalized.to(x.dtype).to(dtype)
    if weight is not None:
        normalized = normalized * (offset + weight.to(dtype))
    if out_dtype is None:
        out_dtype = default_out_dtype(x.dtype, weight, casting)
    return normalized.to(out_dtype)


def rms_norm_backward_reference(
    x: Tensor, weight: Tensor | None, dy: Tensor, eps: float = 1e-6, *, offset: float = 0.0
) -> tuple[Tensor, Tensor | None]:
    """The backward formula of the module docstring over the last dimension, in fp32 (float64 for
    float64 input): dx in x's dtype, dw summed over the leading dims in the weight's dtype (None
    without a weight). ops._backward_composite is the op's differentiable form of it.
    """
    dtype = compute_dtype(x.dtype)
    xf, dyf = x.to(dtype), dy.to(dtype)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    scale = offset + weight.to(dtype) if weight is not None else torch.ones((), dtype=dtype, device=x.device)
    u = dyf * scale
    dx = r * u - xf * r.pow(3) * (u * xf).mean(-1, keepdim=True)
    dw = None
    if weight is not None:
        dw = (dyf * xf * r).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx.to(x.dtype), dw
