"""The compiled host path (host/__init__.py, host/csrc/host.cpp) against the Python one: bitwise the same
outputs and gradients, the same errors, and each path taken where it should be.

The CPU tests cover the plan encoding and the choice of path; the GPU tests build the extension
(RMSNORM_KERNEL_HOST=python makes them skip with the reason, as a machine without a compiler
does under ``auto``) and compare both paths on the H200.
"""

from __future__ import annotations

import itertools
import struct

import pytest
import torch
import torch.nn.functional as F

from rmsnorm_kernel import host, launch, ops, rms_norm
from rmsnorm_suite import cases
from tests.conftest import requires_cuda


def test_mode_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv(host.ENV, "fast")
    with pytest.raises(ValueError, match=host.ENV):
        host.mode()


def test_python_mode_never_builds(monkeypatch):
    monkeypatch.setenv(host.ENV, "python")
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "_build", lambda: pytest.fail("built under RMSNORM_KERNEL_HOST=python"))
    assert host.extension() is None


def test_auto_falls_back_with_one_log_line(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setenv(host.ENV, "auto")
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "_build", broken)
    with caplog.at_level("WARNING", logger="rmsnorm_kernel"):
        assert host.extension() is None
        assert host.extension() is None  # remembered: no second attempt, no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no compiler here" in lines[0] and "Python host path" in lines[0]


def test_compiled_mode_raises_when_it_cannot_build(monkeypatch):
    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setenv(host.ENV, "compiled")
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "_build", broken)
    with pytest.raises(RuntimeError, match="no compiler here"):
        host.extension()


def test_loaded_extension_gets_the_contract(monkeypatch):
    """The C++ side learns the kernel dtypes, the casting modes (and which promote the output:
    bf16 x, fp32 weight gives fp32) and the default eps from contract.table(), not a copy of
    its own."""
    from rmsnorm_kernel import contract

    class Ext:
        common_call = object()

        def set_callbacks(self, *callbacks):
            pass

        def set_contract(self, dtypes, modes, eps):
            self.dtypes, self.modes, self.eps = dtypes, modes, eps

    ext = Ext()
    monkeypatch.setenv(host.ENV, "compiled")
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "entry", None)
    monkeypatch.setattr(host, "_build", lambda: ext)
    assert host.extension() is ext and host.entry is ext.common_call
    weight = torch.ones(4, dtype=torch.float32)
    promotes = {
        name: contract.default_out_dtype(torch.bfloat16, weight, name) != torch.bfloat16
        for name in launch.CASTING_MODES
    }
    assert ext.modes == [(name, code, promotes[name]) for name, code in launch.CASTING_MODES.items()]
    assert any(promotes.values()) and not all(promotes.values())
    assert ext.dtypes == [host.SCALAR_TYPES[d] for d in contract.KERNEL_DTYPES]
    assert ext.eps == torch.finfo(torch.float32).eps


def test_extension_builds_and_loads(built_extension):
    """The C++ source compiles against this torch and Triton (CPU machines included: the GPU is
    only needed to launch)."""
    ext = built_extension
    assert ext is not None
    assert all(isinstance(v, int) and v >= 0 for v in (*ext.counts(), *ext.plans()))
    # the operator it registers: its schema, an Autograd kernel and a CUDA kernel, nothing else
    op = torch.ops.rmsnorm_kernel_host.rms_norm.default
    assert [a.name for a in op._schema.arguments] == ["x", "weight", "eps", "offset", "casting", "out_dtype"]
    residual_op = torch.ops.rmsnorm_kernel_host.rms_norm_residual.default
    assert [a.name for a in residual_op._schema.arguments] == [
        "x",
        "residual",
        "weight",
        "eps",
        "offset",
        "casting",
        "out_dtype",
        "residual_dtype",
    ]
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in (op.name(), residual_op.name()):
        assert has(name, "Autograd") and has(name, "CUDA") and not has(name, "CPU")
    # its Autograd kernel refuses a dual tensor (it would compute no tangent) before any work,
    # which the CPU can check: the refusal comes before the CUDA kernel would be needed
    x, w = torch.ones(2, 8), torch.ones(8)
    with torch.autograd.forward_ad.dual_level():
        for dual_x, dual_w in [(True, False), (False, True)]:
            xd = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)) if dual_x else x
            wd = torch.autograd.forward_ad.make_dual(w, torch.ones_like(w)) if dual_w else w
            with pytest.raises(RuntimeError, match="forward-mode AD"):
                op(xd, wd, 1e-6, 0.0, 0, torch.float32)


class _Compiled:
    """A stand-in CompiledKernel: what host.plan reads."""

    def __init__(self, signature, num_warps=4, shared=0, **metadata):
        self.src = type("Src", (), {"signature": signature})()
        self.metadata = type("Md", (), {"num_warps": num_warps, "shared": shared, **metadata})()
        self.function = 0xABC


def _recording(compiled, args, constexprs=(), scratch=()):
    launcher = type("L", (), {"kernels": {"k": compiled}})()
    return launch.Recording([(launcher, "k", (3, 1, 1), args, constexprs)], list(scratch))


def test_plan_encodes_slots_constants_and_scratch():
    x, w, y = torch.ones(8), torch.ones(4), torch.empty(8)
    partial = torch.empty(2, 4)
    compiled = _Compiled(
        {
            "X": "*fp32",
            "W": "*fp32",
            "Y": "*fp32",
            "P": "*fp32",
            "M": "i32",
            "S": "i64",
            "EPS": "fp32",
            "B": "constexpr",
        },
        num_warps=8,
        shared=128,
    )
    rec = _recording(compiled, (x, w, y, partial, -2, 2**40, 1e-6), (64,), [(partial, False)])
    scratch, launches = host.plan(rec, [x, w, y, None])
    assert scratch == [(8, host.SCALAR_TYPES[torch.float32], False)]
    ((function, gx, gy, gz, threads, shared, cooperative, pdl, params),) = launches
    assert (function, gx, gy, gz, threads, shared, cooperative, pdl) == (
        0xABC,
        3,
        1,
        1,
        256,
        128,
        False,
        False,
    )
    eps_bits = struct.unpack("<I", struct.pack("<f", 1e-6))[0]
    assert params == [
        (0, 8, 0),
        (1, 8, 0),
        (2, 8, 0),
        (4, 8, 0),
        (-1, 4, 2**32 - 2),
        (-1, 8, 2**40),
        (-1, 4, eps_bits),
    ]


def test_plan_refuses_what_it_cannot_replay():
    x, y, stray = torch.ones(8), torch.empty(8), torch.empty(8)
    sig = {"X": "*fp32", "Y": "*fp32"}
    assert host.plan(_recording(_Compiled(sig), (x, stray)), [x, None, y, None]) is None  # no slot's pointer
    assert host.plan(_recording(_Compiled(sig), (x, y)), [x, x, y, None]) is None  # two slots, one address
    assert host.plan(launch.Recording([], []), [x, None, y, None]) is None  # nothing recorded (interpreter)
    clustered = _Compiled(sig, num_ctas=2)
    assert host.plan(_recording(clustered, (x, y)), [x, None, y, None]) is None
    scratchy = _Compiled(sig, global_scratch_size=64)
    assert host.plan(_recording(scratchy, (x, y)), [x, None, y, None]) is None
    assert (
        host.plan(
            _recording(_Compiled({"X": "*fp32", "D": "tensordesc<fp32[4]>"}), (x, y)), [x, None, y, None]
        )
        is None
    )


def test_calls_counts_both_paths(monkeypatch):
    monkeypatch.setattr(host, "counts", lambda: (5, 7))
    ops.reset_counters()
    assert dict(ops.CALLS) == {"forward": 5, "backward": 7, "fallback": 0}
    assert ops.CALLS == {"forward": 5, "backward": 7, "fallback": 0}


# ---------------------------------------------------------------------------------------------
# GPU: both paths
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ext():
    if host.mode() == "python":
        pytest.skip(f"{host.ENV}=python: the compiled host path is switched off")
    e = host.extension()
    if e is None:
        pytest.skip("the compiled host path could not be built here (the log says why)")
    return e


def _python_path(monkeypatch):
    monkeypatch.setattr(host, "_extension", None)
    monkeypatch.setattr(host, "entry", None)


# (M-shape, N, x dtype, weight dtype or None, offset, casting)
CASES = [
    ((1,), 4096, torch.bfloat16, torch.bfloat16, 0.0, "default"),
    ((256,), 4096, torch.bfloat16, torch.bfloat16, 0.0, "default"),
    ((128,), 257, torch.float32, torch.float32, 0.0, "default"),
    ((128,), 257, torch.float16, torch.float16, 1.0, "gemma"),
    ((4, 33), 1024, torch.float16, torch.float32, 0.0, "llama"),
    ((3000,), 768, torch.bfloat16, None, 0.0, "default"),
    ((), 4096, torch.float32, torch.float32, 0.0, "default"),  # 1-D x
    ((2, 3, 5), 64, torch.bfloat16, torch.bfloat16, 0.0, "default"),
    ((64,), 12288, torch.bfloat16, torch.bfloat16, 0.0, "default"),  # two-walk
    ((16,), 65536, torch.bfloat16, torch.bfloat16, 0.0, "default"),  # wide: looped forward, wide backward
    ((0,), 4096, torch.bfloat16, torch.bfloat16, 0.0, "default"),  # no rows
]


def _run(lead, n, dtype, wdtype, offset, casting, grad, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*lead, n, device="cuda", generator=g).to(dtype).requires_grad_(grad)
    w = None
    if wdtype is not None:
        w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(wdtype).requires_grad_(grad)
    y = rms_norm(x, n, w, 1e-6, offset=offset, casting=casting)
    if not grad:
        return [y]
    dy = torch.randn(y.shape, device="cuda", generator=g).to(y.dtype)
    y.backward(dy)
    return [y, x.grad] + ([w.grad] if w is not None else [])


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{'x'.join(map(str, c[0])) or '1d'}x{c[1]}-{c[2]}-{c[5]}"
)
def test_bitwise_equal_to_python_path(ext, monkeypatch, case, grad):
    host.clear_plans()
    before = host.counts()
    compiled = [_run(*case, grad) for _ in range(3)]  # the first records the plan, the others replay it
    after = host.counts()
    if case[0] != (0,):
        assert after[0] - before[0] == 2, "the compiled path did not replay the forward"
        assert after[1] - before[1] == (2 if grad else 0), "the compiled path did not replay the backward"
    _python_path(monkeypatch)
    python = _run(*case, grad)
    for c in compiled:
        for got, want in zip(c, python, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
            assert torch.equal(got, want)


@requires_cuda
@pytest.mark.gpu
def test_expanded_gradient_and_second_derivative(ext, monkeypatch):
    def run():
        x = torch.randn(
            8, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(1)
        ).requires_grad_()
        w = torch.ones(512, device="cuda").requires_grad_()
        y = rms_norm(x, 512, w, 1e-6)
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)  # dy is expanded: stride 0
        (gxx,) = torch.autograd.grad((gx * gx).sum(), x)
        y2 = rms_norm(x, 512, w, 1e-6)
        y2.sum().backward()
        return gx.detach(), gxx, x.grad, w.grad

    compiled = run()
    _python_path(monkeypatch)
    for got, want in zip(compiled, run(), strict=True):
        assert torch.equal(got, want)


@requires_cuda
@pytest.mark.gpu
def test_cuda_graph_replays_compiled_path(ext):
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # record the plans outside the capture
        rms_norm(x, 4096, w, 1e-6).backward(dy)
    expect = (rms_norm(x.detach(), 4096, w.detach(), 1e-6),)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = rms_norm(x.detach(), 4096, w.detach(), 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expect[0])


@requires_cuda
@pytest.mark.gpu
def test_unaligned_input_gets_its_own_plan(ext, monkeypatch):
    base = torch.randn(4 * 1024 + 1, device="cuda", dtype=torch.float16)
    aligned, unaligned = base[:4096].view(4, 1024), base[1:].view(4, 1024)
    w = torch.randn(1024, device="cuda", dtype=torch.float16)
    got = [rms_norm(t, 1024, w, 1e-5) for t in (aligned, unaligned, aligned, unaligned)]
    _python_path(monkeypatch)
    for t, g in zip((aligned, unaligned, aligned, unaligned), got):
        assert torch.equal(g, rms_norm(t, 1024, w, 1e-5))


@requires_cuda
@pytest.mark.gpu
def test_operator_node_behaves_as_torchs_own(ext):
    """The operator's backward node is built as torch's generated ones are: its name, its edges,
    the saved-tensor rules (a second backward raises, retain_graph keeps them, saved-tensor hooks
    pack them), only the wanted gradients, the profiler's record of the op, inference mode."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 1024, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(1024, device="cuda", generator=g)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(64, 1024, device="cuda", generator=g, dtype=torch.bfloat16)

    y = rms_norm(x, 1024, w, 1e-6)
    assert y.grad_fn.name() == "RmsNormBackward"
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions] == ["AccumulateGrad", "AccumulateGrad"]
    y.backward(dy, retain_graph=True)
    dx, dw = x.grad.clone(), w.grad.clone()
    y.backward(dy)  # retained: the same gradients again, accumulated
    assert torch.equal(x.grad, dx + dx) and torch.equal(w.grad, dw + dw)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward(dy)

    # only what is asked for: no dw for a grad wrt x alone
    x.grad = w.grad = None
    (gx,) = torch.autograd.grad(rms_norm(x, 1024, w, 1e-6), x, dy)
    assert torch.equal(gx, dx) and w.grad is None

    # saved-tensor hooks see x, the weight and r, and the backward runs on what they unpack
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.cpu()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.cuda()):
        y = rms_norm(x, 1024, w, 1e-6)
    assert sorted(packed) == sorted([x.shape, w.shape, x.shape[:-1]])
    y.backward(dy)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rms_norm(x, 1024, w, 1e-6).backward(dy)
    names = {e.key for e in prof.key_averages()}
    assert {"rmsnorm_kernel_host::rms_norm", "RmsNormBackward"} <= names

    with torch.inference_mode():
        y = rms_norm(x, 1024, w, 1e-6)
    assert y.grad_fn is None and torch.equal(y, rms_norm(x.detach(), 1024, w.detach(), 1e-6))
    direct = torch.ops.rmsnorm_kernel_host.rms_norm(x.detach(), w.detach(), 1e-6, 0.0, 0, torch.bfloat16)
    assert torch.equal(direct, y)


@requires_cuda
@pytest.mark.gpu
def test_first_call_loads_the_entry_and_takes_it(ext, monkeypatch):
    """A process's first CUDA call loads the extension before any check, so its checks are made
    once, by the entry (the Python predicate never runs); that call already takes the compiled
    path (its node is the C++ one), and later calls start at the entry it set."""
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "entry", None)
    monkeypatch.setattr(ops, "_takes_fast_path", lambda *a: pytest.fail("the Python predicate ran"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 96, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(96, device="cuda", generator=g, requires_grad=True)
    y = rms_norm(x, 96, w, 1e-6)
    assert host.entry is not None and y.grad_fn.name() == "RmsNormBackward"
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (96,), w, 1e-6))


@requires_cuda
@pytest.mark.gpu
def test_invalid_first_call_loads_the_entry_and_raises_torchs_error(ext, monkeypatch):
    """An invalid first CUDA call loads the extension too, and still raises the general path's
    error naming the argument; the next valid call takes the entry."""
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "entry", None)
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match=r"weight must have shape normalized_shape \(64,\)"):
        rms_norm(x, 64, torch.ones(63, device="cuda"))
    assert host.entry is not None
    monkeypatch.setattr(ops, "_takes_fast_path", lambda *a: pytest.fail("the Python predicate ran"))
    torch.testing.assert_close(rms_norm(x, 64), torch.nn.functional.rms_norm(x, (64,)))


@requires_cuda
@pytest.mark.gpu
def test_common_call_skips_the_python_predicate(ext, monkeypatch):
    """Once the extension is loaded, the common call (with or without grad) is its common_call's:
    ops._takes_fast_path never runs, and y and the gradients are torch's."""
    monkeypatch.setattr(ops, "_takes_fast_path", lambda *a: pytest.fail("the Python predicate ran"))
    assert host.entry is not None
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 96, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(96, device="cuda", generator=g, requires_grad=True)
    for _ in range(2):  # the first call of a key records its plan, the second replays it
        y = rms_norm(x, 96, w, 1e-6)
        torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (96,), w, 1e-6))
        assert y.grad_fn.name() == "RmsNormBackward"
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, (96,), w), torch.nn.functional.rms_norm(x, (96,), w))


# ---------------------------------------------------------------------------------------------
# The residual call: rmsnorm_kernel_host::rms_norm_residual
# ---------------------------------------------------------------------------------------------

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Which outputs the loss reads: y, h or both (the node gets dy, dh or both; "h" needs no kernel);
# "sums": y.sum() + h.sum(), whose gradients arrive expanded (stride 0).
USES = ("y", "h", "both")


def _residual_run(x, r, w, residual_dtype, offset, casting, use, direct_ext=None):
    """y, h and the gradients (x, residual, weight) of one residual call with a seeded loss over
    ``use``; through the operator directly where ``direct_ext`` is given, else rms_norm."""
    if direct_ext is None:
        y, h = rms_norm(
            x, x.shape[-1], w, 1e-6, residual=r, residual_dtype=residual_dtype, offset=offset, casting=casting
        )
    else:
        direct_ext.clear_plans()
        h_dtype = residual_dtype or x.dtype
        out = h_dtype if casting == "llama" else x.dtype  # ops.rms_norm's rule
        if casting == "llama" and w is not None:
            out = torch.promote_types(out, w.dtype)
        op = torch.ops.rmsnorm_kernel_host.rms_norm_residual
        y, h = op(x, r, w, 1e-6, offset, launch.CASTING_MODES[casting], out, h_dtype)
    if use is None:
        return [y, h]
    g = torch.Generator(device=x.device).manual_seed(5)
    if use == "sums":
        (y.sum() + h.sum()).backward()
    else:
        outputs = {"y": [y], "h": [h], "both": [y, h]}[use]
        grads = [torch.randn(t.shape, device=x.device, generator=g).to(t.dtype) for t in outputs]
        torch.autograd.backward(outputs, grads)
    return [y, h, x.grad, r.grad] + ([w.grad] if w is not None else [])


def _residual_inputs(lead, n, dtype, res_dtype, wdtype, grad, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*lead, n, device=device, generator=g).to(dtype).requires_grad_(grad)
    r = torch.randn(*lead, n, device=device, generator=g).to(res_dtype).requires_grad_(grad)
    w = None
    if wdtype is not None:
        w = (1 + 0.1 * torch.randn(n, device=device, generator=g)).to(wdtype).requires_grad_(grad)
    return x, r, w


def _assert_same(got_list, want_list):
    for got, want in zip(got_list, want_list, strict=True):
        if want is None or got is None:  # a gradient neither path computes (dw when only h is used)
            assert got is want
            continue
        assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got, want)


@pytest.mark.interpret
def test_residual_operator_autograd_matches_python_path(interpreted_extension):
    """The residual operator's C++ node against the Python path's autograd.Function, bitwise, on
    the interpreter: dy, dh or both arriving; x, residual, h and weight dtypes that differ (the
    gradient reaching h is computed in x's and the residual's promoted dtype, then cast to each);
    both castings; with and without a weight."""
    ext = interpreted_extension
    for (xd, rd), hd, casting, wd, use in itertools.product(
        [(F32, F32), (BF16, F32), (F16, BF16)],
        [None, F32, BF16],
        ["default", "llama"],
        [None, BF16],
        (*USES, "sums"),
    ):
        args = (hd, 0.0, casting, use)
        direct = _residual_run(*_residual_inputs((3,), 40, xd, rd, wd, True, "cpu"), *args, direct_ext=ext)
        with host.python_path():
            python = _residual_run(*_residual_inputs((3,), 40, xd, rd, wd, True, "cpu"), *args)
        _assert_same(direct, python)
        assert direct[0].grad_fn.name() == "RmsNormResidualBackward"


# (M-shape, N, x dtype, residual dtype, residual_dtype, weight dtype or None, offset, casting)
RESIDUAL_CASES = [
    ((256,), 4096, BF16, BF16, None, BF16, 0.0, "default"),
    ((128,), 257, F32, F32, None, F32, 0.0, "default"),
    ((4, 33), 1024, F16, F32, F32, F32, 0.0, "llama"),
    ((2, 3, 5), 64, BF16, BF16, F32, None, 0.0, "default"),
    ((), 4096, F32, BF16, None, F32, 1.0, "gemma"),  # 1-D x
    ((64,), 12288, BF16, BF16, F32, BF16, 0.0, "default"),  # two-walk
    ((16,), 65536, BF16, BF16, None, BF16, 1.0, "gemma"),  # wide: looped forward, wide backward
]


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("use", [None, *USES], ids=["forward", *USES])
@pytest.mark.parametrize(
    "case", RESIDUAL_CASES, ids=lambda c: f"{'x'.join(map(str, c[0])) or '1d'}x{c[1]}-{c[2]}-{c[3]}-{c[7]}"
)
def test_residual_bitwise_equal_to_python_path(ext, monkeypatch, case, use):
    """rms_norm with a residual takes the compiled path (its plans replayed) and gives what the
    Python path gives, bitwise: y, h, and the gradients wrt x, the residual and the weight."""
    lead, n, xd, rd, hd, wd, offset, casting = case
    host.clear_plans()
    before = host.counts()
    compiled = []
    for _ in range(3):  # the first records the plans, the others replay them
        x, r, w = _residual_inputs(lead, n, xd, rd, wd, use is not None)
        compiled.append(_residual_run(x, r, w, hd, offset, casting, use))
    after = host.counts()
    assert after[0] - before[0] == 2, "the compiled path did not replay the forward"
    kernel_backward = use in ("y", "both")  # dh alone passes straight to x and the residual
    assert after[1] - before[1] == (2 if kernel_backward else 0), "the backward's replays"
    assert compiled[0][0].grad_fn is None or compiled[0][0].grad_fn.name() == "RmsNormResidualBackward"
    _python_path(monkeypatch)
    x, r, w = _residual_inputs(lead, n, xd, rd, wd, use is not None)
    python = _residual_run(x, r, w, hd, offset, casting, use)
    for c in compiled:
        _assert_same(c, python)


@requires_cuda
@pytest.mark.gpu
def test_residual_node_keeps_torchs_saved_tensor_rules(ext, monkeypatch):
    """h, saved as an output of the node, refuses a backward after an in-place change on both
    paths; a second backward raises; create_graph gives the Python path's second derivatives."""

    def rules():
        x, r, w = _residual_inputs((8,), 512, F32, F32, F32, True, seed=2)
        y, h = rms_norm(x, 512, w, 1e-6, residual=r)
        h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        y, h = rms_norm(x, 512, w, 1e-6, residual=r)
        (y.sum() + h.sum()).backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.sum().backward()

    def second():
        x, r, w = _residual_inputs((8,), 512, F32, F32, F32, True, seed=3)
        y, h = rms_norm(x, 512, w, 1e-6, residual=r)
        assert (y.grad_fn.name() == "RmsNormResidualBackward") == (host.entry is not None)
        gx, gr = torch.autograd.grad((y * y).sum() + h.sum(), (x, r), create_graph=True)
        (gxx,) = torch.autograd.grad((gx * gr).sum(), x)
        return [gx.detach(), gr.detach(), gxx]

    rules()
    compiled = second()
    _python_path(monkeypatch)
    rules()
    _assert_same(compiled, second())


@requires_cuda
@pytest.mark.gpu
def test_first_residual_call_loads_the_entry_and_takes_it(ext, monkeypatch):
    """A process whose first call carries a residual loads the compiled path there, and that call
    takes it."""
    monkeypatch.setattr(host, "_extension", host._UNSET)
    monkeypatch.setattr(host, "entry", None)
    x, r, w = _residual_inputs((8,), 96, F32, F32, F32, True, seed=4)
    y, h = rms_norm(x, 96, w, 1e-6, residual=r)
    assert host.entry is not None and y.grad_fn.name() == "RmsNormResidualBackward"
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (96,), w, 1e-6))
    assert torch.equal(h, x + r)


def _plain_run(xd, wd, casting, direct_ext=None):
    """y, dx, dw, and dx with its graph and a second derivative, of one common call on CPU tensors
    (the interpreter); through the operator directly where ``direct_ext`` is given."""
    x, _, w = _residual_inputs((3,), 40, xd, xd, wd, True, "cpu", seed=7)
    if direct_ext is not None:
        direct_ext.clear_plans()
        out = torch.promote_types(xd, wd) if casting == "llama" and wd is not None else xd
        y = torch.ops.rmsnorm_kernel_host.rms_norm(x, w, 1e-6, 0.0, launch.CASTING_MODES[casting], out)
    else:
        with host.python_path():
            y = rms_norm(x, 40, w, 1e-6, casting=casting)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8)).to(y.dtype)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    (gxx,) = torch.autograd.grad(gx.float().square().sum(), x)
    y.backward(dy)
    return [y, x.grad, w.grad if w is not None else None, gx, gxx]


@pytest.mark.interpret
def test_operator_autograd_matches_python_path(interpreted_extension):
    """The common call's operator (RmsNormBackward) against the Python path on the interpreter,
    bitwise: y, dx and dw over dtypes, castings, weight or none, and a second derivative
    (create_graph=True takes the composite formula through the node's callback)."""
    for xd, wd, casting in itertools.product([F32, BF16, F16], [None, F32, BF16], ["default", "llama"]):
        got = _plain_run(xd, wd, casting, interpreted_extension)
        assert got[0].grad_fn.name() == "RmsNormBackward"
        _assert_same(got, _plain_run(xd, wd, casting))


def _fake_inputs(mode, xd, rd, wd):
    """x, residual and weight (requiring grad) as fake tensors of ``mode`` (CPU, 3 x 40)."""
    x, r, w = _residual_inputs((3,), 40, xd, rd, wd, False, "cpu", seed=9)
    return [mode.from_tensor(t).requires_grad_() if t is not None else None for t in (x, r, w)]


@pytest.mark.interpret
def test_operators_take_meta_and_fake_tensors(interpreted_extension):
    """Called directly, both operators take meta tensors (their Meta kernels) and fake tensors
    that require grad (the Autograd kernel hands the forward to the fake mode; the backward is
    the composite's torch ops). Outputs match the custom op's fake kernel in shape, dtype and
    strides; gradients have their inputs' shapes and dtypes, as the real run's do."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    ops_ = torch.ops.rmsnorm_kernel_host
    for xd, rd, wd, casting in [
        (F32, F32, F32, "default"),
        (BF16, F32, F16, "llama"),
        (F16, F16, None, "gemma"),
    ]:
        code = launch.CASTING_MODES[casting]
        out = torch.promote_types(xd, wd) if casting == "llama" and wd is not None else xd
        x, r, w = (
            t.to("meta") if t is not None else None
            for t in _residual_inputs((2, 3), 40, xd, rd, wd, False, "cpu")
        )
        want = ops._forward_fake(x, w, r, 1e-6, 0.0, code, out, rd)
        y = ops_.rms_norm(x, w, 1e-6, 0.0, code, out)
        y2, h = ops_.rms_norm_residual(x, r, w, 1e-6, 0.0, code, out, rd)
        for got, ref in ((y, want[0]), (y2, want[0]), (h, want[2])):
            assert got.is_meta
            assert (got.shape, got.dtype, got.stride()) == (ref.shape, ref.dtype, ref.stride())

        with FakeTensorMode() as mode:
            x, r, w = _fake_inputs(mode, xd, rd, wd)
            y = ops_.rms_norm(x, w, 1e-6, 0.0, code, out)
            y2, h = ops_.rms_norm_residual(x, r, w, 1e-6, 0.0, code, out, rd)
            assert y.grad_fn.name() == "RmsNormBackward" and y2.grad_fn.name() == "RmsNormResidualBackward"
            leaves = [t for t in (x, r, w) if t is not None]
            outputs = [y, y2, h]
            grads = torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs])
        for leaf, grad in zip(leaves, grads, strict=True):
            assert isinstance(grad, FakeTensor) and (grad.shape, grad.dtype) == (leaf.shape, leaf.dtype)


@pytest.mark.gpu
def test_operators_pass_opcheck_and_compile(ext):
    """torch.library.opcheck of both operators (schema, autograd registration, fake tensors, AOT
    dispatch); each called directly inside torch.compile(fullgraph=True) and under a dispatch
    mode (which sees it): outputs as the eager call's, bitwise; their backward (the composite
    formula) within the dtype's tolerance of the kernels'."""
    from rmsnorm_suite import cases

    ops_ = torch.ops.rmsnorm_kernel_host
    for xd in (F32, BF16):
        x, r, w = _residual_inputs((4, 8), 256, xd, xd, xd, True)
        code = launch.CASTING_MODES["default"]
        for op, args in ((ops_.rms_norm, (x, w, 1e-6, 0.0, code, xd)),
                         (ops_.rms_norm_residual, (x, r, w, 1e-6, 0.0, code, xd, xd))):  # fmt: skip
            result = torch.library.opcheck(op, args, raise_exception=False)
            assert all(v == "SUCCESS" for v in result.values()), result
            leaves = [t for t in args[:3] if isinstance(t, torch.Tensor)]
            eager = op(*args)
            compiled = torch.compile(op, fullgraph=True)(*args)
            eager, compiled = (o if isinstance(o, tuple) else (o,) for o in (eager, compiled))
            for e, c in zip(eager, compiled, strict=True):
                assert torch.equal(e, c)
            with _SeesOperators(answer=False) as mode:
                moded = op(*args)
            moded = moded if isinstance(moded, tuple) else (moded,)
            assert str(op.default) in mode.seen
            for e, c in zip(eager, moded, strict=True):
                assert torch.equal(e, c)
            want = torch.autograd.grad(sum(o.float().sum() for o in eager), leaves)
            tol = cases.TOLERANCES[xd]
            for other in (compiled, moded):  # both backwards: the composite formula
                got = torch.autograd.grad(sum(o.float().sum() for o in other), leaves)
                for g_, w_ in zip(got, want, strict=True):
                    torch.testing.assert_close(g_, w_, atol=tol.atol, rtol=tol.rtol)


class _SeesOperators(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operators it sees; answers ours itself (empty results) where ``answer``."""

    def __init__(self, answer):
        super().__init__()
        self.answer, self.seen = answer, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        if self.answer and func.namespace == "rmsnorm_kernel_host":
            return _empty_results(args)
        return func(*args, **(kwargs or {}))


def _empty_results(args):
    """y (and h) of an operator call's shape and dtypes, uninitialised."""
    x, out = args[0], [a for a in args if isinstance(a, torch.dtype)]
    y = torch.empty_like(x, dtype=out[0])
    return (y, torch.empty_like(x, dtype=out[1])) if len(out) == 2 else y


@pytest.mark.interpret
def test_dispatch_mode_sees_the_operators(interpreted_extension):
    """A Python dispatch mode sees both operators when they are called directly (their Autograd
    kernel hands the call under a mode to the dispatcher), with grad and without, and the node
    still records the history."""
    ops_ = torch.ops.rmsnorm_kernel_host
    code = launch.CASTING_MODES["default"]
    for grad in (False, True):
        x, r, w = _residual_inputs((3,), 40, F32, F32, F32, grad, "cpu", seed=3)
        with _SeesOperators(answer=True) as mode:
            y = ops_.rms_norm(x, w, 1e-6, 0.0, code, F32)
            y2, h = ops_.rms_norm_residual(x, r, w, 1e-6, 0.0, code, F32, F32)
        ours = [op for op in mode.seen if op.startswith("rmsnorm_kernel_host.")]
        assert ours == [
            "rmsnorm_kernel_host.rms_norm.default",
            "rmsnorm_kernel_host.rms_norm_residual.default",
        ]
        assert (y.grad_fn is not None, y2.grad_fn is not None, h.grad_fn is not None) == (grad, grad, grad)


@pytest.mark.interpret
def test_operator_backward_reads_negative_and_batched_gradients(interpreted_extension):
    """Both operators' C++ nodes on a gradient stored negated (the negative bit: resolved before
    its pointer is read; it gave -dx) and on a batched one (is_grads_batched: autograd's vmap,
    whose tensors have no storage; the node takes the composite formula). Against torch's
    float64 autograd of the same composition, by the fp32 entry of the tolerance table."""
    tol = cases.TOLERANCES[F32]
    ext = interpreted_extension
    g = torch.Generator().manual_seed(11)
    x, r, w, dy = (torch.randn(*s, generator=g) for s in ((3, 40), (3, 40), (40,), (3, 40)))
    dys = torch.randn(2, 3, 40, generator=g)

    def grads(residual, double, neg, batched):
        xs, ws = x.double() if double else x, w.double() if double else w
        xs, ws = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        if double:
            h = xs + r.double() if residual else xs
            y = F.rms_norm(h, (40,), ws, 1e-6)
        elif residual:
            y, _ = torch.ops.rmsnorm_kernel_host.rms_norm_residual(xs, r, ws, 1e-6, 0.0, 0, F32, F32)
        else:
            y = torch.ops.rmsnorm_kernel_host.rms_norm(xs, ws, 1e-6, 0.0, 0, F32)
        if not double:
            assert y.grad_fn.name() == ("RmsNormResidualBackward" if residual else "RmsNormBackward")
        gout = (dys if batched else dy).to(y.dtype)
        gout = torch._neg_view(-gout) if neg else gout
        return torch.autograd.grad(y, (xs, ws), gout, is_grads_batched=batched)

    ext.clear_plans()
    for residual, (neg, batched) in itertools.product((False, True), ((True, False), (False, True))):
        for got, want in zip(grads(residual, False, neg, batched), grads(residual, True, False, batched)):
            torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)
