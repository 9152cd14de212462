"""Kernel lab, round 4: the production forward_looped at N = 65536 under launch variants (programs,
warps, chunk, L2 hints), and the tile forward at N = 4096 against its previous configuration.
Development only. Usage: python tools/kernel_lab4.py OUT.json"""

import importlib.util
import itertools
import json
import sys

import torch
from triton.testing import do_bench

from rmsnorm_kernel import kernels, launch

spec = importlib.util.spec_from_file_location("kernel_lab", "tools/kernel_lab.py")
lab1 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lab1)


def median_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy = 4 * a.numel() / (median_us(lambda: b.copy_(a)) * 1e-6) / 1e12
    a = b = None
    print(f"copy ceiling {copy:.3f} TB/s", flush=True)
    rows = []

    def record(shape, name, fn, nbytes):
        try:
            us = median_us(fn)
        except Exception as e:
            print(shape, name, "failed", type(e).__name__, str(e)[:120], flush=True)
            return
        frac = nbytes / (us * 1e-6) / 1e12 / copy
        rows.append(dict(shape=shape, variant=name, us=us, frac=frac))
        print(f"{shape:>22} {name:<44} {us:8.1f} us {frac:6.1%}", flush=True)

    for m, n, dt in [
        (32768, 4096, torch.bfloat16),
        (4096, 4096, torch.float32),
        (4096, 4096, torch.float16),
        (4096, 4096, torch.bfloat16),
        (2048, 65536, torch.bfloat16),
    ]:
        torch.manual_seed(0)
        shape = f"{m}x{n}-{str(dt)[6:]}"
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dt)
        y = torch.empty_like(x)
        rstd = torch.empty(m, device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        record(shape, "production", lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt), nbytes)
        if n == 4096:
            record(
                shape,
                "previous (w8, weight after the sum)",
                lambda: lab1.fwd_tile_v[(m,)](x, w, y, rstd, m, n, n, 1e-6, 4096, 1, 0, 0, 0, 1, num_warps=8),
                nbytes,
            )
            continue
        policies = [("", ""), ("evict_last", "evict_first"), ("evict_last", ""), ("", "evict_first")]
        for per_sm, warps, block, (p1, p2) in itertools.product([1, 2, 0], [16, 32], [8192, 16384], policies):
            programs = m if per_sm == 0 else min(m, per_sm * sms)
            args = (x, x, w, y, y, rstd, m, n, programs, n, n, n, n, 1e-6, 0.0)
            name = f"looped p{per_sm or 'M'} w{warps} b{block} {p1 or '-'}/{p2 or '-'}"
            record(
                shape,
                name,
                lambda: kernels.forward_looped[(programs,)](
                    *args, True, False, 0, block, p1, p2, num_warps=warps
                ),
                nbytes,
            )
    with open(sys.argv[1], "w") as f:
        json.dump(dict(copy=copy, rows=rows), f, indent=1)
    best = {}
    for r in rows:
        if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
            best[r["shape"]] = r
    for shape, r in best.items():
        prod = next(p for p in rows if p["shape"] == shape and p["variant"] == "production")
        print(
            f"BEST {shape}: {r['variant']} {r['us']:.1f} us {r['frac']:.1%} | production {prod['us']:.1f} {prod['frac']:.1%}"
        )


if __name__ == "__main__":
    main()
