"""The op inside torch: ``torch.library.opcheck`` of its custom ops, ``torch.compile`` and CUDA
graph capture, one implementation of each. tests/op/test_kernels.py asserts on the result and
`verdict` reports it.

Each check returns a :class:`Result`: passed, a one-line key figure, the failed properties one
per line, and details for the verdict's JSON. A failed property is listed, not raised; a check
raises for bad arguments (ValueError) and where the op itself raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rmsnorm_suite import cases, numerics
from rmsnorm_suite.cases import Case

F32, BF16 = torch.float32, torch.bfloat16


@dataclass
class Result:
    """One check's outcome: it passed when no property failed."""

    figure: str
    failures: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures


def mismatch(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None where ``actual`` is element-wise within the declared tolerance of ``expected``: the
    row of the coarser of ``dtype`` (x's) and actual's own dtype; NaN fails. Else the reason."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    coarser = max((dtype, actual.dtype), key=lambda d: torch.finfo(d).eps)
    tol = cases.TOLERANCES[coarser]
    a, e = actual.detach().float(), expected.detach().float()
    close = torch.isclose(a, e, rtol=tol.rtol, atol=tol.atol)
    if bool(close.all()):
        return None
    worst = (a - e).abs().nan_to_num(nan=float("inf")).max().item()
    return (
        f"{int((~close).sum())}/{close.numel()} elements beyond atol {tol.atol:g} + rtol {tol.rtol:g}·|ref| "
        f"(max |err| {worst:.3g})"
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------

OPCHECK_SHAPE = (5, 257)  # an odd width: the tile's masked tail


def opcheck(device: str, dtypes: Sequence[torch.dtype] = cases.DTYPES, *, seed: int = 0) -> Result:
    """``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT dispatch) of
    the forward op without and with a residual (x, weight and residual requiring grad), and of
    the backward op on the forward's rstd (and h), without and with dh; per dtype."""
    from rmsnorm_kernel.ops import backward_op, forward_op

    if not dtypes:
        raise ValueError("opcheck: dtypes must name at least one dtype")
    m, n = OPCHECK_SHAPE
    runs: dict[str, dict[str, str]] = {}
    failures = []
    for dtype in dtypes:
        name = cases.dtype_name(dtype)
        x, w, dy = numerics.make_inputs(m, n, dtype, device=device, seed=seed)
        r, _, dh = numerics.make_inputs(m, n, dtype, device=device, seed=seed + 1)
        for residual in (None, r):
            fused = residual is not None
            options = (cases.EPS, 0.0, 0, dtype, dtype)  # eps, offset, casting, out_dtype, residual_dtype
            leaves = [
                t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, residual)
            ]
            forward = torch.library.opcheck(forward_op, (*leaves, *options), raise_exception=False)
            _, rstd, h = forward_op(x, w, residual, *options)
            backward_args = (dy, dh if fused else None, h if fused else x, w, rstd, 0.0, 0, True, dtype)
            backward = torch.library.opcheck(backward_op, backward_args, raise_exception=False)
            for label, result in (
                (f"forward {name}{' with residual' if fused else ''}", forward),
                (f"backward {name}{' with dh' if fused else ''}", backward),
            ):
                runs[label] = {
                    t: v if v == "SUCCESS" else f"failed: {_first_line(v)}" for t, v in result.items()
                }
                failures += [f"{label} {t}: {_first_line(v)}" for t, v in result.items() if v != "SUCCESS"]
    tests = sum(len(r) for r in runs.values())
    figure = (
        f"{tests - len(failures)}/{tests} opcheck tests (forward op without and with residual, "
        f"backward op without and with dh; {len(dtypes)} dtypes)"
    )
    return Result(figure, failures, {"opcheck": runs})


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------

# The first batch size compiles a static graph, the second marks the batch dim dynamic; no new
# graph may appear after that. 8 and 24 take different row blocks; 3 and 17 are odd.
COMPILE_BATCHES: tuple[int, ...] = (3, 8, 17, 24)
COMPILE_N = 257
KERNEL_CALLS = {"forward": 2, "backward": 2, "fallback": 0}  # per batch: one compiled, one eager pass


def _functional(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    import rmsnorm_kernel

    return rmsnorm_kernel.rms_norm(x, weight=w, eps=cases.EPS)


def compile_fullgraph(device: str, *, seed: int = 0, batches: Sequence[int] = COMPILE_BATCHES) -> Result:
    """``torch.compile(fullgraph=True)`` of ``rms_norm`` and of a small model with ``RMSNorm``,
    forward and backward at each batch size: no graph break, no recompilation after the second
    batch size, the kernels run in the compiled and the eager pass (no fallback); ``rms_norm``'s y,
    dx and dw bitwise those of eager mode; the model's output and gradients within the fp32
    tolerance of eager (Inductor compiles the Linear and SiLU around the op its own way)."""
    from torch._dynamo.utils import counters

    import rmsnorm_kernel

    if len(batches) < 3 or min(batches) < 2 or len(set(batches)) != len(batches):
        raise ValueError(f"batches must be at least three distinct sizes >= 2, got {tuple(batches)}")
    torch._dynamo.reset()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), rmsnorm_kernel.RMSNorm(64, eps=cases.EPS), torch.nn.SiLU()
        ).to(device)
    targets = {
        "rms_norm": (torch.compile(_functional, fullgraph=True), _functional),
        "model": (torch.compile(model, fullgraph=True), model),
    }
    failures: list[str] = []
    details: dict[str, Any] = {}
    for target, (compiled, eager) in targets.items():
        new_graphs = []
        for m in batches:
            counters.clear()
            rmsnorm_kernel.reset_counters()
            if target == "rms_norm":
                x, w, dy = numerics.make_inputs(m, COMPILE_N, F32, device=device, seed=seed)
                runs = [_forward_backward(f, (x, w), dy) for f in (compiled, eager)]
            else:
                x = numerics.make_inputs(m, 32, F32, device=device, seed=seed)[0]
                runs = [_model_forward_backward(f, x, model) for f in (compiled, eager)]
            calls = {k: rmsnorm_kernel.CALLS[k] for k in KERNEL_CALLS}
            new_graphs.append(counters["stats"]["unique_graphs"])
            breaks = sum(counters["graph_break"].values())
            where = f"{target} M={m}"
            if target == "rms_norm":
                differ = [k for k in runs[0] if not torch.equal(runs[0][k], runs[1][k])]
                failures += [f"{where}: compiled {k} not bitwise equal to eager" for k in differ]
            else:
                differ = [k for k in runs[0] if mismatch(runs[0][k], runs[1][k], F32)]
                failures += [
                    f"{where}: compiled {k}: {mismatch(runs[0][k], runs[1][k], F32)}" for k in differ
                ]
            if calls != KERNEL_CALLS:
                failures.append(f"{where}: kernel calls {calls}, expected {KERNEL_CALLS}")
            if breaks:
                failures.append(f"{where}: {breaks} graph breaks")
            details[where] = {"differ_from_eager": differ, "calls": calls, "graph_breaks": breaks}
        details[f"{target} new graphs per batch"] = new_graphs
        if any(new_graphs[2:]):
            failures.append(
                f"{target} recompiled for new batch sizes {list(batches)}: new graphs {new_graphs}"
            )
    sizes = ", ".join(map(str, batches))
    figure = (
        f"fullgraph, no recompile after the 2nd batch size (M = {sizes}); rms_norm forward+backward "
        "bitwise equal to eager, a Linear-RMSNorm-SiLU model within fp32 tolerance"
    )
    return Result(figure, failures, details)


def _forward_backward(fn, inputs, dy) -> dict[str, torch.Tensor]:
    x, w = (t.detach().clone().requires_grad_() for t in inputs)
    y = fn(x, w)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad}


def _model_forward_backward(fn, x, model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    xg = x.detach().clone().requires_grad_()
    out = fn(xg)
    out.sum().backward()
    grads = {f"d({name})": p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"out": out.detach(), "dx": xg.grad, **grads}


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------


# N = 4096: the tile backward; 4097: the two-walk paths; 65536: the one-launch wide backward;
# 65537 and 131073: the segmented backward. The fused residual path at 64 and 4096 rows (a
# `benchmark --residual` run with graph timing once hit an illegal memory access).
CUDA_GRAPH_CASES: tuple[Case, ...] = (
    Case.graph(64, 4096),
    Case.graph(64, 4097),
    Case.graph(64, 65536),
    Case.graph(64, 65537),
    Case.graph(64, 131073),
    Case.graph(64, 4096, residual=True),
    Case.graph(4096, 4096, residual=True),
)
FRESH_REPLAYS = 3  # replays on new inputs written into the captured tensors, as a training loop does


def cuda_graph_capture(case: Case, *, seed: int = 0) -> Result:
    """Forward and backward captured in one CUDA graph after a warm-up on a side stream. A replay
    on the captured inputs gives eager mode's outputs and gradients bit for bit; each replay on
    fresh inputs stays within the declared tolerance of the reference: y, dx, dw (with a residual:
    h = x + r, rounded once from fp32, bitwise; y of h; dx = dr = dx of h + dh)."""
    import rmsnorm_kernel
    from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference

    if not torch.cuda.is_available():
        raise ValueError("cuda_graph_capture: needs a CUDA device")
    x, w, dy = numerics.make_inputs(case.m, case.n, BF16, device="cuda", seed=seed)
    r, _, dh = numerics.make_inputs(case.m, case.n, BF16, device="cuda", seed=seed + 1)
    leaves = (x, w, r) if case.residual else (x, w)
    for t in leaves:
        t.requires_grad_()
    names = ("y", "h", "dx", "dr", "dw") if case.residual else ("y", "dx", "dw")

    def step() -> dict[str, torch.Tensor]:
        if case.residual:
            outs = rmsnorm_kernel.rms_norm(x, weight=w, eps=cases.EPS, residual=r)
            grads = torch.autograd.grad(outs, (x, r, w), (dy, dh))
        else:
            outs = (rmsnorm_kernel.rms_norm(x, weight=w, eps=cases.EPS),)
            grads = torch.autograd.grad(outs, (x, w), dy)
        return dict(zip(names, [o.detach() for o in outs] + list(grads), strict=True))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up (compilation, autotuning) outside the capture
            eager = {k: v.clone() for k, v in step().items()}
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    failures = [
        f"{case.name}: {k} of the replay not bitwise equal to eager"
        for k in names
        if not torch.equal(static[k], eager[k])
    ]
    g = torch.Generator().manual_seed(seed + 2)
    for replay in range(1, FRESH_REPLAYS + 1):
        with torch.no_grad():
            for t in (x, r) if case.residual else (x,):
                t.copy_(torch.randn(t.shape, generator=g).to(BF16))
        graph.replay()
        torch.cuda.synchronize()
        xh = x.detach()
        expected = {}
        if case.residual:
            xh = (x.detach().float() + r.detach().float()).to(BF16)
            if not torch.equal(static["h"], xh):
                failures.append(f"{case.name}, fresh replay {replay}: h is not x + r")
        expected["y"] = rms_norm_reference(xh, w.detach(), cases.EPS)
        expected["dx"], expected["dw"] = rms_norm_backward_reference(xh, w.detach(), dy, cases.EPS)
        if case.residual:
            expected["dx"] = expected["dr"] = (expected["dx"].float() + dh.float()).to(BF16)
        for k, ref in expected.items():
            reason = mismatch(static[k], ref, BF16)
            if reason:
                failures.append(f"{case.name}, fresh replay {replay}: {k}: {reason}")
    return Result(f"{case.name}: replay bitwise equal to eager, {FRESH_REPLAYS} fresh replays", failures)


def cuda_graphs(graph_cases: Sequence[Case] = CUDA_GRAPH_CASES, *, seed: int = 0) -> Result:
    """:func:`cuda_graph_capture` of every case."""
    if not graph_cases:
        raise ValueError("graph_cases must hold at least one case")
    results = {c.name: cuda_graph_capture(c, seed=seed) for c in graph_cases}
    good = sum(r.passed for r in results.values())
    figure = (
        f"{good}/{len(results)} captures of forward+backward (bf16, N 4096 to 131073, fused residual): "
        f"replays bitwise equal to eager, {FRESH_REPLAYS} replays on fresh inputs within tolerance"
    )
    failures = [f for r in results.values() for f in r.failures]
    return Result(figure, failures, {"cases": {k: r.failures for k, r in results.items()}})
