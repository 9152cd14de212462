"""The inference features' benchmark providers (rmsnorm_suite.featurebench) at tiny shapes under
the interpreter: each builds, and its results agree with torch's (tolerances declared first: the
quantised codes within regression.toml's quant_quanta of torch's sequence, QK-norm within
cases.TOLERANCES and the op on copies bit for bit); bytes moved; the command without CUDA."""

from __future__ import annotations

import pytest
import torch

from rmsnorm_suite import cases, cli, featurebench, inference
from rmsnorm_suite.featurebench import FEATURE_PROVIDERS, FeatureShape
from rmsnorm_suite.thresholds import load_thresholds

from ..conftest import KERNEL_DEVICES

QUANTA = load_thresholds().features["quant_quanta"]
TOL = cases.TOLERANCES
EPS = 1e-6
TINY = {
    "quant": FeatureShape("quant", 5, n=64, dtype=torch.float32),
    "qk": FeatureShape("qk", 3, n=96, hq=4, hk=2, d=16, dtype=torch.float32),
}


def test_shapes_and_bytes():
    names = [s.name for s in featurebench.FEATURE_SHAPES]
    assert "qk-32768x32+8x128-bfloat16" in names and "quant-1x4096-bfloat16" in names
    assert {s.group for s in featurebench.feature_shapes("qk", ["decode"])} == {"decode"}
    qk = featurebench.feature_shapes("qk", ["qk-256x32+8x128-bfloat16"])[0]
    assert (
        qk.nbytes("forward") == 2 * 256 * 40 * 128 * 2
        and qk.nbytes("forward_backward") == 5 * 256 * 40 * 128 * 2
    )
    quant = featurebench.feature_shapes("quant", ["quant-256x4096-bfloat16"])[0]
    assert quant.nbytes("forward") == 256 * 4096 * 3 + 4 * 256
    with pytest.raises(ValueError, match="unknown qk shapes"):
        featurebench.feature_shapes("qk", ["quant-1x4096-bfloat16"])


def test_without_cuda_the_command_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["benchmark", "--feature", "qk", "--shapes", "decode"]) == 2
    assert "CUDA" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not qk providers"):
        cli.main(["benchmark", "--feature", "qk", "--providers", "kernel_fp8"])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("out", ["fp8", "int8"])
def test_quant_providers_agree_with_torch(device, out):
    dt = {"fp8": inference.FP8, "int8": inference.I8}[out]
    inp = featurebench.make_inputs(TINY["quant"], device)
    ref_q, ref_s = FEATURE_PROVIDERS[f"torch_{out}"].build(EPS)(inp)
    y_q, scales = FEATURE_PROVIDERS[f"kernel_{out}"].build(EPS)(inp)
    assert y_q.dtype == dt and y_q.shape == ref_q.shape
    assert inference.codes_apart(y_q, ref_q).max().item() <= QUANTA
    errs = featurebench.errors(
        FEATURE_PROVIDERS[f"kernel_{out}"], FEATURE_PROVIDERS[f"kernel_{out}"].build(EPS), inp, "forward", EPS
    )
    assert 0 < errs["y"] < 0.1  # the dequantised y against the float64 formula: quantisation error only
    torch.testing.assert_close(
        scales.reshape(ref_s.shape), ref_s, rtol=load_thresholds().features["quant_scales"], atol=0
    )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
def test_qk_providers_agree_with_torch(device, mode):
    inp = featurebench.make_inputs(TINY["qk"], device)
    outs = {}
    for name in featurebench.providers_of("qk"):
        fn = FEATURE_PROVIDERS[name].build(EPS)
        call, leaves = featurebench.make_call(fn, inp, mode)
        got = call()
        outs[name] = got if mode == "forward" else [t.grad for t in leaves]
        errs = featurebench.errors(FEATURE_PROVIDERS[name], fn, inp, mode, EPS)
        assert max(errs.values()) < 1e-5, (name, errs)  # fp32 against the float64 formula
    tol = TOL[torch.float32]
    for a, b in zip(outs["kernel_qk"], outs["torch_qk"]):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol)
    if mode == "forward":  # the op on copies: the same bits as the in-place path
        assert all(torch.equal(a, b) for a, b in zip(outs["kernel_qk"], outs["kernel_qk_copies"]))
