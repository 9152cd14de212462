"""QK-norm on the heads of a fused qkv projection: q = qkv[..., :q_size].view(T, Hq, D)
and the k slice beside it, normalised per head over D by ``rms_norm`` and by ``qk_norm`` (q and k
in one launch), forward and backward, read in place (no copy), under the interpreter on CPU and
on CUDA. Torch is the reference: F.rms_norm on each of q and k, in float64.

Tolerances, declared here before any comparison, against float64 torch on randn rows (mean square
about 1), eps = 1e-6: TOL[dtype] = (rtol, atol) for y, GRAD_TOL[dtype] for dq, dk (through the
views, into qkv's gradient) and dw (a sum over T * H rows). Beyond tolerances, the per-head path
is held to the contiguous path: its y and dx are the same bits as ``rms_norm`` of a contiguous copy
(the same math and launch plan), and so is dw under the interpreter (on the GPU: GRAD_TOL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rmsnorm_kernel
from rmsnorm_kernel import contract, launch, ops, qknorm
from rmsnorm_kernel.contract import InvalidArgument

from ..conftest import INTERPRET, KERNEL_DEVICES

EPS = 1e-6
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}
GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 3e-2)}
# (Hq, Hk): multi-head, grouped-query (GQA) and multi-query attention.
HEADS = [(4, 4), (4, 2), (6, 1)]
DEVICE = KERNEL_DEVICES  # interpret (CPU) and cuda


def _fused(t, hq, hk, d, dtype, device, seed, lead=()):
    """A fused qkv activation (*lead, T, (hq + 2 hk) * d) and the (q, k) views of its heads."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(*lead, t, (hq + 2 * hk) * d, generator=g) * 2).to(dtype).to(device)
    return qkv


def _views(qkv, hq, hk, d):
    q = qkv[..., : hq * d].view(*qkv.shape[:-1], hq, d)
    k = qkv[..., hq * d : (hq + hk) * d].view(*qkv.shape[:-1], hk, d)
    return q, k


def _weights(d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [(1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in range(2)]


def _oracle(qkv, hq, hk, d, wq, wk, gq, gk, offset=0.0):
    """float64 torch: (yq, yk, dqkv, dwq, dwk) through the same views."""
    qkv64 = qkv.detach().double().requires_grad_()
    wq64, wk64 = (w.detach().double().requires_grad_() for w in (wq, wk))
    q64, k64 = _views(qkv64, hq, hk, d)
    yq = F.rms_norm(q64, (d,), offset + wq64, EPS)
    yk = F.rms_norm(k64, (d,), offset + wk64, EPS)
    ((yq * gq.double()).sum() + (yk * gk.double()).sum()).backward()
    return yq.detach(), yk.detach(), qkv64.grad, wq64.grad, wk64.grad


def _close(got, want, tol):
    rtol, atol = tol
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def _both(kind, q, k, wq, wk, offset=0.0, casting="default"):
    if kind == "qk_norm":
        return rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS, offset=offset, casting=casting)
    return (
        rmsnorm_kernel.rms_norm(q, (q.shape[-1],), wq, EPS, offset=offset, casting=casting),
        rmsnorm_kernel.rms_norm(k, (k.shape[-1],), wk, EPS, offset=offset, casting=casting),
    )


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("kind", ["rms_norm", "qk_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hq,hk", HEADS)
def test_views_of_fused_qkv_match_torch_forward_and_backward(device, kind, dtype, hq, hk):
    t, d = 5, 16
    qkv = _fused(t, hq, hk, d, dtype, device, seed=hq * 10 + hk).requires_grad_()
    wq, wk = (w.requires_grad_() for w in _weights(d, dtype, device, seed=3))
    q, k = _views(qkv, hq, hk, d)
    # q's rows need two strides; k's too, but with one head (MQA), where one row stride serves.
    assert launch.strided_heads(q, d) is not None
    assert (launch.strided_heads(k, d) is not None) == (hk > 1) and launch.head_rows(k, d) is not None
    yq, yk = _both(kind, q, k, wq, wk)
    g = torch.Generator().manual_seed(7)
    gq, gk = (torch.randn(y.shape, generator=g).to(dtype).to(device) for y in (yq, yk))
    ((yq * gq).sum() + (yk * gk).sum()).backward()
    oq, ok, dqkv, dwq, dwk = _oracle(qkv, hq, hk, d, wq, wk, gq, gk)
    assert yq.shape == (t, hq, d) and yk.shape == (t, hk, d) and yq.is_contiguous()
    assert yq.dtype == dtype and yk.dtype == dtype
    _close(yq, oq, TOL[dtype])
    _close(yk, ok, TOL[dtype])
    _close(qkv.grad, dqkv, GRAD_TOL[dtype])
    _close(wq.grad, dwq, GRAD_TOL[dtype])
    _close(wk.grad, dwk, GRAD_TOL[dtype])


def _leading_layouts(device):
    """(name, qkv (..., T, W) view, whether its q and k heads are read in place): the leading
    dims of q flatten to one stride, or to two (transposed batch and tokens, every other batch
    of tokens: Gemma3's transposed q is one of these), or (two batch dims, transposed, and every
    other token) to three, and q is copied first."""
    base = _fused(6, 4, 2, 16, torch.float32, device, seed=11, lead=(4,))  # (B=4, T=6, W)
    wide = torch.cat([base, base[..., :32]], dim=-1)  # a row stride beyond the fused width
    return [
        ("batch, tokens", base, True),
        ("every other token", base[:, ::2], True),
        ("every other batch", base[::2], True),  # two strides: batch, then tokens
        ("wider rows", wide[..., : base.shape[-1]], True),
        ("transposed", base.transpose(0, 1), True),  # two strides: tokens, then batch
        ("three strides", base.view(2, 2, 6, -1)[:, :, ::2].transpose(0, 1), False),
    ]


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("kind", ["rms_norm", "qk_norm"])
@pytest.mark.parametrize(
    "layout",
    range(6),
    ids=["batch-tokens", "tokens-step", "batch-step", "wide", "transposed", "three-strides"],
)
def test_non_contiguous_leading_strides(device, kind, layout):
    name, qkv, in_place = _leading_layouts(device)[layout]
    d, hq, hk = 16, 4, 2
    qkv = qkv.detach().requires_grad_()  # a leaf with the view's strides
    wq, wk = (w.requires_grad_() for w in _weights(d, torch.float32, device, seed=5))
    q, k = _unflattened(qkv, hq, hk, d)
    assert (launch.strided_heads(q, d) is not None) == in_place, name
    yq, yk = _both(kind, q, k, wq, wk)
    g = torch.Generator().manual_seed(9)
    gq, gk = (torch.randn(y.shape, generator=g).to(device) for y in (yq, yk))
    ((yq * gq).sum() + (yk * gk).sum()).backward()
    qkv64 = qkv.detach().double().requires_grad_()
    wq64, wk64 = (w.detach().double().requires_grad_() for w in (wq, wk))
    q64, k64 = _unflattened(qkv64, hq, hk, d)
    oq, ok = F.rms_norm(q64, (d,), wq64, EPS), F.rms_norm(k64, (d,), wk64, EPS)
    ((oq * gq.double()).sum() + (ok * gk.double()).sum()).backward()
    _close(yq, oq, TOL[torch.float32])
    _close(yk, ok, TOL[torch.float32])
    _close(qkv.grad, qkv64.grad, GRAD_TOL[torch.float32])
    _close(wq.grad, wq64.grad, GRAD_TOL[torch.float32])
    _close(wk.grad, wk64.grad, GRAD_TOL[torch.float32])


def _unflattened(qkv, hq, hk, d):
    """The q and k heads of any qkv layout (unflatten views what view cannot)."""
    return qkv[..., : hq * d].unflatten(-1, (hq, d)), qkv[..., hq * d : (hq + hk) * d].unflatten(-1, (hk, d))


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("kind", ["rms_norm", "qk_norm"])
@pytest.mark.parametrize(
    "dtype,offset,casting",
    [(torch.float32, 0.0, "default"), (torch.bfloat16, 1.0, "gemma"), (torch.float16, 0.0, "llama")],
    ids=["fp32", "bf16-gemma", "fp16-llama"],
)
@pytest.mark.parametrize("d", [16, 64])
def test_same_bits_as_the_contiguous_path(device, kind, dtype, offset, casting, d):
    """y and dx (and dw under the interpreter) of the in-place path are the bits of rms_norm on
    a contiguous copy of the same heads."""
    hq, hk, t = 4, 2, 7
    qkv = _fused(t, hq, hk, d, dtype, device, seed=d).requires_grad_()
    wq, wk = (w.requires_grad_() for w in _weights(d, dtype, device, seed=d))
    q, k = _views(qkv, hq, hk, d)
    yq, yk = _both(kind, q, k, wq, wk, offset, casting)
    g = torch.Generator().manual_seed(1)
    gq, gk = (torch.randn(y.shape, generator=g).to(dtype).to(device) for y in (yq, yk))
    dq, dk, dwq, dwk = torch.autograd.grad((yq, yk), (q, k, wq, wk), (gq, gk))

    results = []
    for x, w, gy in ((q, wq, gq), (k, wk, gk)):
        xc = x.detach().contiguous().requires_grad_()
        wc = w.detach().clone().requires_grad_()
        yc = rmsnorm_kernel.rms_norm(xc, (d,), wc, EPS, offset=offset, casting=casting)
        results.append((yc, *torch.autograd.grad(yc, (xc, wc), gy)))
    for got, (yc, dxc, dwc), dw in zip(((yq, dq), (yk, dk)), results, (dwq, dwk)):
        assert torch.equal(got[0], yc)
        assert torch.equal(got[1], dxc)
        if INTERPRET:
            assert torch.equal(dw, dwc)
        else:
            _close(dw, dwc, GRAD_TOL[dtype])


class _Recorder:
    """Wraps a Launcher: records the tensors each launch hands the kernel."""

    def __init__(self, launcher):
        self.launcher, self.calls = launcher, []

    def __call__(self, grid, args, num_warps, constexprs):
        self.calls.append([a for a in args if isinstance(a, torch.Tensor)])
        return self.launcher(grid, args, num_warps, constexprs)


def _watch_the_row_path(monkeypatch):
    """(tensors launch.as_rows was handed, Recorders of the row kernels): what a copy to contiguous
    rows leaves behind; both stay empty where per-head views are read in place."""
    as_rows_calls = []
    real_as_rows = launch.as_rows
    monkeypatch.setattr(launch, "as_rows", lambda t, n: as_rows_calls.append(t) or real_as_rows(t, n))
    row_kernels = {name: _Recorder(getattr(launch, name)) for name in ("_forward_tile", "_backward_tile")}
    for name, recorder in row_kernels.items():
        monkeypatch.setattr(launch, name, recorder)
    return as_rows_calls, row_kernels


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("kind", ["rms_norm", "qk_norm"])
def test_no_copy_the_kernels_read_the_qkv_memory(device, kind, monkeypatch):
    """The tensors the kernels read for q and k are the views themselves (their data pointers and
    strides, in qkv's storage): nothing was copied, as_rows never ran, and the contiguous-row
    kernels were not launched. qk_norm takes one launch forward and one backward for q and k."""
    d, hq, hk = 16, 4, 2
    qkv = _fused(5, hq, hk, d, torch.float32, device, seed=2).requires_grad_()
    wq, wk = (w.requires_grad_() for w in _weights(d, torch.float32, device, seed=2))
    q, k = _views(qkv, hq, hk, d)
    fwd, bwd = _Recorder(launch._heads_forward), _Recorder(launch._heads_backward)
    monkeypatch.setattr(launch, "_heads_forward", fwd)
    monkeypatch.setattr(launch, "_heads_backward", bwd)
    as_rows_calls, row_kernels = _watch_the_row_path(monkeypatch)

    yq, yk = _both(kind, q, k, wq, wk)
    (yq.sum() + yk.sum()).backward()

    launches = 1 if kind == "qk_norm" else 2
    assert len(fwd.calls) == launches and len(bwd.calls) == launches
    read = [c[0] for c in fwd.calls] + [c[4] for c in fwd.calls if kind == "qk_norm"]
    read_back = [c[0] for c in bwd.calls] + [c[6] for c in bwd.calls if kind == "qk_norm"]
    storage = qkv.untyped_storage().data_ptr()
    for got in (read, read_back):  # (autograd runs k's backward first after two rms_norm calls)
        assert sorted((t.data_ptr(), t.stride()) for t in got) == [
            (q.data_ptr(), q.stride()),
            (k.data_ptr(), k.stride()),
        ]
        assert all(t.untyped_storage().data_ptr() == storage for t in got)
    assert as_rows_calls == [] and all(r.calls == [] for r in row_kernels.values())


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize(
    "dtype,offset,casting",
    [(torch.float32, 0.0, "default"), (torch.bfloat16, 1.0, "gemma")],
    ids=["fp32", "bf16-gemma"],
)
def test_gemma3_transposed_heads_are_read_in_place(device, dtype, offset, casting, monkeypatch):
    """Gemma3 normalises q after transposing it to (batch, heads, tokens, D): a view whose leading
    dims flatten to two strides. rms_norm reads it where it lies (as_rows never runs, the row
    kernels are not launched) forward and backward, and y and dx are the bits of rms_norm on a
    contiguous copy."""
    b, t, h, d = 3, 5, 4, 16
    g = torch.Generator().manual_seed(3)
    proj = torch.randn(b, t, h * d, generator=g).to(dtype).to(device).requires_grad_()
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(device).requires_grad_()
    q = proj.view(b, t, h, d).transpose(1, 2)
    gy = torch.randn(b, h, t, d, generator=g).to(dtype).to(device)
    xc = q.detach().contiguous().requires_grad_()
    wc = w.detach().clone().requires_grad_()
    yc = rmsnorm_kernel.rms_norm(xc, (d,), wc, EPS, offset=offset, casting=casting)
    dxc, dwc = torch.autograd.grad(yc, (xc, wc), gy)

    as_rows_calls, row_kernels = _watch_the_row_path(monkeypatch)
    y = rmsnorm_kernel.rms_norm(q, (d,), w, EPS, offset=offset, casting=casting)
    dq, dw = torch.autograd.grad(y, (q, w), gy)
    assert as_rows_calls == [] and all(r.calls == [] for r in row_kernels.values())
    assert y.is_contiguous() and torch.equal(y, yc) and torch.equal(dq, dxc)
    if INTERPRET:
        assert torch.equal(dw, dwc)
    else:
        _close(dw, dwc, GRAD_TOL[dtype])


@pytest.mark.parametrize("device", DEVICE)
def test_a_layout_without_head_rows_is_copied_and_still_right(device):
    """A view whose last dim is not unit-stride has no head rows: qk_norm copies it first."""
    d = 16
    base = _fused(8, 2, 1, d, torch.float32, device, seed=4)
    q = base[:, : 2 * d].view(8, 2, d).transpose(1, 2).contiguous().transpose(1, 2)  # last stride 2
    k = base[:, 2 * d : 3 * d].view(8, 1, d)
    assert launch.head_rows(q, d) is None
    wq, wk = _weights(d, torch.float32, device, seed=4)
    yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
    _close(yq, F.rms_norm(q.double(), (d,), wq.double(), EPS), TOL[torch.float32])
    _close(yk, F.rms_norm(k.double(), (d,), wk.double(), EPS), TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICE)
def test_qk_norm_without_weights_and_one_output_used(device):
    d = 16
    qkv = _fused(3, 2, 2, d, torch.float32, device, seed=6).requires_grad_()
    q, k = _views(qkv, 2, 2, d)
    yq, yk = rmsnorm_kernel.qk_norm(q, k)  # eps=None: torch's default
    yk.sum().backward()  # only k's output used: q's gradient slice is zero
    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64 = _views(qkv64, 2, 2, d)
    F.rms_norm(k64, (d,)).sum().backward()
    eps = torch.finfo(torch.float32).eps
    _close(yq, F.rms_norm(q.double(), (d,), eps=eps), TOL[torch.float32])
    _close(qkv.grad, qkv64.grad, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("t", [0, 1])
def test_qk_norm_of_no_token_one_token_and_1_d_heads(device, t):
    """Decode (one token), an empty batch, and 1-D / 2-D q and k (one head, no token dim)."""
    d = 16
    qkv = _fused(t, 4, 2, d, torch.float32, device, seed=12).requires_grad_()
    wq, wk = (w.requires_grad_() for w in _weights(d, torch.float32, device, seed=12))
    q, k = _views(qkv, 4, 2, d)
    yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
    (yq.sum() + yk.sum()).backward()
    _close(yq, F.rms_norm(q.double(), (d,), wq.double(), EPS), TOL[torch.float32])
    _close(yk, F.rms_norm(k.double(), (d,), wk.double(), EPS), TOL[torch.float32])
    assert wq.grad is not None and (t > 0 or not wq.grad.any())
    a, b = (
        qkv.detach()[..., :d].reshape(-1)[:d].clone() if t else torch.randn(d, device=device),
        torch.randn(3, d),
    )
    ya, yb = rmsnorm_kernel.qk_norm(a, b.to(device))
    assert ya.shape == (d,) and yb.shape == (3, d)
    _close(ya, F.rms_norm(a.double(), (d,)), TOL[torch.float32])
    _close(yb, F.rms_norm(b.double(), (d,)).to(device), TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICE)
def test_qk_norm_traces_with_aot_autograd(device):
    """torch.compile (aot_eager) traces qk_norm's operators without a graph break: their fakes
    and autograd, forward and backward, give eager's results."""
    torch._dynamo.reset()
    d = 16
    qkv = _fused(4, 4, 2, d, torch.float32, device, seed=8).requires_grad_()
    wq, wk = (w.requires_grad_() for w in _weights(d, torch.float32, device, seed=8))

    def f(qkv, wq, wk):
        q, k = _views(qkv, 4, 2, d)
        yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
        return yq.sum() + 2 * yk.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(qkv, wq, wk), (qkv, wq, wk))
    want = torch.autograd.grad(f(qkv, wq, wk), (qkv, wq, wk))
    for a, b in zip(got, want):
        _close(a, b, GRAD_TOL[torch.float32])


@pytest.mark.skipif(INTERPRET, reason="the CPU path without the interpreter (run without TRITON_INTERPRET)")
def test_on_cpu_without_the_interpreter_qk_norm_refuses_or_falls_back():
    """The kernels do not run on CPU without the interpreter: qk_norm raises UnsupportedInput, as
    rms_norm does, and with allow_fallback=True gives torch's result through the reference."""
    d = 16
    qkv = _fused(3, 4, 2, d, torch.float32, "cpu", seed=1).requires_grad_()
    q, k = _views(qkv, 4, 2, d)
    wq, wk = _weights(d, torch.float32, "cpu", seed=1)
    with pytest.raises(contract.UnsupportedInput):
        rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
    with pytest.warns(RuntimeWarning) if not ops._warned_fallback else _nothing():
        yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS, allow_fallback=True)
    _close(yq, F.rms_norm(q.double(), (d,), wq.double(), EPS), TOL[torch.float32])
    _close(yk, F.rms_norm(k.double(), (d,), wk.double(), EPS), TOL[torch.float32])
    (yq.sum() + yk.sum()).backward()
    assert qkv.grad is not None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# The contract (no kernel runs): what qk_norm refuses, before any launch.
def _qk(**over):
    d = 8
    args = {
        "q": torch.randn(2, 4, d),
        "k": torch.randn(2, 2, d),
        "q_weight": torch.ones(d),
        "k_weight": torch.ones(d),
    }
    args.update(over)
    return lambda: rmsnorm_kernel.qk_norm(args["q"], args["k"], args["q_weight"], args["k_weight"], EPS)


BAD_QK = [
    ("head dims differ", _qk(k=torch.randn(2, 2, 4)), ValueError, "share the head dim"),
    ("one weight", _qk(k_weight=None), ValueError, "both or neither"),
    ("weight of other heads", _qk(k_weight=torch.ones(4, 8)), InvalidArgument, "(heads, head_dim) = (2, 8)"),
    ("weight (D, H)", _qk(q_weight=torch.ones(8, 4)), InvalidArgument, "= (4, 8), got (8, 4)"),
    ("3-D weight", _qk(q_weight=torch.ones(2, 4, 8)), InvalidArgument, "q_weight must have shape"),
    ("weight of D - 1", _qk(q_weight=torch.ones(4, 7)), InvalidArgument, "(head_dim,) = (8,)"),
    ("(1, D), 1-D q", _qk(q=torch.randn(8), q_weight=torch.ones(1, 8)), InvalidArgument, "(8,), got (1, 8)"),
    ("weight on meta", _qk(q_weight=torch.ones(4, 8, device="meta")), InvalidArgument, "device"),
    ("dtypes differ", _qk(k=torch.randn(2, 2, 8, dtype=torch.float16)), TypeError, "share a dtype"),
    ("q not a tensor", _qk(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    ("scalar k", _qk(k=torch.tensor(1.0)), ValueError, "at least one dimension"),
    (
        "integer q",
        _qk(q=torch.ones(2, 4, 8, dtype=torch.int32), k=torch.ones(2, 2, 8, dtype=torch.int32)),
        TypeError,
        "x must be",
    ),  # fmt: skip
    (
        "casting",
        lambda: rmsnorm_kernel.qk_norm(torch.randn(2, 8), torch.randn(2, 8), casting="x"),
        ValueError,
        "casting",
    ),  # fmt: skip
]


@pytest.mark.parametrize("call,exc,fragment", [c[1:] for c in BAD_QK], ids=[c[0] for c in BAD_QK])
def test_qk_norm_refuses_bad_input_before_any_launch(call, exc, fragment, monkeypatch):
    """Refused with the contract's class (InvalidArgument: also ValueError and RuntimeError, as
    torch raises for a shape) and a message naming the argument, before any launch."""
    launched = []
    monkeypatch.setattr(launch, "_heads_forward", lambda *a: launched.append(a))
    with pytest.raises(exc, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call()
    assert launched == []


# Per-head weights: q_weight (Hq, D) and k_weight (Hk, D), each or one of them (the other (D,)).
# The reference is float64 torch, F.rms_norm without a weight times the weight row of each head
# (Llama's casting rounds x * r to the input dtype first, as the op's casting mode does), with
# the tolerances declared at the top.

MIXES = {"both": (True, True), "q (D,), k per head": (False, True), "q per head, k (D,)": (True, False)}
CASTS = [(torch.float32, 0.0, "default"), (torch.bfloat16, 1.0, "gemma"), (torch.float16, 0.0, "llama")]


def _head_weights(d, hq, hk, mix, dtype, device, seed):
    """(wq, wk): per head (H, D) or shared (D,) by ``mix``, seeded, leaves requiring grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(h, d) if per_head else (d,) for h, per_head in zip((hq, hk), MIXES[mix])]
    return [(1 + 0.3 * torch.randn(s, generator=g)).to(dtype).to(device).requires_grad_() for s in shapes]


def _per_head_oracle(qkv, hq, hk, d, wq, wk, gq, gk, dtype, offset, casting):
    """float64 torch through the same views: (yq, yk, dqkv, dwq, dwk)."""
    qkv64 = qkv.detach().double().requires_grad_()
    ws = [w.detach().double().requires_grad_() for w in (wq, wk)]
    ys = []
    for x, w in zip(_views(qkv64, hq, hk, d), ws):
        xn = F.rms_norm(x, (d,), None, EPS)
        if casting == "llama":
            xn = xn.to(dtype).double()
        ys.append(xn * (offset + w))
    ((ys[0] * gq.double()).sum() + (ys[1] * gk.double()).sum()).backward()
    return ys[0].detach(), ys[1].detach(), qkv64.grad, ws[0].grad, ws[1].grad


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype,offset,casting", CASTS, ids=["fp32", "bf16-gemma", "fp16-llama"])
@pytest.mark.parametrize("hq,hk", HEADS)
def test_per_head_weights_match_torch_forward_and_backward(device, mix, dtype, offset, casting, hq, hk):
    """y, the gradient of qkv through the q and k views, and each weight's gradient (per head:
    a sum over the tokens of that head only), 37 tokens (several backward programs per head)."""
    t, d = 37, 16
    qkv = _fused(t, hq, hk, d, dtype, device, seed=hq + 3 * hk).requires_grad_()
    wq, wk = _head_weights(d, hq, hk, mix, dtype, device, seed=hq)
    q, k = _views(qkv, hq, hk, d)
    yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS, offset=offset, casting=casting)
    g = torch.Generator().manual_seed(5)
    gq, gk = (torch.randn(y.shape, generator=g).to(y.dtype).to(device) for y in (yq, yk))
    ((yq * gq).sum() + (yk * gk).sum()).backward()
    oq, ok, dqkv, dwq, dwk = _per_head_oracle(qkv, hq, hk, d, wq, wk, gq, gk, dtype, offset, casting)
    assert yq.shape == q.shape and yk.shape == k.shape and yq.dtype == yk.dtype == dtype
    assert wq.grad.shape == wq.shape and wk.grad.shape == wk.shape
    _close(yq, oq, TOL[dtype])
    _close(yk, ok, TOL[dtype])
    _close(qkv.grad, dqkv, GRAD_TOL[dtype])
    _close(wq.grad, dwq, GRAD_TOL[dtype])
    _close(wk.grad, dwk, GRAD_TOL[dtype])


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("dtype,offset,casting", CASTS, ids=["fp32", "bf16-gemma", "fp16-llama"])
def test_per_head_weight_of_equal_rows_keeps_the_shared_weights_bits(device, dtype, offset, casting):
    """An (H, D) weight whose rows are all one (D,) weight gives that weight's y and dx bits (the
    same math and launch plan; the row is read per head), and dw rows that sum to its dw."""
    hq, hk, t, d = 4, 2, 21, 32
    qkv = _fused(t, hq, hk, d, dtype, device, seed=31).requires_grad_()
    q, k = _views(qkv, hq, hk, d)
    shared = [w.detach() for w in _weights(d, dtype, device, seed=31)]
    rows = [w.expand(h, d).clone() for w, h in zip(shared, (hq, hk))]
    g = torch.Generator().manual_seed(2)
    gq, gk = (torch.randn(x.shape, generator=g).to(dtype).to(device) for x in (q, k))
    got = {}
    for name, (wq, wk) in (("shared", shared), ("rows", rows)):
        wq, wk = wq.clone().requires_grad_(), wk.clone().requires_grad_()
        yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS, offset=offset, casting=casting)
        got[name] = (yq, yk, *torch.autograd.grad((yq, yk), (qkv, wq, wk), (gq, gk)))
    for a, b in zip(got["shared"][:3], got["rows"][:3]):  # yq, yk, dqkv
        assert torch.equal(a, b)
    for dw, dw_rows in zip(got["shared"][3:], got["rows"][3:]):
        _close(dw_rows.double().sum(0), dw, GRAD_TOL[dtype])


@pytest.mark.parametrize("device", DEVICE)
def test_per_head_weights_one_launch_each_way_no_copy(device, monkeypatch):
    """q, k and both per-head weights are read where they lie, a weight with a row stride wider
    than D (a slice of a larger parameter) too: one heads_forward and one heads_backward launch,
    no row kernels."""
    hq, hk, d = 4, 2, 16
    qkv = _fused(9, hq, hk, d, torch.float32, device, seed=3).requires_grad_()
    q, k = _views(qkv, hq, hk, d)
    big = torch.randn(hq, 2 * d, device=device) * 0.1 + 1
    wq, wk = big[:, :d].detach().requires_grad_(), torch.ones(hk, d, device=device, requires_grad=True)
    fwd, bwd = _Recorder(launch._heads_forward), _Recorder(launch._heads_backward)
    monkeypatch.setattr(launch, "_heads_forward", fwd)
    monkeypatch.setattr(launch, "_heads_backward", bwd)
    row_kernels = {name: _Recorder(getattr(launch, name)) for name in ("_forward_tile", "_backward_tile")}
    for name, recorder in row_kernels.items():
        monkeypatch.setattr(launch, name, recorder)
    yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
    (yq.sum() + yk.sum()).backward()
    assert len(fwd.calls) == 1 and len(bwd.calls) == 1
    assert all(r.calls == [] for r in row_kernels.values())
    (x0, w0, *_, x1, w1, _y1, _r1), (bx0, bw0, *_) = fwd.calls[0], bwd.calls[0]
    assert [x0.data_ptr(), x1.data_ptr(), bx0.data_ptr()] == [q.data_ptr(), k.data_ptr(), q.data_ptr()]
    assert w0.data_ptr() == bw0.data_ptr() == big.data_ptr() and w1.data_ptr() == wk.data_ptr()
    _close(wq.grad, _per_head_oracle(qkv, hq, hk, d, wq, wk, torch.ones_like(yq), torch.ones_like(yk),
                                     torch.float32, 0.0, "default")[3], GRAD_TOL[torch.float32])  # fmt: skip


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("path", ["vmap", "create_graph", "wide"])
def test_per_head_weights_off_the_launch(device, path):
    """Where the launch does not run: under vmap (torch ops), a backward with create_graph=True
    (the composite backward), and a head dim wider than a tile (rms_norm without a weight, then
    the weight product): torch's values and gradients."""
    hq, hk = 2, 1
    d = launch.FORWARD_MAX_TILE * 2 if path == "wide" else 16
    qkv = _fused(3, hq, hk, d, torch.float32, device, seed=17).requires_grad_()
    wq, wk = _head_weights(d, hq, hk, "both", torch.float32, device, seed=17)
    g = torch.Generator().manual_seed(4)
    gq, gk = torch.randn(3, hq, d, generator=g).to(device), torch.randn(3, hk, d, generator=g).to(device)
    q, k = _views(qkv, hq, hk, d)
    if path == "vmap":  # over the tokens: each call sees (H, D)
        yq, yk = torch.func.vmap(lambda a, b: rmsnorm_kernel.qk_norm(a, b, wq, wk, EPS))(q, k)
    else:
        yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
    grads = torch.autograd.grad((yq, yk), (qkv, wq, wk), (gq, gk), create_graph=path == "create_graph")
    oq, ok, *want = _per_head_oracle(qkv, hq, hk, d, wq, wk, gq, gk, torch.float32, 0.0, "default")
    _close(yq, oq, TOL[torch.float32])
    _close(yk, ok, TOL[torch.float32])
    for got, expected in zip(grads, want):
        _close(got, expected, GRAD_TOL[torch.float32])
    if path == "create_graph":  # a gradient with a graph: a second derivative exists
        assert grads[1].requires_grad and grads[1].grad_fn is not None


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("mix", list(MIXES))
def test_per_head_weights_trace_with_aot_autograd(device, mix):
    """torch.compile (aot_eager, fullgraph) through the per-head shapes: the fakes give the (H, D)
    gradients, equal to eager's."""
    torch._dynamo.reset()
    hq, hk, d = 4, 2, 16
    qkv = _fused(5, hq, hk, d, torch.float32, device, seed=23).requires_grad_()
    wq, wk = _head_weights(d, hq, hk, mix, torch.float32, device, seed=23)

    def f(qkv, wq, wk):
        q, k = _views(qkv, hq, hk, d)
        yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
        return (yq * yq).sum() + 2 * yk.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(qkv, wq, wk), (qkv, wq, wk))
    want = torch.autograd.grad(f(qkv, wq, wk), (qkv, wq, wk))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        _close(a, b, GRAD_TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICE)
def test_the_qknorm_module(device):
    """QKNorm holds (Hq, D) and (Hk, D) weights (or (D,) without heads), ones at first, and its
    forward is qk_norm with them: values and the weights' gradients."""
    hq, hk, d = 4, 2, 16
    norm = rmsnorm_kernel.QKNorm(d, hq, hk, eps=EPS, offset=1.0, casting="gemma", device=device)
    assert norm.q_weight.shape == (hq, d) and norm.k_weight.shape == (hk, d)
    assert bool((norm.q_weight == 1).all()) and set(norm.state_dict()) == {"q_weight", "k_weight"}
    with torch.no_grad():
        for w in norm.parameters():
            w.add_(0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(device))
    qkv = _fused(6, hq, hk, d, torch.float32, device, seed=41).requires_grad_()
    q, k = _views(qkv, hq, hk, d)
    yq, yk = norm(q, k)
    (yq.sum() + 3 * yk.sum()).backward()
    oq, ok, _dqkv, dwq, dwk = _per_head_oracle(qkv, hq, hk, d, norm.q_weight, norm.k_weight, torch.ones_like(yq),
                                                3 * torch.ones_like(yk), torch.float32, 1.0, "gemma")  # fmt: skip
    for got, want, tol in ((yq, oq, TOL), (yk, ok, TOL), (norm.q_weight.grad, dwq, GRAD_TOL),
                           (norm.k_weight.grad, dwk, GRAD_TOL)):  # fmt: skip
        _close(got, want, tol[torch.float32])
    shared = rmsnorm_kernel.QKNorm(d, device=device)
    assert shared.q_weight.shape == shared.k_weight.shape == (d,)
    bare = rmsnorm_kernel.QKNorm(d, hq, hk, elementwise_affine=False)
    assert bare.q_weight is None and list(bare.parameters()) == []
    eps = torch.finfo(torch.float32).eps  # eps=None: torch's default
    _close(bare(q, k)[0], F.rms_norm(q.double(), (d,), None, eps), TOL[torch.float32])


BAD_MODULE = [
    ({"head_dim": 0}, "head_dim"),
    ({"head_dim": 8, "q_heads": 2.0}, "q_heads"),
    ({"head_dim": 8, "casting": "x"}, "casting"),
    ({"head_dim": 8, "offset": 1.0, "elementwise_affine": False}, "offset needs a weight"),
]


@pytest.mark.parametrize("kwargs,fragment", BAD_MODULE)
def test_qknorm_refuses_bad_arguments_and_wrong_heads(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        rmsnorm_kernel.QKNorm(**kwargs)
    norm = rmsnorm_kernel.QKNorm(8, 3, 2)  # q of 4 heads: its weight has 3 rows
    with pytest.raises(RuntimeError, match=r"q_weight must have shape"):  # InvalidArgument is one
        norm(torch.randn(2, 4, 8), torch.randn(2, 2, 8))


@pytest.mark.parametrize("device", DEVICE)
@pytest.mark.parametrize("grad", [True, False])
def test_eager_calls_skip_the_dispatcher(device, grad, monkeypatch):
    """An eager call (no trace, no dispatch mode, plain tensors) launches directly, through
    autograd.Function where a gradient is needed, as rms_norm's eager path does: the custom ops'
    Python dispatch costs more host time than a decode step's kernel. Values as before."""
    hq, hk, d = 4, 2, 16
    qkv = _fused(5, hq, hk, d, torch.float32, device, seed=21).requires_grad_(grad)
    wq, wk = _weights(d, torch.float32, device, seed=21)
    want = [
        F.rms_norm(v.detach().double(), (d,), w.double(), EPS)
        for v, w in zip(_views(qkv, hq, hk, d), (wq, wk))
    ]

    def refuse(*args, **kwargs):
        raise AssertionError("the custom op was called from an eager call")

    monkeypatch.setattr(qknorm, "qk_forward_op", refuse)
    monkeypatch.setattr(qknorm, "qk_backward_op", refuse)
    yq, yk = rmsnorm_kernel.qk_norm(*_views(qkv, hq, hk, d), wq, wk, EPS)
    for got, expected in zip((yq, yk), want):
        _close(got, expected, TOL[torch.float32])
    if grad:
        (yq.sum() + 2 * yk.sum()).backward()
        assert qkv.grad is not None and qkv.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICE)
def test_a_head_dim_short_of_its_block_matches_torch(device):
    """A head dim that is not a power of two and more than one column short of the block the
    kernels tile it with (80 in a block of 128, as some models have): the columns past D are
    neither read nor written, forward and backward, with a per-head and a shared weight."""
    t, hq, hk, d = 3, 4, 2, 80
    qkv = _fused(t, hq, hk, d, torch.float32, device, seed=21).requires_grad_()
    wq, wk = _head_weights(d, hq, hk, "q per head, k (D,)", torch.float32, device, seed=21)
    q, k = _views(qkv, hq, hk, d)
    yq, yk = rmsnorm_kernel.qk_norm(q, k, wq, wk, EPS)
    g = torch.Generator().manual_seed(21)
    gq, gk = (torch.randn(y.shape, generator=g).to(device) for y in (yq, yk))
    ((yq * gq).sum() + (yk * gk).sum()).backward()
    oq, ok, dqkv, dwq, dwk = _per_head_oracle(qkv, hq, hk, d, wq, wk, gq, gk, torch.float32, 0.0, "default")
    _close(yq, oq, TOL[torch.float32])
    _close(yk, ok, TOL[torch.float32])
    _close(qkv.grad, dqkv, GRAD_TOL[torch.float32])
    _close(wq.grad, dwq, GRAD_TOL[torch.float32])
    _close(wk.grad, dwk, GRAD_TOL[torch.float32])
