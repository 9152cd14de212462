"""Walkthrough configuration: seeds, case grids, dtypes, tolerances, training sizes and output folders.

A config is a small YAML file: a path, or the name of one shipped beside this module (``minimum``,
``exercise``: ``configs/*.yaml``). Every key is optional and defaults to ``configs/minimum.yaml``;
shapes and dtypes default to :mod:`rmsnorm_suite.cases`. A config may tighten a tolerance, never
loosen one. Validation errors name the file and the key::

    ValueError: my.yaml: training.steps must be a positive integer, got -3
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import yaml

from rmsnorm_suite import cases

SHIPPED_CONFIGS = ("minimum", "exercise")  # package data of rmsnorm_suite: configs/NAME.yaml
DEFAULT_CONFIG = "minimum"
GRIDS = ("auto", "gpu", "gpu-wide", "interpret", "shapes")


@dataclass(frozen=True)
class Seeds:
    data: int = 0  # synthetic regression data and its splits
    model: int = 0  # network initialisation (shared by both paths)
    batches: int = 0  # order of the training batches
    checks: int = 0  # inputs of the case grids


@dataclass(frozen=True)
class ChecksConfig:
    grid: str = "auto"  # auto: cases.gpu_grid() on CUDA, cases.interpret_grid() under the interpreter
    shapes: tuple[tuple[int, int], ...] = ()  # (M, N) pairs, used when grid is "shapes"
    dtypes: tuple[torch.dtype, ...] = cases.DTYPES
    tolerances: dict[torch.dtype, cases.Tolerance] = field(default_factory=lambda: dict(cases.TOLERANCES))

    def grid_cases(self, device: str) -> list[tuple[int, int, torch.dtype]]:
        """(M, N, dtype) cases for this config on ``device`` ("cuda" or "cpu" under the interpreter)."""
        grid = self.grid
        if grid == "auto":
            grid = "gpu" if device == "cuda" else "interpret"
        if grid == "gpu":
            base = cases.gpu_grid()
        elif grid == "gpu-wide":
            base = cases.gpu_grid() + cases.gpu_wide_grid()
        elif grid == "interpret":
            base = cases.interpret_grid()
        else:
            base = [(m, n, d) for d in cases.DTYPES for m, n in self.shapes]
        return [(m, n, d) for m, n, d in base if d in self.dtypes]


@dataclass(frozen=True)
class DataConfig:
    features: int = 64
    train: int = 3200
    validation: int = 512
    test: int = 512
    noise: float = 0.05


@dataclass(frozen=True)
class TrainingSize:
    """The short variant used on CPU under the Triton interpreter."""

    steps: int = 100
    hidden: int = 33
    batch_size: int = 32


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-3
    hidden: int = 257
    resume_step: int = 50  # the interrupted run stops here and resumes from its checkpoint
    interpret: TrainingSize = TrainingSize()

    def for_device(self, device: str) -> TrainingConfig:
        """Full size on CUDA; the short variant on CPU (interpreter)."""
        if device == "cuda":
            return self
        short = self.interpret
        resume = min(self.resume_step, short.steps // 2) if short.steps > 1 else 0
        return dataclasses.replace(
            self, steps=short.steps, hidden=short.hidden, batch_size=short.batch_size, resume_step=resume
        )


@dataclass(frozen=True)
class ExerciseConfig:
    widths: tuple[int, ...] = (257, 256)
    value: float = 1.0


@dataclass(frozen=True)
class Config:
    source: str = "<defaults>"
    output_dir: str = "outputs"
    artifacts_dir: str = "artifacts"
    seeds: Seeds = Seeds()
    checks: ChecksConfig = ChecksConfig()
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()
    exercise: ExerciseConfig = ExerciseConfig()

    @property
    def outputs(self) -> Path:
        return Path(self.output_dir)

    @property
    def artifacts(self) -> Path:
        return Path(self.artifacts_dir)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready record of the config (dtypes as names)."""
        return _jsonable(dataclasses.asdict(self))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {_jsonable_key(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return cases.dtype_name(value)
    return value


def _jsonable_key(key: Any) -> str:
    return cases.dtype_name(key) if isinstance(key, torch.dtype) else str(key)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


class _Reader:
    """Reads one mapping, names the file and dotted key in every error, and rejects unknown keys."""

    def __init__(self, source: str, mapping: Any, prefix: str):
        self.source = source
        self.prefix = prefix
        if mapping is None:
            mapping = {}
        if not isinstance(mapping, dict):
            where = prefix.rstrip(".") or "the top level"
            self.fail(f"{where} must be a mapping, got {type(mapping).__name__} {mapping!r}")
        self.mapping = mapping
        self.used: set[str] = set()

    def fail(self, message: str) -> None:
        raise ValueError(f"{self.source}: {message}")

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def get(self, name: str, default: Any) -> Any:
        self.used.add(name)
        return self.mapping.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.mapping

    def section(self, name: str) -> _Reader:
        return _Reader(self.source, self.get(name, None), f"{self.prefix}{name}.")

    def int(self, name: str, default: int, minimum: int = 1) -> int:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            self.fail(f"{self.key(name)} must be {what}, got {value!r}")
        return value

    def float(self, name: str, default: float, *, positive: bool = True) -> float:
        value = self.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{self.key(name)} must be a number, got {value!r}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            self.fail(f"{self.key(name)} must be finite, got {value!r}")
        if positive and value <= 0:
            self.fail(f"{self.key(name)} must be > 0, got {value!r}")
        if not positive and value < 0:
            self.fail(f"{self.key(name)} must be >= 0, got {value!r}")
        return value

    def relative_dir(self, name: str, default: str) -> str:
        value = self.get(name, default)
        if not isinstance(value, str) or not value.strip():
            self.fail(f"{self.key(name)} must be a non-empty relative path, got {value!r}")
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or str(path) in (".", "") or "\\" in value:
            self.fail(
                f"{self.key(name)} must be a folder inside the project (relative, no '..', not '.'), "
                f"got {value!r}"
            )
        return str(path)

    def done(self) -> None:
        unknown = sorted(set(self.mapping) - self.used, key=str)
        if unknown:
            names = ", ".join(self.key(str(k)) for k in unknown)
            self.fail(f"unknown key {names}; expected one of {sorted(self.key(k) for k in self.used)}")


def _dtype_list(r: _Reader, name: str) -> tuple[torch.dtype, ...]:
    default = [cases.dtype_name(d) for d in cases.DTYPES]
    value = r.get(name, default)
    if not isinstance(value, list) or not value:
        r.fail(f"{r.key(name)} must be a non-empty list of dtype names, got {value!r}")
    out = []
    for item in value:
        if item not in cases.DTYPE_NAMES:
            r.fail(f"{r.key(name)} has unknown dtype {item!r}; expected some of {sorted(cases.DTYPE_NAMES)}")
        dtype = cases.DTYPE_NAMES[item]
        if dtype in out:
            r.fail(f"{r.key(name)} lists {item!r} twice")
        out.append(dtype)
    return tuple(out)


def _shapes(r: _Reader, name: str) -> tuple[tuple[int, int], ...]:
    value = r.get(name, [])
    if not isinstance(value, list):
        r.fail(f"{r.key(name)} must be a list of [M, N] pairs, got {value!r}")
    out = []
    for i, item in enumerate(value):
        ok = (
            isinstance(item, list)
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            and item[0] >= 0
            and item[1] >= 1
        )
        if not ok:
            r.fail(f"{r.key(name)}[{i}] must be [M, N] with integers M >= 0 and N >= 1, got {item!r}")
        out.append((item[0], item[1]))
    return tuple(out)


def _tolerances(r: _Reader, dtypes: tuple[torch.dtype, ...]) -> dict[torch.dtype, cases.Tolerance]:
    section = r.section("tolerances")
    out = dict(cases.TOLERANCES)
    for name in list(section.mapping):
        if name not in cases.DTYPE_NAMES:
            section.fail(
                f"{section.key(str(name))} is not a dtype; expected some of {sorted(cases.DTYPE_NAMES)}"
            )
        dtype = cases.DTYPE_NAMES[name]
        declared = cases.TOLERANCES[dtype]
        tol = section.section(name)
        atol = tol.float("atol", declared.atol)
        rtol = tol.float("rtol", declared.rtol, positive=False)
        tol.done()
        for key, value, limit in (("atol", atol, declared.atol), ("rtol", rtol, declared.rtol)):
            if value > limit:
                tol.fail(
                    f"{tol.key(key)} = {value!r} is looser than the declared {limit!r} "
                    f"(rmsnorm_suite.cases.TOLERANCES); a config may tighten a tolerance, never loosen it"
                )
        out[dtype] = cases.Tolerance(atol=atol, rtol=rtol)
    return out


def parse_config(mapping: Any, source: str = "<config>") -> Config:
    """Validate a mapping (parsed YAML) into a :class:`Config`; errors name ``source`` and the key."""
    top = _Reader(source, mapping, "")
    output_dir = top.relative_dir("output_dir", Config.output_dir)
    artifacts_dir = top.relative_dir("artifacts_dir", Config.artifacts_dir)
    if output_dir == artifacts_dir:
        top.fail(f"output_dir and artifacts_dir must differ, both are {output_dir!r}")

    s = top.section("seeds")
    seeds = Seeds(**{f.name: s.int(f.name, f.default, minimum=0) for f in dataclasses.fields(Seeds)})
    s.done()

    c = top.section("checks")
    grid = c.get("grid", "auto")
    if grid not in GRIDS:
        c.fail(f"checks.grid must be one of {list(GRIDS)}, got {grid!r}")
    shapes = _shapes(c, "shapes")
    if grid == "shapes" and not shapes:
        c.fail("checks.shapes must list at least one [M, N] pair when checks.grid is 'shapes'")
    if grid != "shapes" and shapes:
        c.fail(f"checks.shapes is only used with checks.grid: shapes, but checks.grid is {grid!r}")
    dtypes = _dtype_list(c, "dtypes")
    tolerances = _tolerances(c, dtypes)
    c.done()
    checks = ChecksConfig(grid=grid, shapes=shapes, dtypes=dtypes, tolerances=tolerances)

    d = top.section("data")
    data = DataConfig(
        features=d.int("features", DataConfig.features),
        train=d.int("train", DataConfig.train),
        validation=d.int("validation", DataConfig.validation),
        test=d.int("test", DataConfig.test),
        noise=d.float("noise", DataConfig.noise, positive=False),
    )
    d.done()

    t = top.section("training")
    steps = t.int("steps", TrainingConfig.steps)
    batch_size = t.int("batch_size", TrainingConfig.batch_size)
    lr = t.float("lr", TrainingConfig.lr)
    hidden = t.int("hidden", TrainingConfig.hidden)
    resume_step = t.int("resume_step", TrainingConfig.resume_step)
    if resume_step >= steps:
        t.fail(f"training.resume_step must be smaller than training.steps ({steps}), got {resume_step}")
    i = t.section("interpret")
    short = TrainingSize(
        steps=i.int("steps", TrainingSize.steps),
        hidden=i.int("hidden", TrainingSize.hidden),
        batch_size=i.int("batch_size", TrainingSize.batch_size),
    )
    i.done()
    t.done()
    for key, size in (
        ("training.batch_size", batch_size),
        ("training.interpret.batch_size", short.batch_size),
    ):
        if size > data.train:
            top.fail(f"{key} must not exceed data.train ({data.train}), got {size}")
    training = TrainingConfig(
        steps=steps, batch_size=batch_size, lr=lr, hidden=hidden, resume_step=resume_step, interpret=short
    )

    e = top.section("exercise")
    widths = e.get("widths", list(ExerciseConfig.widths))
    if (
        not isinstance(widths, list)
        or not widths
        or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths)
    ):
        e.fail(f"exercise.widths must be a non-empty list of positive integers, got {widths!r}")
    exercise = ExerciseConfig(widths=tuple(widths), value=e.float("value", ExerciseConfig.value))
    e.done()

    top.done()
    return Config(
        source=source,
        output_dir=output_dir,
        artifacts_dir=artifacts_dir,
        seeds=seeds,
        checks=checks,
        data=data,
        training=training,
        exercise=exercise,
    )


def config_path(name_or_path: str | Path) -> Path:
    """A shipped config by name (``minimum``, ``exercise``: found through the package, not the working
    directory), or any other YAML file by its path."""
    if str(name_or_path) in SHIPPED_CONFIGS:
        return Path(str(resources.files("rmsnorm_suite").joinpath("configs", f"{name_or_path}.yaml")))
    return Path(name_or_path)


def load_config(path: str | Path = DEFAULT_CONFIG) -> Config:
    """Read and validate a YAML config file, given by its path or a shipped config's name."""
    path = config_path(path)
    if not path.is_file():
        raise ValueError(
            f"--config: no such file {str(path)!r} (pass a YAML file, or one of the shipped configs: "
            f"{', '.join(SHIPPED_CONFIGS)})"
        )
    try:
        mapping = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(mapping, source=str(path))
