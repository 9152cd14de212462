"""PyTorch's own OpInfo samples for ``nn.functional.rms_norm`` (``op_db`` of
``torch.testing._internal.common_methods_invocations``) through ``rms_norm`` and ``RMSNorm``,
compared with torch by the rule of tests/op/differential_strategies.py; the OpInfo's error inputs,
and any sample torch rejects, must be rejected by ours with a ValueError or TypeError before
any launch. Skips with the reason where torch's internal testing API is unavailable.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

import rmsnorm_kernel
from rmsnorm_kernel import ops
from rmsnorm_kernel.launch import UnsupportedInput

from ..conftest import KERNEL_DEVICES
from .differential_strategies import DTYPES, assert_close, check_against_torch, default_eps


@functools.cache
def rms_norm_opinfo():
    """(torch's OpInfo for nn.functional.rms_norm, "") or (None, why not). Imported on first
    use, not at collection: the import takes seconds, and only the kernel tests need it. The
    import freezes torch.backends flags (disable_global_flags); they are unfrozen again, so that
    the other tests of the process see torch as they would without this module."""
    frozen = torch.backends.flags_frozen()
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as error:
        return None, f"torch.testing._internal.common_methods_invocations does not import: {error}"
    finally:
        if not frozen:
            setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)  # noqa: B010
    op = next((o for o in op_db if o.name == "nn.functional.rms_norm"), None)
    return (op, "") if op is not None else (None, "torch's op_db has no nn.functional.rms_norm")


def opinfo():
    op, reason = rms_norm_opinfo()
    if op is None:
        pytest.skip(reason)
    return op


def unpack(sample):
    """(x, normalized_shape, weight, eps) of a SampleInput of F.rms_norm(input, normalized_shape,
    weight=None, eps=None)."""
    args = list(sample.args) + [None] * (3 - len(sample.args))
    ns, weight, eps = args[0], sample.kwargs.get("weight", args[1]), sample.kwargs.get("eps", args[2])
    return sample.input, ns, weight, eps


def torch_accepts(x, ns, weight, eps) -> bool:
    try:
        with torch.no_grad():
            F.rms_norm(x, ns, weight, eps)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    return True


def assert_rejected(call) -> None:
    """``call`` raises a ValueError or TypeError (not UnsupportedInput) and launches nothing."""
    before = dict(ops.CALLS)
    with pytest.raises((ValueError, TypeError)) as raised:
        call()
    assert not isinstance(raised.value, UnsupportedInput), f"rejected as unsupported: {raised.value}"
    assert ops.CALLS == before


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "backward"])
def test_opinfo_samples_through_rms_norm(device, dtype, requires_grad):
    op = opinfo()
    samples = list(op.sample_inputs(device, dtype, requires_grad=requires_grad))
    assert samples, "the OpInfo gave no samples"
    gen = torch.Generator().manual_seed(0)
    for i, sample in enumerate(samples):
        x, ns, weight, eps = unpack(sample)
        if not torch_accepts(x, ns, weight, eps):
            assert_rejected(lambda: rmsnorm_kernel.rms_norm(x, ns, weight, eps))  # noqa: B023
            continue
        grad_y = torch.randn(x.shape, generator=gen).to(dtype=dtype, device=device) if requires_grad else None
        try:
            check_against_torch(x, ns, weight, eps, grad_y=grad_y)
        except AssertionError as error:
            raise AssertionError(f"sample {i}: {sample}\n{error}") from error


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opinfo_samples_through_module(device, dtype):
    """RMSNorm against torch.nn.RMSNorm on each sample: y, and x.grad and weight.grad against the
    float64 nn.RMSNorm (the oracle)."""
    op = opinfo()
    gen = torch.Generator().manual_seed(0)
    for i, sample in enumerate(op.sample_inputs(device, dtype, requires_grad=True)):
        x, ns, weight, eps = unpack(sample)
        if not torch_accepts(x, ns, weight, eps):
            continue  # rejected samples are test_opinfo_samples_through_rms_norm's
        affine = weight is not None
        ours = rmsnorm_kernel.RMSNorm(ns, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
        oracle = torch.nn.RMSNorm(ns, eps=default_eps(eps), elementwise_affine=affine, dtype=torch.float64)
        oracle = oracle.to(device)
        if affine:
            with torch.no_grad():
                ours.weight.copy_(weight)
                oracle.weight.copy_(weight)
        with torch.no_grad():
            theirs = torch.nn.RMSNorm(ns, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)
            if affine:
                theirs.weight.copy_(weight)
            want = theirs(x)
        x_ours = x.detach().requires_grad_()
        x64 = x.detach().double().requires_grad_()
        y, y64 = ours(x_ours), oracle(x64)
        what = f"sample {i} ({tuple(x.shape)}, {ns}, eps={eps})"
        assert y.dtype == want.dtype, f"{what}: y dtype {y.dtype}, torch's {want.dtype}"
        assert_close(y, want, dtype, what=f"{what}: y")
        grad_y = torch.randn(x.shape, generator=gen).to(dtype=dtype, device=device)
        y.backward(grad_y)
        y64.backward(grad_y.double())
        assert_close(x_ours.grad, x64.grad, dtype, what=f"{what}: x.grad")
        if affine:
            assert_close(ours.weight.grad, oracle.weight.grad, dtype, what=f"{what}: weight.grad")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_opinfo_error_inputs_rejected(device):
    op = opinfo()
    if op.error_inputs_func is None:
        pytest.skip("the OpInfo declares no error inputs")
    errors = list(op.error_inputs(device))
    assert errors, "the OpInfo gave no error inputs"
    for error in errors:
        x, ns, weight, eps = unpack(error.sample_input)
        with pytest.raises(error.error_type):  # torch's own rejection, as the OpInfo declares it
            F.rms_norm(x, ns, weight, eps)
        assert_rejected(lambda: rmsnorm_kernel.rms_norm(x, ns, weight, eps))  # noqa: B023
