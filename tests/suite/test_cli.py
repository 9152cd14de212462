"""The walkthrough commands: help, cleanup that never deletes on --dry-run, the exercise's arithmetic,
JSON output, and (under the interpreter) the commands that run the kernels."""

import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from rmsnorm_suite import cli, console
from rmsnorm_suite.config import parse_config
from rmsnorm_suite.walkthrough import exercise, figures, oraclecheck

from ..conftest import HAS_CUDA, INTERPRET, requires_interpret

MINE = [
    name
    for name, (module, _) in cli.COMMANDS.items()
    if module.startswith("rmsnorm_suite.walkthrough.") or module.rsplit(".", 1)[1] in ("training", "verdict")
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project folder as the working directory (no configs/: built-in defaults)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


WALKTHROUGH = {
    "check-environment": "environment",
    "reference": "oraclecheck",
    "check-forward": "grids",
    "check-backward": "grids",
    "check-gamma": "grids",
    "exercise": "exercise",
    "figures": "figures",
    "check-checkpoints": "checkpoints",
    "clean": "clean",
}


def test_my_commands_are_all_routed():
    """Each walkthrough command is a module of the walkthrough package with configure and run."""
    assert set(MINE) == set(WALKTHROUGH) | {"train-integration", "verdict"}
    for command, module in WALKTHROUGH.items():
        assert cli.COMMANDS[command][0] == f"rmsnorm_suite.walkthrough.{module}"
        loaded = importlib.import_module(cli.COMMANDS[command][0])
        assert callable(loaded.configure) and callable(loaded.run)


@pytest.mark.parametrize("command", MINE)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"rmsnorm-kernel {command}" in out and "--config" in out


@pytest.mark.parametrize("command", ["check-forward", "exercise", "train-integration", "check-environment"])
def test_device_option(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "--device {auto,cuda,cpu}" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# clean
# ---------------------------------------------------------------------------------------------


def populate(root: Path) -> dict[str, Path]:
    files = {
        "out": root / "outputs" / "check-forward.json",
        "nested": root / "outputs" / "figures" / "errors.png",
        "ckpt": root / "artifacts" / "train-integration" / "kernel.pt",
        "keep_src": root / "src" / "keep.py",
        "keep_top": root / "notes.txt",
        "keep_cfg": root / "configs" / "minimum.yaml",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x\n")
    return files


def test_clean_dry_run_deletes_nothing(project, capsys):
    files = populate(project)
    (project / "configs" / "minimum.yaml").write_text("output_dir: outputs\n")
    rc, out, _ = run_cli(capsys, "clean", "--scope", "generated", "--dry-run")
    assert rc == 0
    assert all(p.exists() for p in files.values())
    for key in ("out", "nested", "ckpt"):
        assert str(files[key].relative_to(project)) in out
    assert "keep" not in out and "notes.txt" not in out
    assert "nothing was deleted" in out


def test_clean_deletes_only_generated(project, capsys):
    files = populate(project)
    (project / "configs" / "minimum.yaml").write_text("output_dir: outputs\n")
    rc, out, _ = run_cli(capsys, "clean", "--scope", "generated")
    assert rc == 0
    assert not (project / "outputs").exists() and not (project / "artifacts").exists()
    assert all(files[k].exists() for k in ("keep_src", "keep_top", "keep_cfg"))


def test_clean_follows_the_config_folders(project, capsys):
    files = populate(project)
    other = project / "my-out" / "a.json"
    other.parent.mkdir()
    other.write_text("{}")
    cfg = project / "alt.yaml"
    cfg.write_text("output_dir: my-out\nartifacts_dir: my-art\n")
    rc, _, _ = run_cli(capsys, "clean", "--scope", "generated", "--config", str(cfg))
    assert rc == 0 and not other.exists()
    assert files["out"].exists() and files["ckpt"].exists()  # not this config's folders


def test_clean_removes_a_symlink_not_its_target(project, capsys):
    target = project / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("keep")
    (project / "outputs").symlink_to(target, target_is_directory=True)
    rc, out, _ = run_cli(capsys, "clean", "--scope", "generated")
    assert rc == 0 and not (project / "outputs").exists()
    assert (target / "precious.txt").read_text() == "keep"


def test_clean_json_and_empty(project, capsys):
    rc, out, _ = run_cli(capsys, "clean", "--scope", "generated", "--dry-run", "--json")
    assert rc == 0
    assert json.loads(out) == {
        "command": "clean",
        "scope": "generated",
        "dry_run": True,
        "plan": [],
        "deleted": [],
    }


def test_clean_needs_a_scope(project, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["clean", "--dry-run"])
    assert info.value.code == 2
    assert "--scope" in capsys.readouterr().err


def test_bad_config_is_a_clear_error(project, capsys):
    cfg = project / "bad.yaml"
    cfg.write_text("training:\n  steps: -3\n")
    rc, _, err = run_cli(capsys, "clean", "--scope", "generated", "--config", str(cfg))
    assert rc == 2
    assert "bad.yaml: training.steps must be a positive integer, got -3" in err


# ---------------------------------------------------------------------------------------------
# exercise: the arithmetic of both sides (no kernel needed)
# ---------------------------------------------------------------------------------------------

EPS = 1e-6

# (N, denominator, quantity, the tutorial's value, absolute precision of the tutorial's figure)
TUTORIAL = [
    (257, 257, "sum_sq", 257, 0),
    (257, 257, "mean", 1, 0),
    (257, 257, "denominator", 1.0000005, 1e-7),
    (257, 257, "y", 0.9999995, 1e-7),
    (257, 512, "sum_sq", 257, 0),
    (257, 512, "mean", 0.501953125, 0),
    (257, 512, "denominator", 0.708487, 1e-6),
    (257, 512, "y", 1.411458, 1e-6),
    (256, 256, "mean", 1, 0),
]


@pytest.mark.parametrize("n, denominator, key, value, precision", TUTORIAL)
def test_expected_row_matches_the_tutorials_table(n, denominator, key, value, precision):
    assert exercise.expected_row(n, 1.0, EPS, denominator)[key] == pytest.approx(value, abs=precision)


@pytest.mark.parametrize("n, block", [(257, 512), (256, 256), (1, 1), (3, 4), (4097, 8192)])
def test_block_width(n, block):
    assert exercise.next_power_of_2(n) == block


# (N, denominator): the wrong variant is a real computation and agrees with the float64 arithmetic
@pytest.mark.parametrize("n, denominator", [(257, 257), (257, 512), (256, 256), (3, 4)])
def test_padded_computation_agrees_with_arithmetic(n, denominator):
    x = torch.ones(1, n)
    got = exercise.padded_row_norm(x, EPS, denominator)
    want = exercise.expected_row(n, 1.0, EPS, denominator)
    for key in ("sum_sq", "mean", "denominator"):
        assert got[key].item() == pytest.approx(want[key], rel=1e-6)
    assert got["y"].shape == (n,)
    assert torch.allclose(got["y"].double(), torch.full((n,), want["y"], dtype=torch.float64), rtol=1e-6)


@pytest.mark.parametrize(
    "n, denominator, dx",
    [
        (257, 257, 1e-6),  # r - r^3 for a row of ones: about eps
        (257, 512, 1 - 257 / 512),  # the backward's mean divided by BLOCK
        (256, 256, 1e-6),
    ],
)
def test_backward_mean_denominator(n, denominator, dx):
    x, dy = torch.ones(1, n), torch.ones(1, n)
    r = exercise.padded_row_norm(x, EPS, n)["r"]
    got = exercise.padded_row_dx(x, dy, r, denominator)
    assert got["mean_ux"].item() == pytest.approx(n / denominator, rel=1e-6)
    assert got["dx"][0].item() == pytest.approx(dx, abs=5e-7)
    assert exercise.expected_row(n, 1.0, EPS, denominator)["dx"] == pytest.approx(dx, abs=5e-7)


def test_exercise_config_selects_the_tutorials_widths():
    cfg = parse_config({"exercise": {"widths": [257, 256]}})
    assert cfg.exercise.widths == (257, 256) and cfg.exercise.value == 1.0


# ---------------------------------------------------------------------------------------------
# JSON output, missing inputs, missing device
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def few_gradcheck_shapes(monkeypatch):
    """The reference command's rows at three shapes, one 3-D: tests/op/test_contract.py runs the
    check at every shape (the 17x257 gradchecks take seconds each)."""
    monkeypatch.setattr(oraclecheck, "GRADCHECK_SHAPES", ((1, 1), (3, 7), (2, 3, 5)))


def test_reference_json(project, capsys, few_gradcheck_shapes):
    rc, out, _ = run_cli(capsys, "reference", "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["command"] == "reference" and result["passed"] is True
    assert [(g["shape"], g["offset"]) for g in result["gradcheck"]] == [
        (list(s), offset) for s in oraclecheck.GRADCHECK_SHAPES for offset in oraclecheck.GRADCHECK_OFFSETS
    ]
    assert all(g["gradcheck"] and g["formula_vs_autograd"] for g in result["gradcheck"])
    assert set(result["splits"]["summary"]) == {"train", "validation", "test"}
    saved = torch.load(project / "outputs" / "data" / "splits.pt", weights_only=True)
    assert saved["test"]["x"].shape == (512, 64)
    assert json.loads((project / "outputs" / "reference.json").read_text()) == result


def test_reference_catches_a_wrong_formula(monkeypatch, few_gradcheck_shapes):
    """The gradcheck step can fail: an explicit backward without the r^3 term is refused."""
    from rmsnorm_kernel import reference as op_reference

    def wrong(x, weight, dy, eps=1e-6, **_):
        r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
        return (dy * weight * r).to(x.dtype), (dy * x * r).sum(0).to(weight.dtype)

    monkeypatch.setattr(op_reference, "rms_norm_backward_reference", wrong)
    rows = oraclecheck.reference_checks()
    assert not any(r["formula_vs_autograd"] for r in rows if r["shape"] != [1, 1])


def test_figures_without_inputs_skip_with_messages(project, capsys):
    rc, out, _ = run_cli(capsys, "figures", "--json")
    assert rc == 0
    messages = json.loads(out)["messages"]
    assert len(messages) == 3 and all(m.startswith("skipped") for m in messages)
    assert not list((project / "outputs" / "figures").glob("*.png"))


def test_figures_from_recorded_outputs(project, capsys):
    out = project / "outputs"
    out.mkdir()
    case = {"dtype": "float32", "max_abs": 1e-7, "atol": 1e-5, "passed": True}
    (out / "check-forward.json").write_text(
        json.dumps({"device": "cpu", "cases": [case, case | {"max_abs": "nan"}]})
    )
    losses = [1.0 / (i + 1) for i in range(10)]
    record = {
        "device": "cpu",
        "training": {"hidden": 33, "batch_size": 32},
        "losses": {"reference": losses, "kernel": losses},
    }
    (out / "train-integration.json").write_text(json.dumps(record))
    rc, stdout, _ = run_cli(capsys, "figures")
    assert rc == 0
    assert (out / "figures" / "errors.png").stat().st_size > 0
    assert (out / "figures" / "losses.png").stat().st_size > 0
    assert "skipped bandwidth plot" in stdout


def test_bandwidth_figure_from_the_latest_benchmark(project, capsys):
    from rmsnorm_suite import bench

    rows = [
        {
            "provider": p,
            "shape": f"4096x{n}-bfloat16",
            "mode": mode,
            "dtype": "bfloat16",
            "group": "large",
            "status": "ok",
            "m": 4096,
            "n": n,
            "tbs": t,
        }
        for p, t in (("kernel", 3.0), ("native", 2.0))
        for mode in bench.MODES
        for n in (1024, 4096)
    ]
    folder = project / "outputs" / figures.BENCH_DIR
    folder.mkdir(parents=True)
    (folder / "bench-old.json").write_text("not json, and older")
    newest = folder / "bench-new.json"
    newest.write_text(
        json.dumps({"schema": 1, "results": rows, "copy": {"tbs": 4.0}, "machine": {"device": "test"}})
    )
    os.utime(folder / "bench-old.json", (1, 1))
    assert figures.latest_bench_json(project / "outputs") == newest
    rc, out, _ = run_cli(capsys, "figures")
    assert rc == 0, out
    assert f"from {newest.relative_to(project)}" in out
    assert (project / "outputs" / "figures" / "bandwidth.png").stat().st_size > 0


def test_bandwidth_figure_skipped_without_memory_bound_rows(project, capsys):
    """A benchmark of the launch-bound shapes only has nothing for the bandwidth plot: the figure
    is skipped with the reason, the others still drawn, and the command succeeds."""
    from rmsnorm_suite import bench

    rows = [
        {"provider": "kernel", "shape": "1x4096-bfloat16", "mode": mode, "dtype": "bfloat16", "group": "small",
         "status": "ok", "m": 1, "n": 4096, "tbs": 0.01}
        for mode in bench.MODES
    ]  # fmt: skip
    folder = project / "outputs" / figures.BENCH_DIR
    folder.mkdir(parents=True)
    (folder / "bench-small.json").write_text(json.dumps({"schema": 1, "results": rows, "copy": {"tbs": 4.0}}))
    rc, out, _ = run_cli(capsys, "figures")
    assert rc == 0, out
    assert "skipped bandwidth plot: no successful large/medium bfloat16 rows" in out
    assert not (project / "outputs" / "figures" / "bandwidth.png").exists()


@pytest.mark.skipif(
    HAS_CUDA or INTERPRET, reason="checks the message shown without CUDA and without the interpreter"
)
@pytest.mark.parametrize("command", ["check-forward", "exercise", "train-integration"])
def test_no_device_explains_the_interpreter(project, capsys, command):
    rc, _, err = run_cli(capsys, command)
    assert rc == 2
    assert f"TRITON_INTERPRET=1 rmsnorm-kernel {command}" in err


@pytest.mark.skipif(
    HAS_CUDA or INTERPRET, reason="checks the diagnosis shown without CUDA and without the interpreter"
)
def test_check_environment_diagnoses_a_missing_device(project, capsys):
    rc, out, _ = run_cli(capsys, "check-environment", "--json")
    assert rc == 1
    result = json.loads(out)
    assert result["passed"] is False
    assert any("TRITON_INTERPRET=1" in d for d in result["diagnosis"])


def test_check_checkpoints_without_checkpoints(project, capsys):
    rc, _, err = run_cli(capsys, "check-checkpoints")
    assert rc == 1 and "run train-integration first" in err


def test_table_format():
    text = console.format_table(["a", "bb"], [[1, "x"], ["long", 2.5]])
    assert text.splitlines() == ["a     bb", "----  ---", "1     x", "long  2.5"]


# ---------------------------------------------------------------------------------------------
# Commands that run the kernels on CPU (Triton interpreter)
# ---------------------------------------------------------------------------------------------

SMALL = "checks:\n  grid: shapes\n  shapes: [[3, 257], [1, 64]]\n  dtypes: [float32, float16]\n"


@pytest.mark.interpret
@requires_interpret
def test_check_environment_runs_a_real_kernel(project, capsys):
    rc, out, _ = run_cli(capsys, "check-environment", "--json")
    result = json.loads(out)
    assert rc == 0, result["diagnosis"]
    assert result["device"] == "cpu" and result["interpreter"] is True
    assert result["kernel_run"]["calls"] == {"forward": 1, "backward": 1, "fallback": 0}


@pytest.mark.interpret
@requires_interpret
@pytest.mark.parametrize("command", ["check-forward", "check-backward", "check-gamma"])
def test_check_grid_json_and_table(project, capsys, command):
    (project / "small.yaml").write_text(SMALL)
    rc, out, _ = run_cli(capsys, command, "--config", "small.yaml", "--json")
    result = json.loads(out)
    assert rc == 0, [c["reason"] for c in result["cases"] if not c["passed"]]
    assert len(result["cases"]) == 4
    assert [s["dtype"] for s in result["summary"]] == ["float32", "float16"]
    assert (project / "outputs" / f"{command}.json").is_file()
    rc, out, _ = run_cli(capsys, command, "--config", "small.yaml")
    assert rc == 0
    header = next(line.split() for line in out.splitlines() if line.startswith("dtype"))
    assert header[:2] == ["dtype", "cases"] and "tolerance" in header and header[-1] == "pass"
    assert out.strip().endswith(f"details in outputs/{command}.json")


@pytest.mark.interpret
@requires_interpret
def test_check_grid_fails_when_tolerance_is_tightened_below_the_error(project, capsys):
    """A config that tightens fp32's tolerance below the kernel's rounding differences (a few
    1e-7 on these rows) makes the grid fail: the command's exit status follows the cases."""
    (project / "tight.yaml").write_text(SMALL + "  tolerances: {float32: {atol: 1.0e-9, rtol: 0.0}}\n")
    rc, out, _ = run_cli(capsys, "check-forward", "--config", "tight.yaml", "--json")
    result = json.loads(out)
    assert rc == 1 and not result["passed"]
    assert {c["dtype"] for c in result["cases"] if not c["passed"]} == {"float32"}


@pytest.mark.interpret
@requires_interpret
def test_exercise(project, capsys):
    rc, out, _ = run_cli(capsys, "exercise", "--json")
    result = json.loads(out)
    assert rc == 0
    rows = {r["n"]: r for r in result["rows"]}
    assert rows[257]["defect_visible"] == {"forward": True, "backward": True}
    assert rows[256]["defect_visible"] == {"forward": False, "backward": False}
    assert rows[257]["kernel"]["y"] == pytest.approx(1 / math.sqrt(1 + EPS), abs=1e-7)
    assert rows[257]["wrong_block"]["y"] == pytest.approx(1.411458, abs=1e-6)
    assert rows[257]["wrong_block"]["mean"] == 0.501953125
    rc, out, _ = run_cli(capsys, "exercise")
    assert "wrong variant (/512)" in out and "cannot see the bug" in out


def _command_missing(monkeypatch, module_name: str) -> None:
    """A subcommand `ghost` whose run imports ``module_name``, which is not installed."""
    import types

    ghost = types.ModuleType("rmsnorm_suite_ghost")
    ghost.configure = lambda parser, name: None

    def run(args):
        raise ModuleNotFoundError(f"No module named {module_name!r}", name=module_name)

    ghost.run = run
    monkeypatch.setitem(sys.modules, "rmsnorm_suite_ghost", ghost)
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("rmsnorm_suite_ghost", "a command with a missing dependency"))


@pytest.mark.parametrize(
    "module_name, extra",
    [("matplotlib.pyplot", "bench"), ("asv", "bench"), ("transformers", "models"), ("scipy.stats", "suite")],
)
def test_a_missing_optional_dependency_names_its_extra_in_one_line(monkeypatch, capsys, module_name, extra):
    _command_missing(monkeypatch, module_name)
    assert cli.main(["ghost"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f'rmsnorm-kernel ghost: needs {module_name}: pip install "rmsnorm-kernel[{extra}]"'], err


def test_a_missing_module_of_no_extra_is_not_hidden(monkeypatch):
    _command_missing(monkeypatch, "no_such_module")
    with pytest.raises(ModuleNotFoundError):
        cli.main(["ghost"])


def test_every_extra_named_for_a_missing_module_is_declared():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the `suite` extra's tomli
        import tomli as tomllib

    declared = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert set(cli.EXTRA_OF.values()) <= set(declared["project"]["optional-dependencies"])
