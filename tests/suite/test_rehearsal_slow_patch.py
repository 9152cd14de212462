"""The slower heads `tools/gate_rehearsal.py ab --slow` writes: the work they add, on CPU, not timed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gate_rehearsal.py"
spec = importlib.util.spec_from_file_location("gate_rehearsal_under_test", TOOL)
rehearsal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rehearsal)


def patched(which: str, percent: float):
    """The patch run on a stand-in op (a plain RMSNorm) that records the rows of every call and
    of every backward; returns (rms_norm as patched, the record)."""
    seen = {"forward": [], "backward": []}

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward"].append(x.shape[0])
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dy):
            seen["backward"].append(dy.shape[0])
            return dy

    def rms_norm(x, weight=None, eps=1e-6):
        x = Record.apply(x)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * weight if weight is not None else y

    namespace = {"rms_norm": rms_norm}
    exec(compile(rehearsal.slow_patch(which, percent), "patch", "exec"), namespace)
    return namespace["rms_norm"], rms_norm, seen


def test_slow_forward_adds_a_forward_over_p_percent_of_the_rows():
    op, plain, seen = patched("forward", 5)
    x, w = torch.randn(200, 16), torch.randn(16)
    torch.testing.assert_close(op(x, w), plain(x, w))
    assert seen["forward"] == [10, 200, 200]  # 5% of 200 rows, then the call itself (and plain's)


def test_slow_backward_leaves_the_forward_and_adds_a_share_to_the_backward():
    op, plain, seen = patched("backward", 10)
    x = torch.randn(500, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    y = op(x, w)
    assert seen["forward"] == [500]  # nothing added to the forward
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    share = round(500 * 0.10 * 3 / 5)  # the extra bytes: 10% of the backward's
    assert seen["forward"] == [500, share] and sorted(seen["backward"]) == [share, 500]
    ref_dx, ref_dw = torch.autograd.grad(plain(x, w), (x, w), dy)
    torch.testing.assert_close((dx, dw), (ref_dx, ref_dw))  # the gradients are the op's
    with torch.no_grad():
        op(x, w)
    assert seen["forward"] == [500, share, 500, 500]  # no autograd: the call alone


@pytest.mark.parametrize(("which", "percent"), [("sideways", 5), ("forward", 0), ("backward", 101)])
def test_slow_patch_refuses_what_it_cannot_write(which, percent):
    with pytest.raises(ValueError):
        rehearsal.slow_patch(which, percent)
