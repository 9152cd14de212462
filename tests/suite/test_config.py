"""Walkthrough configs: the shipped YAML files load, and every invalid value is refused with an
error that names the file and the key."""

import json
from pathlib import Path

import pytest
import torch

from rmsnorm_suite import cases
from rmsnorm_suite.config import (
    DEFAULT_CONFIG,
    SHIPPED_CONFIGS,
    Config,
    TrainingConfig,
    load_config,
    parse_config,
)

ROOT = Path(__file__).resolve().parents[2]
SRC = "configs/test.yaml"


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_shipped_configs_load(name):
    cfg = load_config(name)  # found through the package, from any working directory
    assert cfg.source.endswith(f"{name}.yaml")
    json.dumps(cfg.to_dict())  # JSON-ready record


def test_minimum_yaml_states_the_defaults():
    """The shipped configs/minimum.yaml spells out the built-in defaults: the two may not drift apart."""
    cfg = load_config(DEFAULT_CONFIG)
    assert cfg.to_dict() | {"source": ""} == Config().to_dict() | {"source": ""}


def test_defaults_come_from_cases():
    cfg = parse_config({}, SRC)
    assert cfg.checks.dtypes == cases.DTYPES
    assert cfg.checks.tolerances == cases.TOLERANCES
    assert cfg.training.steps == 100 and cfg.training.batch_size == 32


# (config mapping, the message it must raise, after "configs/test.yaml: ")
BAD = [
    ({"training": {"steps": -3}}, "training.steps must be a positive integer, got -3"),
    ({"training": {"steps": 0}}, "training.steps must be a positive integer, got 0"),
    ({"training": {"steps": "100"}}, "training.steps must be a positive integer, got '100'"),
    ({"training": {"steps": True}}, "training.steps must be a positive integer, got True"),
    ({"training": {"steps": 2.5}}, "training.steps must be a positive integer, got 2.5"),
    ({"training": {"lr": 0}}, "training.lr must be > 0, got 0.0"),
    ({"training": {"lr": "fast"}}, "training.lr must be a number, got 'fast'"),
    ({"training": {"lr": float("nan")}}, "training.lr must be finite"),
    ({"training": {"stepz": 5}}, "unknown key training.stepz"),
    ({"training": {"resume_step": 100}}, "training.resume_step must be smaller than training.steps (100)"),
    ({"training": {"batch_size": 5000}}, "training.batch_size must not exceed data.train (3200)"),
    ({"training": {"interpret": {"hidden": 0}}}, "training.interpret.hidden must be a positive integer"),
    ({"training": {"interpret": {"fast": 1}}}, "unknown key training.interpret.fast"),
    ({"training": [1, 2]}, "training must be a mapping, got list"),
    ({"bogus": 1}, "unknown key bogus"),
    ({"seeds": {"data": -1}}, "seeds.data must be an integer >= 0, got -1"),
    ({"seeds": {"dat": 1}}, "unknown key seeds.dat"),
    ({"data": {"noise": -0.1}}, "data.noise must be >= 0, got -0.1"),
    ({"data": {"features": 0}}, "data.features must be a positive integer, got 0"),
    ({"checks": {"grid": "huge"}}, "checks.grid must be one of"),
    ({"checks": {"grid": "shapes"}}, "checks.shapes must list at least one [M, N] pair"),
    ({"checks": {"grid": "shapes", "shapes": [[1]]}}, "checks.shapes[0] must be [M, N]"),
    ({"checks": {"grid": "shapes", "shapes": [[1, 0]]}}, "checks.shapes[0] must be [M, N]"),
    ({"checks": {"shapes": [[1, 8]]}}, "checks.shapes is only used with checks.grid: shapes"),
    ({"checks": {"dtypes": []}}, "checks.dtypes must be a non-empty list of dtype names"),
    ({"checks": {"dtypes": ["float64"]}}, "checks.dtypes has unknown dtype 'float64'"),
    ({"checks": {"dtypes": ["float32", "float32"]}}, "checks.dtypes lists 'float32' twice"),
    (
        {"checks": {"tolerances": {"float32": {"atol": 1e-3}}}},
        "checks.tolerances.float32.atol = 0.001 is looser",
    ),
    (
        {"checks": {"tolerances": {"float16": {"rtol": 0.1}}}},
        "checks.tolerances.float16.rtol = 0.1 is looser",
    ),
    ({"checks": {"tolerances": {"float64": {"atol": 1e-9}}}}, "checks.tolerances.float64 is not a dtype"),
    ({"checks": {"tolerances": {"float32": {"tol": 1e-9}}}}, "unknown key checks.tolerances.float32.tol"),
    ({"output_dir": "/etc"}, "output_dir must be a folder inside the project"),
    ({"output_dir": "../elsewhere"}, "output_dir must be a folder inside the project"),
    ({"output_dir": "."}, "output_dir must be a folder inside the project"),
    ({"artifacts_dir": ""}, "artifacts_dir must be a non-empty relative path"),
    ({"output_dir": "same", "artifacts_dir": "same"}, "output_dir and artifacts_dir must differ"),
    ({"exercise": {"widths": [0]}}, "exercise.widths must be a non-empty list of positive integers"),
    ({"exercise": {"value": -1}}, "exercise.value must be > 0"),
    ([1, 2], "the top level must be a mapping"),
]


@pytest.mark.parametrize("mapping, message", BAD, ids=[m for _, m in BAD])
def test_invalid_config_names_the_key(mapping, message):
    with pytest.raises(ValueError) as info:
        parse_config(mapping, SRC)
    assert str(info.value).startswith(f"{SRC}: ")
    assert message in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="--config: no such file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    neg = tmp_path / "neg.yaml"
    neg.write_text("training:\n  steps: -3\n")
    with pytest.raises(ValueError, match=r"neg.yaml: training.steps must be a positive integer, got -3"):
        load_config(neg)


def test_empty_file_means_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(empty).to_dict() | {"source": ""} == Config().to_dict() | {"source": ""}


def test_tolerance_may_be_tightened():
    cfg = parse_config({"checks": {"tolerances": {"float32": {"atol": 1e-6}}}}, SRC)
    tol = cfg.checks.tolerances[torch.float32]
    assert tol.atol == 1e-6 and tol.rtol == cases.TOLERANCES[torch.float32].rtol
    assert cfg.checks.tolerances[torch.float16] == cases.TOLERANCES[torch.float16]


# (config checks section, device, expected grid)
GRIDS = [
    ({}, "cuda", cases.gpu_grid()),
    ({}, "cpu", cases.interpret_grid()),
    ({"grid": "interpret"}, "cuda", cases.interpret_grid()),
    ({"grid": "gpu-wide"}, "cuda", cases.gpu_grid() + cases.gpu_wide_grid()),
    ({"dtypes": ["bfloat16"]}, "cuda", [c for c in cases.gpu_grid() if c[2] == torch.bfloat16]),
    (
        {"grid": "shapes", "shapes": [[3, 257]], "dtypes": ["float32", "float16"]},
        "cpu",
        [(3, 257, torch.float32), (3, 257, torch.float16)],
    ),
]


@pytest.mark.parametrize("section, device, expected", GRIDS)
def test_grid_selection(section, device, expected):
    assert parse_config({"checks": section}, SRC).checks.grid_cases(device) == expected


def test_gpu_grid_is_the_tutorials_72_cases():
    assert len(parse_config({}, SRC).checks.grid_cases("cuda")) == 72


def test_training_size_per_device():
    t = parse_config({"training": {"interpret": {"steps": 40, "hidden": 17}}}, SRC).training
    assert t.for_device("cuda") == t
    short = t.for_device("cpu")
    assert (short.steps, short.hidden, short.resume_step) == (40, 17, 20)
    assert short.lr == t.lr
    assert TrainingConfig().for_device("cpu").resume_step == 50
