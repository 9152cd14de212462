"""The harness's clocks: whole calls between CUDA events, CUDA-graph replays, the host clock.

Every sample is taken after :func:`prepare_sample` (gradients reset, the L2 flushed, optionally a
GPU wait queued for a host lead), outside the timed interval. :func:`time_cuda` times whole calls
(and the host clock around them), :func:`graph_for` and :func:`time_graph` the GPU alone, and
:func:`measure_copy` the device's copy ceiling. docs/gate.md ("One harness") says why each.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from statistics import median
from typing import Any

import torch

from rmsnorm_suite import results
from rmsnorm_suite.results import bandwidth_tbs

FLUSH_BYTES = 256 * 2**20  # written between samples; over 4x the L2 of a Hopper GPU
COPY_ELEMENTS = 2**30  # bf16 elements of the copy-ceiling buffers (2 GiB each)
DEFAULT_WARMUP_MS = 25.0
MAX_LEAD_US = 10_000.0  # the longest GPU wait --lead-us may queue before a sample
DEVICE_TARGET_MS = 0.1  # GPU time per graph replay; shorter calls are captured several times over
DEVICE_MAX_REPS = 64
DEVICE = "cuda"  # tests substitute "cpu" (with stand-in events) to check the run's plumbing
NO_CUDA_MESSAGE = (
    "CUDA is not available: the benchmarks time kernels on a CUDA device and are skipped on this machine "
    "(torch {torch} reports no GPU)."
)


class BenchUnavailable(RuntimeError):
    """Raised when the benchmarks cannot run here (no CUDA device)."""


def cuda_message() -> str:
    return NO_CUDA_MESSAGE.format(torch=torch.__version__)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise BenchUnavailable(cuda_message())


def copy_bytes(elements: int, element_size: int = 2) -> int:
    """A copy reads and writes every element."""
    return 2 * elements * element_size


def make_flush(nbytes: int = FLUSH_BYTES) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.int8, device=DEVICE)


@functools.cache
def sleep_cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep``, measured once per process."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def prepare_sample(grads: Sequence[torch.Tensor], flush: torch.Tensor | None, lead_us: float = 0.0) -> None:
    """What runs before each timed call, outside its interval: the ``grads`` tensors get
    ``.grad = None`` (so the call writes fresh gradients) and ``flush`` is overwritten (so the
    call starts with a cold L2). With ``lead_us``, a GPU wait of that long is queued before the
    flush, so the host runs at least that far ahead of the GPU at the call."""
    for t in grads:
        t.grad = None
    if lead_us:
        torch.cuda._sleep(int(lead_us * sleep_cycles_per_us()))
    if flush is not None:
        flush.zero_()


def time_cuda(
    call: Callable[[], Any],
    *,
    samples: int,
    warmup_ms: float = DEFAULT_WARMUP_MS,
    min_warmup: int = 3,
    flush: torch.Tensor | None = None,
    grads: Sequence[torch.Tensor] = (),
    host_ms: list[float] | None = None,
    lead_us: float = 0.0,
) -> list[float]:
    """Milliseconds of ``samples`` calls, each between two CUDA events, each after
    ``prepare_sample(grads, flush, lead_us)`` (outside the interval). With ``host_ms``, the host
    clock around each of the same calls is appended to it (milliseconds)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples!r}")

    # one untimed call (compiles on first use), one timed estimate, then about warmup_ms of calls
    prepare_sample(grads, flush, lead_us)
    call()
    torch.cuda.synchronize()
    prepare_sample(grads, flush, lead_us)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(min_warmup, min(1000, math.ceil(warmup_ms / estimate)))):
        prepare_sample(grads, flush, lead_us)
        call()
    torch.cuda.synchronize()

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    host = [0.0] * samples
    for i in range(samples):
        prepare_sample(grads, flush, lead_us)
        starts[i].record()
        t0 = time.perf_counter()
        call()
        host[i] = (time.perf_counter() - t0) * 1e3
        ends[i].record()
    torch.cuda.synchronize()
    if host_ms is not None:
        host_ms.extend(host)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def capture_graph(call: Callable[[], Any], reps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``reps`` back-to-back calls. Two warm-up calls run first on a side stream,
    as graph capture requires (lazy initialisation, compilation, autotuning happen there)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    return graph


def time_graph(graph, reps: int, samples: int, flush: torch.Tensor | None = None) -> list[float]:
    """Milliseconds per call: ``samples`` replays of ``graph`` (``reps`` calls each), each between
    two CUDA events, the L2 flushed before each replay (outside the interval)."""
    graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for i in range(samples):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / reps for s, e in zip(starts, ends)]


def graph_for(call: Callable[[], Any], flush: torch.Tensor | None) -> tuple[Any, int]:
    """(graph, reps): a one-call graph, timed, then recaptured with enough calls per replay for
    about DEVICE_TARGET_MS of GPU work, so that short calls are not lost in event resolution."""
    graph = capture_graph(call, 1)
    one = median(time_graph(graph, 1, 5, flush))
    reps = max(1, min(DEVICE_MAX_REPS, math.ceil(DEVICE_TARGET_MS / max(one, 1e-4))))
    if reps > 1:
        del graph
        graph = capture_graph(call, reps)
    return graph, reps


def measure_copy(elements: int = COPY_ELEMENTS, samples: int = 50) -> results.CopyCeiling:
    """Device-to-device bf16 copy: the bandwidth ceiling of this device, measured in this run."""
    a = torch.randn(elements, device=DEVICE, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    times = time_cuda(functools.partial(b.copy_, a), samples=samples)
    nbytes = copy_bytes(elements, 2)
    ms = median(times)
    del a, b
    torch.cuda.empty_cache()
    return results.CopyCeiling(bandwidth_tbs(nbytes, ms), nbytes, tuple(times), ms)
