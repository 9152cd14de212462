"""The mutation runner's configuration (config.toml beside this module): the cosmic-ray operators
and those left out, the targets with their floors and skipped code, the kill commands per device
and what each worker's copy of the tree holds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]  # the checkout
# Relative to the checkout, as are the catalogue's and the equivalence file's paths (the tests
# pass a toy project as the root).
CONFIG = Path("maintainer/mutation/config.toml")


class MutationError(ValueError):
    """A configuration or catalogue entry that cannot be used (named in the message)."""


def read_toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    file: str
    floor: float
    kill: str  # name of the kill command in [kill.<device>]
    definitions: tuple[str, ...]  # only mutants inside these functions (empty: all)
    skip_definitions: dict[str, str]  # function -> why it is not mutated
    skip_assignments: dict[str, str]  # module- or class-level name -> why (launch.Tuning fields, ...)
    gpu_only: dict[str, str]  # function -> why the interpreter cannot reach it


@dataclasses.dataclass(frozen=True)
class Config:
    operators: tuple[str, ...]  # regular expressions over cosmic-ray operator names
    excluded_operators: dict[str, str]
    targets: dict[str, Target]
    kill: dict[str, dict[str, list[dict[str, Any]]]]  # device -> name -> steps
    timeout_factor: float
    timeout_min_s: float
    tree: tuple[str, ...]  # what each worker's copy of the tree holds


def load_config(root: Path = ROOT, path: Path = CONFIG) -> Config:
    data = read_toml(root / path)
    ops = data.get("operators", {})
    targets = {}
    for name, t in data.get("targets", {}).items():
        for key in ("file", "floor", "kill"):
            if key not in t:
                raise MutationError(f"{path}: targets.{name} needs {key!r}")
        targets[name] = Target(
            name=name,
            file=t["file"],
            floor=float(t["floor"]),
            kill=t["kill"],
            definitions=tuple(t.get("definitions", ())),
            skip_definitions=dict(t.get("skip_definitions", {})),
            skip_assignments=dict(t.get("skip_assignments", {})),
            gpu_only=dict(t.get("gpu_only", {})),
        )
    run = data.get("run", {})
    config = Config(
        operators=tuple(ops.get("include", ())),
        excluded_operators=dict(ops.get("excluded", {})),
        targets=targets,
        kill=data.get("kill", {}),
        timeout_factor=float(run.get("timeout_factor", 5.0)),
        timeout_min_s=float(run.get("timeout_min_s", 60.0)),
        tree=tuple(run.get("tree", ("src", "tests", "pyproject.toml"))),
    )
    for device, commands in config.kill.items():
        for t in targets.values():
            if t.kill not in commands:
                raise MutationError(f"{path}: kill.{device} has no command {t.kill!r} (targets.{t.name})")
    return config
