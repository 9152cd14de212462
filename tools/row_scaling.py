"""The forward's time against its row count at one width (kernel development tool): separates the
steady-state rate (the slope, per row) from the fixed cost of one launch (the intercept: fill and
drain, and in the flushed timing the write-back of the dirty lines the flush left in L2). Row
counts are whole and half multiples of the SM count, so a partial last wave would show as a
step. Timed twice: with ``do_bench`` (L2 flushed before each call, as the benchmark does) and as
back-to-back launches (no flush). Usage: python tools/row_scaling.py [--n 65536] [--providers
kernel quack ...] (bf16; providers as in the benchmark)."""

import argparse
import statistics

import torch
from triton.testing import do_bench

from rmsnorm_suite import providers


def back_to_back_us(fn, calls: int = 20, repeats: int = 15) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` launches in a row, no flush."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=65536, help="row width (default 65536)")
    parser.add_argument("--providers", nargs="+", default=["kernel"], help="benchmark providers")
    args = parser.parse_args()
    n = args.n
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    counts = [14 * sms, 15 * sms, 31 * sms // 2, 16 * sms, 17 * sms, 31 * sms]
    for name in args.providers:
        fn = providers.get_provider(name).build(1e-6)
        flushed, unflushed = [], []
        for m in counts:
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

            def call():
                fn(x, w)

            flushed.append(1e3 * do_bench(call, warmup=50, rep=300))  # median, L2 flushed before each call
            unflushed.append(back_to_back_us(call))
            print(
                f"{name} {m:6d}x{n} ({m / sms:5.2f} rows per SM): flushed {flushed[-1]:7.1f} us, "
                f"back to back {unflushed[-1]:7.1f} us",
                flush=True,
            )
        for label, times in (("flushed", flushed), ("back to back", unflushed)):
            slope, intercept = statistics.linear_regression(counts, times)  # least squares
            print(
                f"{name} {label}: {intercept:.1f} us per launch + {slope * 1e3:.1f} ns per row "
                f"(steady state {4 * n / (slope * 1e6):.2f} TB/s, bf16 read + write)"
            )


if __name__ == "__main__":
    main()
