"""The harness's run: every (provider, shape, mode) measured, checked and recorded.

:func:`run_benchmarks` draws each shape's inputs, checks each provider against the float64
oracle (:mod:`rmsnorm_suite.numerics`), times it in blocks with the providers rotated between
blocks (:mod:`rmsnorm_suite.timing`) and returns the records of :mod:`rmsnorm_suite.results`.
:class:`cases.Case` is a shape (``Case.bench``). asv, pytest-benchmark, the ``benchmark``
command, pr-verdict's worker and the performance page all measure through here.
"""

from __future__ import annotations

import datetime
import importlib
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

from rmsnorm_suite import cases, numerics, results, timing
from rmsnorm_suite.cases import Case
from rmsnorm_suite.numerics import relative_l2
from rmsnorm_suite.providers import Fn, ResidualFn, get_provider
from rmsnorm_suite.results import bandwidth_tbs

MODES: tuple[str, ...] = ("forward", "forward_backward")
DEFAULT_SAMPLES = 100  # per block
DEFAULT_BLOCKS = 3


# ---------------------------------------------------------------------------------------------
# One shape: inputs, oracle, errors, timing
# ---------------------------------------------------------------------------------------------


def select_cases(names: Sequence[str] | None) -> list[Case]:
    """Shape names from cases.BENCH_SHAPES; "all" and the group names select groups."""
    if not names:
        names = ["all"]
    out: list[Case] = []
    for name in names:
        if name in ("all", "large", "medium", "small"):
            chosen = [s for s in cases.BENCH_SHAPES if name == "all" or s.group == name]
        else:
            chosen = [cases.bench_shape(name)]
        out.extend(s for s in chosen if s.name not in {c.name for c in out})
    return out


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
    """The case a spec names; ValueError when its name or bytes are not its shape's."""
    case = Case.bench(d["m"], d["n"], getattr(torch, d["dtype"]), d["group"])
    if d.get("name", case.name) != case.name or dict(d.get("bytes", case.nbytes)) != case.nbytes:
        raise ValueError(f"a case's name or bytes are not those of {case.name}")
    return case


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's x, w, dy (:func:`numerics.make_inputs`), drawn on the GPU: large shapes."""
    return numerics.make_inputs(
        case.m, case.n, case.dtype, device=timing.DEVICE, seed=seed, draw_on=timing.DEVICE
    )


def make_residual(case: Case, seed: int = 0) -> torch.Tensor:
    """The residual stream r ~ N(0, 1) for the residual providers, seeded apart from x."""
    g = torch.Generator(device=timing.DEVICE).manual_seed(seed + 1)
    return torch.randn(case.m, case.n, device=timing.DEVICE, dtype=torch.float32, generator=g).to(case.dtype)


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
        whole = timing.time_cuda(x.clone, samples=samples, warmup_ms=warmup_ms, flush=flush, lead_us=lead_us)
        figures[0] = median(whole)
        figures[1] = bandwidth_tbs(nbytes, figures[0])
        if device_time:
            graph, reps = timing.graph_for(x.clone, flush)
            figures[2] = median(timing.time_graph(graph, reps, samples, flush))
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
    """tqdm on a terminal (when installed), else a line on stderr every twentieth of the way."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.enabled = enabled
        self.total = total
        self.count = 0
        self.bar = None
        if enabled and sys.stderr.isatty():
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
    warmup_ms: float = timing.DEFAULT_WARMUP_MS,
    eps: float = 1e-6,
    seed: int = 0,
    errors: bool = True,
    copy_elements: int = timing.COPY_ELEMENTS,
    flush_bytes: int = timing.FLUSH_BYTES,
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
    timing.require_cuda()
    for name in providers:
        get_provider(name)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {list(MODES)}")
    if blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {blocks!r}")
    if not 0 <= lead_us <= timing.MAX_LEAD_US:
        raise ValueError(f"lead_us must be in [0, {timing.MAX_LEAD_US}], got {lead_us!r}")
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
            f"CUDA graph replays of back-to-back calls (about {timing.DEVICE_TARGET_MS} ms of GPU work each), "
            "per call; L2 flushed before each replay"
            if device_time
            else None
        ),
        "flush_bytes": flush_bytes,
        "lead_us": lead_us,
    }
    machine, git = environment_info(), git if git is not None else git_info()
    copy = timing.measure_copy(copy_elements)
    copies: dict[str, results.ShapeCopy] = {}  # shape name -> its copy of x (forward runs)
    flush = timing.make_flush(flush_bytes)
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
                            times = timing.time_cuda(
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
            graphs[key] = (*timing.graph_for(call, flush), call)
        graph, reps, _call = graphs[key]
        times = timing.time_graph(graph, reps, samples, flush)
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
