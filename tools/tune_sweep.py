"""Launch-configuration sweep for kernel development: times launch.forward / launch.backward
(GPU work plus the lean launch path) under configuration variants at the large benchmark
shapes, beside torch's fused rms_norm in the same run. Prints the best variant per shape."""

import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from rmsnorm_kernel import launch

SHAPES = [(32768, 4096), (16384, 8192), (8192, 16384), (2048, 65536), (65536, 1024), (4096, 4096)]
DT = torch.bfloat16


def set_config(rows=None, warps=None, slots=None, fwd_tile=None, bwd_tile=None, loop_block=None, loop_warps=None):
    launch.forward_config.cache_clear()
    launch.backward_config.cache_clear()
    launch.program_slots.cache_clear()

    def cfg(n, elem):
        block_n = triton.next_power_of_2(n)
        r = rows if rows is not None else max(1, min(16, 4096 // block_n))
        w = warps if warps is not None else max(1, min(16, block_n * r // 512))
        return block_n, r, w

    launch.forward_config = launch.backward_config = cfg
    launch.PROGRAMS_PER_SM = slots or 4
    launch.FORWARD_MAX_TILE = fwd_tile or 16384
    launch.BACKWARD_MAX_TILE = bwd_tile or 16384
    launch.LOOP_BLOCK = loop_block or 4096
    launch.LOOP_WARPS = loop_warps or 8


def main():
    results = []
    a = torch.randn(2**30, device="cuda", dtype=DT)
    b = torch.empty_like(a)
    copy = 4 * a.numel() / (do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median") * 1e-3) / 1e12
    del a, b
    print(f"copy {copy:.3f} TB/s", flush=True)
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=DT)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(DT)
        dy = torch.randn_like(x)
        nbytes = m * n * 2
        t_nat = do_bench(lambda: F.rms_norm(x, (n,), w, 1e-6), warmup=10, rep=60, return_mode="median")
        print(f"{m}x{n} native fwd {t_nat*1e3:.1f} us {2*nbytes/t_nat/1e9:.2f} TB/s", flush=True)
        variants = []
        wide = n > 16384
        for warps, rows in itertools.product([4, 8, 16, 32], [None, 1, 2] if n <= 2048 else [None]):
            if not wide:
                variants.append(dict(warps=warps, rows=rows))
        if wide:
            for lb, lw in itertools.product([2048, 4096, 8192], [4, 8, 16]):
                variants.append(dict(loop_block=lb, loop_warps=lw))
            variants.append(dict(fwd_tile=65536, bwd_tile=16384, warps=32))
        for v in variants:
            for slots in ([2, 4, 8, 16] if not wide else [1, 2, 4]):
                set_config(slots=slots, **v)
                try:
                    y, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, DT, DT)
                    tf = do_bench(lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, DT, DT), warmup=10, rep=60,
                                  return_mode="median") if slots == ([2, 4, 8, 16] if not wide else [1, 2, 4])[0] else None
                    tb = do_bench(lambda: launch.backward(dy, None, x, w, rstd, 0.0, 0, True, DT), warmup=10,
                                  rep=60, return_mode="median")
                except Exception as e:
                    print(f"  {v} slots={slots} FAILED {type(e).__name__} {str(e)[:100]}", flush=True)
                    continue
                rec = dict(m=m, n=n, slots=slots, fwd_us=tf * 1e3 if tf else None, bwd_us=tb * 1e3, **v)
                results.append(rec)
                fs = f"fwd {tf*1e3:7.1f} us {2*nbytes/tf/1e9:4.2f}" if tf else " " * 22
                print(f"  {str(v):60} slots={slots:2} {fs} | bwd {tb*1e3:7.1f} us {3*nbytes/tb/1e9:4.2f} TB/s",
                      flush=True)
        del x, dy
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as fh:
        json.dump(dict(copy_tbs=copy, rows=results), fh)
    print("\nbest per shape:")
    for m, n in SHAPES:
        rs = [r for r in results if r["m"] == m and r["n"] == n]
        bf = min((r for r in rs if r["fwd_us"]), key=lambda r: r["fwd_us"])
        bb = min(rs, key=lambda r: r["bwd_us"])
        print(f"{m}x{n}: fwd {bf['fwd_us']:.1f} us {bf} \n          bwd {bb['bwd_us']:.1f} us {bb}")


if __name__ == "__main__":
    main()
