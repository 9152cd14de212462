"""The fast path's predicate against the validator it is derived from: every call that
``ops._takes_fast_path`` accepts is one that ``contract.normalized_size`` and ``contract.validate``
accept, and gives bitwise the same result (y, its dtype and strides, and the gradients) as the
general path. The rest of the predicate only chooses the route: each of those conditions alone
sends a valid call to the general path.

The agreement with the validator runs no kernel (plain CPU, the interpreter's device rule
switched on for the call): calls the fast path takes, with one or two arguments changed to forms
it does not take (``OFF_PATH``), each change alone on a few calls and in pairs under hypothesis.
The bitwise comparison runs the kernels (the interpreter on CPU, the GPU session on CUDA) on a
bounded number of small calls.
"""

import os
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import rmsnorm_kernel
from rmsnorm_kernel import contract, kernels, launch, ops

from ..conftest import KERNEL_DEVICES
from .differential_strategies import DTYPES

PROFILE = settings.get_profile(os.environ.get("RMSNORM_HYPOTHESIS_PROFILE", "ci"))
# Calls of the bitwise comparison: each runs the op four times (fast and general path, forward
# and backward), under the interpreter on two cores in CI.
BITWISE_EXAMPLES = 100

F32, F64 = torch.float32, torch.float64
ARGUMENTS = (
    "x",
    "normalized_shape",
    "weight",
    "eps",
    "residual",
    "residual_dtype",
    "offset",
    "casting",
    "out_dtype",
)


class Call(NamedTuple):
    """A call the fast path takes, as a description that prints as code."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    x_grad: bool
    weight_dtype: torch.dtype | None  # None: no weight
    weight_grad: bool
    normalized_shape: object  # None, N or (N,)
    eps: float | None
    offset: float
    casting: str
    seed: int

    def build(self, device):
        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.shape, generator=g).to(device=device, dtype=self.dtype)
        w = None
        if self.weight_dtype is not None:
            w = torch.randn(self.shape[-1], generator=g).to(device=device, dtype=self.weight_dtype)
        return x, w, g

    def arguments(self, device) -> dict:
        """rms_norm's arguments by name, positional order (_takes_fast_path's too)."""
        x, w, _ = self.build(device)
        values = (x, self.normalized_shape, w, self.eps, None, None, self.offset, self.casting, None)
        return dict(zip(ARGUMENTS, values))


@st.composite
def fast_calls(draw, max_n: int = 80) -> Call:
    n = draw(st.integers(1, max_n))
    shape = tuple(draw(st.sampled_from((0, 1, 2, 3))) for _ in range(draw(st.integers(0, 2)))) + (n,)
    weight_dtype = draw(st.one_of(st.none(), st.sampled_from(DTYPES)))
    return Call(
        shape,
        draw(st.sampled_from(DTYPES)),
        draw(st.booleans()),
        weight_dtype,
        weight_dtype is not None and draw(st.booleans()),
        draw(st.sampled_from((None, n, (n,)))),
        draw(st.sampled_from((None, 1e-6, 1e-5, 0.1, 0.0))),
        draw(st.sampled_from((0.0, 1.0))) if weight_dtype is not None else 0.0,
        draw(st.sampled_from(tuple(launch.CASTING_MODES))),
        draw(st.integers(0, 2**31 - 1)),
    )


def _weight(call: dict) -> torch.Tensor:
    """The call's weight, or one of its shape where it has none."""
    w = call["weight"]
    return torch.randn(call["x"].shape[-1]) if w is None else w


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return x.mT.contiguous().mT if x.dim() >= 2 else x


def _n(call: dict) -> int:
    return call["x"].shape[-1]


# Changes to one argument of a call the fast path takes (made from that call), each to a form the
# fast path does not take: invalid, unsupported, or valid but routed elsewhere; a few keep the
# call valid and on the path (nan eps, a weight that is a Parameter), which the check allows.
OFF_PATH: dict[str, Callable[[dict], dict]] = {
    "x float64": lambda c: {"x": c["x"].double()},
    "x int32": lambda c: {"x": c["x"].int()},
    "x bool": lambda c: {"x": c["x"].bool()},
    "x strided": lambda c: {"x": torch.randn(*c["x"].shape[:-1], 2 * _n(c))[..., ::2].to(c["x"].dtype)},
    "x column-major": lambda c: {"x": _transposed(c["x"])},
    "x on meta": lambda c: {"x": c["x"].to("meta")},
    "x a Parameter": lambda c: {"x": torch.nn.Parameter(c["x"], requires_grad=False)},
    "x 0-dim": lambda c: {"x": c["x"].new_ones(())},
    "x without columns": lambda c: {"x": c["x"].new_empty((*c["x"].shape[:-1], 0))},
    "x a list": lambda c: {"x": c["x"].tolist()},
    "x a numpy array": lambda c: {"x": c["x"].float().numpy()},
    "x a float": lambda c: {"x": 1.0},
    "x sparse": lambda c: {"x": c["x"].to_sparse()},
    "x sparse CSR": lambda c: {"x": c["x"].reshape(-1, _n(c)).to_sparse_csr()},
    "x nested": lambda c: {
        "x": torch.nested.nested_tensor([torch.randn(2, _n(c)), torch.randn(1, _n(c))], layout=torch.jagged)
    },
    "shape N+1": lambda c: {"normalized_shape": _n(c) + 1},
    "shape (N+1,)": lambda c: {"normalized_shape": (_n(c) + 1,)},
    "shape [N]": lambda c: {"normalized_shape": [_n(c)]},
    "shape Size([N])": lambda c: {"normalized_shape": torch.Size([_n(c)])},
    "shape (None,)": lambda c: {"normalized_shape": (None,)},
    "shape (True,)": lambda c: {"normalized_shape": (True,)},
    "shape True": lambda c: {"normalized_shape": True},
    "shape float N": lambda c: {"normalized_shape": float(_n(c))},
    "shape (float N,)": lambda c: {"normalized_shape": (float(_n(c)),)},
    "shape numpy N": lambda c: {"normalized_shape": np.int64(_n(c))},
    "shape (numpy N,)": lambda c: {"normalized_shape": (np.int64(_n(c)),)},
    "shape ()": lambda c: {"normalized_shape": ()},
    "shape (1, N)": lambda c: {"normalized_shape": (1, _n(c))},
    "shape (N, N)": lambda c: {"normalized_shape": (_n(c), _n(c))},
    "shape a str": lambda c: {"normalized_shape": str(_n(c))},
    "shape a set": lambda c: {"normalized_shape": {_n(c)}},
    "weight float64": lambda c: {"weight": _weight(c).double()},
    "weight int32": lambda c: {"weight": _weight(c).int()},
    "weight bool": lambda c: {"weight": _weight(c).bool()},
    "weight strided": lambda c: {"weight": torch.randn(2 * _n(c))[::2].to(_weight(c).dtype)},
    "weight on meta": lambda c: {"weight": _weight(c).to("meta")},
    "weight a Parameter": lambda c: {"weight": torch.nn.Parameter(_weight(c))},
    "weight (N+1,)": lambda c: {"weight": torch.randn(_n(c) + 1)},
    "weight (1, N)": lambda c: {"weight": torch.randn(1, _n(c))},
    "weight 0-dim": lambda c: {"weight": torch.randn(())},
    "weight a list": lambda c: {"weight": [1.0] * _n(c)},
    "weight sparse": lambda c: {"weight": _weight(c).to_sparse()},
    "no weight, an offset": lambda c: {"weight": None, "offset": 1.0},
    "eps int": lambda c: {"eps": 0},
    "eps True": lambda c: {"eps": True},
    "eps numpy float32": lambda c: {"eps": np.float32(1e-5)},
    "eps numpy float64": lambda c: {"eps": np.float64(1e-3)},
    "eps a str": lambda c: {"eps": "1e-6"},
    "eps a tensor": lambda c: {"eps": torch.tensor(1e-6)},
    "eps nan": lambda c: {"eps": float("nan")},
    "offset int": lambda c: {"offset": 1},
    "offset True": lambda c: {"offset": True},
    "offset inf": lambda c: {"offset": float("inf")},
    "offset -inf": lambda c: {"offset": float("-inf")},
    "offset nan": lambda c: {"offset": float("nan")},
    "offset numpy": lambda c: {"offset": np.float64(1.0)},
    "offset a str": lambda c: {"offset": "1"},
    "offset None": lambda c: {"offset": None},
    "offset a tensor": lambda c: {"offset": torch.tensor(1.0)},
    "casting Llama": lambda c: {"casting": "Llama"},
    "casting empty": lambda c: {"casting": ""},
    "casting None": lambda c: {"casting": None},
    "casting int": lambda c: {"casting": 1},
    "casting a tuple": lambda c: {"casting": ("default",)},
    "casting a list": lambda c: {"casting": ["default"]},
    "residual": lambda c: {"residual": c["x"].clone()},
    "residual float64": lambda c: {"residual": c["x"].double()},
    "residual other shape": lambda c: {"residual": torch.randn(3)},
    "residual a list": lambda c: {"residual": c["x"].tolist()},
    "residual_dtype": lambda c: {"residual_dtype": F32},
    "residual_dtype float64": lambda c: {"residual_dtype": F64},
    "out_dtype": lambda c: {"out_dtype": F32},
    "out_dtype float16": lambda c: {"out_dtype": torch.float16},
    "out_dtype float64": lambda c: {"out_dtype": F64},
    "out_dtype int32": lambda c: {"out_dtype": torch.int32},
}


def general_path_accepts(call: dict) -> tuple[int, tuple[int, ...]]:
    """What rms_norm's general path checks before it runs the kernels: _normalized_size, then
    validate with eps=None made explicit; (N, normalized shape), or their exception."""
    x, weight, eps = call["x"], call["weight"], call["eps"]
    n, shape = contract.normalized_size(x, call["normalized_shape"], weight)
    if eps is None:
        eps = contract.default_eps(x.dtype)
    contract.validate(
        x,
        weight,
        call["residual"],
        eps,
        call["offset"],
        call["casting"],
        call["out_dtype"],
        call["residual_dtype"],
        n,
    )
    return n, shape


def check_agreement(call: dict) -> bool:
    """Where the predicate takes ``call`` (on a kernel device), the general path's checks pass
    and normalise over x's last dim alone with the eps the fast path takes; the predicate never
    raises. Returns whether it took the call."""
    if not ops._takes_fast_path(*call.values()):
        return False
    x = call["x"]
    n, shape = general_path_accepts(call)  # raises where the predicate took invalid input
    assert (n, shape) == (x.shape[-1], (x.shape[-1],))
    assert contract.default_eps(x.dtype) == ops._DEFAULT_EPS  # the fast path's eps=None
    return True


# Calls the fast path takes, on which each change of OFF_PATH is checked alone: one column
# (where True == 1), with and without a weight and an offset, each normalized_shape form.
BASES = [
    Call((3, 1), F32, False, None, False, None, None, 0.0, "default", 0),
    Call((1,), torch.bfloat16, False, F32, False, 1, 1e-6, 1.0, "gemma", 1),
    Call((2, 3, 5), torch.float16, False, torch.bfloat16, False, (5,), 0.0, 0.0, "llama", 2),
    Call((0, 4), F32, False, torch.float16, False, 4, None, -0.5, "default", 3),
]


@pytest.mark.parametrize("off", OFF_PATH)
def test_each_change_alone_agrees_with_the_validator(monkeypatch, off):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    for base in BASES:
        call = base.arguments("cpu")
        assert check_agreement(call), f"{base} is off the fast path"
        call.update(OFF_PATH[off](call))
        check_agreement(call)


@settings(PROFILE)
@given(base=fast_calls(max_n=8), offs=st.lists(st.sampled_from(tuple(OFF_PATH)), max_size=2, unique=True))
def test_fast_path_accepts_only_what_the_validator_accepts(base, offs):
    """On a kernel device (the CPU, with the interpreter's device rule on for the call), every
    call the predicate takes passes _normalized_size and validate as the general path calls them
    (``check_agreement``): calls it takes, with up to two changes of OFF_PATH."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "INTERPRET", True)
        accepted = base.arguments("cpu")
        assert check_agreement(accepted), f"{base} is off the fast path"
        call = dict(accepted)
        for off in offs:
            call.update(OFF_PATH[off](accepted))
        check_agreement(call)


def _common(x=None, **changes) -> dict:
    call = dict.fromkeys(ARGUMENTS)
    call.update(x=torch.randn(4, 8) if x is None else x, weight=torch.randn(8), offset=0.0, casting="default")
    call.update(changes)
    return call


COMMON = {
    "weight": {},
    "no-weight": {"weight": None},
    "int-shape": {"normalized_shape": 8},
    "tuple-shape": {"normalized_shape": (8,)},
    "eps-float": {"eps": 1e-5},
    "gemma": {"casting": "gemma", "offset": 1.0},
    "llama-bf16-weight": {"casting": "llama", "weight": torch.randn(8, dtype=torch.bfloat16)},
    "parameter-weight": {"weight": torch.nn.Parameter(torch.randn(8))},
    "x-requires-grad": {"x": torch.randn(2, 3, 8, requires_grad=True)},
    "one-dim": {"x": torch.randn(8)},
    "no-rows": {"x": torch.randn(0, 8)},
}


@pytest.mark.parametrize("changes", COMMON.values(), ids=COMMON.keys())
def test_common_calls_take_the_fast_path(monkeypatch, changes):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common(**changes)
    assert ops._takes_fast_path(*call.values())


class _Subclass(torch.Tensor):
    """A __torch_function__ subclass (torch's default handler)."""


# Valid calls, each one change from an accepted one, that the fast path leaves to the general
# path: a condition that only chooses the route, or a form its exact-type tests leave out.
GENERAL_ONLY = {
    "residual": {"residual": torch.randn(4, 8)},
    "out_dtype": {"out_dtype": F32},
    "strided-x": {"x": torch.randn(4, 16)[:, ::2]},
    "strided-weight": {"weight": torch.randn(16)[::2]},
    "numpy-eps": {"eps": np.float64(1e-6)},
    "int-offset": {"offset": 0},
    "list-shape": {"normalized_shape": [8]},
    "size-shape": {"normalized_shape": torch.Size([8])},
    "two-dims": {"normalized_shape": (4, 8), "weight": torch.randn(4, 8)},
    # negative views: their storage holds -t, so the general path resolves them first
    "negative-x": {"x": torch._neg_view(torch.randn(4, 8))},
    "negative-weight": {"weight": torch._neg_view(torch.randn(8))},
    # a subclass weight sees the call through its __torch_function__, as F.rms_norm's does
    "subclass-weight": {"weight": torch.randn(8).as_subclass(_Subclass)},
}


@pytest.mark.parametrize("changes", GENERAL_ONLY.values(), ids=GENERAL_ONLY.keys())
def test_valid_calls_the_fast_path_leaves(monkeypatch, changes):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common(**changes)
    general_path_accepts(call)
    assert not ops._takes_fast_path(*call.values())


@pytest.mark.parametrize("active", ["_are_functorch_transforms_active", "is_compiling"])
def test_functorch_transforms_and_tracing_leave_the_fast_path(monkeypatch, active):
    """Under a functorch transform (vmap, grad: torch ops serve) or while tracing
    (torch.compile: the custom op), an otherwise accepted call takes the general path."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common()
    assert ops._takes_fast_path(*call.values())
    monkeypatch.setattr(torch._C if active.startswith("_") else torch.compiler, active, lambda: True)
    assert not ops._takes_fast_path(*call.values())


def _route_while_traced(takes, call: dict) -> bool:
    """``takes(call)`` evaluated inside torch.jit.trace (with the traced x)."""
    seen = []

    def traced(x):
        seen.append(takes(*{**call, "x": x}.values()))
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's and torch.jit's warnings
        torch.jit.trace(traced, call["x"])
    return seen[0]


def test_jit_tracer_leaves_the_fast_path(monkeypatch):
    """Under torch.jit.trace an otherwise accepted call takes the composite (torch ops the tracer
    records; the kernels' launches would be recorded as nothing)."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common()
    assert ops._takes_fast_path(*call.values())
    assert not _route_while_traced(ops._takes_fast_path, call)


def test_forward_mode_ad_leaves_the_fast_path(monkeypatch):
    """Inside a forward-mode AD level (dual tensors: torch ops serve, the kernels compute no
    tangent) an otherwise accepted call takes the general path."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common()
    assert ops._takes_fast_path(*call.values())
    with torch.autograd.forward_ad.dual_level():
        assert not ops._takes_fast_path(*call.values())
    assert ops._takes_fast_path(*call.values())


def test_autocast_leaves_the_fast_path(monkeypatch):
    """Under autocast (which may make y float32: ops._autocast_float32) an otherwise accepted call
    takes the general path."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not ops._takes_fast_path(*call.values())
    assert ops._takes_fast_path(*call.values())


def test_devices_the_kernels_do_not_run_leave_the_fast_path(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)
    call = _common()
    assert not ops._takes_fast_path(*call.values())
    with pytest.raises(launch.UnsupportedInput):
        general_path_accepts(call)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("normalized_shape", [(None,), (True,), (8.0,), np.int64(8)], ids=str)
def test_normalized_shape_of_no_int_is_refused_on_a_kernel_device(device, normalized_shape):
    """A 1-tuple that holds no int is refused as off a kernel device (the fast path once read
    ``(None,)`` as None)."""
    with pytest.raises(TypeError, match="normalized_shape"):
        rmsnorm_kernel.rms_norm(torch.randn(4, 8, device=device), normalized_shape)


def test_casting_of_another_type_is_refused_by_name():
    """A casting that is no str (a list cannot even be looked up) is a ValueError naming it."""
    with pytest.raises(ValueError, match="casting must be one of"):
        rmsnorm_kernel.rms_norm(torch.randn(4, 8), casting=["llama"])


# ---------------------------------------------------------------------------------------------
# The same bits through both paths
# ---------------------------------------------------------------------------------------------


def _run(call: Call, device) -> dict[str, torch.Tensor]:
    """y, and dx and dw where x and the weight require grad, for dy drawn from the call's seed."""
    x, w, g = call.build(device)
    x.requires_grad_(call.x_grad)
    if w is not None:
        w.requires_grad_(call.weight_grad)
    y = rmsnorm_kernel.rms_norm(
        x, call.normalized_shape, w, call.eps, offset=call.offset, casting=call.casting
    )
    leaves = {name: t for name, t in (("dx", x), ("dw", w)) if t is not None and t.requires_grad}
    if not leaves:
        return {"y": y}
    dy = torch.randn(y.shape, generator=g).to(device=device, dtype=y.dtype)
    return {"y": y.detach(), **dict(zip(leaves, torch.autograd.grad(y, list(leaves.values()), dy)))}


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()]).cpu()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@settings(PROFILE, max_examples=min(PROFILE.max_examples, BITWISE_EXAMPLES))
@given(call=fast_calls())
def test_fast_path_gives_the_general_paths_bits(device, call):
    """Each call of the strategy takes the fast path and gives bitwise what the general path
    gives with the predicate switched off: y (and its dtype, shape and strides), dx and dw."""
    assert ops._takes_fast_path(*call.arguments(device).values())
    fast = _run(call, device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "_takes_fast_path", lambda *args: False)
        general = _run(call, device)
    assert fast.keys() == general.keys()
    for what, a in fast.items():
        b = general[what]
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), what
        assert torch.equal(_bits(a), _bits(b)), f"{what} differs between the fast and the general path"


# The compiled host path's predicate (csrc/host.cpp, fast_path_mode) makes the same tests in C++:
# it takes exactly the calls _takes_fast_path takes. Its extension builds on CPU machines too.


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _same_route(ext, call: dict) -> bool:
    took = ops._takes_fast_path(*call.values())
    assert ext.takes_fast_path(*call.values()) == took, f"C++ {'leaves' if took else 'takes'} {call}"
    return took


@pytest.mark.parametrize("off", OFF_PATH)
def test_compiled_predicate_each_change_alone(monkeypatch, built_extension, off):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    for base in BASES:
        call = base.arguments("cpu")
        assert _same_route(built_extension, call)
        call.update(OFF_PATH[off](call))
        _same_route(built_extension, call)


@settings(PROFILE)
@given(base=fast_calls(max_n=8), offs=st.lists(st.sampled_from(tuple(OFF_PATH)), max_size=2, unique=True))
def test_compiled_predicate_takes_what_python_takes(built_extension, base, offs):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "INTERPRET", True)
        accepted = base.arguments("cpu")
        assert _same_route(built_extension, accepted)
        call = dict(accepted)
        for off in offs:
            call.update(OFF_PATH[off](accepted))
        _same_route(built_extension, call)


@pytest.mark.parametrize("changes", [*COMMON.values(), *GENERAL_ONLY.values()], ids=[*COMMON, *GENERAL_ONLY])
def test_compiled_predicate_on_common_and_general_calls(monkeypatch, built_extension, changes):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    _same_route(built_extension, _common(**changes))


def test_compiled_predicate_under_transforms_autocast_and_dual_tensors(monkeypatch, built_extension):
    """vmap and autocast send a call to the general path on both; forward-mode AD on the tensors'
    tangents in C++ (a dual tensor leaves, a plain one inside a level stays), on the level in
    Python (anything inside a level leaves)."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _common()
    takes = built_extension.takes_fast_path
    assert takes(*call.values())
    in_vmap = torch.func.vmap(lambda x: torch.tensor(takes(*{**call, "x": x}.values())))(call["x"])
    assert not in_vmap.any()
    with torch.autocast("cpu"):
        assert not takes(*call.values())
    with _Mode():  # a Python dispatch mode: both leave, for the custom op
        assert not takes(*call.values()) and not ops._takes_fast_path(*call.values())
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fake_weight = fake.from_tensor(call["weight"])
    _same_route(built_extension, {**call, "weight": fake_weight})
    assert not takes(*{**call, "weight": fake_weight}.values())
    assert not _route_while_traced(takes, call)
    with torch.autograd.forward_ad.dual_level():
        assert takes(*call.values())
        for name in ("x", "weight"):
            dual = torch.autograd.forward_ad.make_dual(call[name], torch.ones_like(call[name]))
            assert not takes(*{**call, name: dual}.values())


# The compiled path's route for a call with a residual (csrc/host.cpp, residual_path_mode) has no
# Python counterpart: on the Python host path every residual call takes the general path. Every
# call it takes must be one the general path's checks accept, normalised over x's last dim.

RESIDUAL_OFF_PATH: dict[str, Callable[[dict], dict]] = {
    "residual int32": lambda c: {"residual": c["residual"].int()},
    "residual bool": lambda c: {"residual": c["residual"].bool()},
    "residual strided": lambda c: {
        "residual": torch.randn(*c["x"].shape[:-1], 2 * _n(c))[..., ::2].to(c["residual"].dtype)
    },
    "residual column-major": lambda c: {"residual": _transposed(c["residual"])},
    "residual on meta": lambda c: {"residual": c["residual"].to("meta")},
    "residual a Parameter": lambda c: {"residual": torch.nn.Parameter(c["residual"], requires_grad=False)},
    "residual (N,)": lambda c: {"residual": torch.randn(_n(c))},
    "residual a row more": lambda c: {"residual": torch.randn(1, *c["x"].shape)},
    "residual sparse": lambda c: {"residual": c["residual"].to_sparse()},
    "residual a numpy array": lambda c: {"residual": c["residual"].float().numpy()},
    "residual_dtype float16": lambda c: {"residual_dtype": torch.float16},
    "residual_dtype int32": lambda c: {"residual_dtype": torch.int32},
    "residual_dtype a str": lambda c: {"residual_dtype": "float32"},
}


def _with_residual(base: Call, dtype: torch.dtype) -> dict:
    call = base.arguments("cpu")
    call["residual"] = torch.randn(call["x"].shape).to(dtype)
    return call


def _residual_route(ext, call: dict) -> bool:
    """Whether the C++ residual route takes ``call``; where it does, the general path's checks
    pass and normalise over x's last dim alone."""
    if not ext.takes_residual_path(*call.values()):
        return False
    n, shape = general_path_accepts(call)  # raises where the route took invalid input
    assert (n, shape) == (call["x"].shape[-1], (call["x"].shape[-1],))
    return True


@pytest.mark.parametrize("off", [*OFF_PATH, *RESIDUAL_OFF_PATH])
def test_compiled_residual_route_takes_only_valid_calls(monkeypatch, built_extension, off):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    change = OFF_PATH.get(off) or RESIDUAL_OFF_PATH[off]
    for base in BASES:
        for dtype in (F32, torch.bfloat16):
            call = _with_residual(base, dtype)
            assert _residual_route(built_extension, call), f"{base} with a {dtype} residual is off the route"
            call.update(change(call))
            _residual_route(built_extension, call)


def test_compiled_residual_route_under_modes_and_dual_tensors(monkeypatch, built_extension):
    """Autocast, a Python dispatch mode, a fake residual and a dual residual send a residual call to
    the general path, as they send the common call."""
    monkeypatch.setattr(kernels, "INTERPRET", True)
    call = _with_residual(BASES[0], F32)
    takes = built_extension.takes_residual_path
    assert takes(*call.values())
    with torch.autocast("cpu"):
        assert not takes(*call.values())
    with _Mode():
        assert not takes(*call.values())
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fake_residual = fake.from_tensor(call["residual"])
    assert not takes(*{**call, "residual": fake_residual}.values())
    assert not takes(*{**call, "residual": torch._neg_view(call["residual"])}.values())
    assert not _route_while_traced(takes, call)
    with torch.autograd.forward_ad.dual_level():
        assert takes(*call.values())
        dual = torch.autograd.forward_ad.make_dual(call["residual"], torch.ones_like(call["residual"]))
        assert not takes(*{**call, "residual": dual}.values())
