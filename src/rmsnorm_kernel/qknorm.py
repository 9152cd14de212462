"""``QKNorm``: the per-head norms of q and k (Qwen3-, OLMo2- and Gemma3-style attention) as one
module holding both weights, whose forward is one ``qk_norm`` call (docs/features.md, QK-norm).
"""

from __future__ import annotations

import numbers

import torch
from torch import nn

from rmsnorm_kernel.contract import CASTING_CODES
from rmsnorm_kernel.module import _check_eps
from rmsnorm_kernel.ops import qk_norm


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
