"""Every kernel path at its smallest shape, against the float64 reference: the kill command of
the mutation tests (maintainer.mutation, maintainer/mutation/config.toml), cheap enough for the
default interpreter run. Each check is sharp where a catalogued failure mode (maintainer/mutation/catalogue.toml) is small: eps of the order of
mean(x^2), so eps outside the square root shows; r compared in fp32 at 1e-5, so an accumulation
in low precision shows; fp16 inputs near 300, whose squares overflow fp16; every other row of a
wider tensor, so a row stride taken as N shows; an odd row count, so a block past the last row
must be masked.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rmsnorm_kernel
from rmsnorm_kernel import launch
from rmsnorm_kernel.reference import rms_norm_backward_reference, rms_norm_reference

from ..conftest import KERNEL_DEVICES, requires_cuda
from ._fixtures import EPS, check_residual_call, close, inputs

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# Path -> (M, N), the smallest shape that takes it (kernels.py and launch.py describe the paths).
PATHS = {
    "tile": (5, 257),  # two rows per program, a last block of one row
    "tile-prefetch": (5, 1000),  # backward prefetching its next row block; masked columns
    "even": (3, 2048),  # forward without masks (EVEN): N a power of two, few rows
    "two-walk-2": (3, 5000),  # forward: 1 masked chunk of 8192; backward: 2 chunks of 4096
    "two-walk": (3, 9000),  # forward: 2 chunks of 8192; backward: 3 chunks of 4096
    "two-walk-4": (2, 12289),  # backward: 4 chunks, the most it has
    "wide": (3, 24577),  # forward: 2 unrolled chunks of 16384; backward in segments
    "wide-3": (1, 40961),  # forward: 3 unrolled chunks, the last one partial
    "wide-4": (1, 65536),  # forward: 4 unrolled chunks, none masked
    "wide-rolled": (1, 65537),  # forward: 5 chunks, rolled walks
}
PATH_PARAMS = [pytest.param(*shape, id=name) for name, shape in PATHS.items()]


def grads(x, w, dy, **kwargs):
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_() if w is not None else None
    y = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, **kwargs)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad if wg is not None else None


# The cooperative backward's programs wait on each other: run in a child with a deadline.
COOPERATIVE_CHILD = """
import torch
from rmsnorm_kernel import launch
g = torch.Generator().manual_seed(0)
x, dy = (torch.randn(64, 65536, generator=g).to(torch.bfloat16).cuda() for _ in range(2))
w = (0.5 + torch.rand(65536, generator=g)).to(torch.bfloat16).cuda()
rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
def two_launches(*args):
    raise AssertionError("the two-launch wide backward ran, not the one launch")
launch._backward_wide_dot = two_launches
dx, dw = launch.backward(dy, None, x, w, rstd, 0.0, launch.CASTING_MODES["default"], True, torch.bfloat16)
torch.cuda.synchronize()
print("finished")
"""


@pytest.mark.gpu
@requires_cuda
def test_cooperative_wide_backward_finishes():
    """The one-launch wide backward (kernels.backward_wide_fused) finishes in bounded time: each
    row waits until every segment has posted its sum, and a wait that can never be met hangs the
    GPU. First in this file, in a process with a deadline, so a hang fails here instead of
    stalling every later test (test_kernels checks this path's values)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", COOPERATIVE_CHILD],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the cooperative wide backward did not finish within 180 s (a wait never met)")
    assert done.returncode == 0 and done.stdout.strip() == "finished", done.stderr[-2000:]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_saved_r_is_one_over_rms(device, m, n):
    """The r the forward stores for the backward: 1 / sqrt(mean(x^2) + eps), in fp32."""
    x, w, _, _ = inputs(m, n, F32, device)
    y, rstd, _ = launch.forward(x, w, None, EPS, 0.0, 0, F32, F32)
    expected = torch.rsqrt(x.double().square().mean(-1) + EPS)
    torch.testing.assert_close(rstd.double().cpu(), expected.cpu(), rtol=1e-5, atol=0)
    close(y, rms_norm_reference(x.double(), w.double(), EPS), F32, "y")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_fp16_squares_do_not_overflow(device, m, n):
    """x near 300: x^2 exceeds fp16's range, so the squares must be taken in fp32."""
    x, w, _, _ = inputs(m, n, F16, device, scale=300.0)
    y = rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS)
    close(y, rms_norm_reference(x.double(), w.double(), EPS).to(F16), F16, "y")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_forward_and_backward(device, m, n):
    x, w, dy, _ = inputs(m, n, F32, device)
    y, dx, dw = grads(x, w, dy)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    close(y, rms_norm_reference(xd, wd, EPS), F32, "y")
    dx_ref, dw_ref = rms_norm_backward_reference(xd, wd, dyd, EPS)
    close(dx, dx_ref, F32, "dx")
    close(dw, dw_ref, F32, "dw")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_strided_rows_without_weight(device, m, n):
    """Every other row of a wider tensor (row stride 2N), no weight."""
    x, _, dy, _ = inputs(2 * m, n, F32, device)
    x, dy = x[::2], dy[::2]
    y, dx, _ = grads(x, None, dy)
    xd, dyd = x.double(), dy.double()
    close(y, rms_norm_reference(xd, None, EPS), F32, "y")
    close(dx, rms_norm_backward_reference(xd, None, dyd, EPS)[0], F32, "dx")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_residual_offset_and_h_gradient(device, m, n):
    """h = x + residual normalised, with Gemma's offset, and a gradient arriving at h as well."""
    x, w, dy, res = inputs(m, n, F32, device)
    dh = torch.flip(dy, dims=[-1]).contiguous()
    xg, rg, wg = (t.detach().requires_grad_() for t in (x, res, w))
    y, h = rmsnorm_kernel.rms_norm(xg, weight=wg, eps=EPS, residual=rg, offset=1.0)
    torch.autograd.backward([y, h], [dy, dh])
    hd = x.double() + res.double()
    close(h, hd, F32, "h")
    close(y, rms_norm_reference(hd, w.double(), EPS, offset=1.0), F32, "y")
    dx_ref, dw_ref = rms_norm_backward_reference(hd, w.double(), dy.double(), EPS, offset=1.0)
    close(xg.grad, dx_ref + dh.double(), F32, "dx")
    close(rg.grad, dx_ref + dh.double(), F32, "dresidual")
    close(wg.grad, dw_ref, F32, "dw")


def _apart(t, pad, offset):
    """``t``'s values in a view whose rows are ``t.shape[-1] + pad`` apart, starting ``offset``
    elements into its storage (a slice of a wider stream, as a fused projection gives)."""
    m, n = t.shape
    wide = torch.full((m + 1, n + pad), float("nan"), dtype=t.dtype, device=t.device)
    view = wide.view(-1)[offset : offset + m * (n + pad)].view(m, n + pad)[:, :n]
    view.copy_(t)
    return view


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_every_tensor_with_its_own_row_stride(device, m, n):
    """x, the residual and both incoming gradients (at y and at h) each a view with its own row
    stride and storage offset, NaN between rows: a kernel that reads one tensor's rows with
    another's stride, or past a row's end, reads NaN or another row. dh's rows are its own (a
    backward that reads dh at dy's stride gets another row's values)."""
    x, w, dy, res = inputs(m, n, F32, device)
    dh = torch.flip(dy, dims=[-1]).contiguous()
    x, res, dy, dh = (
        _apart(t, pad, off) for t, pad, off in ((x, 3, 1), (res, 8, 5), (dy, 16, 2), (dh, 40, 7))
    )
    assert len({t.stride(0) for t in (x, res, dy, dh)}) == 4
    check_residual_call(x, res, w, dy, dh)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("m", "n"), PATH_PARAMS)
def test_llama_casting_in_bf16(device, m, n):
    """Llama's rounding of xn to bf16 before an fp32 weight multiply: y (fp32) is that product
    exactly, where one more or one less rounding would change nearly every element. (An r one
    ulp off may flip the rounding of a few elements, hence 99%.) dx does not round; dw, y's
    derivative in w, is the sum of dy times the rounded xn: built here from the r the kernel
    saves, so the roundings are the kernel's own and only the fp32 sum's error is left (a dw of
    unrounded xn is ~1e-3 away)."""
    x, _, dy, _ = inputs(m, n, BF16, device)
    w = inputs(m, n, F32, device)[1]
    y, dx, dw = grads(x, w, dy, casting="llama")
    expected = rms_norm_reference(x, w, EPS, casting="llama")  # fp32 compute, as the kernel
    assert y.dtype == expected.dtype == F32
    exact = ((y - expected).abs() <= 1e-6 * expected.abs()).double().mean().item()
    assert exact >= 0.99, f"y is Llama's product in only {exact:.1%} of elements"
    close(dx, rms_norm_backward_reference(x.double(), w.double(), dy.double(), EPS)[0], BF16, "dx")
    rstd = launch.forward(x, w, None, EPS, 0.0, 1, F32, BF16)[1]
    xn = (x.float() * rstd[:, None]).to(BF16).double()
    dw_ref = (dy.double() * xn).sum(0)
    error = (dw.double() - dw_ref).norm() / dw_ref.norm()
    assert error < 1e-5, f"dw: relative L2 error {error:.2e} from the sum of dy * bf16(xn)"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "n",
    [
        pytest.param(257, id="tile"),
        pytest.param(1000, id="tile-prefetch"),  # the next row block's loads, used
        pytest.param(5000, id="two-walk-2"),  # backward: 2 chunks, scratch rows N < 2 chunks wide
        pytest.param(9000, id="two-walk"),
        pytest.param(24577, id="wide"),
    ],
)
def test_every_row_block_of_a_persistent_backward(device, n):
    """More rows than the backward has programs (or row groups), so each program walks several
    row blocks (prefetching the next where it does), adds them into its dw share, and the
    reduction sums many shares: a dropped partial, a wrong prefetch or a scratch row overrun
    shows."""
    m = 3 * 8 * launch.sm_count(torch.device(device)) + 1
    x, w, dy, _ = inputs(m, n, F32, device)
    _, dx, dw = grads(x, w, dy)
    dx_ref, dw_ref = rms_norm_backward_reference(x.double(), w.double(), dy.double(), EPS)
    close(dx, dx_ref, F32, "dx")
    # dw sums M rows: its rounding grows with M (thousands of rows on a GPU), and elements near zero
    # carry the error of their large terms, so it is held as a whole: relative L2 error. A dropped
    # share of one program or row group moves it by a percent or more.
    error = (dw.double() - dw_ref).norm() / dw_ref.norm()
    assert error < 1e-5, f"dw: relative L2 error {error:.2e}"


@pytest.mark.parametrize("device", [KERNEL_DEVICES[1]])  # the interpreter runs rows one after another
@pytest.mark.parametrize("n", [pytest.param(40961, id="wide-3"), pytest.param(53249, id="wide-4")])
def test_many_rows_of_the_unrolled_wide_forward(device, n):
    """Rows of a partial last chunk, many at once on the GPU: a store past a row's end would land
    in the next row, which another program may have written already."""
    m = 4 * launch.sm_count(torch.device(device)) + 1
    x, w, _, _ = inputs(m, n, F32, device)
    close(
        rmsnorm_kernel.rms_norm(x, weight=w, eps=EPS),
        rms_norm_reference(x.double(), w.double(), EPS),
        F32,
        "y",
    )


# Under the interpreter either way (it reads through the addresses); on a GPU machine too, so
# that the GPU kill command (-m gpu) runs it.
GUARDED = [KERNEL_DEVICES[0], pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda], id="gpu-machine")]


@pytest.mark.parametrize("device", GUARDED)
def test_no_path_touches_memory_past_the_end_of_an_input(device):
    """Every path's forward and backward with x, the weight, dy, the residual, dh and the
    backward's scratch each ending against an inaccessible page (tests/op/guard_pages.py), in a
    process of its own: an unmasked load past a row's end stops it, though the values it reads
    are masked away before any store."""
    sizes = sorted({n for _, n in PATHS.values()} | {53249})  # and 4 unrolled chunks, the last partial
    done = subprocess.run(
        [sys.executable, "-m", "tests.op.guard_pages", *map(str, sizes)],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    ran = done.stdout.strip().splitlines()
    assert done.returncode == 0 and ran and ran[-1] == "guarded: every case ran", (
        f"exit {done.returncode} (-11: SIGSEGV, an access past an input's end) in "
        f"{ran[-1] if ran else 'the start'}\n{done.stderr[-2000:]}"
    )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("per_head", [False, True], ids=["shared-weights", "per-head-weights"])
def test_qk_norm_of_several_programs_each_way(device, per_head):
    """qk_norm's one launch each way over q and k views of a fused projection: tokens enough for
    several forward blocks and several backward programs of each tensor (k's programs follow
    q's in one grid), distinct weights per head, D short of its block (masked columns); y, dq,
    dk and both dw against float64 torch per head, within fp32's tolerance."""
    tokens, hq, hk, d = 37, 4, 2, 96
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g).to(device)
    shape_q, shape_k = ((hq, d), (hk, d)) if per_head else ((d,), (d,))
    wq, wk = ((0.5 + torch.rand(*s, generator=g)).to(device) for s in (shape_q, shape_k))
    dyq, dyk = (
        torch.randn(tokens, hq, d, generator=g).to(device),
        torch.randn(tokens, hk, d, generator=g).to(device),
    )

    def run(norm, dtype):
        leaf = qkv.to(dtype).detach().requires_grad_()
        w = [t.to(dtype).detach().requires_grad_() for t in (wq, wk)]
        q = leaf[:, : hq * d].view(tokens, hq, d)
        k = leaf[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
        yq, yk = norm(q, k, *w)
        ((yq * dyq.to(dtype)).sum() + (yk * dyk.to(dtype)).sum()).backward()
        return yq.detach(), yk.detach(), leaf.grad, w[0].grad, w[1].grad

    got = run(lambda q, k, a, b: rmsnorm_kernel.qk_norm(q, k, a, b, EPS), F32)
    want = run(
        lambda q, k, a, b: (rms_norm_reference(q, None, EPS) * a, rms_norm_reference(k, None, EPS) * b),
        torch.float64,
    )
    for name, a, b in zip(("yq", "yk", "dqkv", "dwq", "dwk"), got, want):
        close(a, b, F32, f"{name}, {'per-head' if per_head else 'shared'} weights")
    # the shape is sharp only if each tensor has several forward blocks and each head several
    # backward row blocks (so k's programs are several too)
    assert tokens * hk > launch.forward_config(d)[1] and tokens > launch.backward_config(d)[1]
