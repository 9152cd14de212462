"""The forward's time against its row count at one width (kernel development tool): separates the
steady-state rate (the slope, per row) from the fixed cost of one launch (the intercept: fill and
drain). Row counts are whole and half multiples of the SM count, so a partial last wave would
show as a step. Usage: python tools/row_scaling.py [N] (default 65536, bf16)."""

import sys

import torch
from triton.testing import do_bench

from rmsnorm_kernel import launch


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    rows, times = [], []
    for m in [14 * sms, 15 * sms, 31 * sms // 2, 16 * sms, 17 * sms, 31 * sms]:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        us = 1e3 * do_bench(
            lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, x.dtype, x.dtype), warmup=50, rep=300
        )  # median, L2 flushed before each call
        rows.append(m)
        times.append(us)
        tbs = 4 * m * n / us / 1e6  # bf16: read x, write y
        print(f"{m:6d} rows ({m / sms:5.2f} per SM): {us:7.1f} us, {tbs:.2f} TB/s", flush=True)
    mean_m, mean_t = sum(rows) / len(rows), sum(times) / len(times)
    slope = sum((m - mean_m) * (t - mean_t) for m, t in zip(rows, times)) / sum(
        (m - mean_m) ** 2 for m in rows
    )
    intercept = mean_t - slope * mean_m
    print(
        f"fit: {intercept:.1f} us per launch + {slope * 1e3:.1f} ns per row "
        f"(steady state {4 * n / (slope * 1e6):.2f} TB/s)"
    )


if __name__ == "__main__":
    main()
