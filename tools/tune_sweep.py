"""Launch-configuration sweep for kernel development: times launch.forward / launch.backward
(GPU work plus the lean launch path) under variants of the wide backward's knobs (segment width
and warps) at wide shapes, beside torch's fused rms_norm in the same run. Prints the best variant
per shape. The forward's and the two-walk backward's variants: tools/kernel_lab.py."""

import itertools
import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from rmsnorm_kernel import launch

DT = torch.bfloat16


def set_config(**knobs):
    """Override launch-configuration knobs of rmsnorm_kernel.launch by name (upper-case globals)."""
    for name, value in DEFAULTS.items():
        setattr(launch, name, knobs.get(name, value))


DEFAULTS = {name: getattr(launch, name) for name in ("SEGMENT", "SEGMENT_WARPS")}
SHAPES = [(2048, 65536), (512, 262144)]


def main():
    results = []
    a = torch.randn(2**30, device="cuda", dtype=DT)
    b = torch.empty_like(a)
    copy = (
        4 * a.numel() / (do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median") * 1e-3) / 1e12
    )
    a = b = None  # free the 4 GiB before the shapes
    print(f"copy {copy:.3f} TB/s", flush=True)
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=DT)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(DT)
        dy = torch.randn_like(x)
        nbytes = m * n * 2
        t_nat = do_bench(lambda: F.rms_norm(x, (n,), w, 1e-6), warmup=10, rep=60, return_mode="median")
        print(f"{m}x{n} native fwd {t_nat * 1e3:.1f} us {2 * nbytes / t_nat / 1e9:.2f} TB/s", flush=True)
        variants = [{}]
        if n > 16384:
            for sg, sw in itertools.product([2048, 4096, 8192], [4, 8, 16]):
                variants.append(dict(SEGMENT=sg, SEGMENT_WARPS=sw))
        for v in variants:
            set_config(**v)
            try:
                y, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, DT, DT)
                tf = do_bench(
                    lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, DT, DT),
                    warmup=10,
                    rep=60,
                    return_mode="median",
                )
                tb = do_bench(
                    lambda: launch.backward(dy, None, x, w, rstd, 0.0, 0, True, DT),
                    warmup=10,
                    rep=60,
                    return_mode="median",
                )
            except Exception as e:
                print(f"  {v} FAILED {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            results.append(dict(m=m, n=n, fwd_us=tf * 1e3, bwd_us=tb * 1e3, **v))
            print(
                f"  {str(v):70} fwd {tf * 1e3:7.1f} us {2 * nbytes / tf / 1e9:4.2f} | bwd {tb * 1e3:7.1f} us "
                f"{3 * nbytes / tb / 1e9:4.2f} TB/s",
                flush=True,
            )
        x = dy = None  # free before the next shape
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as fh:
        json.dump(dict(copy_tbs=copy, rows=results), fh)
    print("\nbest per shape:")
    for m, n in SHAPES:
        rs = [r for r in results if r["m"] == m and r["n"] == n]
        bf = min(rs, key=lambda r: r["fwd_us"])
        bb = min(rs, key=lambda r: r["bwd_us"])
        print(f"{m}x{n}: fwd {bf['fwd_us']:.1f} us {bf} \n          bwd {bb['bwd_us']:.1f} us {bb}")


if __name__ == "__main__":
    main()
