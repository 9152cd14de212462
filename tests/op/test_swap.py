"""swap_rms_norm decides by behaviour: each module that looks like an RMSNorm is probed and swapped
only where the replacement matches its forward (values within the tolerance table, and the
output dtype); every other one is left as it was, with the reason in the report.

* the RMSNorm constructor's eps and out_dtype checks, the probe tolerance against the suite's
  table, and what is refused before any kernel runs (hooks, buffers, a CPU model without the
  interpreter): no kernels, every session;
* hand-written modules for each defect of the module-swap class (a (1 + w) formula without "Gemma" in
  the name, a "Gemma" name with a plain w, a subclass with its own forward, hooks, the output
  dtype of bf16 x with an fp32 weight): the real kernels, under the interpreter and on CUDA;
* a sweep over every class named ``*RMSNorm`` in the installed transformers (the optional
  `models` extra), built with random weights in fp32, fp16, bf16 and an fp32 weight with bf16
  input, swapped, and compared with the original on inputs other than the probes.
"""

import importlib
import importlib.util
import inspect
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import rmsnorm_kernel
from rmsnorm_kernel import kernels, module
from rmsnorm_kernel.module import LastDimRMSNorm, RMSNorm, SwapReport, swap_rms_norm
from rmsnorm_suite.cases import TOLERANCES

from ..conftest import KERNEL_DEVICES
from ._fixtures import LlamaRMSNorm

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HIDDEN = 64
EPS = 1e-5  # not the classes' default (1e-6), so that a swap that dropped the module's eps shows


def coarser(*dtypes):
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def inputs(shape, dtype, device, seed=1):
    """Rows at 1, 1e-2 and 10 in turn (other scales and seed than the probes')."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    scales = torch.tensor([(1.0, 1e-2, 10.0)[i % 3] for i in range(x[..., 0].numel())])
    return (x * scales.view(*shape[:-1], 1)).to(dtype).to(device)


def assert_matches(got, expected, x_dtype, what=""):
    """Same dtype and shape; values within TOLERANCES of the coarser of x's and the output's
    dtype (a rounding to x's dtype inside a formula may flip by one ulp of x's dtype)."""
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, the original returns {expected.dtype}"
    tol = TOLERANCES[coarser(x_dtype, expected.dtype)]
    torch.testing.assert_close(
        got.double(), expected.double(), atol=tol.atol, rtol=tol.rtol, msg=lambda m: f"{what}: {m}"
    )


def perturbed(norm: nn.Module, seed=0) -> nn.Module:
    """The module with 0.1 N(0, 1) added to each parameter: around its own initial value (ones for
    a plain weight, zeros for a (1 + w) one), so that a wrong offset or a dropped weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
    return norm


def rng_state(device) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


def holder(norm: nn.Module) -> nn.Module:
    model = nn.Module()
    model.norm = norm
    return model


# ---------------------------------------------------------------------------------------------
# The constructor, the probe tolerance, and what is refused before any kernel runs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [0, 0.0, -1e-6, 1, 1e-5, np.float32(1e-5), np.float64(1e-6), True, np.True_])
def test_rmsnorm_takes_any_real_eps_as_torch_does(eps):
    torch.nn.RMSNorm(8, eps=eps)  # torch takes it
    assert RMSNorm(8, eps=eps).eps == float(eps) and type(RMSNorm(8, eps=eps).eps) is float
    assert RMSNorm(8).eps is None and LastDimRMSNorm().eps is None


@pytest.mark.parametrize("eps", ["1e-6", torch.tensor(1e-6), [1e-6], 1j])
def test_rmsnorm_rejects_a_non_real_eps_at_construction(eps):
    with pytest.raises(TypeError, match="eps"):
        RMSNorm(8, eps=eps)
    with pytest.raises(TypeError, match="eps"):
        LastDimRMSNorm(eps=eps)


@pytest.mark.parametrize("out_dtype", ["x", torch.float64, torch.int32, 16])
def test_rmsnorm_rejects_a_bad_out_dtype_at_construction(out_dtype):
    with pytest.raises(ValueError, match="out_dtype"):
        RMSNorm(8, out_dtype=out_dtype)


def test_probe_tolerance_is_no_looser_than_the_suites():
    assert module.PROBE_TOLERANCES.keys() == TOLERANCES.keys()
    for dtype, (atol, rtol) in module.PROBE_TOLERANCES.items():
        assert atol <= TOLERANCES[dtype].atol and rtol <= TOLERANCES[dtype].rtol, dtype


# Llama's formula: the normalised activations cast to x's dtype, then the weight multiply.
LlamaLikeRMSNorm = LlamaRMSNorm


def test_swap_rejects_a_model_the_kernels_cannot_run_before_changing_it(monkeypatch):
    """A CPU model without the interpreter: a ValueError at swap time, nothing replaced."""
    monkeypatch.setattr(kernels, "INTERPRET", False)
    model = nn.Sequential(nn.Linear(8, 8), LlamaLikeRMSNorm(8), nn.RMSNorm(8))
    before = list(model)
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1.*2 RMSNorm module\(s\).*1 on cpu, 2 on cpu"):
        swap_rms_norm(model)
    assert list(model) == before


class GatedRMSNorm(LlamaLikeRMSNorm):
    def forward(self, hidden_states, gate=None):
        y = super().forward(hidden_states)
        return y if gate is None else y * torch.sigmoid(gate)


class BiasRMSNorm(LlamaLikeRMSNorm):
    def __init__(self, hidden_size):
        super().__init__(hidden_size)
        self.bias = nn.Parameter(torch.zeros(hidden_size))


class BufferRMSNorm(LlamaLikeRMSNorm):
    def __init__(self, hidden_size):
        super().__init__(hidden_size)
        self.register_buffer("scale", torch.ones(()))


class MatrixRMSNorm(LlamaLikeRMSNorm):
    def __init__(self, hidden_size):
        super().__init__(hidden_size)
        self.weight = nn.Parameter(torch.ones(4, hidden_size))


class NoEpsRMSNorm(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class GateInsideRMSNorm(LlamaLikeRMSNorm):
    """Named like one, with a gate inside (as transformers' AXK2GatedRMSNorm)."""

    def __init__(self, hidden_size):
        super().__init__(hidden_size)
        self.gate = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states):
        return super().forward(hidden_states) * torch.sigmoid(self.gate(hidden_states))


def hooked(kind):
    norm = LlamaLikeRMSNorm(8)
    if kind == "forward hook":
        norm.register_forward_hook(lambda m, args, out: out * 2)
    elif kind == "forward pre-hook":
        norm.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    elif kind == "backward hook":
        norm.register_full_backward_hook(lambda m, gin, gout: None)
    elif kind == "state_dict hook":
        norm.register_state_dict_post_hook(lambda m, sd, prefix, local: None)
    return norm


# name: (module, fragment of the reason). Each is refused before a probe runs, so no kernel runs.
STRUCTURAL = {
    "forward hook": (lambda: hooked("forward hook"), "forward hooks"),
    "forward pre-hook": (lambda: hooked("forward pre-hook"), "forward pre hooks"),
    "backward hook": (lambda: hooked("backward hook"), "backward hooks"),
    "state_dict hook": (lambda: hooked("state_dict hook"), "state dict hooks"),
    "gate argument": (lambda: GatedRMSNorm(8), "takes more than the input (gate)"),
    "bias": (lambda: BiasRMSNorm(8), "parameters other than weight (bias)"),
    "buffer": (lambda: BufferRMSNorm(8), "buffers (scale)"),
    "2-D weight": (lambda: MatrixRMSNorm(8), "weight has shape (4, 8)"),
    "no eps": (lambda: NoEpsRMSNorm(8), "no eps attribute"),
    "float64 weight": (lambda: LlamaLikeRMSNorm(8).double(), "float64"),
    "submodules": (lambda: GateInsideRMSNorm(8), "submodules (gate)"),
}


@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_swap_leaves_what_it_cannot_stand_in_for_with_the_reason(case, caplog, monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)  # refused before a probe: nothing runs
    make, fragment = STRUCTURAL[case]
    norm = make()
    model = holder(norm)
    with caplog.at_level(logging.INFO, logger="rmsnorm_kernel.module"):
        report = swap_rms_norm(model)
    assert isinstance(report, SwapReport) and report == [] and model.norm is norm
    assert fragment in report.skipped["norm"], report.skipped
    assert any(r.levelno == logging.WARNING and fragment in r.getMessage() for r in caplog.records)


def test_swap_reports_the_model_itself_and_skips_its_own_modules(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)
    norm = LlamaLikeRMSNorm(8)
    assert "the model itself" in swap_rms_norm(norm).skipped[""]
    ours = holder(RMSNorm(8))
    report = swap_rms_norm(ours)  # this project's module: neither probed nor reported, nor an error on CPU
    assert report == [] and report.skipped == {}


# ---------------------------------------------------------------------------------------------
# The module-swap class, one hand-written module per defect: the real kernels
# ---------------------------------------------------------------------------------------------


class ZeroCenteredNorm(nn.Module):
    """Qwen3-Next's and Qwen3.5's formula, (1 + w) in fp32, without "Gemma" in the name: swapped
    by name it got Llama's formula and output zeros."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (output * (1.0 + self.weight.float())).type_as(x)


class Gemma3nLikeRMSNorm(nn.Module):
    """Gemma3n's and Gemma4's formula, a plain w in fp32, with "Gemma" in the name: swapped by name
    it got offset 1."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        output = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (output * self.weight.float()).type_as(x)


class CastAtEndRMSNorm(LlamaLikeRMSNorm):
    """(w * normalised).to(x's dtype), fp32 throughout: bf16 x with an fp32 weight returns bf16.
    Swapped by name it got Llama's formula, which returns fp32 there."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class DoubledRMSNorm(nn.RMSNorm):
    """A torch.nn.RMSNorm subclass with its own forward, which swapping by class lost."""

    def forward(self, x):
        return 2 * super().forward(x)


class CountingRMSNorm(nn.RMSNorm):
    """Same numbers as torch's, but its forward keeps a count the replacement would not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class ChannelsFirstRMSNorm(nn.Module):
    """Normalises dim 1 (an image's channels) with a 1-D weight and an eps: looks like one."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x):
        r = torch.rsqrt(x.float().pow(2).mean(1, keepdim=True) + self.eps)
        return (x.float() * r * self.weight.float().view(-1, *[1] * (x.dim() - 2))).type_as(x)


class TwoEpsRMSNorm(LlamaLikeRMSNorm):
    """Two eps-named attributes; the forward uses variance_epsilon."""

    def __init__(self, hidden_size):
        super().__init__(hidden_size, eps=1e-5)
        self.layer_norm_eps = 1e-3


class RandomDrawingRMSNorm(LlamaLikeRMSNorm):
    """Draws from the global generator in its forward (as a dropout would) without changing its
    numbers: swapped, and the probes must leave the generator's state as it was."""

    def forward(self, hidden_states):
        return super().forward(hidden_states + 0.0 * torch.randn_like(hidden_states))


class WeightlessRMSNorm(nn.Module):
    """No weight, any width (nanochat's, DeepSeek-V4's unweighted norm)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


# name: (module, what the swap must have made of it: None where it must be refused, else
# (offset, casting, out_dtype)). Only a torch.nn.RMSNorm gets out_dtype None (F.rms_norm's rule,
# autocast's included); a look-alike keeps the rule its forward follows.
BEHAVIOURS = {
    "(1 + w) without Gemma in the name": (lambda: ZeroCenteredNorm(HIDDEN, eps=EPS), (1.0, "gemma", "input")),
    "Gemma in the name, plain w": (lambda: Gemma3nLikeRMSNorm(HIDDEN, eps=EPS), (0.0, "default", "input")),
    "Llama": (lambda: LlamaLikeRMSNorm(HIDDEN, eps=EPS), (0.0, "llama", "promoted")),
    "cast at the end": (lambda: CastAtEndRMSNorm(HIDDEN, eps=EPS), (0.0, "default", "input")),
    "two eps attributes": (lambda: TwoEpsRMSNorm(HIDDEN), (0.0, "llama", "promoted")),
    "draws random numbers": (lambda: RandomDrawingRMSNorm(HIDDEN, eps=EPS), (0.0, "llama", "promoted")),
    "torch.nn.RMSNorm": (lambda: nn.RMSNorm(HIDDEN, eps=EPS), (0.0, "default", None)),
    "torch.nn.RMSNorm, eps=None": (lambda: nn.RMSNorm(HIDDEN), (0.0, "default", None)),
    "torch.nn.RMSNorm, eps=True (torch reads 1.0)": (
        lambda: nn.RMSNorm(HIDDEN, eps=True),
        (0.0, "default", None),
    ),
    "torch.nn.RMSNorm, 2-D": (lambda: nn.RMSNorm((4, HIDDEN // 4), eps=EPS), (0.0, "default", None)),
    "torch.nn.RMSNorm, no weight": (
        lambda: nn.RMSNorm(HIDDEN, eps=EPS, elementwise_affine=False),
        (0.0, "default", None),
    ),
    "weightless, any width": (lambda: WeightlessRMSNorm(eps=EPS), (0.0, "default", None)),
    "subclass with its own forward": (lambda: DoubledRMSNorm(HIDDEN, eps=EPS), None),
    "forward that sets an attribute": (lambda: CountingRMSNorm(HIDDEN, eps=EPS), None),
    "channels first": (lambda: ChannelsFirstRMSNorm(HIDDEN), None),
}
REFUSAL = {
    "subclass with its own forward": "no setting reproduces its forward",
    "forward that sets an attribute": "sets attributes (calls)",
    "channels first": "its forward raised RuntimeError",
}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", list(BEHAVIOURS))
def test_swap_decides_by_behaviour(case, dtype, device):
    make, expected = BEHAVIOURS[case]
    norm = perturbed(make()).to(device=device, dtype=dtype)
    model = holder(norm)
    state = {k: v.clone() for k, v in norm.state_dict().items()}
    rng = rng_state(device)
    report = swap_rms_norm(model)
    assert torch.equal(rng_state(device), rng), "the probes changed the global RNG state"
    if expected is None:
        assert report == [] and model.norm is norm, f"{case}: swapped"
        assert REFUSAL[case] in report.skipped["norm"], report.skipped
        assert getattr(norm, "calls", 0) == 0, "the probes left the module's attributes changed"
        return
    assert report == ["norm"] and report.skipped == {}, report.skipped
    new = model.norm
    if isinstance(norm, nn.RMSNorm) or hasattr(norm, "weight"):
        offset, casting, out_dtype = expected
        assert type(new) is RMSNorm
        assert (new.offset, new.casting, new.out_dtype) == (offset, casting, out_dtype), repr(new)
        assert new.weight is getattr(norm, "weight", None), "the weight Parameter must be shared"
        assert new.eps == (norm.eps if isinstance(norm, nn.RMSNorm) else EPS)  # None stays None
    else:
        assert type(new) is LastDimRMSNorm and new.eps == EPS
    assert all(torch.equal(v, norm.state_dict()[k]) for k, v in state.items())
    assert swap_rms_norm(model) == [] and model.norm is new  # a second call leaves it
    width = 24 if type(new) is LastDimRMSNorm else None  # a width other than the probe's
    shape = (3, 5, *(norm.normalized_shape if isinstance(norm, nn.RMSNorm) else (width or HIDDEN,)))
    x_dtypes = [dtype, BF16] if dtype == F32 else [dtype]  # an fp32 weight with bf16 x too
    for x_dtype in x_dtypes:
        x = inputs(shape, x_dtype, device)
        with torch.no_grad():
            assert_matches(new(x), norm(x), x_dtype, f"{case}, x {x_dtype}")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_swapped_output_dtype_follows_the_original(device):
    """bf16 x with an fp32 weight: Llama returns fp32, the cast-at-the-end formula bf16."""
    model = nn.Module()
    model.llama = perturbed(LlamaLikeRMSNorm(HIDDEN)).to(device)
    model.cast_at_end = perturbed(CastAtEndRMSNorm(HIDDEN)).to(device)
    originals = dict(model.named_children())
    assert swap_rms_norm(model) == ["llama", "cast_at_end"]
    x = inputs((4, HIDDEN), BF16, device)
    assert model.llama(x).dtype == originals["llama"](x).dtype == F32
    assert model.cast_at_end(x).dtype == originals["cast_at_end"](x).dtype == BF16


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_swap_replaces_a_shared_module_at_every_path_and_keeps_hooks_alive(device, caplog):
    model = nn.Module()
    shared = perturbed(ZeroCenteredNorm(HIDDEN)).to(device)
    model.a, model.b = shared, shared
    model.hooked = hooked("forward hook").to(device)
    model.layer_norm = nn.LayerNorm(HIDDEN, bias=False).to(device)
    model.layer_norm_with_bias = nn.LayerNorm(HIDDEN).to(device)
    with caplog.at_level(logging.INFO, logger="rmsnorm_kernel.module"):
        report = swap_rms_norm(model)
    assert report == ["a", "b"] and model.a is model.b and type(model.a) is RMSNorm
    assert set(report.settings) == {"a", "b"} and "offset=1.0" in report.settings["a"]
    assert "forward hooks" in report.skipped["hooked"]
    # Looks like one: probed, refused (CUDA's LayerNorm raises on bf16 input with fp32 parameters
    # where the CPU's computes, so either reason is a refusal by probe).
    reason = report.skipped["layer_norm"]
    assert "no setting reproduces" in reason or "its forward raised" in reason, reason
    assert "layer_norm_with_bias" not in report.skipped  # has a bias: not an RMSNorm look-alike
    levels = {r.getMessage().split()[2]: r.levelno for r in caplog.records if "left" in r.getMessage()}
    assert levels == {"hooked": logging.WARNING, "layer_norm": logging.INFO}, levels
    assert any("a (ZeroCenteredNorm) ->" in r.getMessage() for r in caplog.records)
    x = inputs((2, 8), F32, device)
    assert torch.equal(model.hooked(x), 2 * LlamaLikeRMSNorm.forward(model.hooked, x)), "the hook must run"
    again = swap_rms_norm(model)
    assert again == [] and again.skipped.keys() == {"hooked", "layer_norm"}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("eps", [0, np.float32(1e-5), None])
def test_rmsnorm_forward_with_any_eps_gives_torchs_numbers(eps, device):
    ours = perturbed(RMSNorm(HIDDEN, eps=eps)).to(device)
    theirs = nn.RMSNorm(HIDDEN, eps=eps).to(device)
    theirs.load_state_dict(ours.state_dict())
    for dtype in (F32, BF16):
        x = inputs((3, HIDDEN), dtype, device)
        with torch.no_grad():
            assert_matches(ours(x), theirs(x), dtype, f"eps={eps!r}, x {dtype}")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_rmsnorm_out_dtype_rules(device):
    w = perturbed(RMSNorm(HIDDEN)).to(device).weight
    x = inputs((3, HIDDEN), BF16, device)
    for out_dtype, expected in [(None, BF16), ("input", BF16), ("promoted", F32), (F16, F16)]:
        norm = RMSNorm(HIDDEN, out_dtype=out_dtype).to(device)
        norm.weight = w
        y = norm(x)
        assert y.dtype == expected, out_dtype
        assert_matches(y, rmsnorm_kernel.rms_norm(x, weight=w, out_dtype=expected), BF16, str(out_dtype))
    assert "out_dtype='promoted'" in repr(RMSNorm(8, out_dtype="promoted"))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_swapped_look_alike_traces_with_fx(device):
    """torch.fx.symbolic_trace of a model whose Llama-style norm was swapped (RMSNorm with the
    out_dtype rule "promoted") records one rms_norm call holding the rule, which is resolved when
    the graph runs: the output the original gives, fp32 weight with bf16 x included. It raised
    TraceError (the rule was resolved against a Proxy's dtype), where the original traces."""
    original = perturbed(LlamaLikeRMSNorm(HIDDEN, eps=EPS)).to(device)
    model = nn.Sequential(perturbed(LlamaLikeRMSNorm(HIDDEN, eps=EPS))).to(device)
    model[0].load_state_dict(original.state_dict())
    assert swap_rms_norm(model) == ["0"] and model[0].out_dtype == "promoted"
    traced = torch.fx.symbolic_trace(model)
    calls = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [rmsnorm_kernel.rms_norm]
    assert calls[0].kwargs["out_dtype"] == "promoted"
    for dtype in (F32, BF16):
        x = inputs((3, HIDDEN), dtype, device)
        with torch.no_grad():
            assert_matches(traced(x), original(x), dtype, f"traced, x {dtype}")


# ---------------------------------------------------------------------------------------------
# Every *RMSNorm class of the installed transformers
# ---------------------------------------------------------------------------------------------

# Every refusal on transformers 5.17.0, the version requirements/constraints.txt pins (the GPU
# runner's too): class name: fragment of the reason. There a refused class not listed fails the
# sweep; on another version it skips with the reason (a new class to look at, then list here).
# HYV4VL and MuseSparkTextInput are of 5.24.0, where the table was first written; 5.17.0 has
# neither, and keeping them keeps the table right when the pin moves.
TABLE_VERSION = "5.17.0"
KNOWN_REFUSALS = {
    "AXK2GatedRMSNorm": "has submodules",  # an RMSNorm and a gate MLP inside
    "FalconMambaWeightlessRMSNorm": "has buffers (weight)",  # an unused buffer named weight
    "HYV4UnweightedRMSNorm": f"returns {(*module.PROBE_LEADING, 1)}",  # 1/rms, not the normalised x
    "HYV4VLUnweightedRMSNorm": f"returns {(*module.PROBE_LEADING, 1)}",
    "MuseSparkTextInputScaledRMSNorm": "no setting reproduces",  # scales by (1 + w), then normalises
}
# Constructor arguments that give the normalised size, by name.
SIZE_ARGUMENTS = ("hidden_size", "dim", "num_features", "normalized_shape", "hidden_dim", "d_model")
# module dtype: x dtypes compared (an fp32 weight with bf16 x too, as mixed-precision models run)
SWEEP_DTYPES = {F32: (F32, BF16), F16: (F16,), BF16: (BF16,)}


def transformers_classes() -> list[tuple[str, str]]:
    """(modeling module, class name) of each class named *RMSNorm, found in the source files
    (importing every modeling module at collection would cost each pytest run seconds)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return []
    models = Path(spec.origin).parent / "models"
    found = []
    for path in sorted(models.glob("*/modeling_*.py")):
        for name in re.findall(r"^\s*class (\w+RMSNorm)\(", path.read_text(encoding="utf-8"), re.M):
            found.append((f"transformers.models.{path.parent.name}.{path.stem}", name))
    return found


SWEEP = transformers_classes()


def build_transformers_norm(module_name: str, class_name: str) -> nn.Module:
    """An instance with HIDDEN features and eps EPS, built from (size, eps=...) or from its
    config class; pytest.skip with the reason where neither works."""
    try:
        source = importlib.import_module(module_name)
    except Exception as error:
        pytest.skip(f"{module_name} does not import: {type(error).__name__}: {error}")
    cls = getattr(source, class_name, None)
    if cls is None:
        pytest.skip(f"{module_name} defines no {class_name} here (a conditional definition)")
    parameters = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    kwargs = {}
    for p in parameters:
        if p.name == "eps":
            kwargs["eps"] = EPS
        elif p.name in SIZE_ARGUMENTS:
            kwargs[p.name] = HIDDEN
        elif p.name == "config":
            kwargs["config"] = config_for(source, cls)
        elif p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            pytest.skip(f"{class_name}'s constructor needs {p.name!r}, which the sweep does not know")
    try:
        return cls(**kwargs)
    except Exception as error:
        pytest.skip(f"{class_name}({', '.join(kwargs)}) raised {type(error).__name__}: {error}")


def config_for(source, cls):
    """The config class named in the constructor's annotation, with HIDDEN features."""
    annotation = inspect.signature(cls.__init__).parameters["config"].annotation
    config_cls = getattr(source, annotation, None) if isinstance(annotation, str) else annotation
    if not inspect.isclass(config_cls):
        pytest.skip(f"{cls.__name__} takes a config of no class found ({annotation!r})")
    try:
        config = config_cls()
    except Exception as error:
        pytest.skip(f"{config_cls.__name__}() raised {type(error).__name__}: {error}")
    config.hidden_size = HIDDEN
    config.rms_norm_eps = EPS
    return config


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", list(SWEEP_DTYPES), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(
    ("module_name", "class_name"),
    SWEEP or [pytest.param("", "", marks=pytest.mark.skip(reason="needs transformers (the `models` extra)"))],
    ids=[f"{source.split('.')[2]}.{name}" for source, name in SWEEP] or ["no-transformers"],
)
def test_transformers_rms_norm_class(module_name, class_name, dtype, device):
    import transformers

    norm = perturbed(build_transformers_norm(module_name, class_name)).to(device=device, dtype=dtype)
    model = holder(norm)
    report = swap_rms_norm(model)
    reason = report.skipped.get("norm")
    if class_name in KNOWN_REFUSALS:
        assert reason is not None and KNOWN_REFUSALS[class_name] in reason, (report, reason)
        assert model.norm is norm
        return
    if reason is not None:
        assert model.norm is norm
        message = f"{class_name} refused by swap_rms_norm: {reason}"
        if transformers.__version__ == TABLE_VERSION:
            pytest.fail(f"{message}; not in KNOWN_REFUSALS")
        pytest.skip(
            f"{message} (transformers {transformers.__version__}; KNOWN_REFUSALS is of {TABLE_VERSION})"
        )
    assert report == ["norm"] and isinstance(model.norm, RMSNorm | LastDimRMSNorm)
    for x_dtype in SWEEP_DTYPES[dtype]:
        x = inputs((3, 5, HIDDEN), x_dtype, device)
        with torch.no_grad():
            assert_matches(model.norm(x), norm(x), x_dtype, f"{class_name}, {dtype} weight, {x_dtype} x")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_swapped_modules_keep_their_output_dtype_under_autocast(device, monkeypatch):
    """Under CUDA autocast, torch releases that list rms_norm run F.rms_norm in float32, which
    rms_norm follows where out_dtype is None; a look-alike's dtype comes from its own code, which
    autocast leaves as it is. The swap keeps each: a torch.nn.RMSNorm follows rms_norm's rule, a
    look-alike, RMSNorm(out_dtype="input") and LastDimRMSNorm keep x's dtype. Torch's rule is
    forced on (ops._autocast_float32), so this runs with any torch, on any device."""
    from rmsnorm_kernel import ops

    def forced(x):
        return True

    monkeypatch.setattr(ops, "_autocast_float32", forced)
    monkeypatch.setattr(module, "_autocast_float32", forced)
    x = inputs((3, 5, HIDDEN), BF16, device)
    r = inputs((3, 5, HIDDEN), BF16, device, seed=2)
    swapped = {}
    for name, make in [
        ("cast at the end", lambda: CastAtEndRMSNorm(HIDDEN, eps=EPS)),
        ("weightless", lambda: WeightlessRMSNorm(eps=EPS)),
        ("torch.nn.RMSNorm", lambda: nn.RMSNorm(HIDDEN, eps=EPS)),
    ]:
        model = holder(perturbed(make()).to(device=device, dtype=BF16))
        assert swap_rms_norm(model) == ["norm"]
        swapped[name] = model.norm
    made = {
        "input": RMSNorm(HIDDEN, out_dtype="input").to(device=device, dtype=BF16),
        "none": RMSNorm(HIDDEN),
    }
    made["none"] = made["none"].to(device=device, dtype=BF16)
    with torch.no_grad(), torch.autocast(device_type=device, dtype=BF16):
        assert swapped["cast at the end"](x).dtype == BF16
        assert swapped["weightless"](x).dtype == BF16
        assert swapped["torch.nn.RMSNorm"](x).dtype == F32  # rms_norm's (forced) autocast rule
        assert made["input"](x).dtype == BF16 and made["input"](x, r)[0].dtype == BF16
        assert made["none"](x).dtype == F32
        assert swapped["weightless"](x, r)[0].dtype == BF16


# ---------------------------------------------------------------------------------------------
# Formulas a weight can hide. At the default all-ones weight each below computes
# torch.nn.RMSNorm's numbers; with any trained weight it does not.
# ---------------------------------------------------------------------------------------------


class SquaredWeightRMSNorm(LlamaLikeRMSNorm):
    """Computes with w^2."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float().square() * x).to(hidden_states.dtype)


class AbsWeightRMSNorm(LlamaLikeRMSNorm):
    """Computes with |w|."""

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float().abs() * x).to(hidden_states.dtype)


class MeanScaledRMSNorm(nn.RMSNorm):
    """A torch.nn.RMSNorm subclass that scales its output by mean(w)."""

    def forward(self, x):
        return super().forward(x) * self.weight.mean()


HIDDEN_BY_WEIGHT = {
    "w^2": (lambda: SquaredWeightRMSNorm(HIDDEN, eps=EPS), False),
    "|w|": (lambda: AbsWeightRMSNorm(HIDDEN, eps=EPS), False),
    "output scaled by mean(w)": (lambda: MeanScaledRMSNorm(HIDDEN, eps=EPS), False),
    "torch.nn.RMSNorm": (lambda: nn.RMSNorm(HIDDEN, eps=EPS), True),
    "Llama": (lambda: LlamaLikeRMSNorm(HIDDEN, eps=EPS), True),
    "(1 + w) at w = 0": (lambda: ZeroCenteredNorm(HIDDEN, eps=EPS), True),
}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", list(HIDDEN_BY_WEIGHT))
def test_swap_at_initial_weights_is_decided_by_more_than_the_weight(case, device):
    """Swapped at their initial weights, the look-alikes were replaced and diverged by O(1)
    after load_state_dict; the probes now run perturbed weights too, so each is refused, and
    the true RMSNorms are still swapped and match the original after loading trained weights."""
    make, swapped = HIDDEN_BY_WEIGHT[case]
    norm, trained = make().to(device), perturbed(make(), seed=3).to(device)
    with torch.no_grad():  # a trained weight: of both signs, away from the initial value
        for p in trained.parameters():
            p.mul_(-3.0).add_(0.5)
    model = holder(norm)
    report = swap_rms_norm(model)
    if not swapped:
        assert report == [] and model.norm is norm, f"{case}: swapped"
        assert "differs" in report.skipped["norm"] or "reproduces" in report.skipped["norm"], report.skipped
        return
    assert report == ["norm"], report.skipped
    model.norm.load_state_dict(trained.state_dict())
    x = inputs((3, 5, HIDDEN), F32, device)
    with torch.no_grad():
        assert_matches(model.norm(x), trained(x), F32, f"{case} after load_state_dict")


@pytest.mark.parametrize("interpret", [False, True])
def test_swap_refuses_a_meta_model_before_changing_it(monkeypatch, interpret):
    """A model on the meta device (no values to probe): UnsupportedInput, a ValueError and a
    NotImplementedError as for a device the kernels cannot run; it raised RuntimeError from inside
    a probe under the interpreter."""
    monkeypatch.setattr(kernels, "INTERPRET", interpret)
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8)).to("meta")
    before = list(model)
    with pytest.raises(rmsnorm_kernel.contract.UnsupportedInput, match="on meta") as raised:
        swap_rms_norm(model)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, NotImplementedError)
    assert list(model) == before
