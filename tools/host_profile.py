"""Host-side cost per call at launch-bound shapes (kernel development tool): per-call wall time
of this op beside torch's fused rms_norm, launches that missed the compiled-kernel cache, where a
forward+backward call's host time goes (before, inside and after this op's backward node, with
the autograd device thread and without it), and a cProfile of the op's forward+backward host path.

    python tools/host_profile.py          the above
    python tools/host_profile.py parts    the launch-bound backward's host path, piece by piece
    python tools/host_profile.py floor    whole calls beside the cheapest Python autograd node
    python tools/host_profile.py qk       qk_norm on the views of a fused qkv, piece by piece

What ``parts`` and ``floor`` time: the docstrings of the functions of those names.
"""

import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import rmsnorm_kernel
from rmsnorm_kernel import launch, ops
from rmsnorm_suite import harness, timing


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


def host_spans_us(call, grads, flush, samples=100):
    """Microseconds of host time per call (``time.perf_counter`` around ``call``) in the timing
    loop of ``timing.time_cuda`` (grads reset and L2 flushed before each call, no synchronisation
    between calls). Where it exceeds the CUDA-event time, the call waits on its host work."""
    for _ in range(30):
        timing.prepare_sample(grads, flush)
        call()
    torch.cuda.synchronize()
    spans = []
    for _ in range(samples):
        timing.prepare_sample(grads, flush)
        start = time.perf_counter()
        call()
        spans.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return [s * 1e6 for s in spans]


def floor(rounds=6, samples=100):
    """Median whole-call forward+backward of native, this op and the empty Python node, each
    timed in ``rounds`` interleaved blocks of ``samples`` calls, and the median host time of the
    same calls (``host_spans_us``).

    Timed with the benchmark's harness (CUDA events, L2 flushed before each call), with the
    autograd device thread and without it. The empty node (``_Empty``: forward and backward only
    allocate their outputs) is the floor of any op whose backward node is Python, against which
    the host work of this op's calls is measured."""
    fns = {
        "native": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        "kernel": lambda x, w: rmsnorm_kernel.rms_norm(x, weight=w),
        "empty python node": lambda x, w: _Empty.apply(x, w),
    }
    flush = timing.make_flush()
    for m, n, dtype in FLOOR_SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        w = torch.randn(n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for threaded in (True, False):
            samples_us = {name: [] for name in fns}
            spans_us = {name: [] for name in fns}
            with torch.autograd.set_multithreading_enabled(threaded):
                for _ in range(rounds):
                    for name, fn in fns.items():
                        call, grads = harness.make_call(fn, x, w, dy, "forward_backward")
                        ms = timing.time_cuda(call, samples=samples, flush=flush, grads=grads)
                        samples_us[name] += [v * 1e3 for v in ms]
                        spans_us[name] += host_spans_us(call, grads, flush, samples)
            medians = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in samples_us.items())
            spans = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in spans_us.items())
            thread = "on" if threaded else "off"
            print(f"{m}x{n} {dtype} fwd+bwd, device thread {thread}: whole call {medians} us", flush=True)
            print(f"  host time of the same calls: {spans} us", flush=True)


def attribute(label, forward, dy, reps=300):
    """Median microseconds of a forward+backward call split at this op's backward node: engine
    to node entry, node body, node exit to .backward() returning (the node's body is timed by a
    wrapper around the backward of the eager Function, ``_EagerFunction``, which the common call
    takes too)."""
    stamps = {}
    functions = (ops._EagerFunction,)
    originals = [f.backward for f in functions]

    def timing(original):
        def timed(ctx, *grads):
            stamps["enter"] = time.perf_counter()
            out = original(ctx, *grads)
            stamps["exit"] = time.perf_counter()
            return out

        return staticmethod(timed)

    for function, original in zip(functions, originals):
        function.backward = timing(original)
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
        for function, original in zip(functions, originals):
            function.backward = staticmethod(original)
    print(f"  {label}: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in parts.items()))


def _inputs(m, n, dtype):
    """x, w and dy on CUDA, copies of x and w that require grad, and x's rstd."""
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    w = torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    _, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, dtype, dtype)
    return x, w, dy, x.clone().requires_grad_(), w.clone().requires_grad_(), rstd


PART_NAMES = ("dx alloc", "dw alloc", "plan", "hot key", "stream", "C launch", "reduce", "total")


def _stamped_backward(dy2, xh2, weight, rstd, stamps):
    """launch.backward's tile path (a weight, no dh, dw wanted, casting 0), with a
    time stamp after each piece; appends the pieces' nanoseconds to ``stamps``."""
    pc = time.perf_counter_ns
    t0 = pc()
    m, n = xh2.shape
    device = xh2.device
    dx = torch.empty(m, n, dtype=dy2.dtype, device=device)
    t1 = pc()
    dw = torch.empty(n, dtype=weight.dtype, device=device)
    t2 = pc()
    rows, num_warps, per_sm, constexprs = launch._backward_tile_plan(n, True, False, True, 0)
    programs = launch.backward_programs((m + rows - 1) // rows, per_sm, launch.sm_count(device))
    partial = dw if programs == 1 else torch.empty(programs, n, dtype=torch.float32, device=device)
    args = (xh2, weight, dy2, dy2, rstd, dx, partial, m, n, programs, xh2.stride(0), dy2.stride(0),
            dy2.stride(0), n, 0.0)  # fmt: skip
    t3 = pc()
    tile = launch._backward_tile
    tensors, scalars = args[: tile.pointers], args[tile.pointers :]
    pointers = list(map(launch._data_ptr, tensors))
    dev = tensors[0].get_device()
    key = (dev, num_warps, constexprs, *map(launch._dtype, tensors), *scalars, *map(type, scalars))
    entry = tile.seen.get(key)
    t4 = pc()
    hot = entry is not None and dev == torch._C._cuda_getDevice()
    if hot:
        fn, function, metadata, cooperative, pdl = entry
        stream = torch._C._cuda_getCurrentRawStream(dev)
        t5 = pc()
        fn(programs, 1, 1, stream, function, cooperative, pdl, None, None, metadata, None, None, None,
           *pointers, *scalars, *constexprs)  # fmt: skip
    else:  # the first call: through the launcher, which fills its hot cache
        t5 = pc()
        tile((programs, 1, 1), args, num_warps, constexprs)
    t6 = pc()
    if programs > 1:
        grid, reduce_warps, reduce_constexprs = launch._reduce_plan(n, programs)
        launch._reduce_columns(grid, (partial, dw, programs, n), reduce_warps, reduce_constexprs)
    t7 = pc()
    stamps.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t7 - t0))
    return dx, dw


def parts(reps=500):
    """Median microseconds of each piece of _stamped_backward: in a loop, then as the backward of
    a Python autograd node (forward: launch.forward) with the device thread on and off.

    The pieces: allocations, launch plan, the launcher's hot-path key, the C launcher, the dw
    reduction. _stamped_backward mirrors ``launch.backward``'s tile path with a weight, no dh and
    dw wanted: keep it in step."""
    stamps = []

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y, rstd, _ = launch.forward(x, w, None, 1e-6, 0.0, 0, x.dtype, x.dtype)
            ctx.save_for_backward(x, w, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, rstd = ctx.saved_tensors
            return _stamped_backward(dy, x, w, rstd, stamps)

    def report(label, fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        stamps.clear()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        medians = [statistics.median(column) / 1e3 for column in zip(*stamps)]
        print(f"  {label:>26}: " + ", ".join(f"{k} {v:.2f}" for k, v in zip(PART_NAMES, medians)), flush=True)

    for m, n, dtype in [(1, 4096, torch.bfloat16), (256, 4096, torch.bfloat16)]:
        x, w, dy, xg, wg, rstd = _inputs(m, n, dtype)
        print(f"{m}x{n} {dtype}, microseconds per piece:", flush=True)
        report("loop", lambda: _stamped_backward(dy, x, w, rstd, stamps))
        for threaded in (True, False):
            with torch.autograd.set_multithreading_enabled(threaded):
                report(
                    f"backward node, thread {'on' if threaded else 'off'}",
                    lambda: Node.apply(xg, wg).backward(dy),
                )


def qk(calls=300):
    """qk_norm's host cost on q and k views of a bf16 qkv (32 q and 8 k heads of 128, the feature
    benchmark's): per-call wall time of the forward and the forward+backward beside two
    F.rms_norm calls, at 1 and 256 tokens; the launches that missed the raw-argument cache while
    timed; then a cProfile of the forward+backward, where its host time goes."""
    from rmsnorm_suite import inference

    hq, hk, d = 32, 8, 128
    launchers = {name: obj for name, obj in vars(launch).items() if isinstance(obj, launch.Launcher)}
    for tokens in (1, 256):
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16)
        leaf = qkv.clone().requires_grad_()
        wq, wk = (torch.rand(d, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(2))
        gq = torch.randn(tokens, hq, d, device="cuda", dtype=torch.bfloat16)
        gk = torch.randn(tokens, hk, d, device="cuda", dtype=torch.bfloat16)

        def ours(t):
            return rmsnorm_kernel.qk_norm(*inference.qkv_views(t, hq, hk, d), wq, wk, 1e-6)

        def torchs(t):
            q, k = inference.qkv_views(t, hq, hk, d)
            return F.rms_norm(q, (d,), wq, 1e-6), F.rms_norm(k, (d,), wk, 1e-6)

        cases = {
            "qk_norm fwd": lambda: ours(qkv),
            "two F.rms_norm fwd": lambda: torchs(qkv),
            "qk_norm fwd+bwd": lambda: torch.autograd.backward(ours(leaf), (gq, gk)),
            "two F.rms_norm fwd+bwd": lambda: torch.autograd.backward(torchs(leaf), (gq, gk)),
        }
        before = {k: v.slow_launches for k, v in launchers.items()}
        for name, fn in cases.items():
            print(f"{tokens} tokens: {name:>22}: {per_call_us(fn, calls):7.1f} us per call (host)")
        print("  slow launches while timed:", {k: v.slow_launches - before[k] for k, v in launchers.items()})
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            torch.autograd.backward(ours(leaf), (gq, gk))
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def main():
    launchers = {name: obj for name, obj in vars(launch).items() if isinstance(obj, launch.Launcher)}
    for m, n, dtype in [(1, 4096, torch.bfloat16), (128, 257, torch.float32)]:
        x, w, dy, xg, wg, rstd = _inputs(m, n, dtype)
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
    elif sys.argv[1:] == ["parts"]:
        parts()
    elif sys.argv[1:] == ["qk"]:
        qk()
    else:
        main()
