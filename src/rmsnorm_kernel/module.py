"""``RMSNorm``, a drop-in ``torch.nn.RMSNorm`` backed by the Triton kernels, and
``swap_rms_norm``, which puts it into an existing model."""

from __future__ import annotations

import math

import torch
from torch import nn

from rmsnorm_kernel.launch import CASTING_MODES
from rmsnorm_kernel.ops import rms_norm


class RMSNorm(nn.RMSNorm):
    """Same constructor, parameters and ``state_dict`` as ``torch.nn.RMSNorm``; the forward runs
    the Triton kernels. ``eps=None`` means torch's default (``torch.finfo(x.dtype).eps``).

    Extra keyword-only options: ``offset`` (y = x * r * (offset + weight); Gemma uses 1.0) and
    ``casting`` ("default", "gemma" or "llama", see ``rms_norm``). ``forward(x, residual=None)``
    returns ``y``, or ``(y, h)`` with ``h = x + residual`` when a residual is given.
    """

    def __init__(
        self,
        normalized_shape,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        offset: float = 0.0,
        casting: str = "default",
    ) -> None:
        if casting not in CASTING_MODES:
            raise ValueError(f"casting must be one of {sorted(CASTING_MODES)}, got {casting!r}")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise ValueError(f"offset must be a finite float, got {offset!r}")
        if offset and not elementwise_affine:
            raise ValueError(
                "offset needs a weight: y = x * r * (offset + weight); elementwise_affine is False"
            )
        super().__init__(
            normalized_shape, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype
        )
        self.offset = float(offset)
        self.casting = casting

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(
            x,
            self.normalized_shape,
            self.weight,
            self.eps,
            residual=residual,
            offset=self.offset,
            casting=self.casting,
        )

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.offset:
            extra += f", offset={self.offset}"
        if self.casting != "default":
            extra += f", casting={self.casting!r}"
        return extra


def _hf_style(module: nn.Module) -> tuple[float, str, float] | None:
    """(eps, casting, offset) for a Hugging Face-style RMSNorm module, else None.

    Recognised: a ``weight`` parameter of one dimension and an ``eps`` or ``variance_epsilon``
    attribute, in a class whose name ends in "RMSNorm". Gemma's modules (class name containing
    "Gemma") store ``weight`` as an offset from 1 and compute in fp32; the others follow Llama.
    """
    name = type(module).__name__
    if not name.endswith("RMSNorm") or isinstance(module, nn.RMSNorm):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, (int, float)):
        return None
    if "Gemma" in name:
        return float(eps), "gemma", 1.0
    return float(eps), "llama", 0.0


def swap_rms_norm(model: nn.Module) -> list[str]:
    """Replace, in place, every RMSNorm module of ``model`` (``torch.nn.RMSNorm`` and Hugging
    Face-style modules) by this project's ``RMSNorm`` with the matching casting mode, sharing
    the original weight Parameter. Returns the qualified names of the replaced modules."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replaced: list[str] = []
    for qualified, module in list(model.named_modules()):
        if isinstance(module, RMSNorm) or qualified == "":
            continue
        if isinstance(module, nn.RMSNorm):
            new = RMSNorm(
                module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine
            )
            new.weight = module.weight
        else:
            style = _hf_style(module)
            if style is None:
                continue
            eps, casting, offset = style
            new = RMSNorm(tuple(module.weight.shape), eps=eps, offset=offset, casting=casting)
            new.weight = module.weight
        new.train(module.training)
        parent_name, _, child = qualified.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
        replaced.append(qualified)
    return replaced
