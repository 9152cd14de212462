"""The op in distributed training: one rank's process group (``World``), a Llama-style block and a
small language model of them with their tensor-parallel plans, and the training comparison run by
`nox -s gpu-distributed`: the model with the op swapped in (``swap_rms_norm``) against
``torch.nn.RMSNorm`` under FSDP2, TP and both, seeded synthetic tokens, the loss and every gradient
held to ``MODEL_TOL`` at each step, and each model's median step time. Run by torchrun, one process
per rank: ``python -m torch.distributed.run --standalone --nproc-per-node N -m
rmsnorm_suite.distributed``; on CPU over gloo at ``--size tiny`` under TRITON_INTERPRET=1.
docs/features.md ("Distributed training") gives the method and the results.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import rmsnorm_kernel  # before torch.distributed.tensor: its rules register on that import

# Declared before any comparison: torch.testing's defaults for float32 (rtol 1.3e-6, atol 1e-5)
# and bfloat16's rtol (1.6e-2, one rounding of the output) with an atol of 1e-2 for values near
# zero. The op against torch: both reduce in fp32, in other orders. The models are held to the
# same: the kernels' differences from torch's composite stay within them after the matmuls and
# the sums over rows and ranks.
OP_TOL = {torch.float32: {"rtol": 1.3e-6, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}
MODEL_TOL = OP_TOL
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("fsdp2", "tp", "fsdp2+tp")  # fsdp2+tp: a 2-D mesh (data, tensor) of tensor size 2
# model sizes: the GPU run's and the CPU test's
SIZES = {
    "small": {"vocab": 8192, "dim": 1024, "heads": 16, "layers": 4, "seq": 1024, "batch": 4},
    "tiny": {"vocab": 64, "dim": 32, "heads": 4, "layers": 2, "seq": 8, "batch": 2},
}
RESULT = "distributed-training"  # .json and .md under --out


class World:
    """This rank's process group and a 1-D mesh of every rank. Rendezvous through a file
    (DIST_STORE, the tests' own ranks) or torchrun's environment (env://); on CUDA the rank's
    device is cuda:LOCAL_RANK."""

    def __init__(self, backend: str | None = None, device: str | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank = int(os.environ["RANK"])
        self.size = int(os.environ["WORLD_SIZE"])
        self.device = torch.device(device or os.environ.get("DIST_DEVICE", "cpu"))
        if self.device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        store = os.environ.get("DIST_STORE")
        dist.init_process_group(
            backend or os.environ.get("DIST_BACKEND", "gloo"),
            init_method="file://" + store if store else "env://",
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=120),
        )
        self.mesh = init_device_mesh(self.device.type, (self.size,))

    def tensor(self, *shape, dtype=torch.float32, seed=0):
        """The same values on every rank (seeded), on this rank's device."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).to(self.device, dtype)

    def dt(self, t, *placements, grad=True):
        from torch.distributed.tensor import distribute_tensor

        d = distribute_tensor(t.detach(), self.mesh, list(placements))
        return d.requires_grad_() if grad else d

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def full(t):
    """A DTensor's full tensor (a collective), a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def swapped(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with the op swapped in for its norms (at least one)."""
    ours = copy.deepcopy(model)
    report = rmsnorm_kernel.swap_rms_norm(ours)
    assert report, f"nothing swapped in {type(model).__name__}"
    return ours


# ---------------------------------------------------------------------------------------------
# The models and their tensor-parallel plans
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: a tensor-parallel rank holds its share of them
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """A Llama-style pre-norm block. With the op swapped in, the second norm takes the residual
    add (``norm(a, residual=x)`` returns ``(y, h)``): the fused residual variant under TP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x):
        a = self.attention(self.attention_norm(x))
        if isinstance(self.ffn_norm, rmsnorm_kernel.RMSNorm):
            y, h = self.ffn_norm(a, residual=x)
        else:
            h = x + a
            y = self.ffn_norm(h)
        return h + self.feed_forward(y)


class TinyLM(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and the output projection to logits."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, **_) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def block_plan(prefix: str = "") -> dict:
    """Tensor parallel (colwise/rowwise matmuls) with sequence-parallel norms: the residual stream
    stays Shard(1) DTensors between the matmuls."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather,
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return {prefix + name: style for name, style in plan.items()}


def lm_plan(layers: int) -> dict:
    """TinyLM's plan: the embedding's rows sharded (its output sequence-sharded), each block's
    plan, the final norm sequence parallel, the logits gathered whole on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(layers):
        plan.update(block_plan(f"layers.{i}."))
    return plan


# ---------------------------------------------------------------------------------------------
# The training comparison
# ---------------------------------------------------------------------------------------------


def parallelize(world: World, model: nn.Module, mode: str, dtype: torch.dtype, layers: int) -> int:
    """Apply ``mode`` to ``model`` in place; returns this rank's data-parallel index (its batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if mode == "tp":
        parallelize_module(model.to(dtype), world.mesh, lm_plan(layers))
        return 0  # every rank the same batch
    if mode == "fsdp2":
        dp_mesh, dp_rank = world.mesh, world.rank
    else:  # fsdp2+tp
        mesh = init_device_mesh(world.device.type, (world.size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], lm_plan(layers))
        dp_mesh, dp_rank = mesh["dp"], mesh.get_local_rank("dp")
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return dp_rank


def batch(world: World, size: dict, seed: int, step: int, dp_rank: int):
    """Seeded synthetic tokens and targets: each target a fixed random permutation of its token."""
    g = torch.Generator().manual_seed(seed)
    permutation = torch.randperm(size["vocab"], generator=g)
    g.manual_seed(seed + 1 + 1000 * step + dp_rank)
    tokens = torch.randint(size["vocab"], (size["batch"], size["seq"]), generator=g)
    return tokens.to(world.device), permutation[tokens].to(world.device)


def worst_ratio(got: torch.Tensor, expected: torch.Tensor, tol: dict) -> float:
    """max |got - expected| / (atol + rtol |expected|): at most 1 is within ``tol`` (assert_close's test)."""
    got, expected = got.detach().double(), expected.detach().double()
    return float(((got - expected).abs() / (tol["atol"] + tol["rtol"] * expected.abs())).max())


def compare(
    world: World, mode: str, dtype: torch.dtype, size: dict, steps: int, warmup: int, seed: int
) -> dict:
    """Train the two models in lockstep: each step both start from the reference's parameters
    (copied into the swapped model outside the timed region) and take the same batch; the
    losses and every gradient are compared, then each optimizer steps."""
    import torch.distributed as dist

    torch.manual_seed(seed)
    reference = TinyLM(**size).to(world.device)
    models = {"torch": reference, "ours": swapped(reference)}
    dp_rank = 0
    for m in models.values():
        dp_rank = parallelize(world, m, mode, dtype, size["layers"])
    optims = {n: torch.optim.AdamW(m.parameters(), lr=3e-3) for n, m in models.items()}
    tol = MODEL_TOL[dtype]
    times = {n: [] for n in models}
    losses = {n: [] for n in models}
    worst = {"loss": 0.0, "grad": 0.0, "grad_norm_rel": 0.0, "grad_max_abs": 0.0, "grad_max_abs_diff": 0.0}
    calls = dict(rmsnorm_kernel.CALLS)
    for step in range(steps):
        with torch.no_grad():
            for p_o, p_t in zip(models["ours"].parameters(), reference.parameters()):
                p_o.copy_(p_t)
        tokens, targets = batch(world, size, seed, step, dp_rank)
        grads, loss = {}, {}
        for name in ("torch", "ours") if step % 2 == 0 else ("ours", "torch"):  # either goes first
            m = models[name]
            world.sync()
            started = time.perf_counter()
            out = m(tokens)
            loss[name] = F.cross_entropy(out.float().flatten(0, 1), targets.flatten())
            loss[name].backward()
            world.sync()
            times[name].append(time.perf_counter() - started)
            grads[name] = {n: full(p.grad) for n, p in m.named_parameters()}
            losses[name].append(loss[name].item())
        worst["loss"] = max(worst["loss"], worst_ratio(loss["ours"], loss["torch"], tol))
        assert grads["ours"].keys() == grads["torch"].keys()
        for n, g_t in grads["torch"].items():
            g_o = grads["ours"][n]
            worst["grad"] = max(worst["grad"], worst_ratio(g_o, g_t, tol))
            diff = (g_o.float() - g_t.float()).norm() / g_t.float().norm().clamp_min(1e-30)
            worst["grad_norm_rel"] = max(worst["grad_norm_rel"], float(diff))
            worst["grad_max_abs"] = max(worst["grad_max_abs"], float(g_t.abs().max()))
            worst["grad_max_abs_diff"] = max(worst["grad_max_abs_diff"], float((g_o - g_t).abs().max()))
        for name in ("torch", "ours"):
            world.sync()
            started = time.perf_counter()
            optims[name].step()
            optims[name].zero_grad()
            world.sync()
            times[name][-1] += time.perf_counter() - started
    ran = {k: rmsnorm_kernel.CALLS[k] - calls[k] for k in calls}
    # every rank's worst, and each step's time on the slowest rank
    summary = torch.tensor([worst[k] for k in worst], dtype=torch.float64, device=world.device)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    worst = dict(zip(worst, summary.tolist()))
    medians = {}
    for name, seconds in times.items():
        t = torch.tensor(seconds, dtype=torch.float64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        medians[name] = statistics.median(t.tolist()[warmup:]) if steps > warmup else float("nan")
    ok = worst["loss"] <= 1 and worst["grad"] <= 1 and ran["forward"] > 0 and ran["backward"] > 0
    return {
        "mode": mode,
        "dtype": str(dtype).removeprefix("torch."),
        "steps": steps,
        "warmup": warmup,
        "tolerance": tol,
        "ok": ok and not ran["fallback"],
        "worst": worst,
        "loss_first": losses["torch"][0],
        "loss_last": losses["torch"][-1],
        "losses_ours": losses["ours"],
        "losses_torch": losses["torch"],
        "median_step_ms": {n: 1e3 * s for n, s in medians.items()},
        "kernel_calls_rank0": ran,
    }


def markdown(results: dict) -> str:
    head = results["environment"]
    lines = [
        f"Distributed training comparison: {head['world_size']} ranks, {head['device']} ({head['backend']}), "
        f"torch {head['torch']}, size {head['size']}",
        "",
        "| mode | dtype | steps | loss first -> last | worst loss / tol | worst grad / tol | grad rel. L2 "
        "| step ms torch | step ms ours | ours / torch | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        ms = r["median_step_ms"]
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['steps']} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} "
            f"| {r['worst']['loss']:.2f} | {r['worst']['grad']:.2f} | {r['worst']['grad_norm_rel']:.1e} "
            f"| {ms['torch']:.2f} | {ms['ours']:.2f} | {ms['ours'] / ms['torch']:.3f} "
            f"| {'pass' if r['ok'] else 'FAIL'} |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m rmsnorm_suite.distributed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--modes", default="fsdp2,tp,fsdp2+tp", help="of " + ", ".join(MODES))
    parser.add_argument("--dtypes", default="fp32,bf16", help="of " + ", ".join(DTYPES))
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="steps compared but not timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs") / "gpu-distributed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch.distributed as dist

    world = World("nccl" if args.device == "cuda" else "gloo", args.device)
    size = SIZES[args.size]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; the modes: {', '.join(MODES)}")
    if "fsdp2+tp" in modes and (world.size < 4 or world.size % 2):
        modes.remove("fsdp2+tp")  # a 2-D mesh needs two ranks on each of its dimensions
        if world.rank == 0:
            print(f"fsdp2+tp left out: it needs an even number of ranks, four or more ({world.size} here)")
    runs = []
    for mode in modes:
        for name in args.dtypes.split(","):
            started = time.perf_counter()
            runs.append(compare(world, mode, DTYPES[name], size, args.steps, args.warmup, args.seed))
            if world.rank == 0:
                r = runs[-1]
                print(f"{mode} {name}: {'pass' if r['ok'] else 'FAIL'} in {time.perf_counter() - started:.1f} s, "
                      f"worst loss/tol {r['worst']['loss']:.2f}, grad/tol {r['worst']['grad']:.2f}, "
                      f"median step ms torch {r['median_step_ms']['torch']:.2f} ours {r['median_step_ms']['ours']:.2f}",
                      flush=True)  # fmt: skip
    results = {
        "environment": {
            "world_size": world.size,
            "device": torch.cuda.get_device_name(world.device) if args.device == "cuda" else "cpu",
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "size": {"name": args.size, **size},
            "seed": args.seed,
            "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        },
        "runs": runs,
        "ok": all(r["ok"] for r in runs),
    }
    if world.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{RESULT}.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / f"{RESULT}.md").write_text(markdown(results))
        print(markdown(results))
    # every rank leaves together: a rank that tore its group down while rank 0 still wrote
    # aborted at exit once on two CPU ranks ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
