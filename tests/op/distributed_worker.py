"""One rank of tests/op/test_distributed.py's process group: DTensor, FSDP2 and tensor/sequence
parallel runs of the op against torch.nn.RMSNorm's (F.rms_norm's), each scenario's result written
to a JSON file per rank, so that one start of the group (its imports and its rendezvous are most
of the time) serves every scenario.

Run by the test as ``python tests/op/distributed_worker.py`` in each rank's process, with RANK,
WORLD_SIZE, DIST_STORE (a file for torch's FileStore), DIST_BACKEND (gloo, nccl), DIST_DEVICE
(cpu, cuda), DIST_OUT (the results file prefix), DIST_HOST (1: the compiled host path's
extension is built; its operators are tested too) and DIST_COMPILE (torch.compile's backends,
comma-separated).
On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by the test).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

import rmsnorm_kernel  # before torch.distributed.tensor: its rules register on that import
from rmsnorm_kernel import host, sharding
from rmsnorm_kernel.reference import rms_norm_reference
from rmsnorm_suite import distributed
from rmsnorm_suite.distributed import MODEL_TOL, OP_TOL, Block
from rmsnorm_suite.distributed import full as _full
from rmsnorm_suite.distributed import swapped as _swapped

# The tolerances, declared before any comparison: rmsnorm_suite.distributed.OP_TOL and MODEL_TOL.

SCENARIOS = (
    "registration",
    "sequence_parallel",
    "residual",
    "normalised_dim_sharded",
    "host_operators",
    "qk_norm_heads",
    "fsdp2",
    "tensor_parallel",
    "compile",
)

H = 32  # the normalised size


def _close(got, expected, tol, what: str) -> None:
    torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"{what}: {m}")


class World(distributed.World):
    """The suite's rank (rmsnorm_suite.distributed.World) with this worker's options: DIST_HOST
    and DIST_COMPILE."""

    def __init__(self) -> None:
        super().__init__()
        self.host = os.environ.get("DIST_HOST") == "1"
        self.compile_backends = os.environ.get("DIST_COMPILE", "aot_eager").split(",")


# ---------------------------------------------------------------------------------------------
# Scenarios: each raises on a mismatch; a returned dict is recorded with the result
# ---------------------------------------------------------------------------------------------


def registration(w: World):
    """The package was imported before torch.distributed.tensor: its rules registered on that
    import; the host path's when its extension loaded."""
    imported_before = sharding.DTENSOR_MODULE in sys.modules
    import torch.distributed.tensor  # noqa: F401 - the hook registers the rules here

    expected = {
        "rmsnorm_kernel::forward",
        "rmsnorm_kernel::backward",
        "rmsnorm_kernel::qk_forward",
        "rmsnorm_kernel::qk_backward",
    }
    if w.host:
        host.extension()
        expected |= {"rmsnorm_kernel_host::rms_norm", "rmsnorm_kernel_host::rms_norm_residual"}
    missing = expected - sharding.registered()
    assert not missing, f"no DTensor rule for {sorted(missing)}"
    return {"registered": sorted(sharding.registered()), "dtensor imported before": imported_before}


def _op_case(w: World, placement, dtype, shape=(2, 8, H), **options):
    """rms_norm on a DTensor (x in ``placement``, the weight replicated) against F.rms_norm on
    the same DTensors (torch's own rule) and against the full tensors: values, placements, and
    the gradients of x and the weight."""
    from torch.distributed.tensor import Replicate

    x, w_ = w.tensor(*shape, dtype=dtype, seed=1), w.tensor(H, dtype=dtype, seed=2)
    dy = w.tensor(*shape, dtype=dtype, seed=3)
    tol = OP_TOL[dtype]
    ours = [w.dt(x, placement), w.dt(w_, Replicate())]
    y = rmsnorm_kernel.rms_norm(ours[0], H, ours[1], **options)
    (y * w.dt(dy, placement, grad=False)).sum().backward()
    full = [x.clone().requires_grad_(), w_.clone().requires_grad_()]
    ref_options = dict(options)
    eps = ref_options.pop("eps", torch.finfo(torch.float32).eps)  # rms_norm's eps=None
    y_full = rms_norm_reference(full[0], full[1], eps, **ref_options)
    (y_full * dy).sum().backward()
    what = f"{placement} {dtype}"
    _close(y.full_tensor(), y_full, tol, f"y, {what}")
    _close(ours[0].grad.full_tensor(), full[0].grad, tol, f"dx, {what}")
    _close(ours[1].grad.full_tensor(), full[1].grad, tol, f"dw, {what}")
    placements = {
        "y": str(y.placements),
        "dx": str(ours[0].grad.placements),
        "dw": str(ours[1].grad.placements),
    }
    if not options:  # torch's own rule on the same DTensors: the same values and placements
        theirs = [w.dt(x, placement), w.dt(w_, Replicate())]
        y_t = F.rms_norm(theirs[0], (H,), theirs[1])
        (y_t * w.dt(dy, placement, grad=False)).sum().backward()
        torch_placements = {
            "y": str(y_t.placements),
            "dx": str(theirs[0].grad.placements),
            "dw": str(theirs[1].grad.placements),
        }
        assert placements == torch_placements, f"{what}: ours {placements}, torch's {torch_placements}"
        _close(y.full_tensor(), y_t.full_tensor(), tol, f"y against torch's DTensor rule, {what}")
        _close(ours[1].grad.full_tensor(), theirs[1].grad.full_tensor(), tol, f"dw against torch's, {what}")
    return placements


def sequence_parallel(w: World):
    """Rows sharded (sequence parallel: Shard(1); batch: Shard(0)) or replicated pass through:
    y and dx keep x's placement, the weight's gradient is Partial(sum) from sharded rows."""
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    before = dict(rmsnorm_kernel.CALLS)
    for placement in (Shard(1), Shard(0), Replicate()):
        for dtype in (torch.float32, torch.bfloat16):
            out[f"{placement} {dtype}"] = _op_case(w, placement, dtype)
    out["2-D rows, Shard(0)"] = _op_case(w, Shard(0), torch.float32, shape=(16, H))
    out["llama casting, offset 1"] = _op_case(
        w, Shard(1), torch.bfloat16, eps=1e-6, casting="llama", offset=1.0
    )
    ran = {k: rmsnorm_kernel.CALLS[k] - before[k] for k in before}
    # each case's forward and backward ran the kernels on the local rows, none fell back
    assert ran == {"forward": len(out), "backward": len(out), "fallback": 0}, ran
    return out


def residual(w: World):
    """The residual variant: (y, h) in x's placement; dx, dresidual and dw as torch's."""
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    for placement in (Shard(1), Replicate()):
        for dtype in (torch.float32, torch.bfloat16):
            tol = OP_TOL[dtype]
            x, r = (w.tensor(2, 8, H, dtype=dtype, seed=s) for s in (1, 4))
            w_ = w.tensor(H, dtype=dtype, seed=2)
            dy, dh = w.tensor(2, 8, H, dtype=dtype, seed=3), w.tensor(2, 8, H, dtype=dtype, seed=5)
            ours = [w.dt(x, placement), w.dt(r, placement), w.dt(w_, Replicate())]
            y, h = rmsnorm_kernel.rms_norm(ours[0], H, ours[2], residual=ours[1])
            loss = (y * w.dt(dy, placement, grad=False)).sum() + (h * w.dt(dh, placement, grad=False)).sum()
            loss.backward()
            full = [t.clone().requires_grad_() for t in (x, r, w_)]
            h_full = (full[0].float() + full[1]).to(dtype)
            y_full = F.rms_norm(h_full, (H,), full[2])
            ((y_full * dy).sum() + (h_full * dh).sum()).backward()
            what = f"{placement} {dtype}"
            assert y.placements == h.placements == (placement,), f"{what}: y {y.placements}, h {h.placements}"
            _close(y.full_tensor(), y_full, tol, f"y, {what}")
            _close(h.full_tensor(), h_full, tol, f"h, {what}")
            for name, a, b in zip(("dx", "dresidual", "dw"), ours, full):
                _close(a.grad.full_tensor(), b.grad, tol, f"{name}, {what}")
            out[what] = {"y": str(y.placements), "h": str(h.placements), "dw": str(ours[2].grad.placements)}
    return out


def normalised_dim_sharded(w: World):
    """x sharded on the normalised (last) dim, a sharded weight, and a partial x: the rule takes
    none of them, so DTensor redistributes them first (gathers, or reduces the partial x), as for
    F.rms_norm's rule; y and the gradients are the full tensors' values. The placements it chose
    are recorded (docs/features.md)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x, w_ = w.tensor(2, 8, H, seed=1), w.tensor(H, seed=2)
    dy = w.tensor(2, 8, H, seed=3)
    tol = OP_TOL[torch.float32]
    out = {}
    cases = (
        ("x Shard(2)", Shard(2), Replicate()),
        ("weight Shard(0)", Shard(1), Shard(0)),
        ("x Partial(sum)", Partial("sum"), Replicate()),
    )
    for name, xp, wp in cases:
        if isinstance(xp, Partial):  # each rank holds a share of x: the sum over the mesh is x
            share = (x / w.size).detach()
            ours = [DTensor.from_local(share, w.mesh, [xp]).requires_grad_(), w.dt(w_, wp)]
            xp = Replicate()  # for dy
        else:
            ours = [w.dt(x, xp), w.dt(w_, wp)]
        y = rmsnorm_kernel.rms_norm(ours[0], H, ours[1])
        (y * w.dt(dy, xp, grad=False)).sum().backward()
        full = [x.clone().requires_grad_(), w_.clone().requires_grad_()]
        y_full = F.rms_norm(full[0], (H,), full[1])
        (y_full * dy).sum().backward()
        _close(y.full_tensor(), y_full, tol, f"y, {name}")
        _close(ours[0].grad.full_tensor(), full[0].grad, tol, f"dx, {name}")
        _close(ours[1].grad.full_tensor(), full[1].grad, tol, f"dw, {name}")
        out[name] = {
            "y": str(y.placements),
            "dx": str(ours[0].grad.placements),
            "dw": str(ours[1].grad.placements),
        }
        if w.device.type == "cuda" and name == "x Shard(2)":
            # F.rms_norm there reaches aten._fused_rms_norm, whose DTensor rule is the same
            # (on CPU it decomposes, and fails on this input: docs/features.md)
            y_t = F.rms_norm(w.dt(x, xp), (H,), w.dt(w_, wp))
            assert y_t.placements == y.placements, f"{name}: ours {y.placements}, torch's {y_t.placements}"
            _close(y.full_tensor(), y_t.full_tensor(), tol, f"y against torch's DTensor rule, {name}")
    return out


def host_operators(w: World):
    """The compiled host path's operators called on DTensors (rows sharded, the weight
    replicated): their rule, then their C++ autograd, whose backward for such input is the
    composite's torch ops on the DTensors. On CUDA the values are torch's; on CPU, where the
    operators have no kernel (the host path is CUDA's), the local tensors are meta tensors and
    the placements, shapes and dtypes are checked."""
    if not w.host:
        return {"skipped": "the compiled host path's extension is not built here"}
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    host.extension()
    ops = torch.ops.rmsnorm_kernel_host
    on_meta = w.device.type == "cpu"
    out = {"local tensors": "meta" if on_meta else str(w.device)}
    rows = 8 * w.size
    for dtype in (torch.float32, torch.bfloat16):
        tol = OP_TOL[dtype]
        x, r = (w.tensor(rows, H, dtype=dtype, seed=s) for s in (1, 4))
        w_ = w.tensor(H, dtype=dtype, seed=2)
        dy = w.tensor(rows, H, dtype=dtype, seed=3)
        if on_meta:

            def dt(t, p, grad=True):
                local = torch.empty(t.shape, dtype=t.dtype, device="meta")
                if p == Shard(0):
                    local = local[: t.shape[0] // w.size]
                d = DTensor.from_local(local, w.mesh, [p], run_check=False)
                return d.requires_grad_() if grad else d

        else:
            dt = w.dt
        ours = [dt(x, Shard(0)), dt(r, Shard(0)), dt(w_, Replicate())]
        y = ops.rms_norm(ours[0], ours[2], 1e-6, 0.0, 0, dtype)
        y2, h = ops.rms_norm_residual(ours[0], ours[1], ours[2], 1e-6, 0.0, 0, dtype, dtype)
        ((y + y2) * dt(dy, Shard(0), grad=False)).sum().backward()
        what = f"host operators, {dtype}"
        # Torch's own placements for the same computation on the same mesh and inputs (F.rms_norm
        # and the residual add on DTensors, the same backward): the expectation, not a fixed one.
        # On a mesh of several ranks they are Shard(0) for y, h, dx, dresidual and Partial("sum")
        # for dw; on a one-rank mesh every placement redistributes at no cost, and torch's choice
        # among them is what ours must match.
        theirs = [dt(x, Shard(0)), dt(r, Shard(0)), dt(w_, Replicate())]
        y_t = F.rms_norm(theirs[0], (H,), theirs[2], 1e-6)
        h_t = (theirs[0].float() + theirs[1]).to(dtype)
        y2_t = F.rms_norm(h_t, (H,), theirs[2], 1e-6)
        ((y_t + y2_t) * dt(dy, Shard(0), grad=False)).sum().backward()
        pairs = {"y": (y, y_t), "y (residual)": (y2, y2_t), "h": (h, h_t), "dx": (ours[0].grad, theirs[0].grad),
                 "dresidual": (ours[1].grad, theirs[1].grad), "dw": (ours[2].grad, theirs[2].grad)}  # fmt: skip
        for name, (t, ref) in pairs.items():
            assert t.placements == ref.placements, (
                f"{what}, {name}: ours {t.placements}, torch's {ref.placements}"
            )
            assert t.shape == ref.shape and t.dtype == ref.dtype, (
                what,
                name,
                t.shape,
                t.dtype,
                ref.shape,
                ref.dtype,
            )
        if w.size > 1:  # where a placement is not free to change, the rule's own
            assert all(
                pairs[k][0].placements == (Shard(0),) for k in ("y", "y (residual)", "h", "dx", "dresidual")
            )
            assert pairs["dw"][0].placements == (Partial("sum"),), (what, pairs["dw"][0])
        out[str(dtype)] = {name: str(t.placements) for name, (t, _) in pairs.items()}
        if on_meta:
            continue
        full = [t.clone().requires_grad_() for t in (x, r, w_)]
        y_full = F.rms_norm(full[0], (H,), full[2], 1e-6)
        h_full = (full[0].float() + full[1]).to(dtype)
        y2_full = F.rms_norm(h_full, (H,), full[2], 1e-6)
        ((y_full + y2_full) * dy).sum().backward()
        _close(y.full_tensor(), y_full, tol, f"y, {what}")
        _close(y2.full_tensor(), y2_full, tol, f"y (residual), {what}")
        _close(h.full_tensor(), h_full, tol, f"h, {what}")
        for name, a, b in zip(("dx", "dresidual", "dw"), ours, full):
            _close(a.grad.full_tensor(), b.grad, MODEL_TOL[dtype], f"{name}, {what}")
    return out


def _qk_case(w: World, q_at, k_at, dtype, heads, per_head=False):
    """qk_norm on DTensors q (T, Hq, D) in ``q_at`` and k (T, Hk, D) in ``k_at``, the weights
    replicated (per head: (H, D), sharded with the heads where they are), against per-head
    F.rms_norm on the same DTensors (times the weight, per head) for torch's placements and
    values, and against the full tensors: y, dq, dk and both weights' gradients."""
    from torch.distributed.tensor import Replicate, Shard

    eps, r = 1e-6, Replicate()
    tokens = 2 * w.size  # two tokens per rank under Shard(0); the heads a multiple of the ranks
    q, k = (
        w.tensor(tokens, heads[0], H, dtype=dtype, seed=1),
        w.tensor(tokens, heads[1], H, dtype=dtype, seed=4),
    )
    wq, wk = (w.tensor(*([h] if per_head else []), H, dtype=dtype, seed=s) for h, s in zip(heads, (2, 5)))
    dyq, dyk = w.tensor(*q.shape, dtype=dtype, seed=3), w.tensor(*k.shape, dtype=dtype, seed=6)
    tol = OP_TOL[dtype]
    what = f"q {q_at}, k {k_at}, {dtype}" + (", per-head weights" if per_head else "")
    wq_at, wk_at = (Shard(0) if per_head and at == Shard(1) else r for at in (q_at, k_at))

    def run(norm):
        args = [w.dt(q, q_at), w.dt(k, k_at), w.dt(wq, wq_at), w.dt(wk, wk_at)]
        yq, yk = norm(*args)
        loss = (yq * w.dt(dyq, q_at, grad=False)).sum() + (yk * w.dt(dyk, k_at, grad=False)).sum()
        loss.backward()
        return {"yq": yq, "yk": yk, **{n: a.grad for n, a in zip(("dq", "dk", "dwq", "dwk"), args)}}

    before = dict(rmsnorm_kernel.CALLS)
    ours = run(lambda q, k, wq, wk: rmsnorm_kernel.qk_norm(q, k, wq, wk, eps))
    ran = {n: rmsnorm_kernel.CALLS[n] - before[n] for n in before}
    # one launch of the qk kernels each way on the local rows: not two rms_norm calls, no fallback
    assert ran == {"forward": 1, "backward": 1, "fallback": 0}, (what, ran)
    if per_head and w.size == 1 and q_at == Shard(1):
        # torch's own DTensor ops refuse this one on a mesh of one rank (mul's backward reshapes
        # the sharded heads dim): the values are checked against the full tensors below
        theirs = None
    elif per_head:  # torch has no per-head weight: the product with F.rms_norm's output
        theirs = run(lambda *a: tuple(F.rms_norm(x, (H,), None, eps) * w_ for x, w_ in (a[::2], a[1::2])))
    else:
        theirs = run(lambda q, k, wq, wk: (F.rms_norm(q, (H,), wq, eps), F.rms_norm(k, (H,), wk, eps)))
    full = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
    yq_f, yk_f = (rms_norm_reference(x, w_, eps) for x, w_ in ((full[0], full[2]), (full[1], full[3])))
    ((yq_f * dyq).sum() + (yk_f * dyk).sum()).backward()
    expected = dict(
        zip(("yq", "yk"), (yq_f, yk_f)), **{n: t.grad for n, t in zip(("dq", "dk", "dwq", "dwk"), full)}
    )
    placements = {n: str(t.placements) for n, t in ours.items()}
    if theirs is not None:
        torch_placements = {n: str(t.placements) for n, t in theirs.items()}
        if per_head and w.size == 1:
            # torch has no per-head weight; its composed reference's dw placement on a mesh of one
            # rank differs between torch versions (Replicate on 2.11, Partial(sum) on 2.13), all
            # holding the same data there: ours is the rule's, checked where ranks are several
            for n in ("dwq", "dwk"):
                placements.pop(n), torch_placements.pop(n)
        assert placements == torch_placements, f"{what}: ours {placements}, torch's {torch_placements}"
    for n, t in ours.items():
        got = t.full_tensor()
        assert got.dtype == expected[n].dtype, (what, n, got.dtype, expected[n].dtype)
        _close(got, expected[n], tol, f"{n}, {what}")
        if theirs is not None:
            _close(got, theirs[n].full_tensor(), tol, f"{n} against torch's DTensor rule, {what}")
    return placements


def qk_norm_heads(w: World):
    """qk_norm under tensor parallel (q and k sharded on heads, Shard(1) of (T, H, D), with
    Hq != Hk) and sequence parallel (Shard(0): tokens), fp32 and bf16, and with k's heads
    replicated while q's are sharded (GQA with fewer KV heads than ranks): placements, values
    and gradients as per-head F.rms_norm's on the same DTensors; dw Partial(sum) from sharded
    rows."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = {}
    for q_at, k_at in ((Shard(1), Shard(1)), (Shard(0), Shard(0))):
        for dtype in (torch.float32, torch.bfloat16):
            out[f"q {q_at}, k {k_at}, {dtype}"] = _qk_case(w, q_at, k_at, dtype, heads=(2 * w.size, w.size))
    out["q Shard(1), k Replicate()"] = _qk_case(
        w, Shard(1), Replicate(), torch.float32, heads=(2 * w.size, 1)
    )
    for q_at, k_at in ((Shard(1), Shard(1)), (Shard(0), Replicate())):  # per-head (H, D) weights
        heads = (2 * w.size, w.size)
        out[f"per head, q {q_at}, k {k_at}"] = _qk_case(w, q_at, k_at, torch.float32, heads, per_head=True)
    if w.size > 1:  # where a placement is not free to change, the rule's own
        heads = out[f"q {Shard(1)}, k {Shard(1)}, {torch.float32}"]
        assert heads["yq"] == heads["dk"] == str((Shard(1),)), heads
        assert heads["dwq"] == heads["dwk"] == str((Partial("sum"),)), heads
        mixed = out["q Shard(1), k Replicate()"]
        assert mixed["yk"] == mixed["dk"] == mixed["dwk"] == str((Replicate(),)), mixed
        per_head = out[f"per head, q {Shard(1)}, k {Shard(1)}"]  # each rank's own heads' dw, whole
        assert per_head["dwq"] == per_head["dwk"] == str((Shard(0),)), per_head
    return out


class MLP(nn.Module):
    """A small model with two norms: what FSDP2 shards."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, H)
        self.norm1 = nn.RMSNorm(H)
        self.mid = nn.Linear(H, H)
        self.norm2 = nn.RMSNorm(H, eps=1e-6)
        self.out = nn.Linear(H, 1)

    def forward(self, x):
        x = self.norm1(F.silu(self.inp(x)))
        return self.out(self.norm2(x + F.silu(self.mid(x))))


def fsdp2(w: World):
    """FSDP2 (fully_shard per norm-carrying layer and the root) of a small model: the swapped
    model's losses and gradients are torch.nn.RMSNorm's, over two optimizer steps, fp32 and with
    bf16 parameters (MixedPrecisionPolicy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        reference = MLP().to(w.device)
        models = {"torch": reference, "ours": _swapped(reference)}
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        optims = {}
        for name, m in models.items():
            for layer in (m.norm1, m.norm2, m.mid):
                fully_shard(layer, mesh=w.mesh, mp_policy=policy)
            fully_shard(m, mesh=w.mesh, mp_policy=policy)
            optims[name] = torch.optim.SGD(m.parameters(), lr=0.1)
        tol = MODEL_TOL[dtype]
        losses = []
        for step in range(2):
            # each rank its own batch
            x = w.tensor(4, 16, seed=100 + 10 * step + w.rank)
            target = w.tensor(4, 1, seed=200 + 10 * step + w.rank)
            loss = {}
            for name, m in models.items():
                loss[name] = F.mse_loss(m(x).float(), target)
                loss[name].backward()
            _close(loss["ours"], loss["torch"], tol, f"loss, step {step}, {dtype}")
            grads = {name: {n: _full(p.grad) for n, p in m.named_parameters()} for name, m in models.items()}
            assert grads["ours"].keys() == grads["torch"].keys()
            for n in grads["torch"]:
                _close(grads["ours"][n], grads["torch"][n], tol, f"grad {n}, step {step}, {dtype}")
            for o in optims.values():
                o.step()
                o.zero_grad()
            losses.append(loss["ours"].item())
        ours = models["ours"]
        assert isinstance(ours.norm1, rmsnorm_kernel.RMSNorm) and isinstance(
            ours.norm2, rmsnorm_kernel.RMSNorm
        )
        out[str(dtype)] = {"losses": losses, "norm weight": str(ours.norm1.weight.placements)}
    return out


def _tp_plan():
    return distributed.block_plan()


def _tp_models(w: World, dtype):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    reference = Block(H, max(4, w.size)).to(w.device, dtype)  # a head or more per rank
    models = {"torch": reference, "ours": _swapped(reference)}
    for m in models.values():
        parallelize_module(m, w.mesh, _tp_plan())
    return models


def _tp_step(w: World, models, dtype, step: int, run=None):
    from torch.distributed.tensor import Shard

    x = w.tensor(2, 8, H, dtype=dtype, seed=300 + step)
    results = {}
    for name, m in models.items():
        xd = w.dt(x, Shard(1))
        out = run(xd) if run is not None and name == "ours" else m(xd)
        loss = out.float().square().mean()
        loss.backward()
        grads = {n: _full(p.grad) for n, p in m.named_parameters()}
        grads["input"] = xd.grad.full_tensor()
        results[name] = (loss.full_tensor(), out.placements, grads)
    return results


def _compare_tp(results, dtype, what: str) -> None:
    tol = MODEL_TOL[dtype]
    (l_o, p_o, g_o), (l_t, p_t, g_t) = results["ours"], results["torch"]
    assert p_o == p_t, f"{what}: output placements {p_o}, torch's {p_t}"
    _close(l_o, l_t, tol, f"loss, {what}")
    assert g_o.keys() == g_t.keys()
    for n in g_t:
        _close(g_o[n], g_t[n], tol, f"grad {n}, {what}")


def tensor_parallel(w: World):
    """TP (colwise/rowwise matmuls) with sequence parallel norms of a Llama-style block, the
    op swapped in (its second norm fused with the residual add): loss, input and parameter
    gradients are torch.nn.RMSNorm's over two SGD steps, fp32 and bf16."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        models = _tp_models(w, dtype)
        optims = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
        ours = models["ours"]
        assert isinstance(ours.attention_norm, rmsnorm_kernel.RMSNorm), type(ours.attention_norm)
        assert isinstance(ours.ffn_norm, rmsnorm_kernel.RMSNorm), type(ours.ffn_norm)
        losses = []
        for step in range(2):
            results = _tp_step(w, models, dtype, step)
            _compare_tp(results, dtype, f"step {step}, {dtype}")
            losses.append(results["ours"][0].item())
            for o in optims.values():
                o.step()
                o.zero_grad()
        norm_w = models["ours"].ffn_norm.weight
        out[str(dtype)] = {"losses": losses, "norm weight": str(norm_w.placements)}
    return out


def compile(w: World):
    """torch.compile (fullgraph) of the op on sequence-parallel DTensors, with and without the
    residual, and of the TP block with the op swapped in: the eager results, no graph break,
    for each backend in DIST_COMPILE (CPU: aot_eager, which traces the operators' fakes and
    rules as inductor does without compiling C++; CUDA: inductor too)."""
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    x, r = (w.tensor(2, 8, H, seed=s) for s in (1, 4))
    w_ = w.tensor(H, seed=2)
    tol = OP_TOL[torch.float32]

    def f(x, w_, r):
        y, h = rmsnorm_kernel.rms_norm(x, H, w_, residual=r)
        return rmsnorm_kernel.rms_norm(y, H, w_) + h

    for backend in w.compile_backends:
        started = time.perf_counter()
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=backend, fullgraph=True)
        results = []
        for fn in (f, compiled):
            args = [w.dt(x, Shard(1)), w.dt(w_, Replicate()), w.dt(r, Shard(1))]
            calls = dict(rmsnorm_kernel.CALLS)
            y = fn(*args)
            y.square().sum().backward()
            ran = {k: rmsnorm_kernel.CALLS[k] - calls[k] for k in calls}
            assert ran["forward"] == 2 and ran["backward"] == 2 and not ran["fallback"], (backend, ran)
            results.append((y, [a.grad for a in args]))
        (y_e, g_e), (y_c, g_c) = results
        assert y_c.placements == y_e.placements, (backend, y_c.placements, y_e.placements)
        _close(y_c.full_tensor(), y_e.full_tensor(), tol, f"compiled y, {backend}")
        for name, a, b in zip(("dx", "dw", "dresidual"), g_c, g_e):
            assert a.placements == b.placements, (backend, name, a.placements, b.placements)
            _close(a.full_tensor(), b.full_tensor(), tol, f"compiled {name}, {backend}")
        models = _tp_models(w, torch.float32)
        block = torch.compile(models["ours"], backend=backend, fullgraph=True)
        _compare_tp(
            _tp_step(w, models, torch.float32, 0, run=block), torch.float32, f"compiled TP block, {backend}"
        )
        out[backend] = {"seconds": time.perf_counter() - started}
    return out


# ---------------------------------------------------------------------------------------------


def main() -> None:
    started = time.perf_counter()
    world = World()
    ready = time.perf_counter() - started
    chosen = os.environ.get("DIST_SCENARIOS", ",".join(SCENARIOS)).split(",")
    path = f"{os.environ['DIST_OUT']}.{world.rank}.json"
    results = {"_setup_seconds": ready}
    for name in chosen:
        t, c = time.perf_counter(), time.process_time()
        try:
            detail = globals()[name](world)
            results[name] = {"ok": True, "detail": detail}
        except Exception:  # noqa: BLE001 - every scenario's failure is reported, the next ones run
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - t
        results[name]["cpu_seconds"] = time.process_time() - c
        with open(path, "w") as f:  # after each: a later hang leaves the earlier results
            json.dump(results, f, indent=1, default=str)
    results["_total_seconds"] = time.perf_counter() - started
    results["_cpu_seconds"] = time.process_time()  # the process's, imports included
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
