"""Host-side cost per call at a launch-bound shape (kernel development tool): per-call wall time
of this op beside torch's fused rms_norm, and a cProfile of the op's host path."""

import cProfile
import pstats
import time

import torch
import torch.nn.functional as F

import rmsnorm_kernel
from rmsnorm_kernel import launch


def per_call_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def main():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    cases = {
        "native fwd": lambda: F.rms_norm(x, (4096,), w, 1e-6),
        "kernel fwd": lambda: rmsnorm_kernel.rms_norm(x, weight=w),
        "launch.forward": lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, x.dtype, x.dtype),
        "torch.empty x3": lambda: (
            torch.empty_like(x),
            torch.empty(1, device="cuda"),
            torch.empty(0, device="cuda"),
        ),
        "native fwd+bwd": lambda: F.rms_norm(xg, (4096,), wg, 1e-6).backward(dy),
        "kernel fwd+bwd": lambda: rmsnorm_kernel.rms_norm(xg, weight=wg).backward(dy),
    }
    for name, fn in cases.items():
        print(f"{name:>16}: {per_call_us(fn):7.1f} us per call (host, 2000 calls)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        rmsnorm_kernel.rms_norm(xg, weight=wg).backward(dy)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
