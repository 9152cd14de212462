"""swap_rms_norm in real model architectures: small Llama and Gemma models built from a config with
random weights (Hugging Face transformers, the optional `models` extra; nothing is downloaded).

The original model and a deep copy with its RMSNorm modules swapped get the same batch; logits
and every parameter's gradient must agree within the declared tolerances, on CPU under the
interpreter in fp32 and on CUDA in bf16. On CUDA the swapped model then trains a few steps under
torch.compile.

Only long-standing parts of the transformers API are used (the config classes' basic fields,
`XForCausalLM(config)`, `model(input_ids=..., labels=...)` returning `.loss` and `.logits`), so
the test does not depend on a minor version.
"""

import copy

import pytest
import torch

import rmsnorm_kernel

from ..conftest import HAS_CUDA, KERNEL_DEVICES
from ._fixtures import assert_close_scaled

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (the optional `models` extra: pip install -e .[models])"
)

HIDDEN, LAYERS, HEADS, VOCAB = 64, 2, 4, 128
BATCH, SEQ = 2, 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    max_position_embeddings=4 * SEQ,
    rms_norm_eps=1e-6,
)
# family: (config class, model class, extra config fields, norm weight center, casting, offset).
# Llama's norm weight multiplies directly (initialised to 1); Gemma's is stored as an offset from 1
# (initialised to 0). Both are drawn around their center so that a wrong weight shows.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, 1.0, "llama", 0.0),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": HIDDEN // HEADS}, 0.0, "gemma", 1.0),
}
# Two RMSNorms per decoder layer and the final one.
NORMS = [
    f"model.layers.{i}.{n}" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")
]
NORMS.append("model.norm")


def build(family: str, device, dtype) -> torch.nn.Module:
    """A seeded model with random weights (the global RNG is left as it was)."""
    config_cls, model_cls, extra, center, _, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config)
        with torch.no_grad():
            for name in NORMS:
                model.get_submodule(name).weight.normal_(center, 0.1)
    return model.to(device=device, dtype=dtype)


def batch(device):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)


def swapped_copy(family: str, model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy with its RMSNorms swapped; checks what was swapped and how."""
    _, _, _, _, casting, offset = FAMILIES[family]
    swapped = copy.deepcopy(model)
    assert rmsnorm_kernel.swap_rms_norm(swapped) == NORMS
    for name in NORMS:
        module = swapped.get_submodule(name)
        assert isinstance(module, rmsnorm_kernel.RMSNorm)
        assert (module.casting, module.offset, module.eps) == (casting, offset, 1e-6)
    return swapped


def check_swapped_model_matches(family: str, device, dtype):
    original = build(family, device, dtype)
    swapped = swapped_copy(family, original)
    ids = batch(device)
    out_original = original(input_ids=ids, labels=ids)
    out_original.loss.backward()
    rmsnorm_kernel.reset_counters()
    out_swapped = swapped(input_ids=ids, labels=ids)
    out_swapped.loss.backward()
    calls = dict(rmsnorm_kernel.CALLS)
    assert calls == {"forward": len(NORMS), "backward": len(NORMS), "fallback": 0}, calls

    assert out_swapped.logits.dtype == out_original.logits.dtype
    assert_close_scaled(out_swapped.logits, out_original.logits, dtype, "logits")
    grads_original = {n: p.grad for n, p in original.named_parameters()}
    grads_swapped = {n: p.grad for n, p in swapped.named_parameters()}
    assert grads_swapped.keys() == grads_original.keys()
    for name, expected in grads_original.items():
        assert grads_swapped[name] is not None, f"{name} got no gradient"
        assert_close_scaled(grads_swapped[name], expected, dtype, name)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("device", [p for p in KERNEL_DEVICES if p.id == "interpret"])
def test_swapped_model_matches_original_fp32_interpret(family, device):
    check_swapped_model_matches(family, device, torch.float32)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("device", [p for p in KERNEL_DEVICES if p.id == "cuda"])
def test_swapped_model_matches_original_bf16_cuda(family, device):
    check_swapped_model_matches(family, device, torch.bfloat16)


def train_compiled(family: str, device, dtype, steps: int) -> list[float]:
    """Train the swapped model under torch.compile on one fixed batch; return the losses. The
    counters must show one kernel forward and one backward per RMSNorm per step."""
    torch._dynamo.reset()
    model = swapped_copy(family, build(family, device, dtype))
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batch(device)
    rmsnorm_kernel.reset_counters()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    expected = {"forward": steps * len(NORMS), "backward": steps * len(NORMS), "fallback": 0}
    assert dict(rmsnorm_kernel.CALLS) == expected
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (nox -s gpu)")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_swapped_model_trains_under_torch_compile(family):
    losses = train_compiled(family, "cuda", torch.bfloat16, steps=8)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"
