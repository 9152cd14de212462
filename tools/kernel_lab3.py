"""Kernel lab, round 3: the two-walk forward with one program per row (no persistence), and the
two-walk backward with up to 8 chunks. Development only."""

import importlib.util
import itertools
import json
import sys

import torch
from triton.testing import do_bench

from rmsnorm_kernel import kernels, launch


def load(name):
    spec = importlib.util.spec_from_file_location(name, f"tools/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lab1, lab2 = load("kernel_lab"), load("kernel_lab2")


def median_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    out = sys.argv[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy = 4 * a.numel() / (median_us(lambda: b.copy_(a)) * 1e-6) / 1e12
    a = b = None
    print(f"copy ceiling {copy:.3f} TB/s", flush=True)
    rows_out = []

    def record(kind, shape, name, fn, nbytes):
        try:
            us = median_us(fn)
        except Exception as e:
            print(kind, shape, name, "failed", type(e).__name__, str(e)[:120], flush=True)
            return
        frac = nbytes / (us * 1e-6) / 1e12 / copy
        rows_out.append(dict(kind=kind, shape=shape, variant=name, us=us, frac=frac))
        print(f"{kind:4} {shape:>16} {name:<40} {us:8.1f} us {frac:6.1%}", flush=True)

    shapes = [
        (16384, 8192, torch.bfloat16),
        (8192, 16384, torch.bfloat16),
        (32768, 4096, torch.bfloat16),
        (2048, 65536, torch.bfloat16),
        (65536, 1024, torch.bfloat16),
        (4096, 4096, torch.float32),
    ]
    for m, n, dt in shapes:
        torch.manual_seed(0)
        shape = f"{m}x{n}-{str(dt)[6:]}"
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dt)
        y = torch.empty_like(x)
        rstd = torch.empty(m, device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        record("fwd", shape, "production", lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt), nbytes)
        for chunk, warps, keep in itertools.product([1024, 2048, 4096, 8192], [2, 4, 8, 16], [0, 1]):
            if chunk > n or chunk < warps * 32 * 4 or (chunk == n and n < 8192):
                continue
            record(
                "fwd",
                shape,
                f"rowloop c{chunk} w{warps} keep{keep}",
                lambda: lab1.fwd_loop_v[(m,)](x, w, y, rstd, m, n, m, n, 1e-6, chunk, keep, num_warps=warps),
                nbytes,
            )
        if dt == torch.bfloat16 and n in (8192, 16384):
            dy = torch.randn_like(x)
            _, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, dt, dt)
            dx = torch.empty_like(x)
            dw = torch.empty_like(w)
            nb = 3 * x.numel() * 2
            record(
                "bwd",
                shape,
                "production",
                lambda: launch.backward(dy, None, x, w, rstd, 0.0, 0, True, dt),
                nb,
            )
            for chunk, warps, per_sm in itertools.product([1024, 2048, 4096], [2, 4, 8], [1, 2, 3]):
                chunks = n // chunk
                if chunks > 8 or chunks == 3 or warps * 32 * 4 > chunk:
                    continue
                programs = min(m, per_sm * sms)
                partial = torch.empty(programs, n, device="cuda")
                grid, constexprs = launch._reduce_plan(n, programs)

                def run():
                    lab2.bwd_chunked_v[(programs,)](
                        x, w, dy, rstd, dx, partial, m, n, programs, chunk, chunks, 1, num_warps=warps
                    )
                    kernels.reduce_columns[grid](partial, dw, programs, n, *constexprs, num_warps=4)

                record("bwd", shape, f"chunked c{chunk} w{warps} p{per_sm}", run, nb)
        x = w = y = dy = None
    with open(out, "w") as f:
        json.dump(dict(copy=copy, rows=rows_out), f, indent=1)
    from collections import defaultdict

    g = defaultdict(list)
    for r in rows_out:
        g[(r["kind"], r["shape"])].append(r)
    for k, v in g.items():
        v.sort(key=lambda r: r["us"])
        prod = next(r for r in v if r["variant"] == "production")
        print(
            k,
            f"production {prod['us']:.1f} {prod['frac']:.1%} |",
            "; ".join(f"{r['variant']} {r['us']:.1f} {r['frac']:.1%}" for r in v[:4]),
        )


if __name__ == "__main__":
    main()
