"""Launch-configuration sweep for kernel development: times launch.backward (GPU work plus the
lean launch path, L2 flushed between calls) at wide shapes under variants of the wide backward's
knobs (segment width, warps, programs per SM of the one launch and of the two), each passed as a
launch.Tuning (``dataclasses.replace(launch.TUNING, ...)``, nothing patched), in the dtypes,
castings and with the residual gradient that decide whether it runs as one launch or two, and
says which ran (the profiler's kernel names: nothing in launch is patched). Prints the best variant per case. The forward's and the two-walk backward's variants: tools/kernel_lab.py."""

import dataclasses
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from rmsnorm_kernel import launch

KNOBS = ("SEGMENT", "SEGMENT_WARPS", "WIDE_PER_SM", "FUSED_SEGMENT", "FUSED_WARPS", "FUSED_PER_SM")
# Production's knobs, and neighbours of the one launch's and of the two launches'.
VARIANTS = [
    {},
    dict(FUSED_SEGMENT=8192, FUSED_WARPS=8, FUSED_PER_SM=2),
    dict(FUSED_SEGMENT=2048, FUSED_WARPS=2, FUSED_PER_SM=8),
    dict(SEGMENT=4096, SEGMENT_WARPS=4, WIDE_PER_SM=4),
]
# (M, N, dtype, with a residual gradient, casting)
CASES = [
    (2048, 65536, torch.bfloat16, False, "default"),
    (4096, 32768, torch.bfloat16, False, "default"),
    (1024, 131072, torch.bfloat16, False, "default"),
    (2048, 65536, torch.bfloat16, False, "llama"),
    (2048, 65536, torch.float16, False, "llama"),
    (2048, 65536, torch.bfloat16, True, "default"),
    (2048, 65536, torch.float32, False, "default"),
    (2048, 65537, torch.bfloat16, False, "default"),
]


def tuning(**knobs) -> launch.Tuning:
    """The production launch tuning with the wide backward's ``knobs`` (Tuning fields) replaced."""
    unknown = set(knobs) - set(KNOBS)
    assert not unknown, f"not a wide-backward knob: {sorted(unknown)}"
    return dataclasses.replace(launch.TUNING, **knobs)


def kernels_run(call) -> set[str]:
    """The names of the GPU kernels one ``call`` launches, as the profiler records them."""
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        call()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def main():
    a = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy = (
        4 * a.numel() / (do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median") * 1e-3) / 1e12
    )
    a = b = None  # free the 4 GiB before the shapes
    print(f"copy {copy:.3f} TB/s", flush=True)
    results = []
    for m, n, dtype, with_dh, casting in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
        dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
        dh = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) if with_dh else None
        mode = launch.CASTING_MODES[casting]
        _, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, mode, dtype, dtype)
        nbytes = (4 if with_dh else 3) * m * n * x.element_size()
        name = f"{m}x{n} {str(dtype)[6:]} {casting}{' dh' if with_dh else ''}"
        for v in VARIANTS:
            config = tuning(**v)
            try:

                def call():
                    return launch.backward(dy, dh, x, w, rstd, 0.0, mode, True, dtype, tuning=config)

                names = kernels_run(call)
                path = "one launch" if any("backward_wide_fused" in k for k in names) else "two launches"
                t = do_bench(
                    call,
                    warmup=10,
                    rep=60,
                    return_mode="median",
                )
            except Exception as e:
                print(f"{name:32} {str(v):60} FAILED {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            us = t * 1e3
            frac = nbytes / (us * 1e-6) / 1e12 / copy
            results.append(
                dict(case=name, us=us, frac=frac, path=path, **{k: getattr(config, k) for k in KNOBS})
            )
            print(f"{name:32} {str(v or 'production'):60} {path:13} {us:7.1f} us {frac:6.1%}", flush=True)
        x = dy = dh = None  # free before the next case
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as fh:
        json.dump(dict(copy_tbs=copy, rows=results), fh)
    print("\nbest per case:")
    for case in dict.fromkeys(r["case"] for r in results):
        best = min((r for r in results if r["case"] == case), key=lambda r: r["us"])
        print(f"{case:32} {best['us']:7.1f} us {best['frac']:6.1%} {best['path']:13} "
              f"{ {k: best[k] for k in KNOBS} }")  # fmt: skip


if __name__ == "__main__":
    main()
