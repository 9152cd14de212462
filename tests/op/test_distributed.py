"""The op where models train at scale: DTensor sharding rules for its operators (sharding.py),
sequence and tensor parallel, FSDP2 and torch.compile, against torch.nn.RMSNorm.

The runs need a process group: tests/op/distributed_worker.py is each rank, started here as its
own process (the group's rendezvous through a file, torch's FileStore); one start serves every
scenario there, and this test reports each scenario's result. On CPU: two ranks over gloo, the
kernels under the Triton interpreter. On a GPU: one rank in an NCCL group, where the rules,
DTensor's dispatch to the CUDA kernels and the compiled host path run, and no collective moves
data. One test per device, not one per scenario: pytest-xdist would start the group once for
each worker that took one of them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rmsnorm_kernel
from rmsnorm_kernel import host, sharding
from rmsnorm_suite import distributed

from ..conftest import _extension_here, requires_cuda, requires_interpret
from . import distributed_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(distributed_worker.__file__)
CORE_OPERATORS = {
    "rmsnorm_kernel::forward",
    "rmsnorm_kernel::backward",
    "rmsnorm_kernel::qk_forward",
    "rmsnorm_kernel::qk_backward",
}
HOST_OPERATORS = {"rmsnorm_kernel_host::rms_norm", "rmsnorm_kernel_host::rms_norm_residual"}

requires_distributed = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch is built without torch.distributed"
)


def torchrun(nproc: int, *command: str) -> list[str]:
    """torchrun (torch.distributed.run) starting ``nproc`` processes of ``command`` on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        *command,
    ]


def group_env() -> dict[str, str]:
    """This environment with the tree's packages (those this test imports) first on PYTHONPATH."""
    package = Path(rmsnorm_kernel.__file__).resolve().parents[1]  # the rmsnorm_kernel this test imports
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(package), env.get("PYTHONPATH", "")) if p)
    return env


def run_group(tmp: Path, world_size: int, backend: str, device: str, compile_backends: str, with_host: bool,
              timeout: float, launcher: str = "own") -> tuple[list[dict], float, list[str]]:  # fmt: skip
    """Start ``world_size`` worker processes (``launcher`` "own": one each, meeting through a
    file; "torchrun": torchrun starts them, one per GPU), wait for them (killing any still
    running at ``timeout``), and return each rank's results, the wall seconds, and each rank's
    log (torchrun's: the one log of all ranks)."""
    env = group_env()
    env.update(
        WORLD_SIZE=str(world_size),
        DIST_STORE=str(tmp / "store"),
        DIST_BACKEND=backend,
        DIST_DEVICE=device,
        DIST_OUT=str(tmp / "results"),
        DIST_HOST="1" if with_host else "0",
        DIST_COMPILE=compile_backends,
    )
    started = time.perf_counter()
    procs, logs = [], []
    if launcher == "torchrun":  # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous
        del env["DIST_STORE"], env["WORLD_SIZE"]
        commands = [(torchrun(world_size, str(WORKER)), {})]
    else:
        commands = [([sys.executable, str(WORKER)], {"RANK": str(rank)}) for rank in range(world_size)]
    for i, (command, own) in enumerate(commands):
        log = open(tmp / f"rank{i}.log", "w")  # closed below
        logs.append(log)
        procs.append(
            subprocess.Popen(command, env={**env, **own}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        )
    deadline = started + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - started
    texts = [(tmp / f"rank{i}.log").read_text(errors="replace") for i in range(len(procs))]
    texts += texts[-1:] * (world_size - len(texts))
    results = []
    for rank in range(world_size):
        path = tmp / f"results.{rank}.json"
        found = json.loads(path.read_text()) if path.exists() else {}
        found["_returncode"] = procs[min(rank, len(procs) - 1)].returncode
        results.append(found)
    return results, wall, texts


def check(results: list[dict], logs: list[str], wall: float) -> None:
    """Every scenario ran and passed on every rank; else one failure naming each scenario that
    did not, with its traceback (or the rank's log where it did not finish)."""
    problems = []
    for rank, found in enumerate(results):
        for name in distributed_worker.SCENARIOS:
            result = found.get(name)
            if result is None:
                problems.append(
                    f"rank {rank}: {name} did not run (exit {found['_returncode']})\n{logs[rank][-3000:]}"
                )
            elif not result["ok"]:
                problems.append(f"rank {rank}: {name} failed\n{result['error']}")
        if found["_returncode"] != 0 and not problems:
            problems.append(f"rank {rank} exited {found['_returncode']}\n{logs[rank][-3000:]}")
    if problems:
        pytest.fail(f"{len(problems)} problem(s) in {wall:.0f} s:\n\n" + "\n\n".join(problems), pytrace=False)
    timings = ", ".join(f"{n} {results[0][n]['seconds']:.1f}" for n in distributed_worker.SCENARIOS)
    print(f"process group: {wall:.1f} s wall; rank 0 CPU {results[0]['_cpu_seconds']:.1f} s; {timings}")


@pytest.mark.interpret
@requires_interpret
@requires_distributed
def test_dtensor_fsdp2_tensor_parallel_on_two_cpu_ranks(tmp_path):
    """Two ranks over gloo, the kernels under the interpreter: sequence-parallel and replicated
    rows, the residual variant, a sharded normalised dim, qk_norm on heads (TP) and tokens (SP),
    the host path's operators (on meta local tensors: they have no CPU kernel), FSDP2 and TP of
    small models with the op swapped in, torch.compile; every value and gradient torch.nn.RMSNorm's within the dtype's tolerance
    (distributed_worker.OP_TOL, MODEL_TOL)."""
    try:  # built here, once, so that the ranks load it rather than each build it
        _extension_here()
        with_host = True
    except (pytest.skip.Exception, RuntimeError):  # no compiler here, or the build failed (test_host's)
        with_host = False
    results, wall, logs = run_group(tmp_path, 2, "gloo", "cpu", "aot_eager", with_host, timeout=300)
    check(results, logs, wall)


@pytest.mark.gpu
@requires_cuda
@requires_distributed
def test_dtensor_fsdp2_tensor_parallel_on_one_gpu(tmp_path):
    """The same scenarios on one GPU in a single-rank NCCL group: the rules and DTensor's
    dispatch reach the CUDA kernels (the host path's operators with real values), FSDP2's
    unsharded parameters take the compiled host path, and torch.compile runs aot_eager and
    inductor. One rank moves no data: the collectives are the CPU test's."""
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch is built without NCCL")
    with_host = host.mode() != "python"
    results, wall, logs = run_group(tmp_path, 1, "nccl", "cuda", "aot_eager,inductor", with_host, timeout=600)
    check(results, logs, wall)


@pytest.mark.gpu
@pytest.mark.multigpu
@requires_cuda
@requires_distributed
def test_dtensor_fsdp2_tensor_parallel_on_every_gpu(tmp_path):
    """The same scenarios over NCCL on every GPU of the machine, one rank each, started by
    torchrun (`nox -s gpu-distributed`): the collectives move data between GPUs, the rules and
    the kernels meet as in a user's run."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs two or more GPUs; {count} visible")
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch is built without NCCL")
    with_host = host.mode() != "python"
    results, wall, logs = run_group(
        tmp_path, count, "nccl", "cuda", "aot_eager,inductor", with_host, timeout=900, launcher="torchrun"
    )
    check(results, logs, wall)


TRAINING_RESULT = f"{distributed.RESULT}.json"


@pytest.mark.interpret
@requires_interpret
@requires_distributed
def test_training_comparison_on_two_cpu_ranks(tmp_path):
    """The training comparison of `nox -s gpu-distributed` as it is started there (torchrun,
    python -m rmsnorm_suite.distributed), on two CPU ranks over gloo at the tiny size, three
    steps: FSDP2 and TP, fp32 and bf16, losses and gradients within MODEL_TOL, the kernels ran
    (the interpreter) with no fallback, and the JSON and markdown written."""
    args = ["--device", "cpu", "--size", "tiny", "--steps", "3", "--warmup", "1", "--modes", "fsdp2,tp"]
    command = torchrun(2, "-m", "rmsnorm_suite.distributed", *args, "--out", str(tmp_path))
    done = subprocess.run(command, env=group_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / TRAINING_RESULT).read_text())
    assert results["ok"], results
    assert results["environment"]["world_size"] == 2 and results["environment"]["interpreter"]
    runs = {(r["mode"], r["dtype"]): r for r in results["runs"]}
    assert set(runs) == {(m, d) for m in ("fsdp2", "tp") for d in ("float32", "bfloat16")}
    for r in runs.values():
        assert r["worst"]["loss"] <= 1 and r["worst"]["grad"] <= 1, r
        calls = r["kernel_calls_rank0"]
        assert calls["forward"] > 0 and calls["backward"] > 0 and not calls["fallback"], calls
        assert len(r["losses_ours"]) == len(r["losses_torch"]) == 3
        assert all(math.isfinite(v) for v in r["losses_ours"] + r["losses_torch"])
        assert r["median_step_ms"]["ours"] > 0 and r["median_step_ms"]["torch"] > 0
    assert "| fsdp2 | float32 | 3 |" in (tmp_path / f"{distributed.RESULT}.md").read_text()


@pytest.mark.parametrize("scale", [0.0, 0.5, 0.99, 1.01, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_comparisons_ratio_is_assert_closes_test(scale, dtype):
    """worst_ratio <= 1 exactly where torch.testing.assert_close(tol) passes."""
    tol = distributed.MODEL_TOL[dtype]
    expected = torch.tensor([0.0, 1e-3, -2.0, 40.0], dtype=torch.float64)
    got = expected + scale * (tol["atol"] + tol["rtol"] * expected.abs()) * torch.tensor(
        [1.0, -1.0, 1.0, -1.0]
    )
    ratio = distributed.worst_ratio(got, expected, tol)
    try:
        torch.testing.assert_close(got, expected, **tol)
        passed = True
    except AssertionError:
        passed = False
    assert ratio == pytest.approx(scale) and passed is (ratio <= 1)


@requires_distributed
def test_the_package_import_leaves_dtensor_alone_and_registers_on_its_import():
    """A fresh process: importing the package does not import torch.distributed.tensor (its
    import takes longer than the package's); importing it afterwards registers the rules (the
    import hook), which DTensor's propagator then holds."""
    code = (
        "import sys, torch, rmsnorm_kernel\n"
        "from rmsnorm_kernel import sharding\n"
        "assert sharding.DTENSOR_MODULE not in sys.modules, 'the package imported DTensor'\n"
        "assert not sharding.registered()\n"
        "from torch.distributed.tensor import DTensor\n"
        "rules = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
        "ops = torch.ops.rmsnorm_kernel\n"
        "print(sorted(sharding.registered()), *(getattr(ops, n).default in rules for n in\n"
        "      ('forward', 'backward', 'qk_forward', 'qk_backward')), sharding._hook in sys.meta_path)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "['rmsnorm_kernel::backward',",
        "'rmsnorm_kernel::forward',",
        "'rmsnorm_kernel::qk_backward',",
        "'rmsnorm_kernel::qk_forward']",
        "True",
        "True",
        "True",
        "True",
        "False",
    ]


@requires_distributed
def test_rules_registered_once_dtensor_is_imported():
    """Importing torch.distributed.tensor (in either order with the package) registers the rules
    of the op's operators and qk_norm's; registering again adds nothing."""
    import torch.distributed.tensor  # noqa: F401

    assert CORE_OPERATORS <= sharding.registered()
    assert sharding.register() == []


@requires_distributed
def test_host_rules_registered_when_the_extension_loads(built_extension):
    """The compiled host path's operators get their rules when the extension loads (host.on_load),
    DTensor imported first or not."""
    import torch.distributed.tensor  # noqa: F401

    assert sharding._on_host_load in host.on_load
    sharding.register()
    assert HOST_OPERATORS <= sharding.registered()


PLACEMENTS = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from rmsnorm_kernel import ops
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
x, g, w = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64)
seen = []
for x_at in (Shard(0), Shard(1), Replicate()):
    xh = DTensor.from_local(x, mesh, [x_at])
    dx, dw = (DTensor.from_local(t, mesh, [Replicate()]) for t in (g, w))
    px, pw = ops._placed_as_torch(xh, dx, dw)
    assert torch.equal(px.full_tensor(), g) and torch.equal(pw.full_tensor(), w)
    seen.append(f"{px.placements[0]}/{pw.placements[0]}")
print(" ".join(seen))
dist.destroy_process_group()
"""


@requires_distributed
def test_composite_gradients_take_torchs_placements_on_a_one_rank_mesh():
    """The composite backward's DTensor gradients as torch's F.rms_norm backward places them, even
    where a one-rank mesh left DTensor free to choose (it chose Replicate for dx with torch 2.11):
    dx as x with the normalised dimension whole, dw Partial where x's rows are sharded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", PLACEMENTS], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["S(0)/P(sum)", "R/R", "R/R"]
