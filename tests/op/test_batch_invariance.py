"""Batch invariance: a row's outputs are the same bits whatever the number of rows in the call
and wherever the row sits, for every kernel dtype, with and without a residual, forward (y, h)
and backward (dx; dw sums over rows and is exempt). Under the interpreter on CPU and on CUDA.

With launch.BATCH_INVARIANT off, launches of at most EVEN_MAX_ROWS rows take the hardware
rsqrt estimate and a Newton step (and, on the GPU, other warps per row), and rows of a batch of
1 or 7 can round differently from the same rows in a batch of 512: these tests fail there."""

import pytest
import torch

import rmsnorm_kernel
from rmsnorm_kernel import launch

from ..conftest import KERNEL_DEVICES

# Batches: 1 and 7 rows (few-row launches) and a large one: 512 on CUDA; under the interpreter
# 257 (EVEN_MAX_ROWS + 1, the first batch that launches the many-row plan), for its CPU time. Row
# widths: the tile forward's narrow (several rows per program), masked and power-of-two widths,
# and the two-walk forward (N > FORWARD_MAX_TILE).
SMALL_BATCHES = (1, 7)
LARGE_BATCH = {"cpu": launch.TUNING.EVEN_MAX_ROWS + 1, "cuda": 512}
WIDTHS = (128, 257, 1024, 4096, 5000)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
INTERPRET, CUDA = KERNEL_DEVICES


def _cases(widths, interpreted):
    """(device, n, dtype, residual) params: every combination on CUDA; under the interpreter the
    few in ``interpreted`` (each of which fails with batch invariance off, but 257 bf16)."""
    out = [
        pytest.param(
            "cpu", n, d, r, marks=INTERPRET.marks, id=f"interpret-{n}-{_NAMES[d]}-{'res' if r else 'plain'}"
        )
        for n, d, r in interpreted
    ]
    out += [
        pytest.param("cuda", n, d, r, marks=CUDA.marks, id=f"cuda-{n}-{_NAMES[d]}-{'res' if r else 'plain'}")
        for n in widths
        for d in DTYPES
        for r in (False, True)
    ]
    return out


FORWARD_CASES = _cases(
    WIDTHS,
    [(1024, torch.float32, False), (4096, torch.float16, True), (257, torch.bfloat16, True),
     (5000, torch.float32, True)],
)  # fmt: skip
BACKWARD_CASES = _cases((257, 4096, 5000), [(1024, torch.float32, True)])


def _rows(m, n, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, n, generator=g) * torch.rand(m, 1, generator=g).add(0.05) * 4).to(dtype)
    res = torch.randn(m, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return x.to(device), res.to(device), w.to(device), dy.to(device)


def _call(x, res, w, dy, residual, backward):
    """(y, h or None, dx or None) of one call on fresh copies of the rows."""
    x = x.clone().requires_grad_(backward)
    r = res.clone().requires_grad_(backward) if residual else None
    with torch.set_grad_enabled(backward):
        out = rmsnorm_kernel.rms_norm(x, weight=w, eps=1e-6, residual=r)
        y, h = out if residual else (out, None)
        if backward:
            y.backward(dy)
    return y.detach(), (h.detach() if h is not None else None), (x.grad if backward else None)


def _same_bits(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _picks(large, m, device):
    """Rows from all over the large batch, reversed: each sits elsewhere than in the large call."""
    return torch.linspace(large - 1, 0, m).round().long().to(device)


@pytest.mark.parametrize(("device", "n", "dtype", "residual"), FORWARD_CASES)
def test_a_rows_forward_bits_do_not_depend_on_the_batch(device, n, dtype, residual):
    """Tolerance: none (bit for bit), y and h. Each row of a batch of 1 and of 7 (rows taken from
    the large batch, in another order) against the same row in the large batch."""
    large = LARGE_BATCH[device]
    x, res, w, dy = _rows(large, n, dtype, device, seed=n)
    y_all, h_all, _ = _call(x, res, w, dy, residual, backward=False)
    for m in SMALL_BATCHES:
        idx = _picks(large, m, device)
        y, h, _ = _call(x[idx], res[idx], w, dy[idx], residual, backward=False)
        assert _same_bits(y, y_all[idx]), f"y of a batch of {m} differs from the same rows in {large}"
        if residual:
            assert _same_bits(h, h_all[idx])


@pytest.mark.parametrize(("device", "n", "dtype", "residual"), BACKWARD_CASES)
def test_a_rows_dx_bits_do_not_depend_on_the_batch(device, n, dtype, residual):
    """Tolerance: none (bit for bit), dx of each row at batch 1 and 7 against the large batch.
    dw is a sum over the call's rows: exempt."""
    large = LARGE_BATCH[device]
    x, res, w, dy = _rows(large, n, dtype, device, seed=n + 1)
    _, _, dx_all = _call(x, res, w, dy, residual, backward=True)
    for m in SMALL_BATCHES:
        idx = _picks(large, m, device)
        _, _, dx = _call(x[idx], res[idx], w, dy[idx], residual, backward=True)
        assert _same_bits(dx, dx_all[idx]), f"dx of a batch of {m} differs from the same rows in {large}"
