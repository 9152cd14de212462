"""swap_rms_norm on a model whose attention normalises the heads of q and k (QK-norm): a small
Qwen3 built from a config (transformers, the optional `models` extra; nothing is downloaded).

Its attention calls ``self.q_norm`` and ``self.k_norm`` apart on per-head views of the q and k
projections, (batch, tokens, heads, head_dim). The swap replaces both by ``RMSNorm((head_dim,))``
(Qwen3's formula is Llama's casting), which reads those views where they lie: no copy, forward
or backward. Fusing q and k into one launch would need the attention itself to call
``qk_norm``; the swap leaves transformers' attention code as it is.

Tolerances, declared before any comparison: the suite's TOLERANCES[float32] with each tensor in
units of its own largest element (test_models.assert_close_scaled), for the logits and every
parameter's gradient of the original and the swapped model, fp32 under the interpreter.
"""

import copy

import pytest
import torch

import rmsnorm_kernel
from rmsnorm_kernel import launch

from ..conftest import KERNEL_DEVICES

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (the optional `models` extra: pip install -e .[models])"
)

from ._fixtures import assert_close_scaled  # noqa: E402

LAYERS, HEAD_DIM, Q_HEADS, KV_HEADS = 2, 16, 4, 2
# Each layer's norms in the model's module order, then the final one.
LAYER_NORMS = ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")
NORMS = [f"model.layers.{i}.{n}" for i in range(LAYERS) for n in LAYER_NORMS] + ["model.norm"]
QK_NORMS = [n for n in NORMS if n.endswith(("q_norm", "k_norm"))]


def _qwen3(device, dtype):
    """A seeded tiny Qwen3 (2 layers, hidden 64, 4 heads, 2 KV heads, head_dim 16); the norms'
    weights drawn around 1 so that a dropped or misplaced weight shows."""
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=32, rms_norm_eps=1e-6,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config)
        with torch.no_grad():
            for name in NORMS:
                model.get_submodule(name).weight.normal_(1.0, 0.1)
    return model.to(device=device, dtype=dtype)


class _Pointers:
    """Wraps a Launcher: the data pointer of the input rows (its first tensor) of each launch."""

    def __init__(self, launcher, seen):
        self.launcher, self.seen = launcher, seen

    def __call__(self, grid, args, num_warps, constexprs):
        self.seen.append(args[0].data_ptr())
        return self.launcher(grid, args, num_warps, constexprs)


@pytest.mark.parametrize("device", [p for p in KERNEL_DEVICES if p.id == "interpret"])
def test_qwen3_qk_norms_are_swapped_read_in_place_and_match(device, monkeypatch):
    original = _qwen3(device, torch.float32)
    swapped = copy.deepcopy(original)
    report = rmsnorm_kernel.swap_rms_norm(swapped)
    assert list(report) == NORMS and report.skipped == {}
    for name in QK_NORMS:
        norm = swapped.get_submodule(name)
        assert isinstance(norm, rmsnorm_kernel.RMSNorm), (name, norm)
        assert (norm.normalized_shape, norm.casting, norm.eps) == ((HEAD_DIM,), "llama", 1e-6)
        assert torch.equal(norm.weight, original.get_submodule(name).weight)

    inputs = []  # the data pointers of the per-head views q_norm and k_norm receive

    def record(_module, args):
        inputs.append(args[0].data_ptr())

    for name in QK_NORMS:
        swapped.get_submodule(name).register_forward_pre_hook(record)
    read = []  # the pointers the kernels read their input rows at, forward and backward
    for name, value in vars(launch).items():
        if isinstance(value, launch.Launcher):
            monkeypatch.setattr(launch, name, _Pointers(value, read))

    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    out_original = original(input_ids=ids, labels=ids)
    out_original.loss.backward()
    rmsnorm_kernel.reset_counters()
    out_swapped = swapped(input_ids=ids, labels=ids)
    out_swapped.loss.backward()

    assert dict(rmsnorm_kernel.CALLS) == {"forward": len(NORMS), "backward": len(NORMS), "fallback": 0}
    assert len(inputs) == len(QK_NORMS)
    # each view read where it lies (no copy): a forward and a backward launch at its own pointer
    assert all(read.count(ptr) >= 2 for ptr in inputs), (inputs, read)
    assert_close_scaled(out_swapped.logits, out_original.logits, torch.float32, "logits")
    grads = {n: p.grad for n, p in swapped.named_parameters()}
    for name, p in original.named_parameters():
        assert grads[name] is not None, f"{name} got no gradient"
        assert_close_scaled(grads[name], p.grad, torch.float32, name)
