"""The training integration: seeded data and batches, identical initialisation, checkpoints and
resume; the short run on the kernels under the interpreter and the full run on CUDA."""

import json

import pytest
import torch
from torch import nn

import rmsnorm_kernel
from rmsnorm_suite import cli, console, training
from rmsnorm_suite.config import parse_config
from rmsnorm_suite.walkthrough import checkpoints

from ..conftest import requires_cuda, requires_interpret

SMALL = {"data": {"train": 256, "validation": 64, "test": 64, "features": 16}}


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs/ and artifacts/ are relative to the working directory
    return tmp_path


def test_splits_are_seeded_and_disjoint():
    cfg = parse_config(SMALL)
    a, b = training.make_splits(cfg), training.make_splits(cfg)
    assert training.splits_digest(a) == training.splits_digest(b)
    assert {k: v[0].shape[0] for k, v in a.items()} == {"train": 256, "validation": 64, "test": 64}
    rows = torch.cat([a[k][0] for k in a])
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    other = training.make_splits(parse_config(SMALL | {"seeds": {"data": 1}}))
    assert training.splits_digest(other) != training.splits_digest(a)


def test_batch_order_is_fixed_and_walks_every_row():
    order = training.batch_order(100, steps=10, batch_size=32, seed=0)
    assert order.shape == (10, 32)
    assert torch.equal(order, training.batch_order(100, 10, 32, 0))
    assert set(order[:3].flatten().tolist()) | set(order[3:].flatten().tolist()) == set(range(100))
    assert sorted(order.flatten()[:100].tolist()) == list(range(100))  # one epoch = one permutation


def test_both_paths_start_identical():
    ref = training.build_model("reference", 16, 33, seed=0)
    ker = training.build_model("kernel", 16, 33, seed=0)
    assert isinstance(ker[1], rmsnorm_kernel.RMSNorm)
    assert isinstance(ref[1], training.ReferenceRMSNorm)
    assert training.max_param_diff(ref, ker) == 0.0
    assert training.state_digest(ref) == training.state_digest(ker)
    assert training.max_param_diff(ref, training.build_model("reference", 16, 33, seed=1)) > 0


def test_build_model_rejects_unknown_path():
    with pytest.raises(ValueError, match="path must be one of"):
        training.build_model("fast", 4, 4, seed=0)


def test_resume_logic_on_the_reference_path(project):
    """Checkpoint and resume, checked on the reference path (no kernel needed): stopping at step 5,
    saving, reloading into new objects and finishing gives bitwise the uninterrupted run."""
    cfg = parse_config(SMALL)
    x, y = training.make_splits(cfg)["train"]
    order = training.batch_order(len(x), 12, 8, seed=0)

    def fresh():
        model = training.build_model("reference", 16, 33, seed=0)
        return training.Run(model, training.make_optimizer(model, 1e-2))

    full = training.train_steps(fresh(), x, y, order, 12, "full")
    part = training.train_steps(fresh(), x, y, order, 5, "part")
    meta = {"path": "reference", "features": 16, "hidden": 33, "seed": 0, "lr": 1e-2, "device": "cpu"}
    training.save_checkpoint(project / "ckpt.pt", part, meta, x[:4])
    resumed, payload = training.load_checkpoint(project / "ckpt.pt", "cpu")
    assert payload["step"] == 5 and resumed.step == 5
    training.train_steps(resumed, x, y, order, 12, "resumed")
    assert training.max_param_diff(full.model, resumed.model) == 0.0
    assert training.tensors_equal(full.optimizer.state_dict(), resumed.optimizer.state_dict())
    assert full.losses == resumed.losses
    # ... and resuming without the Adam state does not: the comparison can fail.
    fresh_opt = training.build_model("reference", 16, 33, seed=0)
    fresh_opt.load_state_dict(payload["model"])
    no_state = training.Run(fresh_opt, training.make_optimizer(fresh_opt, 1e-2), list(payload["losses"]), 5)
    training.train_steps(no_state, x, y, order, 12, "resumed without Adam state")
    assert training.max_param_diff(full.model, no_state.model) > 0


def test_counters_catch_a_kernel_path_that_is_not_the_kernel(project, monkeypatch):
    """If the 'kernel' module silently ran the reference, CALLS stays at zero and the run fails."""

    class Impostor(training.ReferenceRMSNorm):
        def __init__(self, hidden, eps=None):
            super().__init__(hidden)

    monkeypatch.setattr(rmsnorm_kernel, "RMSNorm", Impostor)
    cfg = parse_config(SMALL | {"training": {"interpret": {"steps": 6, "hidden": 9, "batch_size": 8}}})
    result = training.run_integration(cfg, "cpu")
    assert result["passed"] is False
    failed = {c["name"] for c in result["checks"] if c["ok"] is False}
    assert failed == {"kernel path: CALLS['forward']", "kernel path: CALLS['backward']"}


# ---------------------------------------------------------------------------------------------
# The real kernels
# ---------------------------------------------------------------------------------------------


@pytest.mark.interpret
@requires_interpret
def test_short_run_under_the_interpreter(project, capsys):
    cfg = parse_config({"training": {"interpret": {"steps": 20, "hidden": 33, "batch_size": 32}}})
    result = training.run_integration(cfg, "cpu")
    failed = [c for c in result["checks"] if c["ok"] is False]
    assert result["passed"], failed
    assert result["calls"] == {"forward": 20, "backward": 20, "fallback": 0}
    assert result["training"]["resume_step"] == 10
    assert len(result["losses"]["reference"]) == len(result["losses"]["kernel"]) == 20
    assert result["losses"]["resumed"] == result["losses"]["kernel"]
    names = sorted(p.name for p in (project / "artifacts" / "train-integration").glob("*.pt"))
    assert names == ["kernel-step10.pt", "kernel.pt", "reference.pt"]

    # check-checkpoints reproduces every checkpoint exactly ...
    console.write_json(project / "outputs" / training.RESULT_JSON, result)
    report = checkpoints.checkpoint_checks(cfg)
    assert report["passed"], report
    assert all(e["max_abs_output_diff"] == 0.0 for e in report["checkpoints"])
    # ... and notices a checkpoint whose parameters changed after training.
    file = project / "artifacts" / "train-integration" / "kernel.pt"
    payload = torch.load(file, weights_only=True)
    payload["model"]["0.weight"][0, 0] += 1e-3
    torch.save(payload, file)
    report = checkpoints.checkpoint_checks(cfg)
    assert not report["passed"]
    bad = [e for e in report["checkpoints"] if not e["passed"]]
    assert [e["file"].rsplit("/", 1)[1] for e in bad] == ["kernel.pt"]


@pytest.mark.interpret
@requires_interpret
def test_train_integration_command(project, capsys):
    (project / "c.yaml").write_text("training:\n  interpret: {steps: 8, hidden: 17, batch_size: 16}\n")
    rc = cli.main(["train-integration", "--config", "c.yaml", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    summary = json.loads(out)
    assert summary["calls"]["forward"] == 8 and "losses" not in summary
    record = json.loads((project / "outputs" / "train-integration.json").read_text())
    assert len(record["losses"]["kernel"]) == 8


@pytest.mark.gpu
@pytest.mark.slow
@requires_cuda
def test_full_run_on_cuda(project):
    cfg = parse_config({})
    result = training.run_integration(cfg, "cuda")
    failed = [c for c in result["checks"] if c["ok"] is False]
    assert result["passed"], failed
    assert result["calls"] == {"forward": 100, "backward": 100, "fallback": 0}
    assert result["training"]["hidden"] == 257 and result["training"]["batch_size"] == 32
    mse = result["mse"]
    rel = abs(mse["reference"]["test"] - mse["kernel"]["test"]) / mse["reference"]["test"]
    assert rel <= training.TEST_MSE_RTOL
    assert checkpoints.checkpoint_checks(cfg, "cuda")["passed"]


def test_reference_module_matches_torch_rmsnorm():
    """The reference path's module computes what torch.nn.RMSNorm computes (fp32, same eps)."""
    ref = training.ReferenceRMSNorm(33)
    native = nn.RMSNorm(33, eps=ref.eps)
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ref(x), native(x))
