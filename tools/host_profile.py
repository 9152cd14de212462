"""Host-side cost per call at launch-bound shapes (kernel development tool): per-call wall time
of this op beside torch's fused rms_norm, launches that missed the compiled-kernel cache, where a
forward+backward call's host time goes (before, inside and after this op's backward node, which
the autograd engine runs on its device thread; with that thread and without it), and a cProfile
of the op's forward+backward host path.

``python tools/host_profile.py floor`` instead times whole forward+backward calls with the
benchmark's harness (CUDA events, L2 flushed before each call) for torch's fused rms_norm, this
op, and the cheapest Python autograd node (``_Empty``: forward and backward only allocate their
outputs), with the autograd device thread and without it: the floor of any op whose backward
node is Python, against which the host work of this op's calls is measured."""

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import rmsnorm_kernel
from rmsnorm_kernel import bench, launch, ops


def per_call_us(fn, calls=1000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


class _Identity(torch.autograd.Function):
    """The cheapest Python autograd node: its backward cost is the engine's cost of any Python node."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Empty(torch.autograd.Function):
    """A Python autograd node that does no work: forward and backward only allocate outputs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w)


FLOOR_SHAPES = [
    (1, 4096, torch.bfloat16),
    (256, 4096, torch.bfloat16),
    (128, 257, torch.float32),
    (4096, 4096, torch.bfloat16),
]


def floor(rounds=6, samples=100):
    """Median whole-call forward+backward of native, this op and the empty Python node, each
    timed in ``rounds`` interleaved blocks of ``samples`` calls."""
    fns = {
        "native": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "kernel": lambda x, w: rmsnorm_kernel.rms_norm(x, weight=w),
        "empty python node": lambda x, w: _Empty.apply(x, w),
    }
    flush = bench.make_flush()
    for m, n, dtype in FLOOR_SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for threaded in (True, False):
            samples_us = {name: [] for name in fns}
            with torch.autograd.set_multithreading_enabled(threaded):
                for _ in range(rounds):
                    for name, fn in fns.items():
                        call, grads = bench.make_call(fn, x, w, dy, "forward_backward")
                        ms = bench.time_cuda(call, samples=samples, flush=flush, grads=grads)
                        samples_us[name] += [v * 1e3 for v in ms]
            medians = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in samples_us.items())
            thread = "on" if threaded else "off"
            print(f"{m}x{n} {dtype} fwd+bwd whole call, device thread {thread}: {medians} us", flush=True)


def attribute(label, forward, dy, reps=300):
    """Median microseconds of a forward+backward call split at this op's backward node: engine
    to node entry, node body, node exit to .backward() returning (the node's body is timed by a
    wrapper around _EagerFunction.backward)."""
    stamps = {}
    original = ops._EagerFunction.backward

    def timed(ctx, *grads):
        stamps["enter"] = time.perf_counter()
        out = original(ctx, *grads)
        stamps["exit"] = time.perf_counter()
        return out

    ops._EagerFunction.backward = staticmethod(timed)
    try:
        for _ in range(30):
            forward().backward(dy)
        torch.cuda.synchronize()
        parts = {"total": [], "engine to node": [], "node body": [], "node to return": []}
        for _ in range(reps):
            start = time.perf_counter()
            y = forward()
            called = time.perf_counter()
            y.backward(dy)
            done = time.perf_counter()
            parts["total"].append(done - start)
            parts["engine to node"].append(stamps["enter"] - called)
            parts["node body"].append(stamps["exit"] - stamps["enter"])
            parts["node to return"].append(done - stamps["exit"])
        torch.cuda.synchronize()
    finally:
        ops._EagerFunction.backward = original
    print(f"  {label}: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in parts.items()))


def main():
    launchers = {name: obj for name, obj in vars(launch).items() if isinstance(obj, launch.Launcher)}
    for m, n, dtype in [(1, 4096, torch.bfloat16), (128, 257, torch.float32)]:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, dtype, dtype)
        cases = {
            "launch.forward": lambda: launch.forward(x, w, None, 1e-6, 0.0, 0, dtype, dtype),
            "launch.backward": lambda: launch.backward(dy, None, x, w, rstd, 0.0, 0, True, dtype),
            "autograd no-op": lambda: (xg * 1).backward(dy),
            "python node no-op": lambda: _Identity.apply(xg).backward(dy),
            "native fwd": lambda: F.rms_norm(x, (n,), w, 1e-6),
            "kernel fwd": lambda: rmsnorm_kernel.rms_norm(x, weight=w),
            "native fwd+bwd": lambda: F.rms_norm(xg, (n,), wg, 1e-6).backward(dy),
            "kernel fwd+bwd": lambda: rmsnorm_kernel.rms_norm(xg, weight=wg).backward(dy),
        }
        before = {k: v.slow_launches for k, v in launchers.items()}
        for name, fn in cases.items():
            print(f"{m}x{n} {dtype}: {name:>16}: {per_call_us(fn):7.1f} us per call (host)")
        print(
            "  slow launches during timing:", {k: v.slow_launches - before[k] for k, v in launchers.items()}
        )
        for threaded in (True, False):
            torch.autograd.set_multithreading_enabled(threaded)
            attribute(
                f"kernel fwd+bwd, autograd device thread {'on' if threaded else 'off'}",
                lambda: rmsnorm_kernel.rms_norm(xg, weight=wg),
                dy,
            )
        torch.autograd.set_multithreading_enabled(True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            rmsnorm_kernel.rms_norm(xg, weight=wg).backward(dy)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(22)


if __name__ == "__main__":
    if sys.argv[1:] == ["floor"]:
        floor()
    else:
        main()
