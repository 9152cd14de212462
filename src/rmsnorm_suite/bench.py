"""The one timing harness: asv, pytest-benchmark, the ``benchmark`` command, ``pr-verdict`` and the
performance page all measure through the functions here.

Timing. CUDA events are recorded around whole calls (allocations, the autograd path and every
launch of the call are inside the interval). Before every sample the harness writes a 256 MiB
buffer, over four times the H200's L2 (50-60 MB on Hopper parts), so every call reads its
inputs from HBM as it would in a model; the flush sits outside the timed interval. This was
chosen over rotating input copies because one flush serves every shape, including the 8 KiB
launch-bound ones that would otherwise need thousands of copies, and because the peers' anchor
figures were taken the same way (``triton.testing.do_bench``). Each (provider, shape, mode) gets
a warm-up, then ``samples`` timed calls per block; every sample is kept so that the gate can
apply statistics, and the reported figure is the median.

Device time. Host-inclusive latency follows the speed of the host that issues the calls: where
the GPU work of a call is shorter than its host work (forward+backward at most shapes, every
launch-bound shape), it measures Python and the autograd engine more than the kernels, and on a
shared host it moves by tens of percent between runs. So every row also gets GPU-only samples:
the call is captured in a CUDA graph (``reps`` back-to-back calls, enough for about
``DEVICE_TARGET_MS`` of GPU work) and each sample is one replay between two CUDA events, the L2
flushed before it, divided by ``reps``. Replays issue no host work per call, so these samples
depend on the kernels alone; the gate judges them with a tight factor. forward+backward is
captured as ``torch.autograd.grad`` (fresh gradients, no accumulation). A provider that cannot be
captured keeps its host-inclusive figures and records why under ``device_error``.

Host time. The whole-call samples above time the GPU as much as the host: where a call's host
work is shorter than the flush queued before it, the start event waits for the flush and the
host's work is hidden (docs/performance-notes.md). Waiting for an idle GPU before each sample does
not help: the interval then carries tens of microseconds of the GPU's start-up, more than the
call. So the same samples also record the host clock around the call (``time.perf_counter``):
the time the caller's thread spends issuing it, which is what a compiled host path saves and what
bounds an eager model whose GPU keeps up. Those samples are the rows' ``host`` timing.

Host lead. How far ahead of the GPU the host runs still moves a launch-bound whole call: a launch
that reaches the GPU as the flush ends reads up to 0.5 µs lower than one queued behind it, for
every provider, ``x.clone()`` included (docs/performance-notes.md), so a provider whose host time
is a little shorter than the flush can read lower than one far ahead. ``lead_us`` (``--lead-us``)
queues a GPU wait before each sample's flush: every provider's launch then waits behind the flush,
the whole call times the GPU alike for all of them, and the host column keeps the host's time.

Bandwidth counts the fewest bytes a pass must move (:func:`rmsnorm_suite.cases.bytes_moved`)
and is also given as a fraction of a device-to-device copy measured in the same run (a 2 GiB
bf16 copy, bytes read plus written). With the forward mode, each shape also gets a copy of its
own x (``x.clone()``: the forward's bytes, read M·N and written M·N), timed both ways: what a
pass of those bytes reaches at that size, where launch and tail costs weigh more than at 2 GiB.

Errors are the relative L2 distance ``||out - ref|| / ||ref||`` to a float64 oracle computed
from the same inputs: y for the forward mode, dx and dw for forward+backward.

pr-verdict times each commit in a worker process (:mod:`rmsnorm_suite.worker`) that runs this
harness from the trusted checkout against that commit's ``rmsnorm_kernel``, so base and head are
timed by the same harness. That is why this module imports nothing of the op at import time.

Why one module of ~900 lines: providers, the two timings and the run loop are one harness that
pr-verdict's worker imports whole from the trusted checkout. Its seams (providers, timing, a run)
are marked by the section rules below; the oracle, errors and inputs live in
:mod:`rmsnorm_suite.numerics`, the records it produces and their file in :mod:`rmsnorm_suite.results`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch

from rmsnorm_suite import numerics, results
from rmsnorm_suite.numerics import relative_l2
from rmsnorm_suite.results import bandwidth_tbs

MODES: tuple[str, ...] = ("forward", "forward_backward")
FLUSH_BYTES = 256 * 2**20  # written between samples; over 4x the L2 of a Hopper GPU
COPY_ELEMENTS = 2**30  # bf16 elements of the copy-ceiling buffers (2 GiB each)
DEFAULT_SAMPLES = 100  # per block
DEFAULT_BLOCKS = 3
DEFAULT_WARMUP_MS = 25.0
MAX_LEAD_US = 10_000.0  # the longest GPU wait --lead-us may queue before a sample
DEVICE_TARGET_MS = 0.1  # GPU time per graph replay; shorter calls are captured several times over
DEVICE_MAX_REPS = 64
DEVICE = "cuda"  # tests substitute "cpu" (with stand-in events) to check the run's plumbing
NO_CUDA_MESSAGE = (
    "CUDA is not available: the benchmarks time kernels on a CUDA device and are skipped on this machine "
    "(torch {torch} reports no GPU)."
)

Fn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ResidualFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BenchUnavailable(RuntimeError):
    """Raised when the benchmarks cannot run here (no CUDA device)."""


def cuda_message() -> str:
    return NO_CUDA_MESSAGE.format(torch=torch.__version__)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise BenchUnavailable(cuda_message())


# ---------------------------------------------------------------------------------------------
# Providers: name -> builder(eps) -> fn(x, w) -> y
# ---------------------------------------------------------------------------------------------


def _build_kernel(eps: float) -> Fn:
    from rmsnorm_kernel import rms_norm

    return lambda x, w: rms_norm(x, weight=w, eps=eps)


def _build_eager(eps: float) -> Fn:
    from rmsnorm_kernel.reference import rms_norm_reference

    return lambda x, w: rms_norm_reference(x, w, eps)


def _build_native(eps: float) -> Fn:
    import torch.nn.functional as F

    return lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)


def _build_compiled(eps: float) -> Fn:
    """torch.compile of the eager reference, static shapes. Dynamo's cache is reset when the
    shape changes, so the per-function recompile limit is never reached and no call silently
    falls back to eager; the two grad variants of one shape share the cache."""
    from rmsnorm_kernel.reference import rms_norm_reference

    def eager(x, w):
        return rms_norm_reference(x, w, eps)

    state: dict[str, Any] = {"key": None, "fn": None}

    def fn(x, w):
        key = (tuple(x.shape), x.dtype, w.dtype)
        if state["key"] != key:
            torch._dynamo.reset()
            state["key"], state["fn"] = key, torch.compile(eager, dynamic=False)
        return state["fn"](x, w)

    return fn


def _build_liger(eps: float) -> Fn:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)


def _build_quack(eps: float) -> Fn:
    from quack.rmsnorm import rmsnorm

    return lambda x, w: rmsnorm(x, w, eps=eps)


def _build_kernel_residual(eps: float) -> ResidualFn:
    from rmsnorm_kernel import rms_norm

    return lambda x, w, r: rms_norm(x, weight=w, eps=eps, residual=r)[0]


def _build_unfused_residual(eps: float) -> ResidualFn:
    """The two-op sequence the fused path replaces: h = x + r in x's dtype, then F.rms_norm."""
    import torch.nn.functional as F

    return lambda x, w, r: F.rms_norm(x + r, (x.shape[-1],), w, eps)


def _build_liger_residual(eps: float) -> ResidualFn:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    return lambda x, w, r: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)[0]


@dataclass(frozen=True)
class Provider:
    name: str
    build: Callable[[float], Fn]
    description: str
    requires: str | None = None  # module that must import for an optional peer
    # A residual provider computes y = norm(x + r) with a residual r the harness makes per shape;
    # it is run only when asked for by name, and compared with residual providers only.
    residual: bool = False


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("kernel", _build_kernel, "rmsnorm_kernel.rms_norm (this project)"),
        Provider("eager", _build_eager, "the readable fp32-compute reference, eager"),
        Provider("native", _build_native, "torch.nn.functional.rms_norm"),
        Provider("compiled", _build_compiled, "torch.compile of the eager reference, dynamic=False"),
        Provider(
            "liger",
            _build_liger,
            "Liger-Kernel LigerRMSNormFunction (llama casting)",
            "liger_kernel.ops.rms_norm",
        ),
        Provider("quack", _build_quack, "quack.rmsnorm (CuTe DSL)", "quack.rmsnorm"),
        Provider(
            "kernel_residual",
            _build_kernel_residual,
            "rmsnorm_kernel.rms_norm(x, residual=r): fused add + RMSNorm, returns (y, h)",
            residual=True,
        ),
        Provider(
            "unfused_residual",
            _build_unfused_residual,
            "h = x + r, then torch.nn.functional.rms_norm(h)",
            residual=True,
        ),
        Provider(
            "liger_residual",
            _build_liger_residual,
            "Liger-Kernel LigerFusedAddRMSNormFunction (llama casting)",
            "liger_kernel.ops.fused_add_rms_norm",
            residual=True,
        ),
    )
}
RESIDUAL_PROVIDERS: tuple[str, ...] = tuple(name for name, p in PROVIDERS.items() if p.residual)
CORE_PROVIDERS: tuple[str, ...] = ("kernel", "eager", "native", "compiled")
_IMPORTABLE: dict[str, bool] = {}


def provider_available(name: str) -> bool:
    """True for the core providers; for a peer, whether its module imports here (cached)."""
    provider = get_provider(name)
    if provider.requires is None:
        return True
    if name not in _IMPORTABLE:
        try:
            importlib.import_module(provider.requires)
            _IMPORTABLE[name] = True
        except Exception:  # an optional peer may fail in many ways (missing module, CUDA toolkit, DSL)
            _IMPORTABLE[name] = False
    return _IMPORTABLE[name]


def get_provider(name: str) -> Provider:
    if name not in PROVIDERS:
        raise ValueError(f"unknown provider {name!r}; expected one of {list(PROVIDERS)}")
    return PROVIDERS[name]


def available_providers(residual: bool = False) -> list[str]:
    """The core providers and every peer that imports here, in registry order: the plain
    RMSNorm providers, or with ``residual`` the fused residual add + RMSNorm ones."""
    return [name for name, p in PROVIDERS.items() if p.residual == residual and provider_available(name)]


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


def copy_bytes(elements: int, element_size: int = 2) -> int:
    """A copy reads and writes every element."""
    return 2 * elements * element_size


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# One shape: inputs, oracle, errors, timing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A benchmark shape as the harness needs it (built from ``cases.BenchShape``, or from a
    pr-verdict spec file)."""

    name: str
    m: int
    n: int
    dtype: torch.dtype
    group: str
    nbytes: dict[str, int]  # mode -> fewest bytes moved


def case_from_bench_shape(shape) -> Case:
    from rmsnorm_suite import cases

    return Case(
        shape.name,
        shape.m,
        shape.n,
        shape.dtype,
        shape.group,
        {m: cases.bytes_moved(shape, m) for m in MODES},
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case_to_json(case: Case) -> dict[str, Any]:
    return {
        "name": case.name,
        "m": case.m,
        "n": case.n,
        "dtype": _dtype_name(case.dtype),
        "group": case.group,
        "bytes": dict(case.nbytes),
    }


def case_from_json(d: dict[str, Any]) -> Case:
    return Case(d["name"], d["m"], d["n"], getattr(torch, d["dtype"]), d["group"], dict(d["bytes"]))


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's x, w, dy (:func:`numerics.make_inputs`), drawn on the GPU: large shapes."""
    return numerics.make_inputs(case.m, case.n, case.dtype, device=DEVICE, seed=seed, draw_on=DEVICE)


def make_residual(case: Case, seed: int = 0) -> torch.Tensor:
    """The residual stream r ~ N(0, 1) for the residual providers, seeded apart from x."""
    g = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    return torch.randn(case.m, case.n, device=DEVICE, dtype=torch.float32, generator=g).to(case.dtype)


def measure_same_bytes_copy(
    case: Case,
    x: torch.Tensor,
    *,
    samples: int,
    warmup_ms: float,
    flush: torch.Tensor | None,
    device_time: bool,
    lead_us: float = 0.0,
) -> results.ShapeCopy:
    """``x.clone()`` timed as a provider's forward is (whole calls; with ``device_time`` also
    graph replays): the forward's bytes moved by a copy, the ceiling at this shape's size. A
    failure is recorded under ``error``, not raised."""
    nbytes = case.nbytes["forward"]
    figures: list[float | None] = [None] * 4  # median_ms, tbs, device_median_ms, device_tbs
    error = None
    try:
        whole = time_cuda(x.clone, samples=samples, warmup_ms=warmup_ms, flush=flush, lead_us=lead_us)
        figures[0] = median(whole)
        figures[1] = bandwidth_tbs(nbytes, figures[0])
        if device_time:
            graph, reps = graph_for(x.clone, flush)
            figures[2] = median(time_graph(graph, reps, samples, flush))
            figures[3] = bandwidth_tbs(nbytes, figures[2])
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.synchronize()
    return results.ShapeCopy(case.m, case.n, _dtype_name(case.dtype), case.group, nbytes, *figures, error)


def provider_errors(fn: Fn, x, w, dy, oracle, modes: Iterable[str]) -> dict[str, dict[str, float]]:
    """Relative L2 errors vs the float64 oracle: {"forward": {"y"}, "forward_backward": {"dx", "dw"}}."""
    y64, dx64, dw64 = oracle
    out: dict[str, dict[str, float]] = {}
    modes = list(modes)
    if "forward" in modes:
        out["forward"] = {"y": relative_l2(fn(x, w), y64)}
    if "forward_backward" in modes:
        xg = x.detach().clone().requires_grad_()
        wg = w.detach().clone().requires_grad_()
        fn(xg, wg).backward(dy)
        out["forward_backward"] = {"dx": relative_l2(xg.grad, dx64), "dw": relative_l2(wg.grad, dw64)}
    return out


def make_call(
    fn: Fn, x, w, dy, mode: str, *, graph: bool = False
) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """The timed call and the tensors whose grads are reset between calls. With ``graph`` (the
    call captured for device time), forward+backward is torch.autograd.grad, so that repeated
    calls in one graph write fresh gradients instead of accumulating into .grad."""
    if mode == "forward":
        return (lambda: fn(x, w)), []
    if mode == "forward_backward":
        xg = x.detach().clone().requires_grad_()
        wg = w.detach().clone().requires_grad_()
        if graph:
            return (lambda: torch.autograd.grad(fn(xg, wg), (xg, wg), dy)), [xg, wg]
        return (lambda: fn(xg, wg).backward(dy)), [xg, wg]
    raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")


# ---------------------------------------------------------------------------------------------
# A run
# ---------------------------------------------------------------------------------------------


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_info() -> results.Git:
    """Commit of the imported rmsnorm_kernel's checkout (a worktree's, under pr-verdict)."""
    try:
        where = Path(importlib.import_module("rmsnorm_kernel").__file__).resolve().parent
    except Exception:
        return results.Git()
    commit = _git(["rev-parse", "HEAD"], where)
    status = _git(["status", "--porcelain", "--untracked-files=no"], where)
    return results.Git(commit, None if status is None else bool(status))


def environment_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    for dist in ("liger-kernel", "quack-kernels"):
        try:
            from importlib.metadata import version

            info[dist] = version(dist)
        except Exception:
            pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["sms"] = props.multi_processor_count
        info["capability"] = f"{props.major}.{props.minor}"
        info["memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


class _Progress:
    """tqdm when installed, else a line on stderr every few steps."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.enabled = enabled
        self.total = total
        self.count = 0
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def step(self, label: str) -> None:
        self.count += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(1)
        elif self.count == self.total or self.count % max(1, self.total // 20) == 0:
            print(f"[{self.count}/{self.total}] {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class _Tally:
    """What one (provider, mode) of a case gathers while it is measured; then a results.Row."""

    status: str = "ok"
    error: str | None = None
    samples_ms: list[float] = field(default_factory=list)
    block_medians_ms: list[float] = field(default_factory=list)
    device_samples_ms: list[float] = field(default_factory=list)
    device_block_medians_ms: list[float] = field(default_factory=list)
    device_reps: int | None = None
    device_error: str | None = None
    host_samples_ms: list[float] = field(default_factory=list)
    host_block_medians_ms: list[float] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)

    def row(self, provider: str, case: Case, mode: str, nbytes: int, residual: bool, copy_tbs) -> results.Row:
        ok = self.status == "ok"
        return results.Row(
            provider, case.name, mode, self.status, case.m, case.n, _dtype_name(case.dtype), case.group,
            bytes=nbytes, residual=residual, error=self.error, errors=dict(self.errors),
            whole=results.timing(self.samples_ms, self.block_medians_ms, nbytes, copy_tbs, summarise=ok),
            device=results.timing(
                self.device_samples_ms, self.device_block_medians_ms, nbytes, copy_tbs, summarise=ok
            ),
            device_reps=self.device_reps, device_error=self.device_error,
            host=results.timing(self.host_samples_ms, self.host_block_medians_ms, None, None, summarise=ok),
        )  # fmt: skip


def run_benchmarks(
    cases_: Sequence[Case],
    providers: Sequence[str],
    modes: Sequence[str] = MODES,
    *,
    samples: int = DEFAULT_SAMPLES,
    blocks: int = DEFAULT_BLOCKS,
    warmup_ms: float = DEFAULT_WARMUP_MS,
    eps: float = 1e-6,
    seed: int = 0,
    errors: bool = True,
    copy_elements: int = COPY_ELEMENTS,
    flush_bytes: int = FLUSH_BYTES,
    progress: bool = True,
    git: results.Git | None = None,
    device_time: bool = True,
    same_bytes_copy: bool = True,
    lead_us: float = 0.0,
    before_case: Callable[[], Any] | None = None,
) -> results.Run:
    """Measure every (provider, case, mode): ``blocks`` blocks of ``samples`` samples, providers
    rotated between blocks so that drift spreads over all of them; with ``device_time``, each
    block also takes as many graph-replay samples (GPU time only); with ``same_bytes_copy`` and
    the forward mode, each case also gets its copy of x timed (``measure_same_bytes_copy``).
    ``lead_us``: a GPU wait queued before each whole-call sample's flush (``prepare_sample``).
    ``before_case``: called before each case (pr-verdict's worker times its calibration there).
    Returns the run's records (:mod:`rmsnorm_suite.results`; docs/gate.md for the file)."""
    require_cuda()
    for name in providers:
        get_provider(name)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks!r}")
    if not 0 <= lead_us <= MAX_LEAD_US:
        raise ValueError(f"lead_us must be in [0, {MAX_LEAD_US}], got {lead_us!r}")
    t0 = time.time()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    settings = {
        "samples_per_block": samples,
        "blocks": blocks,
        "warmup_ms": warmup_ms,
        "eps": eps,
        "seed": seed,
        "timing": "CUDA events around whole calls; L2 flushed before each sample",
        "host_timing": "time.perf_counter around the same calls",
        "device_timing": (
            f"CUDA graph replays of back-to-back calls (about {DEVICE_TARGET_MS} ms of GPU work each), "
            "per call; L2 flushed before each replay"
            if device_time
            else None
        ),
        "flush_bytes": flush_bytes,
        "lead_us": lead_us,
    }
    machine, git = environment_info(), git if git is not None else git_info()
    copy = measure_copy(copy_elements)
    copies: dict[str, results.ShapeCopy] = {}  # shape name -> its copy of x (forward runs)
    flush = make_flush(flush_bytes)
    rows: list[results.Row] = []
    bar = _Progress(len(cases_) * len(modes) * blocks * len(providers), "benchmark", progress)
    builds: dict[str, Any] = {}
    build_errors: dict[str, str] = {}
    for name in providers:
        try:
            builds[name] = get_provider(name).build(eps)
        except Exception as exc:  # a peer that imports but cannot build: reported, not fatal
            builds[name] = None
            build_errors[name] = f"{type(exc).__name__}: {exc}"
    residual_names = [name for name in providers if get_provider(name).residual]
    try:
        for case in cases_:
            if before_case is not None:
                before_case()
            x, w, dy = make_inputs(case, seed)
            r = make_residual(case, seed) if residual_names else None
            fns: dict[str, Fn | None] = {
                name: (None if b is None else _bind_residual(b, r) if name in residual_names else b)
                for name, b in builds.items()
            }
            by_key = {
                (name, mode): _Tally(
                    status="ok" if fns[name] is not None else "failed",
                    error=build_errors.get(name),
                    device_error=None if device_time else "device time not measured in this run",
                )
                for name in providers
                for mode in modes
            }
            if errors:
                oracle = numerics.oracle(x, w, dy, eps)
                # The residual providers normalise h = x + r: their oracle is the formula on the
                # exact h, and dx = dh.
                oracle_res = numerics.oracle(x.double() + r.double(), w, dy, eps) if residual_names else None
                for name in providers:
                    if fns[name] is None:
                        continue
                    for mode in modes:  # a provider may fail in one mode only (no backward, say)
                        try:
                            this_oracle = oracle_res if name in residual_names else oracle
                            errs = provider_errors(fns[name], x, w, dy, this_oracle, [mode])
                            by_key[name, mode].errors = errs[mode]
                        except Exception as exc:
                            _fail(by_key[name, mode], exc)
                del oracle, oracle_res
                torch.cuda.empty_cache()
            graphs: dict[tuple[str, str], tuple[Any, int, Callable[[], Any]]] = {}
            for mode in modes:
                for block in range(blocks):
                    k = block % len(providers)
                    for name in list(providers[k:]) + list(providers[:k]):
                        tally = by_key[name, mode]
                        bar.step(f"{case.name} {mode} {name}")
                        if tally.status != "ok":
                            continue
                        host: list[float] = []
                        try:
                            call, grads = make_call(fns[name], x, w, dy, mode)
                            times = time_cuda(
                                call,
                                samples=samples,
                                warmup_ms=warmup_ms if block == 0 else warmup_ms / 5,
                                flush=flush,
                                grads=grads,
                                host_ms=host,
                                lead_us=lead_us,
                            )
                        except Exception as exc:
                            _fail(tally, exc)
                            continue
                        tally.samples_ms.extend(times)
                        tally.block_medians_ms.append(median(times))
                        tally.host_samples_ms.extend(host)
                        tally.host_block_medians_ms.append(median(host))
                        if tally.device_error is None:
                            _time_device(tally, graphs, (name, mode), fns[name], x, w, dy, samples, flush)
            graphs.clear()
            if same_bytes_copy and "forward" in modes:
                copies[case.name] = measure_same_bytes_copy(
                    case,
                    x,
                    samples=samples * blocks,
                    warmup_ms=warmup_ms,
                    flush=flush,
                    device_time=device_time,
                    lead_us=lead_us,
                )
            for (name, mode), tally in by_key.items():
                residual = name in residual_names
                nbytes = _residual_bytes(case, mode) if residual else case.nbytes[mode]
                rows.append(tally.row(name, case, mode, nbytes, residual, copy.tbs))
            del x, w, dy, r
            torch.cuda.empty_cache()
    finally:
        bar.close()
    if "kernel" in providers or "kernel_residual" in providers:
        machine["op_host_path"] = op_host_path()
    return results.Run(
        tuple(rows), results.SCHEMA, created, machine, git, settings, copy, copies, round(time.time() - t0, 1)
    )


def op_host_path() -> str | None:
    """Which host path served this process's calls of the op: "compiled" once the op's C++ entry
    has loaded, else "python"; None for an op without the choice (rmsnorm_kernel/host/)."""
    host = sys.modules.get("rmsnorm_kernel.host")
    if host is None:
        return None
    return "compiled" if getattr(host, "entry", None) is not None else "python"


def _residual_bytes(case: Case, mode: str) -> int:
    """cases.residual_bytes_moved from the plain op's bytes: 4 against 2 units forward, 7 against
    5 forward+backward."""
    units, plain = {"forward": (4, 2), "forward_backward": (7, 5)}[mode]
    return case.nbytes[mode] // plain * units


def _bind_residual(fn: ResidualFn, r: torch.Tensor) -> Fn:
    """A residual provider as a plain (x, w) -> y provider for one shape's residual r."""
    return lambda x, w: fn(x, w, r)


def _time_device(tally: _Tally, graphs, key, fn, x, w, dy, samples, flush) -> None:
    """One block of graph-replay samples for ``tally``; the graph is captured on first use per
    case. A capture that fails is recorded in the tally (a peer may not be capturable), not raised."""
    try:
        if key not in graphs:
            # The call is kept with its graph: the tensors it closes over (the forward+backward
            # call's own leaf copies of x and w) must outlive every replay, which reads them.
            call, _ = make_call(fn, x, w, dy, key[1], graph=True)
            graphs[key] = (*graph_for(call, flush), call)
        graph, reps, _call = graphs[key]
        times = time_graph(graph, reps, samples, flush)
        tally.device_samples_ms.extend(times)
        tally.device_block_medians_ms.append(median(times))
        tally.device_reps = reps
    except Exception as exc:
        graphs.pop(key, None)
        tally.device_samples_ms, tally.device_block_medians_ms, tally.device_reps = [], [], None
        tally.device_error = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _fail(tally: _Tally, exc: BaseException) -> None:
    tally.status = "failed"
    tally.error = f"{type(exc).__name__}: {str(exc)[:500]}"
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# The `benchmark` command
# ---------------------------------------------------------------------------------------------


def select_cases(names: Sequence[str] | None) -> list[Case]:
    """Shape names from cases.BENCH_SHAPES; "all" and the group names select groups."""
    from rmsnorm_suite import cases

    if not names:
        names = ["all"]
    out: list[Case] = []
    for name in names:
        if name in ("all", "large", "medium", "small"):
            chosen = [s for s in cases.BENCH_SHAPES if name == "all" or s.group == name]
        else:
            chosen = [cases.bench_shape(name)]
        out.extend(case_from_bench_shape(s) for s in chosen if s.name not in {c.name for c in out})
    return out


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--shapes", nargs="+", default=["all"], metavar="SHAPE",
        help='shape names such as 4096x4096-bfloat16, or "all", "large", "medium", "small" (default: all)',
    )  # fmt: skip
    parser.add_argument(
        "--providers", nargs="+", default=None, metavar="NAME",
        help=f"some of {list(PROVIDERS)} (default: every one importable here)",
    )  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="timed calls per block")
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help="timing blocks per shape")
    parser.add_argument("--warmup-ms", type=float, default=DEFAULT_WARMUP_MS)
    parser.add_argument("--no-errors", action="store_true", help="skip the float64-oracle error check")
    parser.add_argument("--config", default=None, help="walkthrough config (output_dir and seeds.checks)")
    parser.add_argument(
        "--out", default=None, help="folder for the results JSON (default: OUTPUT_DIR/benchmark)"
    )
    parser.add_argument(
        "--residual",
        action="store_true",
        help="benchmark the fused residual add + RMSNorm (this kernel, the unfused pair, peers) instead",
    )
    parser.add_argument(
        "--no-device-time", action="store_true", help="skip the CUDA-graph (GPU time only) samples"
    )
    parser.add_argument(
        "--lead-us", type=float, default=0.0, metavar="US",
        help="queue a GPU wait of US microseconds before each whole-call sample's flush, so every "
        "provider's launch waits behind the flush whatever its host time (default: 0)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results JSON instead of the table")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.blocks < 1:
        raise ValueError(f"--blocks must be >= 1, got {args.blocks}")
    if not 0 <= args.lead_us <= MAX_LEAD_US:
        raise ValueError(f"--lead-us must be in [0, {MAX_LEAD_US}], got {args.lead_us}")
    out_dir, seed = "outputs", 0
    if args.config:
        from rmsnorm_suite.config import load_config

        config = load_config(args.config)
        out_dir, seed = config.output_dir, config.seeds.checks
    out_dir = args.out or str(Path(out_dir) / "benchmark")
    chosen = select_cases(args.shapes)
    providers = args.providers or None
    if providers:
        for name in providers:
            get_provider(name)
        missing = [p for p in providers if not provider_available(p)]
        if missing:
            raise ValueError(
                f"--providers: {missing} cannot be imported here; available: {available_providers()}"
            )
    if not torch.cuda.is_available():
        print(cuda_message(), file=sys.stderr)
        return 2
    if providers is None:
        providers = available_providers(residual=args.residual)
    device_time = not args.no_device_time
    result = run_benchmarks(
        chosen,
        providers,
        args.modes,
        samples=args.samples,
        blocks=args.blocks,
        warmup_ms=args.warmup_ms,
        seed=seed,
        errors=not args.no_errors,
        progress=not args.quiet,
        device_time=device_time,
        lead_us=args.lead_us,
    )
    path = results.write(result, out_dir)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(format_table(result))
        print(f"\nresults: {path}")
    failed = [r for r in result.results if not r.ok]
    for r in failed:
        print(f"FAILED {r.provider} {r.shape} {r.mode}: {r.error}", file=sys.stderr)
    return 1 if any(r.provider == "kernel" for r in failed) else 0


def _paired_blocks(t: results.Timing, kernel: results.Timing) -> tuple[tuple, tuple] | None:
    """The two rows' block medians, block i beside block i; None unless both ran every block."""
    mine, theirs = t.block_medians_ms, kernel.block_medians_ms
    if not mine or len(mine) != len(theirs):
        return None
    return tuple(mine), tuple(theirs)


def _slower_blocks(t: results.Timing, kernel: results.Timing) -> str:
    """ "k/n": in k of the n blocks both rows ran, ``t``'s block median exceeded the kernel's."""
    pairs = _paired_blocks(t, kernel)
    if pairs is None:
        return "-"
    mine, theirs = pairs
    return f"{sum(a > b for a, b in zip(mine, theirs))}/{len(mine)}"


def _ratio_interval(t: results.Timing, kernel: results.Timing, alpha: float = 0.05) -> str:
    """ "low-high": the two-sided (1 - 2 alpha) interval of t's time over the kernel's, from the
    paired block medians (gate.ratio_estimate, as the gate judges rounds). Above 1 throughout: t is
    slower in this run beyond its noise; below 1 throughout: faster."""
    from rmsnorm_suite import gate

    pairs = _paired_blocks(t, kernel)
    if pairs is None or len(pairs[0]) < 2:
        return "-"
    mine, theirs = pairs
    est = gate.ratio_estimate(theirs, mine, alpha, paired=True)
    return f"{est.low:.2f}-{est.high:.2f}"


def format_table(result: results.Run) -> str:
    """One line per (shape, mode, provider): median, the block medians, TB/s, fraction of the copy
    ceiling, errors, the time relative to this kernel (>1: slower than the kernel), in how many
    blocks it was slower than the kernel and the 90% interval of that ratio over the blocks
    (providers take turns within a block, so block i of one row and of another ran side by side:
    where whole calls are noisy, the pairs say more than one median), the GPU time and the host
    time of a call; the failed rows' errors below."""
    from rmsnorm_suite import console  # here, not at the top: the worker needs none of its configs

    machine = result.machine
    lines = [
        f"device {machine.get('device')}  torch {machine.get('torch')}  triton {machine.get('triton')}  "
        f"copy ceiling {result.copy.tbs:.2f} TB/s"
        + (f"  host lead {lead:g} us" if (lead := result.settings.get("lead_us")) else ""),
        "",
    ]
    headers = ["shape", "mode", "provider", "median us", "blocks us", "TB/s", "copy%", "err", "vs kernel"]
    headers += ["slower in", "ratio 90%", "gpu us", "gpu copy%", "host us"]
    rows, failures = [], []
    index = result.index()
    for r in result.results:
        t = r.whole
        if not r.ok or t.median_ms is None:
            rows.append([r.shape, r.mode, r.provider, "FAILED"] + ["-"] * 10)
            failures.append(f"  {r.shape} {r.mode} {r.provider}: {str(r.error)[:80]}")
            continue
        blocks = "/".join(f"{b * 1e3:.1f}" for b in t.block_medians_ms)
        errs = " ".join(f"{k}={v:.1e}" for k, v in r.errors.items())
        kernel = index.get(("kernel_residual" if r.residual else "kernel", r.shape, r.mode))
        vs = f"{t.median_ms / kernel.whole.median_ms:.2f}x" if kernel and kernel.whole.median_ms else "-"
        paired = kernel and kernel is not r
        slower = _slower_blocks(t, kernel.whole) if paired else "-"
        interval = _ratio_interval(t, kernel.whole) if paired else "-"
        gpu = ["-", "-"]
        if r.device.median_ms:
            gpu = [f"{r.device.median_ms * 1e3:.1f}", f"{100 * r.device.fraction_of_copy:.1f}%"]
        host = f"{r.host.median_ms * 1e3:.1f}" if r.host.median_ms else "-"
        rows.append(
            [r.shape, r.mode, r.provider, f"{t.median_ms * 1e3:.1f}", blocks, f"{t.tbs:.2f}"]
            + [f"{100 * t.fraction_of_copy:.1f}%", errs, vs, slower, interval, *gpu, host]
        )
    lines.append(console.format_table(headers, rows, right=range(3, 14)))
    if failures:
        lines += ["", "failed:", *failures]
    copies = {name: c for name, c in result.same_bytes_copy.items() if c.median_ms}
    if copies:
        lines += ["", "copy of x (x.clone(), the forward's bytes):"]
        for name, c in copies.items():
            gpu = f", gpu {c.device_median_ms * 1e3:.1f} us" if c.device_median_ms else ""
            lines.append(
                f"  {name:<22} {c.median_ms * 1e3:.1f} us{gpu}, {100 * c.tbs / result.copy.tbs:.1f}% of copy"
            )
    return "\n".join(lines)
