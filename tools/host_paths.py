"""Both host paths beside torch's F.rms_norm, at the shapes where host time shows (CUDA).

    python tools/host_paths.py [--reps 100] [--blocks 7]
    python tools/host_paths.py --pieces

Per shape and provider (native, this op on the compiled host path, this op on the Python host
path): the whole-call time of a forward and of a forward+backward (median over blocks of
back-to-back calls, a synchronise per block: host or GPU, whichever is longer) and the host
time of one call (median of calls issued to an idle GPU: the time until the call returns).
``--pieces``: where a no-grad forward's host time goes (``--help`` says how it is measured).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from rmsnorm_kernel import host, ops, rms_norm

SHAPES = [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16), (128, 257, torch.float32),
          (4096, 4096, torch.bfloat16), (2048, 65536, torch.bfloat16)]  # fmt: skip
PROVIDERS = ("native", "compiled", "python")


def back_to_back(fn, reps: int, blocks: int, warmup: int = 10, drain: bool = True) -> float:
    """µs per call: the median over blocks of ``reps`` back-to-back calls. ``drain``: a block's
    time includes the synchronise that ends it (the whole call: host or GPU, whichever is longer);
    else it stops when the last call returns (the host's time), and the synchronise follows."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if drain:
            torch.cuda.synchronize()
        out.append((time.perf_counter() - start) / reps * 1e6)
        torch.cuda.synchronize()
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


def pieces() -> None:
    host.extension()  # loaded before any timing
    entry = host.entry
    op = torch.ops.rmsnorm_kernel_host.rms_norm.default

    def per_call(fn):
        return back_to_back(fn, 4000, 9, warmup=200, drain=False)

    def predicate_route(x, n, w):
        with host.python_path(keep_extension=True):
            return per_call(lambda: rms_norm(x, n, w, 1e-6))

    for m, n, dtype in [(128, 257, torch.float32), (1, 4096, torch.bfloat16)]:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        call = (x, n, w, 1e-6, None, None, 0.0, "default", None)
        fns = {
            "rms_norm": lambda: per_call(lambda: rms_norm(x, n, w, 1e-6)),
            "C++ entry": lambda: per_call(lambda: entry(*call)),
            "predicate route": lambda: predicate_route(x, n, w),
            "predicate": lambda: per_call(lambda: ops._takes_fast_path(*call)),
            "torch.ops": lambda: per_call(lambda: op(x, w, 1e-6, 0.0, 0, dtype)),
            "F.rms_norm": lambda: per_call(lambda: F.rms_norm(x, (n,), w, 1e-6)),
            "x.clone": lambda: per_call(x.clone),
        }
        rounds = [{name: f() for name, f in fns.items()} for _ in range(2)]  # pieces in turn
        best = {name: min(r[name] for r in rounds) for name in fns}
        name = f"{m}x{n} {str(dtype).removeprefix('torch.')}"
        print(f"{name:<18}" + "  ".join(f"{k} {v:.2f}" for k, v in best.items()))


PIECES_HELP = """\
--pieces: where a no-grad forward's host time goes at the launch-bound shapes, per call in a
tight loop (4000 calls a block, the median of 9 blocks, the better of two rounds that take the
pieces in turn): rms_norm; the compiled path's C++ entry called directly; rms_norm on the
Python predicate's route (the route before the entry: the predicate, then the entry, whose
checks repeat it); the predicate alone; the operator through torch.ops; F.rms_norm; x.clone().
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=PIECES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument(
        "--pieces", action="store_true", help="the no-grad forward's host time, piece by piece"
    )
    args = parser.parse_args()
    if host.extension() is None:
        raise SystemExit(f"the compiled host path is not available here ({host.ENV}={host.mode()})")
    if args.pieces:
        pieces()
        return
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
                row = (back_to_back(fwd, args.reps, args.blocks), back_to_back(fwd_bwd, args.reps, args.blocks),
                       host_time(fwd, 5 * args.reps), host_time(fwd_bwd, 5 * args.reps))  # fmt: skip
            name = f"{m}x{n} {str(dtype).removeprefix('torch.')}"
            print(
                f"{name:<22}{provider:<10}" + "".join(f"{v:>{w_}.1f}" for v, w_ in zip(row, (9, 12, 10, 14)))
            )
    print("compiled host path calls (forward, backward):", host.counts())


if __name__ == "__main__":
    main()
