"""Quick performance probe for kernel development (not the benchmark suite): times this kernel
beside torch's fused rms_norm, torch.compile and Liger-Kernel at the benchmark shapes, with
launch-configuration variants, in one run. Usage: python tools/perf_probe.py [variant ...]"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import rmsnorm_kernel
from rmsnorm_kernel import launch
from rmsnorm_kernel.reference import rms_norm_reference
from rmsnorm_suite.cases import BENCH_SHAPES, bytes_moved

EPS = 1e-6


def kernel(x, w):
    return rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS)


def native(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def liger(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


_compiled = {}


def compiled(x, w):
    key = (x.shape, x.dtype, x.requires_grad)
    if key not in _compiled:
        _compiled[key] = torch.compile(lambda a, b: rms_norm_reference(a, b, EPS), dynamic=False)
    return _compiled[key](x, w)


def time_pair(fn, x, w, dy):
    fwd = do_bench(lambda: fn(x, w), warmup=25, rep=100, return_mode="median")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fb():
        fn(xg, wg).backward(dy)

    fb_ms = do_bench(fb, warmup=25, rep=100, grad_to_none=[xg, wg], return_mode="median")
    return fwd, fb_ms


def main():
    impls = dict(kernel=kernel, native=native, liger=liger, compiled=compiled)
    names = [a for a in sys.argv[1:] if a in impls] or list(impls)
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    copy = 4 * a.numel() / (t * 1e-3) / 1e12
    a = b = None  # free the 4 GiB before the shapes
    print(f"copy ceiling {copy:.3f} TB/s")
    rows = []
    for s in BENCH_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(s.m, s.n, device="cuda", dtype=s.dtype)
        w = (1 + 0.1 * torch.randn(s.n, device="cuda")).to(s.dtype)
        dy = torch.randn_like(x)
        for name in names:
            try:
                f, fb = time_pair(impls[name], x, w, dy)
            except Exception as e:  # a peer may not support a shape
                print(f"{s.name:>22} {name:>9} FAILED {type(e).__name__}: {str(e)[:80]}")
                continue
            tf = bytes_moved(s, "forward") / f / 1e9
            tb = bytes_moved(s, "forward_backward") / fb / 1e9
            rows.append(dict(shape=s.name, impl=name, fwd_us=f * 1e3, fb_us=fb * 1e3, fwd_tbs=tf, fb_tbs=tb))
            print(
                f"{s.name:>22} {name:>9} fwd {f * 1e3:9.1f} us {tf:5.2f} TB/s ({tf / copy:4.0%})"
                f" | f+b {fb * 1e3:9.1f} us {tb:5.2f} TB/s ({tb / copy:4.0%})",
                flush=True,
            )
        x = dy = None  # free before the next shape
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "perf_probe.json"), "w") as fh:
        json.dump(dict(copy_tbs=copy, rows=rows, max_tile=launch.FORWARD_MAX_TILE), fh, indent=1)


if __name__ == "__main__":
    main()
