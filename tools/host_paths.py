"""Both host paths beside torch's F.rms_norm, at the shapes where host time shows (CUDA).

    python tools/host_paths.py [--reps 100] [--blocks 7]

Per shape and provider (native, this op on the compiled host path, this op on the Python host
path): the whole-call time of a forward and of a forward+backward (median over blocks of
back-to-back calls, a synchronise per block: host or GPU, whichever is longer) and the host
time of one call (median of calls issued to an idle GPU: the time until the call returns).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from rmsnorm_kernel import host, rms_norm

SHAPES = [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16), (128, 257, torch.float32),
          (4096, 4096, torch.bfloat16), (2048, 65536, torch.bfloat16)]  # fmt: skip
PROVIDERS = ("native", "compiled", "python")


def whole_call(fn, reps: int, blocks: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(out)


def host_time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    if host.extension() is None:
        raise SystemExit(f"the compiled host path is not available here ({host.ENV}={host.mode()})")
    print(f"{'shape':<22}{'provider':<10}{'fwd us':>9}{'fwd+bwd us':>12}{'host fwd':>10}{'host fwd+bwd':>14}")
    for m, n, dtype in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        for provider in PROVIDERS:
            # The Python host path: the op as it runs where the extension is not built.
            path = host.python_path() if provider == "python" else contextlib.nullcontext()
            if provider == "native":
                f = lambda a, b: F.rms_norm(a, (n,), b, 1e-6)  # noqa: E731
            else:
                f = lambda a, b: rms_norm(a, n, b, 1e-6)  # noqa: E731

            def fwd():
                return f(x, w)

            def fwd_bwd():
                xg.grad = wg.grad = None
                f(xg, wg).backward(dy)

            with path:
                row = (whole_call(fwd, args.reps, args.blocks), whole_call(fwd_bwd, args.reps, args.blocks),
                       host_time(fwd, 5 * args.reps), host_time(fwd_bwd, 5 * args.reps))  # fmt: skip
            name = f"{m}x{n} {str(dtype).removeprefix('torch.')}"
            print(
                f"{name:<22}{provider:<10}" + "".join(f"{v:>{w_}.1f}" for v, w_ in zip(row, (9, 12, 10, 14)))
            )
    print("compiled host path calls (forward, backward):", host.counts())


if __name__ == "__main__":
    main()
