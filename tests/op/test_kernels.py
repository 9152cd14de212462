"""The real Triton kernels against the reference: layouts, dtypes, features, determinism and the
torch integration (opcheck, torch.compile, CUDA graphs). Each test runs under the interpreter on
CPU (nox -s interpret) and on CUDA (nox -s gpu); tolerances come from rmsnorm_suite.cases."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import rmsnorm_kernel
from rmsnorm_kernel import kernels, launch
from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference
from rmsnorm_suite import torchchecks
from rmsnorm_suite.cases import TOLERANCES, dtype_name

from ..conftest import HAS_CUDA, KERNEL_DEVICES, requires_cuda, requires_interpret

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def assert_close(actual, expected, dtype):
    """Element-wise bound of the declared tolerance: the row of the coarser of ``dtype`` (x's)
    and the result's own dtype (a bf16 dw of fp32 activations carries bf16 rounding)."""
    coarser = max((dtype, actual.dtype), key=lambda d: torch.finfo(d).eps)
    tol = TOLERANCES[coarser]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol.atol, rtol=tol.rtol)


def make(shape, dtype, device, seed=0, weight_dtype=None, n=None):
    g = torch.Generator().manual_seed(seed)
    n = n or shape[-1]
    x = torch.randn(*shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(weight_dtype or dtype)
    dy = torch.randn(*shape, generator=g).to(dtype)
    return x.to(device), w.to(device), dy.to(device)


def run_kernel(x, w, dy, **kwargs):
    # detach(), not clone(): a clone of strided rows is contiguous, and the strided tests are
    # about the op reading x's own layout.
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_() if w is not None else None
    y = rmsnorm_kernel.rms_norm(xg, weight=wg, **kwargs)
    y.backward(dy)
    return y.detach(), xg.grad, (wg.grad if wg is not None else None)


def check_against_reference(x, w, dy, dtype, eps=1e-6):
    y, dx, dw = run_kernel(x, w, dy, eps=eps)
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    assert_close(y, rms_norm_reference(x, w, eps), dtype)
    dx_ref, dw_ref = rms_norm_backward_reference(x, w, dy, eps)
    assert_close(dx, dx_ref, dtype)
    if w is not None:
        assert dw.dtype == w.dtype
        assert_close(dw, dw_ref, dtype)
    return y, dx, dw


# (M, N): odd sizes, M = 0, 1, 17; N = 1, 257, 1000 and 4096 (the tile backward with its next
# row block prefetched; at N = 1000 two rows per block and a last block of one row), 4097 (two-walk path, 2 chunks), 12289 (two-walk,
# 4 chunks, the most it has), 16384 (a multiple of the forward's chunk: its walks without masks)
# and N above the two-walk backward (the wide forward's chunks and the segmented backward):
# 24577 (two chunks, the second one element past a full chunk; 64 rows), 65537 and 131073.
SHAPES = [
    (0, 257),
    (1, 1),
    (1, 257),
    (17, 257),
    (17, 1000),
    (33, 4096),
    (17, 4097),
    (3, 12289),
    (2, 16384),
    (1, 65537),
    (3, 65537),
    (64, 24577),
    (2, 131073),
    (17, 64),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("m", "n"), SHAPES)
def test_forward_and_backward(device, dtype, m, n):
    x, w, dy = make((m, n), dtype, device)
    check_against_reference(x, w, dy, dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_three_d_input(device, dtype):
    x, w, dy = make((2, 3, 257), dtype, device)
    y, _, _ = check_against_reference(x, w, dy, dtype)
    assert y.shape == (2, 3, 257)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_normalized_shape_over_two_dims(device):
    x, w, dy = make((5, 4, 33), F32, device, n=4 * 33)
    w = w.view(4, 33)
    y = rmsnorm_kernel.rms_norm(x, (4, 33), w)
    expected = rms_norm_reference(x.view(5, -1), w.reshape(-1)).view(5, 4, 33)
    assert_close(y, expected, F32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("layout", ["column slice", "every other row", "3-D every other row", "transposed"])
def test_strided_inputs_are_read_in_place_or_copied_correctly(device, layout):
    base, w, _ = make((34, 600), F16, device)
    w = w[:257].contiguous()
    x = {
        "column slice": base[:17, 100:357],  # rows of a wider tensor: row stride 600
        "every other row": base[::2, :257],  # row stride 1200
        "3-D every other row": base[:, :257].reshape(2, 17, 257)[:, ::2],  # not viewable as 2-D: copied
        "transposed": base[:, :257].t().contiguous().t()[:17],  # last-dim stride 34: copied
    }[layout]
    dy = torch.randn(x.shape, dtype=F16, device=device)
    before = base.clone()
    check_against_reference(x, w, dy, F16)
    assert torch.equal(base, before), "the input must not be modified"


# The two-walk and wide forwards take N as the row stride where rows are contiguous and read
# the runtime stride otherwise: strided rows on both paths (N = 9000: two-walk, 3 chunks;
# 24577: wide, the last chunk one element past a full one).
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("n", [9000, 24577])
@pytest.mark.parametrize("layout", ["column slice", "every other row"])
def test_strided_rows_on_the_walked_paths(device, n, layout):
    base, w, _ = make((6, n + 40), BF16, device)
    w = w[:n].contiguous()
    x = base[:3, 40:] if layout == "column slice" else base[::2, :n]
    assert x.stride(0) != n
    dy = torch.randn(x.shape, dtype=BF16, device=device)
    before = base.clone()
    check_against_reference(x, w, dy, BF16)
    assert torch.equal(base, before), "the input must not be modified"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(BF16, F32), (F16, F32), (F32, BF16), (BF16, F16)])
def test_mixed_weight_dtype(device, x_dtype, w_dtype):
    x, w, dy = make((17, 257), x_dtype, device, weight_dtype=w_dtype)
    check_against_reference(x, w, dy, x_dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("n", [257, 24577])
def test_no_weight(device, dtype, n):
    x, _, dy = make((17, n), dtype, device)
    check_against_reference(x, None, dy, dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("n", [257, 9000, 65537])  # tile, two-walk (3 chunks), wide paths
def test_dw_is_bitwise_deterministic_and_dy_untouched(device, n):
    x, w, dy = make((9, n), BF16, device)
    dy_before = dy.clone()
    results = [run_kernel(x, w, dy) for _ in range(3)]
    for y, dx, dw in results[1:]:
        assert (
            torch.equal(dw, results[0][2])
            and torch.equal(dx, results[0][1])
            and torch.equal(y, results[0][0])
        )
    assert torch.equal(dy, dy_before), "dy must never be modified in place"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("n", [257, 24577, 65537])  # tile, wide forward and segmented backward
def test_nan_or_inf_stays_in_its_row(device, n):
    """A NaN or inf in one row reaches that row's y and dx only: the other rows of the same
    program (tile) and of the same row group (segmented backward) stay exact."""
    x, w, dy = make((6, n), F32, device)
    x[1, 5] = float("nan")
    x[2, -1] = -float("nan")
    x[3, 0] = float("inf")
    dy[4, 7] = -float("nan")
    y, dx, dw = run_kernel(x, w, dy)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.isnan(dx[1]).all() and torch.isnan(dx[4]).all()
    finite = [0, 5]
    dx_ref, _ = rms_norm_backward_reference(x[finite], w, dy[finite])
    assert_close(y[finite], rms_norm_reference(x[finite], w), F32)
    assert_close(dx[finite], dx_ref, F32)


@triton.jit
def _rsqrt_newton_probe(V, R, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(V + i, mask=i < n, other=1.0)
    tl.store(R + i, kernels._rsqrt_newton(v), mask=i < n)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rsqrt_newton_within_an_ulp_and_exact_at_special_values(device):
    """The few-row forward's r: within an ulp of 1 / sqrt(v) (fp64) for v from subnormal to near
    the largest float (the Newton step's bound: half an ulp before its final rounding), and
    exact where the estimate is (0 -> inf, inf -> 0, NaN and negative -> NaN)."""
    g = torch.Generator().manual_seed(0)
    finite = torch.cat([
        torch.exp2(torch.empty(4000).uniform_(-149, 127, generator=g)),  # log-uniform, subnormals too
        torch.tensor([1e-45, 1e-40, 1.1754942e-38, 1.0, 2.0, 3.0, 4.0, 3.4e38]),
    ]).float()  # fmt: skip
    special = torch.tensor([0.0, float("inf"), float("nan"), -1.0])
    v = torch.cat([finite, special]).to(device)
    r = torch.empty_like(v)
    _rsqrt_newton_probe[(1,)](v, r, v.numel(), BLOCK=triton.next_power_of_2(v.numel()))
    r = r.cpu()
    k = finite.numel()
    exact = 1 / finite.double().sqrt()
    ulp = torch.nextafter(exact.float(), torch.tensor(float("inf"))).double() - exact.float().double()
    ulps = ((r[:k].double() - exact).abs() / ulp).max().item()
    assert ulps <= 1.0 + 1e-3, f"r is {ulps:.3f} ulps from 1 / sqrt(v)"
    assert r[k] == float("inf") and r[k + 1] == 0.0 and r[k + 2 :].isnan().all()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_dw_skipped_when_weight_frozen(device):
    x, w, dy = make((17, 257), F32, device)
    xg = x.clone().requires_grad_()
    y = rmsnorm_kernel.rms_norm(xg, weight=w)  # w does not require grad
    y.backward(dy)
    assert w.grad is None
    assert_close(xg.grad, rms_norm_backward_reference(x, w, dy)[0], F32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_eps_none_is_torch_default(device):
    x, w, _ = make((4, 64), F32, device)
    y = rmsnorm_kernel.RMSNorm(64, eps=None).to(device)(x)
    assert_close(y, torch.nn.functional.rms_norm(x, (64,), None, None) * 1.0, F32)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_module_matches_torch_module(device):
    x, _, _ = make((17, 257), BF16, device)
    ours = rmsnorm_kernel.RMSNorm(257, eps=1e-5, device=device, dtype=BF16)
    theirs = torch.nn.RMSNorm(257, eps=1e-5, device=device, dtype=BF16)
    with torch.no_grad():
        ours.weight.normal_()
    theirs.load_state_dict(ours.state_dict())
    assert_close(ours(x), theirs(x), BF16)


# ---------------------------------------------------------------------------------------------
# torch integration
# ---------------------------------------------------------------------------------------------


# The checks are those of rmsnorm_suite.torchchecks, which `verdict` reports: one implementation of each.


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_name)
def test_opcheck(device, dtype):
    """Both custom ops, the forward without and with a residual, the backward without and with dh."""
    result = torchchecks.opcheck(device, (dtype,))
    assert result.passed, result.failures


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compile_fullgraph_without_recompiling_per_batch(device):
    result = torchchecks.compile_fullgraph(device)
    assert result.passed, result.failures


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("case", torchchecks.CUDA_GRAPH_CASES, ids=lambda c: c.name.replace(" ", "-"))
def test_cuda_graph_capture_forward_and_backward(case):
    result = torchchecks.cuda_graph_capture(case)
    assert result.passed, result.failures


# ---------------------------------------------------------------------------------------------
# The wide backward as one cooperative launch (backward_wide_fused)
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpret
@requires_interpret
@pytest.mark.parametrize("lookahead", [1, 2])
@pytest.mark.parametrize("with_dh", [False, True])
def test_wide_fused_kernel_with_one_segment(lookahead, with_dh):
    """backward_wide_fused's steps (post a row's sum ahead, finish the row behind from the posted
    sums) under the interpreter. The interpreter runs programs one after another, so a program
    may only wait on itself: one segment per row (a segment as wide as the row), three row
    groups over 17 rows. On CUDA the same kernel runs with several segments per row
    (test_wide_backward_one_launch_and_two_launches)."""
    m, n, groups, eps = 17, 300, 3, 1e-6
    x, w, dy = make((m, n), F32, "cpu")
    dh = torch.randn(m, n, generator=torch.Generator().manual_seed(1)) if with_dh else dy
    rstd = torch.rsqrt(x.square().mean(-1) + eps)
    dot = torch.empty(m, 1)
    posted = torch.zeros(m, dtype=torch.int32)
    dx = torch.full_like(x, float("nan"))
    partial = torch.full((groups, n), float("nan"))
    # HAS_WEIGHT, HAS_DH, COMPUTE_DW, CASTING, BLOCK_S, SEGMENTS, SEGMENTS_POW2, LOOKAHEAD
    constexprs = (True, with_dh, True, 0, 512, 1, 1, lookahead)
    kernels.backward_wide_fused[(groups, 1)](
        x, w, dy, dh, rstd, dot, posted, dx, partial, m, n, groups, n, n, n, n, 0.0, *constexprs, num_warps=4
    )
    assert posted.tolist() == [1] * m  # every row's one sum posted once
    dx_ref, dw_ref = rms_norm_backward_reference(x, w, dy, eps)
    assert_close(dx, dx_ref + (dh if with_dh else 0), F32)
    assert_close(partial.sum(0), dw_ref, F32)


WIDE_FUSED_CASES = [
    # (M, N, dtype, with_dh, casting, fused): several segments per row. bf16 rows with N a
    # multiple of 16 and no dh (either casting) and fp16 ones in the default casting compile to
    # at most 128 registers, so their grids of four programs per SM run fused; the other
    # specialisations need more registers and run fused only where the grid is small enough
    # (few rows), else the two launches.
    (64, 65536, BF16, False, "default", True),
    (300, 32768, F16, False, "default", True),
    (256, 65536, BF16, False, "llama", True),
    (1, 65537, BF16, False, "default", True),
    (2, 65537, F16, True, "default", True),
    (3, 131073, F32, True, "llama", True),
    (128, 65537, F32, True, "default", False),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m, n, dtype, with_dh, casting, fused", WIDE_FUSED_CASES)
def test_wide_backward_one_launch_and_two_launches(monkeypatch, m, n, dtype, with_dh, casting, fused):
    """On CUDA the wide backward runs as one cooperative launch where the driver can make its
    grid resident (the two-launch kernels are not called), else falls back to the two launches.
    Each path is bitwise reproducible and within the declared tolerance of the reference. (The
    two paths split rows into segments of different widths, so their sums round differently:
    they agree to the tolerance, not bitwise.)"""
    x, w, dy = make((m, n), dtype, "cuda")
    dh = torch.randn_like(dy) if with_dh else None
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
    mode = launch.CASTING_MODES[casting]
    calls = []
    two_launch = launch._backward_wide_dot

    def spy(*args):
        calls.append(args)
        two_launch(*args)

    monkeypatch.setattr(launch, "_backward_wide_dot", spy)
    dx1, dw1 = launch.backward(dy, dh, x, w, rstd, 0.0, mode, True, dtype)
    assert len(calls) == (0 if fused else 1), "fused" if fused else "two launches"
    again = launch.backward(dy, dh, x, w, rstd, 0.0, mode, True, dtype)
    assert torch.equal(dx1, again[0]) and torch.equal(dw1, again[1])
    two_launches = dataclasses.replace(launch.TUNING, WIDE_FUSED=False)
    dx2, dw2 = launch.backward(dy, dh, x, w, rstd, 0.0, mode, True, dtype, tuning=two_launches)
    assert len(calls) == (1 if fused else 3)
    # The reference's autograd: with Llama's casting dw sums dy times the rounded activations.
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    rms_norm_reference(xr, wr, 1e-6, casting=casting).backward(dy)
    dx_ref, dw_ref = xr.grad.float() + (dh.float() if with_dh else 0), wr.grad
    for dx, dw in ((dx1, dw1), (dx2, dw2)):
        assert_close(dx, dx_ref, dtype)
        assert_close(dw, dw_ref, dtype)


# ---------------------------------------------------------------------------------------------
# The interpreter's mends (kernels.py, at import under TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


class _OneElementArray:
    """numpy 2.4's 1-element array of one dim: int() refused, item() given."""

    def __int__(self):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    def item(self):
        return 7


@pytest.mark.interpret
@requires_interpret
def test_interpreter_scalars_index_under_numpy_2_4():
    """A scalar of a kernel (a 1-element array under the interpreter) is a loop bound; Triton
    3.6's interpreter calls int() on its array, which numpy 2.4 refuses (every row loop stopped
    with a TypeError on a machine with numpy 2.4). The mend asks for .item()."""
    import operator
    from types import SimpleNamespace

    from triton.runtime import interpreter

    class Scalar:
        pass

    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(Scalar, scope)
    try:
        value = Scalar()
        value.handle = SimpleNamespace(data=_OneElementArray())
        assert operator.index(value) == 7
    finally:
        scope.restore()
