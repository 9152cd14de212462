"""The providers the harness times: this kernel, the references and the optional peers.

A provider is a name and a builder: ``build(eps)`` returns ``fn(x, w) -> y`` (a residual
provider, ``fn(x, w, r) -> y``). Builders import their library when called, so this module
imports nothing of the op: pr-verdict's worker binds the harness before the commit's op loads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ResidualFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _build_kernel(eps: float) -> Fn:
    from rmsnorm_kernel import rms_norm

    return lambda x, w: rms_norm(x, weight=w, eps=eps)


def _build_eager(eps: float) -> Fn:
    from rmsnorm_kernel.reference import rms_norm_reference

    return lambda x, w: rms_norm_reference(x, w, eps)


def _build_native(eps: float) -> Fn:
    import torch.nn.functional as F

    return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)


def _build_compiled(eps: float) -> Fn:
    """torch.compile of the eager reference, static shapes. Dynamo's cache is reset when the
    shape changes, so the per-function recompile limit is never reached and no call silently
    falls back to eager; the two grad variants of one shape share the cache."""
    from rmsnorm_kernel.reference import rms_norm_reference

    def eager(x, w):
        return rms_norm_reference(x, w, eps)

    state: dict[str, Any] = {"key": None, "fn": None}

    def fn(x, w):
        key = (tuple(x.shape), x.dtype, w.dtype)
        if state["key"] != key:
            torch._dynamo.reset()
            state["key"], state["fn"] = key, torch.compile(eager, dynamic=False)
        return state["fn"](x, w)

    return fn


def _build_liger(eps: float) -> Fn:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)


def _build_quack(eps: float) -> Fn:
    from quack.rmsnorm import rmsnorm

    return lambda x, w: rmsnorm(x, w, eps=eps)


def _build_kernel_residual(eps: float) -> ResidualFn:
    from rmsnorm_kernel import rms_norm

    return lambda x, w, r: rms_norm(x, weight=w, eps=eps, residual=r)[0]


def _build_unfused_residual(eps: float) -> ResidualFn:
    """The two-op sequence the fused path replaces: h = x + r in x's dtype, then F.rms_norm."""
    import torch.nn.functional as F

    return lambda x, w, r: F.rms_norm(x + r, (x.shape[-1],), w, eps)


def _build_liger_residual(eps: float) -> ResidualFn:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return lambda x, w, r: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)[0]


@dataclass(frozen=True)
class Provider:
    name: str
    build: Callable[[float], Fn]
    description: str
    requires: str | None = None  # module that must import for an optional peer
    # A residual provider computes y = norm(x + r) with a residual r the harness makes per shape;
    # it is run only when asked for by name, and compared with residual providers only.
    residual: bool = False


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("kernel", _build_kernel, "rmsnorm_kernel.rms_norm (this project)"),
        Provider("eager", _build_eager, "the readable fp32-compute reference, eager"),
        Provider("native", _build_native, "torch.nn.functional.rms_norm"),
        Provider("compiled", _build_compiled, "torch.compile of the eager reference, dynamic=False"),
        Provider(
            "liger",
            _build_liger,
            "Liger-Kernel LigerRMSNormFunction (llama casting)",
            "liger_kernel.ops.rms_norm",
        ),
        Provider("quack", _build_quack, "quack.rmsnorm (CuTe DSL)", "quack.rmsnorm"),
        Provider(
            "kernel_residual",
            _build_kernel_residual,
            "rmsnorm_kernel.rms_norm(x, residual=r): fused add + RMSNorm, returns (y, h)",
            residual=True,
        ),
        Provider(
            "unfused_residual",
            _build_unfused_residual,
            "h = x + r, then torch.nn.functional.rms_norm(h)",
            residual=True,
        ),
        Provider(
            "liger_residual",
            _build_liger_residual,
            "Liger-Kernel LigerFusedAddRMSNormFunction (llama casting)",
            "liger_kernel.ops.fused_add_rms_norm",
            residual=True,
        ),
    )
}
RESIDUAL_PROVIDERS: tuple[str, ...] = tuple(name for name, p in PROVIDERS.items() if p.residual)
CORE_PROVIDERS: tuple[str, ...] = ("kernel", "eager", "native", "compiled")
_IMPORTABLE: dict[str, bool] = {}


def provider_available(name: str) -> bool:
    """True for the core providers; for a peer, whether its module imports here (cached)."""
    provider = get_provider(name)
    if provider.requires is None:
        return True
    if name not in _IMPORTABLE:
        try:
            importlib.import_module(provider.requires)
            _IMPORTABLE[name] = True
        except Exception:  # an optional peer may fail in many ways (missing module, CUDA toolkit, DSL)
            _IMPORTABLE[name] = False
    return _IMPORTABLE[name]


def get_provider(name: str) -> Provider:
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; expected one of {list(PROVIDERS)}")
    return PROVIDERS[name]


def available_providers(residual: bool = False) -> list[str]:
    """The core providers and every peer that imports here, in registry order: the plain
    RMSNorm providers, or with ``residual`` the fused residual add + RMSNorm ones."""
    return [name for name, p in PROVIDERS.items() if p.residual == residual and provider_available(name)]
