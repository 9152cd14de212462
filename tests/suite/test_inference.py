"""The inference features' checks (rmsnorm_suite.inference): batch invariance, quantised output
and QK-norm. Each passes on the op (under the interpreter) and on an honest torch implementation,
and fails on a deliberately broken one: rows that depend on the batch size, a quantisation that
truncates or scales differently, a QK-norm with the weights of q and k swapped. The limits are
regression.toml's [features] (read before any comparison); the verdict holds the figures to them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rmsnorm_suite import inference
from rmsnorm_suite.thresholds import load_thresholds

from ..conftest import KERNEL_DEVICES

LIMITS = load_thresholds().features
FIGURES = dict(inference.FIGURES)


def _norm(x, w, r, eps):
    h = (x.float() + r.float()).to(x.dtype) if r is not None else x
    return F.rms_norm(h.float(), (x.shape[-1],), w.float(), eps).to(x.dtype), (h if r is not None else None)


def _qk(q, k, wq, wk, eps):
    return tuple(
        F.rms_norm(t.float(), (t.shape[-1],), w.float(), eps).to(t.dtype) for t, w in ((q, wq), (k, wk))
    )


torch_impl = inference.InferenceImpl(
    "torch",
    forward=lambda x, w, r, eps: tuple(t.detach() if t is not None else None for t in _norm(x, w, r, eps)),
    norm=lambda x, w, r, eps: _norm(x, w, r, eps)[0],
    quantise=lambda x, w, r, eps, dt: inference.torch_quantise(inference.torch_norm32(x, w, r, eps), dt),
    norm32=inference.torch_norm32,
    qk=_qk,
    rms_norm=lambda x, w, eps: F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype),
)


def _batch_dependent(x, w, r, eps):
    """The honest norm, scaled by a tiny term that grows with the rows in the call."""
    y, h = _norm(x, w, r, eps)
    return (y.float() * (1 + x.shape[0] * 2.0**-20)).to(y.dtype), h


def _truncating(x, w, r, eps, dt):
    """int8 by truncation toward zero (a cast without torch.round); fp8 as torch does."""
    y32 = inference.torch_norm32(x, w, r, eps)
    if dt != torch.int8:
        return inference.torch_quantise(y32, dt)
    scales = (y32.abs().amax(-1, keepdim=True) / 127.0).clamp(min=inference.min_scale(dt))
    return (y32 / scales).clamp(-128, 127).to(torch.int8), scales


def _loose_scale(x, w, r, eps, dt):
    """Scales from amax over a QMAX 1% too small: every code and scale moves."""
    y32 = inference.torch_norm32(x, w, r, eps)
    scales = y32.abs().amax(-1, keepdim=True) / (inference.qmax(dt) * 0.99)
    v = y32 / scales
    v = torch.round(v) if dt == torch.int8 else v
    return v.clamp(inference.qmin(dt), inference.qmax(dt)).to(dt), scales


def _off32(x, w, r, eps):
    """The fp32 y 1e-3 off on every element under half its row's amax (the amax, so the scale,
    unchanged): quantised from it exactly as torch would, only quant_fp32 holds it to torch's norm."""
    y = inference.torch_norm32(x, w, r, eps)
    return y + 1e-3 * (y.abs() < 0.5 * y.abs().amax(-1, keepdim=True))


BROKEN = {
    "batch": dataclasses.replace(
        torch_impl,
        name="batch-dependent",
        forward=_batch_dependent,
        norm=lambda x, w, r, eps: _batch_dependent(x, w, r, eps)[0],
    ),
    "quant-truncating": dataclasses.replace(torch_impl, name="truncating", quantise=_truncating),
    "quant-scale": dataclasses.replace(torch_impl, name="loose scale", quantise=_loose_scale),
    "quant-fp32": dataclasses.replace(
        torch_impl,
        name="fp32 y off",
        norm32=_off32,
        quantise=lambda x, w, r, eps, dt: inference.torch_quantise(_off32(x, w, r, eps), dt),
    ),
    "qk": dataclasses.replace(
        torch_impl, name="weights swapped", qk=lambda q, k, wq, wk, eps: _qk(q, k, wk, wq, eps)
    ),
    "qk-one-stride": dataclasses.replace(
        torch_impl,
        name="one stride read",
        qk=lambda q, k, wq, wk, eps: _qk(_one_stride(q), _one_stride(k), wq, wk, eps),
    ),
}


def _one_stride(t):
    """A (batch, heads, tokens, d) view read as if its leading dims flattened to one stride (the
    heads' stride), as a kernel blind to the outer stride would read it; other views as they are."""
    if t.dim() != 4 or t.is_contiguous():
        return t
    strides = (t.shape[1] * t.stride(1), *t.stride()[1:])
    return torch.as_strided(t, t.shape, strides, t.storage_offset())


def test_the_one_stride_reader_fails_the_heads_first_case_alone():
    """The heads-first case (Gemma3's layout) is what catches an op that reads such views as one
    stride: without it the same op passes, with it both QK figures fail, in every table."""
    broken = BROKEN["qk-one-stride"]
    for table in (inference.CPU_CASES, inference.HOST_CASES):
        rows = dict(table)["qk"]
        without = inference.run(broken, "cpu", "qk", (("qk", tuple(r for r in rows if len(r) == 6)),))
        assert inference.judge(without, LIMITS)[0]
        found = inference.run(broken, "cpu", "qk", table)
        assert found.figures["qk_bits"] > 0 and found.figures["qk_tolerance"] > LIMITS["qk_tolerance"]


def test_limits_are_declared():
    assert set(LIMITS) == {k for keys in FIGURES.values() for k in keys}
    assert LIMITS["batch_invariance"] == 0 and LIMITS["quant_bits"] == 0 and LIMITS["qk_bits"] == 0


@pytest.mark.parametrize("which", ["batch", "quant", "qk"])
def test_an_honest_torch_implementation_passes(which):
    finding = inference.run(torch_impl, "cpu", which)
    passed, figure = inference.judge(finding, LIMITS)
    assert passed, figure
    assert set(finding.figures) == set(FIGURES[which])


@pytest.mark.parametrize(
    "name, which, figure",
    [
        ("batch", "batch", "batch_invariance"),
        ("quant-truncating", "quant", "quant_bits"),
        ("quant-scale", "quant", "quant_scales"),
        ("quant-fp32", "quant", "quant_fp32"),
        ("qk", "qk", "qk_bits"),
        ("qk-one-stride", "qk", "qk_tolerance"),
    ],
)
def test_a_broken_implementation_fails(name, which, figure):
    finding = inference.run(BROKEN[name], "cpu", which)
    passed, text = inference.judge(finding, LIMITS)
    assert not passed, text
    assert finding.figures[figure] > LIMITS[figure], text


def test_a_crash_fails_and_a_missing_option_is_unsupported():
    """Support is the implementation's options, asked once before any case: an option it lacks
    skips the cases that need it (named, and never a full pass); after that any exception is a
    failure, whatever its type or message."""

    def crash(*args):
        raise RuntimeError("boom")

    def old(x, w, r, eps):
        if r is not None:
            raise TypeError("rms_norm() got an unexpected keyword argument 'residual'")
        return _norm(x, w, r, eps)

    crashed = inference.run(dataclasses.replace(torch_impl, qk=crash), "cpu", "qk")
    assert crashed.failures and not inference.judge(crashed, LIMITS)[0]
    # claims the residual (the default options) and raises on it: failed, not "unsupported"
    claims = inference.run(dataclasses.replace(torch_impl, forward=old), "cpu", "batch")
    assert claims.failures and not claims.unsupported and not inference.judge(claims, LIMITS)[0]
    without = frozenset(inference.OPTIONS) - {"residual"}
    older = dataclasses.replace(torch_impl, forward=old, options=lambda: without)
    found = inference.run(older, "cpu", "batch")
    assert found.unsupported and not found.failures and "batch_invariance" in found.figures
    assert not inference.judge(found, LIMITS)[0]  # partly measured is not a pass
    assert len(found.cases) == 1 and "residual" not in found.cases[0]
    figures = inference.gate_figures("cpu", dataclasses.replace(older, qk=crash), inference.HOST_CASES)
    assert figures["qk_bits"]["status"] == "failed"
    batch = figures["batch_invariance"]
    assert batch["status"] == "ok" and "no residual" in batch["note"] and len(batch["cases"]) == 1
    no_qk = dataclasses.replace(torch_impl, options=lambda: frozenset(inference.OPTIONS) - {"qk_norm"})
    assert inference.gate_figures("cpu", no_qk, inference.HOST_CASES)["qk_bits"]["status"] == "unsupported"


class _Subclass(torch.Tensor):
    pass


def _with(forward=None, quantise=None):
    impl = torch_impl
    if forward is not None:
        impl = dataclasses.replace(impl, forward=forward)
    return dataclasses.replace(impl, quantise=quantise) if quantise is not None else impl


def _exits(*args):
    raise SystemExit(0)


WRONG = {
    "not a tensor": ("batch", _with(forward=lambda x, w, r, eps: ([0.0], None))),
    "h None with a residual": ("batch", _with(forward=lambda x, w, r, eps: (_norm(x, w, r, eps)[0], None))),
    "a tensor subclass": (
        "batch",
        _with(
            forward=lambda x, w, r, eps: (
                _norm(x, w, r, eps)[0].as_subclass(_Subclass),
                _norm(x, w, r, eps)[1],
            )
        ),
    ),
    "SystemExit": ("batch", _with(forward=_exits)),
    "scales of the wrong numel": (
        "quant",
        _with(quantise=lambda x, w, r, eps, dt: (torch_impl.quantise(x, w, r, eps, dt)[0], torch.ones(3))),
    ),
    "a scalar for scales": (
        "quant",
        _with(quantise=lambda x, w, r, eps, dt: (torch_impl.quantise(x, w, r, eps, dt)[0], 1.0)),
    ),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_output_fails_the_check(name):
    which, impl = WRONG[name]
    figures = inference.gate_figures("cpu", impl, inference.HOST_CASES, wanted=FIGURES[which])
    assert set(figures) == set(FIGURES[which])
    assert all(f["status"] == "failed" for f in figures.values()), figures


def test_sizes_and_data_follow_the_seed():
    seen = []

    def forward(x, w, r, eps):
        seen.append((x.shape[0], float(x[0, 0])))
        return torch_impl.forward(x, w, r, eps)

    impl = _with(forward=forward)
    for seed in (1, 2):
        inference.run(impl, "cpu", "batch", inference.HOST_CASES, seed=seed)
    half = len(seen) // 2
    assert seen[:half] != seen[half:]
    assert all(257 <= m <= 300 for m, _ in seen[::3])  # each case's large batch


@pytest.mark.parametrize("device", [p for p in KERNEL_DEVICES])
@pytest.mark.parametrize("which", ["batch", "quant", "qk"])
def test_the_op_passes(device, which):
    finding = inference.run(inference.op_impl, device, which)
    passed, figure = inference.judge(finding, LIMITS)
    assert passed, figure


@pytest.mark.parametrize("device", [p for p in KERNEL_DEVICES])
def test_the_op_with_a_batch_dependent_term_fails(device):
    """The op itself, its rows scaled by a tiny term that grows with the batch."""

    def forward(x, w, r, eps):
        y, h = inference.op_impl.forward(x, w, r, eps)
        return (y.float() * (1 + x.shape[0] * 2.0**-20)).to(y.dtype), h

    broken = dataclasses.replace(inference.op_impl, forward=forward)
    finding = inference.run(broken, device, "batch")
    assert finding.figures["batch_invariance"] > LIMITS["batch_invariance"]
