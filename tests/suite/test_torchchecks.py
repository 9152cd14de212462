"""The checks of rmsnorm_suite.torchchecks can fail: a wrong value, a failed opcheck test, a compiled
path that skips the kernels each come back as a listed failure, not a pass. (The checks on the
op itself run in tests/op/test_kernels.py.)"""

import pytest
import torch

from rmsnorm_suite import cases, torchchecks

from ..conftest import HAS_CUDA, requires_interpret


def test_mismatch_takes_the_coarser_dtypes_tolerance():
    expected = torch.ones(4)
    assert torchchecks.mismatch(expected + 5e-6, expected, torch.float32) is None
    assert "1/4 elements" in torchchecks.mismatch(
        expected + torch.tensor([0, 0, 0, 1e-3]), expected, torch.float32
    )
    # a bf16 result is held to bf16's row even where x was fp32
    tol = cases.TOLERANCES[torch.bfloat16]
    near = (expected + tol.atol / 2).to(torch.bfloat16)
    assert torchchecks.mismatch(near, expected, torch.float32) is None


@pytest.mark.parametrize(
    "actual, reason",
    [
        (torch.tensor([1.0, float("nan")]), "1/2 elements"),
        (torch.tensor([1.0, float("inf")]), "1/2 elements"),
        (torch.tensor([1.0]), "shape (1,), expected (2,)"),
    ],
)
def test_mismatch_fails_nan_inf_and_shape(actual, reason):
    assert reason in torchchecks.mismatch(actual, torch.ones(2), torch.float32)


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_graph_capture_refuses_without_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        torchchecks.cuda_graph_capture(torchchecks.CUDA_GRAPH_CASES[0])


def test_compile_refuses_too_few_batch_sizes():
    with pytest.raises(ValueError, match="batches"):
        torchchecks.compile_fullgraph("cpu", batches=(3, 5))


@pytest.mark.interpret
@requires_interpret
def test_opcheck_lists_a_failed_test(monkeypatch):
    real = torch.library.opcheck

    def fake_fails(op, args, **kwargs):
        results = real(op, args, **kwargs)
        return {**results, "test_faketensor": RuntimeError("fake returned the wrong shape")}

    monkeypatch.setattr(torch.library, "opcheck", fake_fails)
    result = torchchecks.opcheck("cpu", (torch.float32,))
    assert not result.passed
    assert len(result.failures) == 4  # both ops, without and with a residual
    assert (
        result.failures[0] == "forward float32 test_faketensor: RuntimeError: fake returned the wrong shape"
    )
    assert result.figure.startswith("12/16 opcheck tests")


@pytest.mark.interpret
@requires_interpret
def test_compile_fails_where_the_kernels_do_not_run(monkeypatch):
    """rms_norm swapped for torch's own: it compiles and agrees, but the kernel counters show that
    the compiled and eager passes never reached the kernels."""
    monkeypatch.setattr(
        torchchecks,
        "_functional",
        lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, cases.EPS),
    )
    result = torchchecks.compile_fullgraph("cpu", batches=(3, 8, 17))
    calls = [f for f in result.failures if "kernel calls" in f]
    assert [f.split(":")[0] for f in calls] == ["rms_norm M=3", "rms_norm M=8", "rms_norm M=17"]
    assert not [f for f in result.failures if f.startswith("model")]
