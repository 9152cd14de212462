"""Helpers the modules of tests/op share: Hugging Face's RMSNorm modules as they are written
there, the kill tests' inputs and checks (tests/op/test_kill_paths.py says why they are sharp),
and a comparison in units of a tensor's own scale."""

import torch
from torch import nn

import rmsnorm_kernel
from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference
from rmsnorm_suite import cases
from rmsnorm_suite.cases import TOLERANCES

F32 = torch.float32
EPS = 1e-2  # the kill tests' eps: of the order of mean(x^2) below, so where eps is added matters
SCALE = 0.1  # x ~ N(0, 0.01): mean(x^2) ~ eps


# ---------------------------------------------------------------------------------------------
# Hugging Face's RMSNorm modules, written here as they are there
# ---------------------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


# style: (class, weight center, offset). Gemma stores its weight as an offset from 1.
HF_MODULES = {
    "llama": (LlamaRMSNorm, 1.0, 0.0),
    "gemma": (GemmaRMSNorm, 0.0, 1.0),
}


def hf_module(style, n, weight, device):
    cls, _, _ = HF_MODULES[style]
    module = cls(n, eps=cases.EPS).to(device)
    module.weight = nn.Parameter(weight.detach().clone())
    return module


# ---------------------------------------------------------------------------------------------
# The kill tests' inputs and checks
# ---------------------------------------------------------------------------------------------


def inputs(m, n, dtype, device, seed=0, scale=SCALE):
    g = torch.Generator().manual_seed(seed * 7919 + n)
    x = (scale * torch.randn(m, n, generator=g)).to(dtype)
    w = (0.5 + torch.rand(n, generator=g)).to(dtype)  # no weight near zero: dw and y both see w
    dy = torch.randn(m, n, generator=g).to(dtype)
    res = (scale * torch.randn(m, n, generator=g)).to(dtype)
    return x.to(device), w.to(device), dy.to(device), res.to(device)


def close(actual, expected, dtype, what):
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double().cpu(),
        expected.double().cpu(),
        atol=tol.atol,
        rtol=tol.rtol,
        msg=lambda m: f"{what}: {m}",
    )


def check_residual_call(x, res, w, dy, dh):
    """rms_norm(x, weight=w, residual=res) with gradients dy at y and dh at h, as they are laid
    out: h, y, dx, dresidual and dw against float64, within fp32's tolerance."""
    xg, rg, wg = (t.detach().requires_grad_() for t in (x, res, w))
    y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, residual=rg)
    torch.autograd.backward([y, h], [dy, dh])
    hd = x.double() + res.double()
    close(h, hd, F32, "h")
    close(y, rms_norm_reference(hd, w.double(), EPS), F32, "y")
    dx_ref, dw_ref = rms_norm_backward_reference(hd, w.double(), dy.double(), EPS)
    close(xg.grad, dx_ref + dh.double(), F32, "dx")
    close(rg.grad, dx_ref + dh.double(), F32, "dresidual")
    close(wg.grad, dw_ref, F32, "dw")


def assert_close_scaled(actual, expected, dtype, what):
    """The declared tolerance of ``dtype`` with each tensor in units of its own largest element:
    parameter gradients of a randomly initialised model are far below 1, where the absolute
    tolerance alone would accept anything."""
    tol = TOLERANCES[dtype]
    scale = expected.detach().abs().max().double().clamp_min(torch.finfo(torch.float32).tiny)
    torch.testing.assert_close(
        actual.detach().double() / scale,
        expected.detach().double() / scale,
        atol=tol.atol,
        rtol=tol.rtol,
        msg=lambda m: f"{what}: {m}",
    )
