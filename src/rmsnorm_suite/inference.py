"""The inference features' checks: batch invariance, quantised output and QK-norm.

An ``InferenceImpl`` is the op's entry points these features use. Each check measures figures
(``FIGURES``; limits in regression.toml's ``[features]``) over its cases: the verdict judges them
(:func:`judge`), pr-verdict's worker reports them (:func:`gate_figures`), the gate judges base
and head. This module runs in the worker beside the commit's op: its tables are immutable and
held by the guard, its torch functions bound at import, outputs must be exactly ``torch.Tensor``,
support is decided once per check before any case (then any exception fails it), and running
figures stay in local numbers. docs/ci.md's threat model says what remains the worker's word.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rmsnorm_suite import cases, results

FP8, I8, F32, BF16, U8 = torch.float8_e4m3fn, torch.int8, torch.float32, torch.bfloat16, torch.uint8
INT_VIEWS = ((1, torch.uint8), (2, torch.int16), (4, torch.int32), (8, torch.int64))
QMAX = ((FP8, 448.0), (I8, 127.0))
QMIN = ((FP8, -448.0), (I8, -128.0))
# The smallest per-row scale (a row of zeros gets it): float32(1 / (QMAX * 512)), a constant so
# that torch.compile of torch's sequence (the benchmark's peer) traces it without a graph break.
MIN_SCALE = tuple((d, float(torch.tensor(1.0 / (q * 512.0), dtype=torch.float32))) for d, q in QMAX)
# The tolerances the checks hold outputs to: rmsnorm_suite.cases.TOLERANCES as (dtype, atol,
# rtol), bound when this module is imported (before any op); the guard holds the tuple.
TOLERANCES = tuple((d, t.atol, t.rtol) for d, t in cases.TOLERANCES.items())
EPS = cases.EPS
# Bound at import: the op's code may replace the module attributes, not these.
_TENSOR = torch.Tensor
_RMS_NORM, _NE, _COUNT, _EQUAL = F.rms_norm, torch.ne, torch.count_nonzero, torch.equal
_VIEW, _CONTIGUOUS, _SIZE = torch.Tensor.view, torch.Tensor.contiguous, torch.Tensor.size
_INDEX, _RESHAPE, _NUMEL = torch.index_select, torch.reshape, torch.numel
_RANDN, _RAND, _RANDINT, _RANDPERM = torch.randn, torch.rand, torch.randint, torch.randperm
_TENSOR_OF, _GENERATOR, _GRAD = torch.tensor, torch.Generator, torch.autograd.grad
_ENABLE_GRAD, _NO_GRAD = torch.enable_grad, torch.no_grad
_DTYPE_OF = inspect.getattr_static(torch.Tensor, "dtype").__get__
_SIGNATURE, _VAR_KEYWORD = inspect.signature, inspect.Parameter.VAR_KEYWORD
_ROUND, _WHERE, _ISNAN, _INF = torch.round, torch.where, math.isnan, math.inf
# the builtins the checks compute figures with (the guard holds builtins' namespace as well)
_MAX, _FLOAT, _INT, _SUM, _SORTED = max, float, int, sum, sorted
FIGURES = results.FEATURE_FIGURES  # per check, its figures in the gate's order
OPTIONS = ("rms_norm", "residual", "out_dtype", "qk_norm")  # what an implementation may lack


def _lookup(table: tuple, key):
    for k, value in table:
        if k == key:
            return value
    raise KeyError(key)


def qmax(dtype: torch.dtype) -> float:
    return _lookup(QMAX, dtype)


def qmin(dtype: torch.dtype) -> float:
    return _lookup(QMIN, dtype)


def min_scale(dtype: torch.dtype) -> float:
    return _lookup(MIN_SCALE, dtype)


def tolerance(dtype: torch.dtype) -> cases.Tolerance:
    for d, atol, rtol in TOLERANCES:
        if d == dtype:
            return cases.Tolerance(atol=atol, rtol=rtol)
    raise KeyError(dtype)


def _all_options() -> frozenset[str]:
    return frozenset(OPTIONS)


@dataclass(frozen=True)
class InferenceImpl:
    """The entry points under check, each without autograd unless said:

    * ``forward(x, weight, residual, eps)`` -> ``(y, h)``, h None without a residual;
    * ``norm(x, weight, residual, eps)`` -> y, differentiable (the batch check's dx);
    * ``quantise(x, weight, residual, eps, out_dtype)`` -> ``(y_q, scales)``, per-row scales;
    * ``norm32(x, weight, residual, eps)`` -> y in fp32 (``out_dtype=torch.float32``);
    * ``qk(q, k, q_weight, k_weight, eps)`` -> ``(yq, yk)`` and ``rms_norm(x, weight, eps)`` -> y,
      both differentiable: the per-head path and the contiguous one;
    * ``options()`` -> which of ``OPTIONS`` it has: asked once per check, before any case.
    """

    name: str
    forward: Callable
    norm: Callable
    quantise: Callable
    norm32: Callable
    qk: Callable
    rms_norm: Callable
    options: Callable[[], frozenset[str]] = _all_options


def _op():
    import rmsnorm_kernel

    return rmsnorm_kernel


def _op_options() -> frozenset[str]:
    """The op's entry points, and the keywords its rms_norm takes: named by its signature, or by
    the signature a ``functools.wraps`` wrapper reports, or any with ``**kw`` in either. A
    signature that cannot be read (a C function) counts as taking every keyword: a case the op
    then rejects fails, where reading it as lacking them would skip its cases (unsupported)."""
    op, found = _op(), set()
    norm = getattr(op, "rms_norm", None)
    if callable(norm):
        found.add("rms_norm")
        names, anything = set(), False
        for follow in (True, False):
            try:
                params = _SIGNATURE(norm, follow_wrapped=follow).parameters
            except (TypeError, ValueError):
                anything = True
                continue
            names.update(params)
            anything = anything or any(p.kind == _VAR_KEYWORD for p in params.values())
        found.update(k for k in ("residual", "out_dtype") if anything or k in names)
    if callable(getattr(op, "qk_norm", None)):
        found.add("qk_norm")
    return frozenset(found)


def _op_norm(x, weight, residual, eps):
    out = _op().rms_norm(
        x, weight=weight, eps=eps, **({"residual": residual} if residual is not None else {})
    )
    return out[0] if residual is not None else out


def _op_forward(x, weight, residual, eps):
    with _NO_GRAD():
        if residual is None:
            return _op().rms_norm(x, weight=weight, eps=eps), None
        y, h = _op().rms_norm(x, weight=weight, eps=eps, residual=residual)
        return y, h


def _op_quantise(x, weight, residual, eps, out_dtype):
    extra = {"residual": residual} if residual is not None else {}
    y_q, scales, *_ = _op().rms_norm(x, weight=weight, eps=eps, out_dtype=out_dtype, **extra)
    return y_q, scales


def _op_norm32(x, weight, residual, eps):
    extra = {"residual": residual} if residual is not None else {}
    out = _op().rms_norm(x, weight=weight, eps=eps, out_dtype=F32, **extra)
    return out[0] if residual is not None else out


def _op_qk(q, k, wq, wk, eps):
    yq, yk = _op().qk_norm(q, k, wq, wk, eps)
    return yq, yk


def _op_rms_norm(x, w, eps):
    return _op().rms_norm(x, weight=w, eps=eps)


op_impl = InferenceImpl(
    "op", _op_forward, _op_norm, _op_quantise, _op_norm32, _op_qk, _op_rms_norm, _op_options
)
"""rmsnorm_kernel.rms_norm and qk_norm; gradients through autograd."""


@dataclass(frozen=True)
class Finding:
    """One check's outcome, built when the check returns: its figures (worst over the cases), why
    any case failed (a crash, an output of the wrong type, dtype or shape), the options the
    implementation lacks (with the cases they skipped) and the labels of the cases measured."""

    check: str
    figures: dict[str, float] = field(default_factory=dict)
    failures: tuple[str, ...] = ()
    unsupported: tuple[str, ...] = ()
    cases: tuple[str, ...] = ()


class Rejected(Exception):
    """An output the check does not take (not exactly a torch.Tensor, wrong dtype or shape)."""


def plain(t, what: str, shape=None, dtype=None):
    """``t`` when it is exactly a torch.Tensor (no subclass) of ``shape`` and ``dtype``."""
    if type(t) is not _TENSOR:
        raise Rejected(f"{what} is a {type(t).__name__}, not a torch.Tensor")
    if shape is not None and tuple(_SIZE(t)) != tuple(shape):
        raise Rejected(f"{what} has shape {tuple(_SIZE(t))}, not {tuple(shape)}")
    if dtype is not None and _DTYPE_OF(t) != dtype:
        raise Rejected(f"{what} is {_DTYPE_OF(t)}, not {dtype}")
    return t


def _worst(old: float, value: float) -> float:
    value = _FLOAT(value)
    return value if _ISNAN(value) or _ISNAN(old) else _MAX(old, value)


def _differing(a, b) -> int:
    """Elements whose bits differ: a and b plain tensors of one shape and dtype, compared as
    integers of their width with functions bound at import."""
    plain(a, "output", tuple(_SIZE(b)), _DTYPE_OF(b))
    plain(b, "reference")
    as_int = _lookup(INT_VIEWS, a.element_size())
    x, y = _VIEW(_CONTIGUOUS(a), as_int), _VIEW(_CONTIGUOUS(b), as_int)
    return _INT(_COUNT(_NE(x, y)))


def _generator(seed: int, index: int):
    return _GENERATOR().manual_seed((_INT(seed) * 1_000_003 + index) % 2**63)


def _size(lo: int, hi: int, gen) -> int:
    """A size drawn from [lo, hi] (the judge's seed: the op cannot tell the check by its rows)."""
    return _INT(_RANDINT(lo, hi + 1, (1,), generator=gen)[0]) if hi > lo else lo


def _draw(shape, dtype, device, gen, scaled=False):
    t = _RANDN(*shape, generator=gen)
    if scaled:  # rows of different scales: the norm matters
        t = t * _RAND(shape[0], 1, generator=gen).add(0.05) * 4
    return t.to(dtype).to(device)


def _unsupported(rows, needs: Callable[[tuple], tuple[str, ...]], label, have: frozenset) -> tuple:
    """(rows to run, notes on the rows skipped for an option the implementation lacks)."""
    run, notes = [], []
    for row in rows:
        lacking = [o for o in needs(row) if o not in have]
        if lacking:
            notes.append(f"{label(row)}: no {', '.join(lacking)}")
        else:
            run.append(row)
    return tuple(run), tuple(notes)


def _check(name, impl, device, rows, seed, eps, needs, label, measure, keys) -> Finding:
    """One check over its rows: which rows the implementation's options allow, decided before any
    case; then each case measured, any exception a failure. The running worst figures stay in
    local numbers (a tuple rebound per case) until the Finding is built at the end."""
    try:
        have = frozenset(impl.options())
    except BaseException as exc:  # the probe is the implementation's code too
        return Finding(name, {}, (f"options: {_why(exc)}",))
    todo, skipped = _unsupported(rows, needs, label, have)
    worst, failures, measured = tuple(-_INF for _ in keys), (), ()
    for index, row in enumerate(rows):
        if row not in todo:
            continue
        try:
            got = tuple(_FLOAT(v) for v in measure(impl, device, row, _generator(seed, index), eps))
        except BaseException as exc:  # whatever the op raises (or a rejected output) fails the case
            failures += (f"{label(row)}: {_why(exc)}",)
            continue
        worst = tuple(_worst(old, value) for old, value in zip(worst, got))
        measured += (label(row),)
    figures = dict(zip(keys, worst)) if measured else {}
    return Finding(name, figures, failures, skipped, measured)


def _why(exc: BaseException) -> str:
    try:
        text = str(exc)[:200]
    except BaseException:  # an exception whose str() raises is still a failure
        text = "?"
    return f"{type(exc).__name__}: {text}"


# ---------------------------------------------------------------------------------------------
# Batch invariance: rows (rows low, rows high, n, dtype, residual)
# ---------------------------------------------------------------------------------------------


def _batch_label(row) -> str:
    lo, hi, n, dtype, residual = row
    return f"{lo}..{hi}x{n}-{cases.dtype_name(dtype)}{' residual' if residual else ''}"


def _batch_needs(row) -> tuple[str, ...]:
    return ("rms_norm", "residual") if row[4] else ("rms_norm",)


def batch_invariance(impl: InferenceImpl, device, rows, seed: int = 0, eps=EPS) -> Finding:
    """``batch_invariance``: elements of y, h and dx of a batch of 1 row and one of 7 (its first
    and last among them) whose bits differ from the same rows of a batch of m rows, m drawn from
    the row's range by ``seed`` (dw sums over rows and is exempt)."""
    keys = _lookup(FIGURES, "batch")
    return _check(
        "batch invariance", impl, device, rows, seed, eps, _batch_needs, _batch_label, _batch_case, keys
    )


def _batch_case(impl, device, row, gen, eps) -> tuple[int]:
    lo, hi, n, dtype, residual = row
    m = _size(lo, hi, gen)
    x = _draw((m, n), dtype, device, gen, scaled=True)
    r = _draw((m, n), dtype, device, gen) if residual else None
    w = (1 + 0.1 * _RANDN(n, generator=gen)).to(dtype).to(device)
    dy = _draw((m, n), dtype, device, gen)
    one = _INT(_RANDINT(0, m, (1,), generator=gen)[0])
    inner = _SORTED(_INT(i) + 1 for i in _RANDPERM(m - 2, generator=gen)[:5])
    big = _outputs(impl, x, w, r, dy, eps, (m, n), dtype)
    differing = 0
    for picks in ([one], [0, *inner, m - 1]):
        idx = _TENSOR_OF(picks, device=device)
        sub = _INDEX(r, 0, idx) if r is not None else None
        shape = (len(picks), n)
        small = _outputs(impl, _INDEX(x, 0, idx), w, sub, _INDEX(dy, 0, idx), eps, shape, dtype)
        for s, b in zip(small, big):
            if b is not None:
                differing += _differing(s, _INDEX(b, 0, idx))
    return (differing,)


def _outputs(impl, x, w, r, dy, eps, shape, dtype):
    """(y, h, dx) of one call, each a plain tensor of ``shape``: dx the gradient of <y, dy> (with
    a residual, dx = dresidual); h None without a residual, required with one."""
    y, h = impl.forward(x, w, r, eps)
    plain(y, "y", shape, dtype)
    h = plain(h, "h", shape, dtype) if r is not None else None
    xg = x.detach().requires_grad_(True)
    with _ENABLE_GRAD():
        out = plain(impl.norm(xg, w, r, eps), "y (autograd)", shape, dtype)
        (dx,) = _GRAD(out, (xg,), dy)
    return y, h, plain(dx, "dx", shape, dtype)


# ---------------------------------------------------------------------------------------------
# Quantised output: rows (rows low, rows high, n, dtype, out_dtype, residual)
# ---------------------------------------------------------------------------------------------


def _quant_label(row) -> str:
    lo, hi, n, dtype, out_dtype, residual = row
    res = " residual" if residual else ""
    return f"{lo}..{hi}x{n}-{cases.dtype_name(dtype)} -> {cases.dtype_name(out_dtype)}{res}"


def _quant_needs(row) -> tuple[str, ...]:
    return ("rms_norm", "out_dtype", "residual") if row[5] else ("rms_norm", "out_dtype")


def torch_quantise(y32: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's unfused per-row sequence on an fp32 y: amax, scale, divide, clamp (int8: round), cast."""
    scales = (y32.abs().amax(-1, keepdim=True) / qmax(out_dtype)).clamp(min=min_scale(out_dtype))
    v = y32 / scales
    if out_dtype == I8:
        v = _ROUND(v)
    return v.clamp(qmin(out_dtype), qmax(out_dtype)).to(out_dtype), scales


def torch_norm32(x, w, r, eps) -> torch.Tensor:
    """Torch's own fp32 norm: h = x + r rounded to x's dtype, then F.rms_norm in fp32."""
    h = (x.float() + r.float()).to(x.dtype) if r is not None else x
    return _RMS_NORM(h.float(), (x.shape[-1],), w.float(), eps)


def codes_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable values between a and b of one dtype (fp8 codes order as sign-magnitude)."""
    if a.dtype == I8:
        return (a.int() - b.int()).abs()

    def ordered(t):
        bits = _VIEW(t, U8).int()
        return _WHERE(bits & 0x80 != 0, -(bits & 0x7F), bits & 0x7F)

    return (ordered(a) - ordered(b)).abs()


def quantised_output(impl: InferenceImpl, device, rows, seed: int = 0, eps=EPS) -> Finding:
    """``quant_bits``: codes and scales whose bits differ from torch's sequence on the op's own fp32
    y; ``quant_quanta``: the most codes apart from torch's sequence on torch's norm; ``quant_scales``:
    the largest relative difference of a scale from that sequence's; ``quant_fp32``: the op's own
    fp32 y (``out_dtype=torch.float32``) against torch's norm, as a fraction of the fp32 tolerance."""
    keys = _lookup(FIGURES, "quant")
    return _check(
        "quantised output", impl, device, rows, seed, eps, _quant_needs, _quant_label, _quant_case, keys
    )


def _quant_case(impl, device, row, gen, eps) -> tuple[float, ...]:
    lo, hi, n, dtype, out_dtype, residual = row
    m = _size(lo, hi, gen)
    x = _draw((m, n), dtype, device, gen, scaled=True)
    r = _draw((m, n), dtype, device, gen) if residual else None
    w = (1 + 0.2 * _RANDN(n, generator=gen)).to(dtype).to(device)
    y_q, scales = impl.quantise(x, w, r, eps, out_dtype)
    plain(y_q, "y_q", (m, n), out_dtype)
    if _NUMEL(plain(scales, "scales")) != m:
        raise Rejected(f"scales has {_NUMEL(scales)} elements, not one per row ({m})")
    scales = _RESHAPE(scales, (m, 1))
    y32 = plain(impl.norm32(x, w, r, eps), "y (out_dtype float32)", (m, n), F32)
    ref32 = torch_norm32(x, w, r, eps)
    own_q, own_s = torch_quantise(y32, out_dtype)
    ref_q, ref_s = torch_quantise(ref32, out_dtype)
    bits = _differing(y_q, own_q) + _differing(scales, own_s)
    quanta = codes_apart(y_q, ref_q).max().item()
    rel = ((scales.double() - ref_s.double()).abs() / ref_s.double()).nan_to_num(nan=_INF)
    return bits, quanta, rel.max().item(), _fraction(y32, ref32, tolerance(F32))


# ---------------------------------------------------------------------------------------------
# QK-norm: rows (tokens low, tokens high, hq, hk, d, dtype), then optionally a batch: q and k
# of a (batch, tokens, W) qkv with their heads before the tokens, as Gemma3 normalises them
# (leading dims of two strides)
# ---------------------------------------------------------------------------------------------


def _qk_label(row) -> str:
    lo, hi, hq, hk, d, dtype, *batch = row
    heads_first = f", {batch[0]} batches, heads before tokens" if batch else ""
    return f"qkv {lo}..{hi}x({hq}+{hk}+{hk})x{d}-{cases.dtype_name(dtype)}{heads_first}"


def _qk_needs(row) -> tuple[str, ...]:
    return ("rms_norm", "qk_norm")


def qkv_views(qkv: torch.Tensor, hq: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as per-head views of a fused qkv (tokens, (hq + 2 hk) d): no copy."""
    t = qkv.shape[0]
    return qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)


def heads_first_views(qkv: torch.Tensor, hq: int, hk: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a (batch, tokens, (hq + 2 hk) d) qkv as (batch, heads, tokens, d) views."""
    q, k = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d]
    return q.unflatten(-1, (hq, d)).transpose(1, 2), k.unflatten(-1, (hk, d)).transpose(1, 2)


def qk_norm_check(impl: InferenceImpl, device, rows, seed: int = 0, eps=EPS) -> Finding:
    """``qk_bits``: elements of yq, yk, dq and dk whose bits differ from two rms_norm calls on
    contiguous copies of the heads; ``qk_tolerance``: the worst |err| / (atol + rtol |ref|) of y
    against torch's F.rms_norm in fp32 and of dw against the copies' (TOLERANCES)."""
    keys = _lookup(FIGURES, "qk")
    return _check("QK-norm", impl, device, rows, seed, eps, _qk_needs, _qk_label, _qk_case, keys)


def _qk_case(impl, device, row, gen, eps) -> tuple[float, float]:
    lo, hi, hq, hk, d, dtype, *batch = row
    tokens = _size(lo, hi, gen)
    qkv = _draw((*batch, tokens, (hq + 2 * hk) * d), dtype, device, gen).requires_grad_()
    wq, wk = ((1 + 0.1 * _RANDN(d, generator=gen)).to(dtype).to(device) for _ in "qk")
    q, k = (heads_first_views if batch else qkv_views)(qkv, hq, hk, d)
    gq, gk = (_draw(t.shape, dtype, device, gen) for t in (q, k))
    yq, yk, dq, dk, dwq, dwk = _per_head(impl, q, k, wq, wk, gq, gk, eps, dtype)
    (yqc, dqc, dwqc), (ykc, dkc, dwkc) = _copies(impl, ((q, wq, gq), (k, wk, gk)), eps, dtype)
    bits = _SUM(_differing(a, b) for a, b in ((yq, yqc), (yk, ykc), (dq, dqc), (dk, dkc)))
    tol = tolerance(dtype)
    fractions = [
        _fraction(y, _RMS_NORM(x.detach().float(), (d,), w.float(), eps).to(dtype), tol)
        for y, x, w in ((yq, q, wq), (yk, k, wk))
    ]
    fractions += [_fraction(dwq, dwqc, tol), _fraction(dwk, dwkc, tol)]
    return bits, _MAX(fractions)


def _per_head(impl, q, k, wq, wk, gq, gk, eps, dtype):
    """yq, yk, dq, dk, dwq, dwk of the per-head path on the views, each a plain tensor."""
    wqg, wkg = wq.detach().requires_grad_(), wk.detach().requires_grad_()
    with _ENABLE_GRAD():
        yq, yk = impl.qk(q, k, wqg, wkg, eps)
        yq, yk = plain(yq, "yq", q.shape, dtype), plain(yk, "yk", k.shape, dtype)
        grads = _GRAD((yq, yk), (q, k, wqg, wkg), (gq, gk))
    shapes = (("dq", q.shape), ("dk", k.shape), ("dwq", wq.shape), ("dwk", wk.shape))
    return (yq, yk, *(plain(g, what, shape, dtype) for g, (what, shape) in zip(grads, shapes)))


def _copies(impl, heads, eps, dtype):
    """Per (x, w, dy) of q and of k: y, dx, dw of rms_norm on a contiguous copy."""
    out = []
    for x, w, gy in heads:
        xc, wc = x.detach().contiguous().requires_grad_(), w.detach().clone().requires_grad_()
        with _ENABLE_GRAD():
            yc = plain(impl.rms_norm(xc, wc, eps), "y (copy)", xc.shape, dtype)
            dxc, dwc = _GRAD(yc, (xc, wc), gy)
        out.append((yc, plain(dxc, "dx (copy)", xc.shape, dtype), plain(dwc, "dw (copy)", wc.shape, dtype)))
    return out


def _fraction(value, ref, tol: cases.Tolerance) -> float:
    """The worst element's |value - ref| / (atol + rtol |ref|): within tolerance at <= 1."""
    plain(value, "output", tuple(_SIZE(ref)))
    v, r = value.detach().double(), ref.detach().double()
    return ((v - r).abs() / (tol.atol + tol.rtol * r.abs())).nan_to_num(nan=_INF).max().item()


# ---------------------------------------------------------------------------------------------
# The cases, the verdict's judgement and the gate's figures
# ---------------------------------------------------------------------------------------------

# Per where the op runs, per check, its rows (tuples of numbers, dtypes and flags: nothing in them
# can change in place). Sizes are drawn in each row's range by the seed (pr-verdict: the judge's,
# per round). The interpreter's cases stay small (CPU time); a batch of 257 is the first that
# launches the op's many-row plan there (tests/op/test_batch_invariance.py).
CPU_CASES = (
    ("batch", ((257, 264, 1024, F32, False), (257, 264, 257, BF16, True))),
    ("quant", ((16, 24, 257, BF16, FP8, False), (16, 24, 64, BF16, I8, True))),
    ("qk", ((3, 5, 4, 2, 64, F32), (2, 3, 4, 1, 16, BF16), (3, 5, 4, 2, 16, F32, 2))),
)
CUDA_CASES = (
    ("batch", tuple((512, 2048, n, d, r) for n in (4096, 5000) for d in (F32, BF16) for r in (False, True))),
    ("quant", tuple((256, 1024, 4096, BF16, o, r) for o in (FP8, I8) for r in (False, True))),
    (
        "qk",
        (
            (256, 1024, 32, 8, 128, BF16),
            (1, 1, 32, 8, 128, BF16),
            (17, 40, 4, 2, 64, F32),
            (64, 256, 8, 4, 128, BF16, 4),
        ),
    ),
)
CASES = (("cpu", CPU_CASES), ("cuda", CUDA_CASES))
# The host stand-in of pr-verdict's worker (CPU tensors, any op): small, fp32.
HOST_CASES = (
    ("batch", ((257, 300, 64, F32, False), (257, 300, 64, F32, True))),
    ("quant", ((8, 16, 64, F32, FP8, False),)),
    ("qk", ((3, 5, 4, 2, 16, F32), (3, 5, 4, 2, 16, F32, 2))),
)
CHECKS = (("batch", batch_invariance), ("quant", quantised_output), ("qk", qk_norm_check))


def case_table(device) -> tuple:
    return _lookup(CASES, "cuda" if str(device).startswith("cuda") else "cpu")


def run(impl: InferenceImpl, device, which: str, table: tuple | None = None, seed: int = 0) -> Finding:
    """One check ("batch", "quant" or "qk") of ``impl`` on its cases for ``device``."""
    rows = _lookup(table if table is not None else case_table(device), which)
    return _lookup(CHECKS, which)(impl, device, rows, seed)


def judge(finding: Finding, limits) -> tuple[bool, str]:
    """(passed, key figure): every figure measured and within its limit, nothing failed, at least
    one case measured and none skipped for an option the implementation lacks."""
    bad = [k for k, v in finding.figures.items() if limits.get(k) is None or not v <= limits[k]]
    figure = ", ".join(f"{k} {v:.3g} (limit {limits.get(k)})" for k, v in finding.figures.items())
    if finding.unsupported:
        figure += f"; not supported: {'; '.join(finding.unsupported)}"
    if finding.failures:
        figure += f"; {len(finding.failures)} failed, first: {finding.failures[0]}"
    passed = not bad and not finding.failures and not finding.unsupported and bool(finding.figures)
    return passed, figure or "nothing measured"


def gate_figures(device, impl: InferenceImpl = op_impl, table=None, seed: int = 0, wanted=None) -> dict:
    """The figures of every check with a figure in ``wanted`` (None: all), as pr-verdict's worker
    reports them (results.Feature's JSON): ``ok`` with its value (its note naming cases skipped for
    an option the implementation lacks), ``failed`` with why, or ``unsupported`` where no case
    ran; ``cases``: the cases measured."""
    out = ()
    for which, keys in FIGURES:
        if wanted is not None and not any(k in wanted for k in keys):
            continue
        found = run(impl, device, which, table, seed)
        skipped = f"not supported: {'; '.join(found.unsupported)}"[:300] if found.unsupported else None
        for key in keys:
            if found.failures:
                note = f"{len(found.failures)} case(s) failed, first: {found.failures[0]}"[:300]
                out += ((key, "failed", None, note, found.cases),)
            elif key in found.figures:
                out += ((key, "ok", found.figures[key], skipped, found.cases),)
            else:
                out += ((key, "unsupported", None, skipped or "nothing measured", ()),)
    return {k: {"status": s, "value": v, "note": n, "cases": list(c)} for k, s, v, n, c in out}
