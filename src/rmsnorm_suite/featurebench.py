"""Benchmark providers of the inference features, timed by the harness's clocks.

``quant``: the op's fused per-token dynamic fp8 and int8 output against torch's unfused sequence
(fp32 norm, amax, scale, clamp, cast: rmsnorm_suite.inference.torch_quantise), eager and under
``torch.compile``. ``qk``: ``qk_norm`` on the q and k views of a fused qkv against two
``F.rms_norm`` calls on the views and against the op on contiguous copies. A provider's
``build(eps)`` returns ``fn(inputs) -> outputs``; nothing of the op is imported until then.
:func:`run_feature_benchmarks` returns the records of :mod:`rmsnorm_suite.results`.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

import torch
import torch.nn.functional as F

from rmsnorm_suite import inference, numerics, results, timing
from rmsnorm_suite.harness import _Progress, _Tally, environment_info, git_info


@dataclass(frozen=True)
class FeatureShape:
    """``tokens`` rows: for ``quant`` of ``n`` values; for ``qk`` a fused qkv of (hq + 2 hk) heads
    of ``d``, whose q and k heads (``n`` = (hq + hk) d values a token) are normalised."""

    feature: str
    tokens: int
    n: int = 0
    hq: int = 0
    hk: int = 0
    d: int = 0
    dtype: torch.dtype = torch.bfloat16

    @property
    def m(self) -> int:
        return self.tokens

    @property
    def group(self) -> str:
        return "decode" if self.tokens == 1 else "prefill"

    @property
    def name(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        if self.feature == "qk":
            return f"qk-{self.tokens}x{self.hq}+{self.hk}x{self.d}-{dt}"
        return f"quant-{self.tokens}x{self.n}-{dt}"

    def nbytes(self, mode: str, out_dtype: torch.dtype | None = None) -> int:
        """The fewest bytes a pass moves. quant: x read, one byte a code written, a fp32 scale a
        row. qk: the q and k heads read and y written (forward); forward+backward also reads x
        and dy and writes dx: 5 passes, as the plain op's bytes count them."""
        elem = self.dtype.itemsize
        if self.feature == "quant":
            return self.tokens * self.n * (elem + 1) + 4 * self.tokens
        heads = self.tokens * (self.hq + self.hk) * self.d * elem
        return {"forward": 2 * heads, "forward_backward": 5 * heads}[mode]


_BF16 = torch.bfloat16
# Qwen3-8B-like: hidden 4096, 32 q heads and 8 kv heads of 128; decode (1 token) and prefill.
FEATURE_SHAPES: tuple[FeatureShape, ...] = tuple(
    FeatureShape("quant", t, n=4096, dtype=_BF16) for t in (1, 256, 32768)
) + tuple(FeatureShape("qk", t, n=40 * 128, hq=32, hk=8, d=128, dtype=_BF16) for t in (1, 256, 32768))


def feature_shapes(feature: str, names: Sequence[str] | None = None) -> list[FeatureShape]:
    """The feature's shapes, all of them or those named (or "decode", "prefill")."""
    mine = [s for s in FEATURE_SHAPES if s.feature == feature]
    if not names or "all" in names:
        return mine
    chosen = [s for s in mine if s.name in names or s.group in names]
    unknown = set(names) - {s.name for s in chosen} - {s.group for s in chosen}
    if unknown:
        raise ValueError(
            f"unknown {feature} shapes {sorted(unknown)}; expected some of {[s.name for s in mine]}"
        )
    return chosen


def make_inputs(shape: FeatureShape, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """quant: x, w. qk: qkv, wq, wk and the gradients gq, gk of the heads' outputs."""
    g = torch.Generator().manual_seed(seed)

    def draw(*size):
        return torch.randn(*size, generator=g).to(shape.dtype).to(device)

    if shape.feature == "quant":
        return {"x": draw(shape.tokens, shape.n), "w": 1 + 0.1 * draw(shape.n)}
    width = (shape.hq + 2 * shape.hk) * shape.d
    return {
        "qkv": draw(shape.tokens, width),
        "wq": 1 + 0.1 * draw(shape.d),
        "wk": 1 + 0.1 * draw(shape.d),
        "gq": draw(shape.tokens, shape.hq, shape.d),
        "gk": draw(shape.tokens, shape.hk, shape.d),
    }


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------


def _kernel_quant(out_dtype):
    def build(eps):
        from rmsnorm_kernel import rms_norm

        return lambda inp: rms_norm(inp["x"], weight=inp["w"], eps=eps, out_dtype=out_dtype)

    return build


def _torch_quant(out_dtype, compiled=False):
    def build(eps):
        def sequence(x, w):
            return inference.torch_quantise(F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps), out_dtype)

        fn = torch.compile(sequence, dynamic=False) if compiled else sequence
        return lambda inp: fn(inp["x"], inp["w"])

    return build


def _views(inp, shape_of):
    hq, hk, d = shape_of(inp)
    return inference.qkv_views(inp["qkv"], hq, hk, d)


def _heads(inp):
    """(hq, hk, d) of a qk input, from its tensors' shapes."""
    return inp["gq"].shape[1], inp["gk"].shape[1], inp["gq"].shape[2]


def _kernel_qk(eps):
    from rmsnorm_kernel import qk_norm

    def fn(inp):
        q, k = _views(inp, _heads)
        return qk_norm(q, k, inp["wq"], inp["wk"], eps)

    return fn


def _torch_qk(eps):
    def fn(inp):
        q, k = _views(inp, _heads)
        d = q.shape[-1]
        return F.rms_norm(q, (d,), inp["wq"], eps), F.rms_norm(k, (d,), inp["wk"], eps)

    return fn


def _kernel_qk_copies(eps):
    from rmsnorm_kernel import rms_norm

    def fn(inp):
        q, k = _views(inp, _heads)
        return rms_norm(q.contiguous(), weight=inp["wq"], eps=eps), rms_norm(
            k.contiguous(), weight=inp["wk"], eps=eps
        )

    return fn


@dataclass(frozen=True)
class FeatureProvider:
    name: str
    feature: str
    build: Callable[[float], Callable]
    description: str
    baseline: str  # the op's provider this one is compared with in the table
    modes: tuple[str, ...] = ("forward",)


_FP8, _I8 = inference.FP8, inference.I8
FEATURE_PROVIDERS: dict[str, FeatureProvider] = {
    p.name: p
    for p in (
        FeatureProvider("kernel_fp8", "quant", _kernel_quant(_FP8), "rms_norm(out_dtype=fp8), per-token scales", "kernel_fp8"),
        FeatureProvider("torch_fp8", "quant", _torch_quant(_FP8), "F.rms_norm fp32, amax, scale, clamp, cast to fp8", "kernel_fp8"),
        FeatureProvider("compiled_fp8", "quant", _torch_quant(_FP8, True), "torch.compile of torch_fp8", "kernel_fp8"),
        FeatureProvider("kernel_int8", "quant", _kernel_quant(_I8), "rms_norm(out_dtype=int8), per-token scales", "kernel_int8"),
        FeatureProvider("torch_int8", "quant", _torch_quant(_I8), "F.rms_norm fp32, amax, scale, round, clamp, cast to int8", "kernel_int8"),
        FeatureProvider("compiled_int8", "quant", _torch_quant(_I8, True), "torch.compile of torch_int8", "kernel_int8"),
        FeatureProvider("kernel_qk", "qk", _kernel_qk, "qk_norm on the q and k views of qkv", "kernel_qk", ("forward", "forward_backward")),
        FeatureProvider("torch_qk", "qk", _torch_qk, "two F.rms_norm calls on the views", "kernel_qk", ("forward", "forward_backward")),
        FeatureProvider("kernel_qk_copies", "qk", _kernel_qk_copies, "rms_norm on contiguous copies of q and k", "kernel_qk", ("forward", "forward_backward")),
    )
}  # fmt: skip
FEATURES: tuple[str, ...] = ("quant", "qk")


def providers_of(feature: str) -> list[str]:
    return [name for name, p in FEATURE_PROVIDERS.items() if p.feature == feature]


# ---------------------------------------------------------------------------------------------
# Calls, errors and the run
# ---------------------------------------------------------------------------------------------


def make_call(fn, inp, mode: str, *, graph: bool = False):
    """The timed call and the tensors whose grads are reset between calls (qk forward+backward:
    qkv and the weights as leaves; with ``graph``, torch.autograd.grad for fresh gradients)."""
    if mode == "forward":
        return (lambda: fn(inp)), []
    leaves = {k: inp[k].detach().clone().requires_grad_() for k in ("qkv", "wq", "wk")}
    live = {**inp, **leaves}
    grads = (inp["gq"], inp["gk"])
    if graph:
        return (lambda: torch.autograd.grad(fn(live), tuple(leaves.values()), grads)), list(leaves.values())
    return (lambda: torch.autograd.backward(fn(live), grads)), list(leaves.values())


def errors(provider: FeatureProvider, fn, inp, mode: str, eps: float) -> dict[str, float]:
    """Relative L2 to the float64 formula: quant, the dequantised y (y_q x scale); qk, y (forward)
    or dx and dw of q and k together (forward+backward)."""
    if provider.feature == "quant":
        y_q, scales = fn(inp)
        y64 = numerics.oracle(inp["x"], inp["w"], None, eps)[0]
        return {"y": numerics.relative_l2(y_q.double() * scales.double(), y64)}
    q, k = _views(inp, _heads)
    oracles = [numerics.oracle(t.reshape(-1, t.shape[-1]), w, gy.reshape(-1, t.shape[-1]), eps)
               for t, w, gy in ((q, inp["wq"], inp["gq"]), (k, inp["wk"], inp["gk"]))]  # fmt: skip
    if mode == "forward":
        yq, yk = fn(inp)
        got = torch.cat([yq.reshape(-1), yk.reshape(-1)])
        return {"y": numerics.relative_l2(got, torch.cat([o[0].reshape(-1) for o in oracles]))}
    call, leaves = make_call(fn, inp, mode)
    call()
    qkv, wq, wk = leaves
    dq, dk = _views({**inp, "qkv": qkv.grad}, _heads)
    dx = torch.cat([dq.reshape(-1), dk.reshape(-1)])
    return {
        "dx": numerics.relative_l2(dx, torch.cat([o[1].reshape(-1) for o in oracles])),
        "dw": numerics.relative_l2(torch.cat([wq.grad, wk.grad]), torch.cat([o[2] for o in oracles])),
    }


def run_feature_benchmarks(
    shapes: Sequence[FeatureShape],
    providers: Sequence[str],
    modes: Sequence[str] = ("forward", "forward_backward"),
    *,
    samples: int = 100,
    blocks: int = 3,
    warmup_ms: float = timing.DEFAULT_WARMUP_MS,
    eps: float = 1e-6,
    seed: int = 0,
    progress: bool = True,
    device_time: bool = True,
) -> results.Run:
    """Every (provider, shape, mode) the provider has, as :func:`harness.run_benchmarks` times
    the plain op's (blocks with the providers rotated, L2 flushed, whole calls, graph replays and
    the host clock); bandwidth from :meth:`FeatureShape.nbytes` over the run's copy ceiling."""
    timing.require_cuda()
    chosen = [FEATURE_PROVIDERS[name] for name in providers]
    t0 = time.time()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    copy = timing.measure_copy(timing.COPY_ELEMENTS)
    flush = timing.make_flush(timing.FLUSH_BYTES)
    builds = {p.name: p.build(eps) for p in chosen}
    rows: list[results.Row] = []
    bar = _Progress(len(shapes) * len(modes) * blocks * len(chosen), "feature benchmark", progress)
    for shape in shapes:
        inp = make_inputs(shape, timing.DEVICE, seed)
        mine = [p for p in chosen if p.feature == shape.feature]
        for mode in modes:
            here = [p for p in mine if mode in p.modes]
            tallies = {p.name: _Tally() for p in here}
            for p in here:
                try:
                    tallies[p.name].errors = errors(p, builds[p.name], inp, mode, eps)
                except Exception as exc:
                    tallies[p.name].status, tallies[p.name].error = (
                        "failed",
                        f"{type(exc).__name__}: {exc}"[:500],
                    )
            for block in range(blocks):
                k = block % max(len(here), 1)
                for p in here[k:] + here[:k]:
                    bar.step(f"{shape.name} {mode} {p.name}")
                    _time_block(
                        tallies[p.name],
                        builds[p.name],
                        inp,
                        mode,
                        samples,
                        warmup_ms,
                        flush,
                        block,
                        device_time,
                    )
            for p in here:
                rows.append(tallies[p.name].row(p.name, shape, mode, shape.nbytes(mode), False, copy.tbs))
    bar.close()
    settings = {"samples_per_block": samples, "blocks": blocks, "warmup_ms": warmup_ms, "eps": eps, "seed": seed,
                "timing": "CUDA events around whole calls; L2 flushed before each sample", "features": True}  # fmt: skip
    return results.Run(tuple(rows), results.SCHEMA, created, environment_info(), git_info(), settings, copy, {},
                       round(time.time() - t0, 1))  # fmt: skip


def _time_block(tally, fn, inp, mode, samples, warmup_ms, flush, block, device_time) -> None:
    """One block of whole-call samples (host clock too) and, with ``device_time``, of graph replays."""
    if tally.status != "ok":
        return
    try:
        call, grads = make_call(fn, inp, mode)
        host: list[float] = []
        wait = warmup_ms if block == 0 else warmup_ms / 5
        times = timing.time_cuda(
            call, samples=samples, warmup_ms=wait, flush=flush, grads=grads, host_ms=host
        )
        tally.samples_ms.extend(times)
        tally.block_medians_ms.append(median(times))
        tally.host_samples_ms.extend(host)
        tally.host_block_medians_ms.append(median(host))
    except Exception as exc:
        tally.status, tally.error = "failed", f"{type(exc).__name__}: {exc}"[:500]
        return
    if not device_time or tally.device_error is not None:
        return
    try:
        graph_call, _ = make_call(fn, inp, mode, graph=True)
        graph, reps = timing.graph_for(graph_call, flush)
        times = timing.time_graph(graph, reps, samples, flush)
        tally.device_samples_ms.extend(times)
        tally.device_block_medians_ms.append(median(times))
        tally.device_reps = reps
    except Exception as exc:  # a provider that cannot be captured keeps its other figures
        tally.device_error = f"{type(exc).__name__}: {str(exc)[:300]}"
        tally.device_samples_ms, tally.device_block_medians_ms = [], []
        torch.cuda.synchronize()
