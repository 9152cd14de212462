"""Mutation testing of the production code: how much of what a bug does the suite kills.

cosmic-ray enumerates and applies the mutants (its operators, its parse trees, its session
database); this module chooses them, runs a fast kill command against each and writes the
report. Two kinds of mutant, both run the same way:

* cosmic-ray's operators (mutation/config.toml says which, and why the others are left out)
  over the targets: kernels.py, launch.py, ops.py and the gate's judgement functions;
* the seed-004 failure catalogue (mutation/catalogue.toml): hand-written patches of the kernels,
  one per failure mode and kernel path. A patch whose old text does not occur exactly once is an
  error, never a skip.

Each worker mutates its own copy of the tree (the checkout is never touched), so Triton's JIT,
which reads a kernel's source from disk, compiles the mutant. A session database
(``<out>/session-<device>.sqlite``, cosmic-ray's WorkDB plus a timing table) makes a run
resumable: ``--budget-s`` stops cleanly, the next run with the same arguments continues.

    python -m rmsnorm_suite.mutation run --device cpu --sample 40 --seed 1 --budget-s 3000
    python -m rmsnorm_suite.mutation run --device gpu --definition _rsqrt_newton --out .mutation/newton
    python -m rmsnorm_suite.mutation report --session .mutation/session-cpu.sqlite

Why one module of ~1K lines: configuration, enumeration, execution and the report share the
session database and its records, and one command line runs them in order; the section rules
below mark where it would split.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import difflib
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path("mutation/config.toml")
CATALOGUE = Path("mutation/catalogue.toml")
EQUIVALENT = Path("mutation/equivalent.toml")
DEFAULT_OUT = Path(".mutation")
DEFAULT_REPORT = Path("docs/mutation.md")
CATALOGUE_OPERATOR = "catalogue"  # operator name of catalogue patches in the session database
CONFIDENCE = 0.95


class MutationError(ValueError):
    """A configuration or catalogue entry that cannot be used (named in the message)."""


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    file: str
    floor: float
    kill: str  # name of the kill command in [kill.<device>]
    definitions: tuple[str, ...]  # only mutants inside these functions (empty: all)
    skip_definitions: dict[str, str]  # function -> why it is not mutated
    skip_assignments: dict[str, str]  # module-level name -> why (launch tuning, ...)
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
    data = tomllib.loads((root / path).read_text(encoding="utf-8"))
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


@dataclasses.dataclass(frozen=True)
class Patch:
    """One seed-004 failure mode written as a patch of a production file on one kernel path."""

    id: str
    failure: str
    path: str  # kernel path: tile, two-walk, wide, cooperative, EVEN, ...
    file: str
    old: str
    new: str
    gpu_only: bool = False


def load_catalogue(root: Path = ROOT, path: Path = CATALOGUE) -> list[Patch]:
    data = tomllib.loads((root / path).read_text(encoding="utf-8"))
    patches, seen = [], set()
    for i, entry in enumerate(data.get("patch", [])):
        missing = [k for k in ("id", "failure", "path", "file", "old", "new") if k not in entry]
        if missing:
            raise MutationError(f"{path}: patch #{i + 1} lacks {', '.join(missing)}")
        if entry["id"] in seen:
            raise MutationError(f"{path}: patch id {entry['id']!r} appears twice")
        if entry["old"] == entry["new"]:
            raise MutationError(f"{path}: patch {entry['id']!r} changes nothing")
        seen.add(entry["id"])
        patches.append(Patch(**{k: entry[k] for k in Patch.__dataclass_fields__ if k in entry}))
    return patches


def apply_patch(text: str, patch: Patch) -> str:
    """``text`` with the patch applied; MutationError unless its old text occurs exactly once."""
    count = text.count(patch.old)
    if count != 1:
        raise MutationError(
            f"catalogue patch {patch.id!r} ({patch.file}): its old text occurs {count} times, "
            "not once; the production code changed, so the patch must be rewritten"
        )
    return text.replace(patch.old, patch.new, 1)


def check_catalogue(patches: list[Patch], root: Path = ROOT) -> None:
    """Every patch applies exactly once to the current files (MutationError naming the first that
    does not) and leaves valid Python."""
    for patch in patches:
        patched = apply_patch((root / patch.file).read_text(encoding="utf-8"), patch)
        try:
            compile(patched, patch.file, "exec")
        except SyntaxError as exc:
            raise MutationError(f"catalogue patch {patch.id!r} leaves invalid Python: {exc}") from exc


def load_equivalent(root: Path = ROOT, path: Path = EQUIVALENT) -> dict[str, dict[str, str]]:
    """Survivors argued equivalent: mutant key -> {why, mutant, and the mutant's description
    (DESCRIPTION)}; ``equivalent = false`` marks a known gap that is explained but still counts
    against the score."""
    if not (root / path).exists():
        return {}
    data = tomllib.loads((root / path).read_text(encoding="utf-8"))
    return {e["key"]: e for e in data.get("mutant", [])}


# What an equivalence entry records of its mutant, so that a key that comes to name another
# mutant is caught: a key hashes the line's text, not its place, and the same line twice in one
# function is told apart only by its order (``-1``, ``-2``), which an edit above it can change.
DESCRIPTION = ("file", "operator", "definition", "source", "mutated", "after")


# ---------------------------------------------------------------------------------------------
# Mutants
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mutant:
    target: str
    file: str
    operator: str
    occurrence: int
    line: int  # 1-based
    col: int
    end: tuple[int, int]
    definition: str | None
    key: str  # stable across unrelated edits: file, operator, function, line text, column
    gpu_only: bool = False


def operator_names(patterns: tuple[str, ...]) -> list[str]:
    import cosmic_ray.plugins

    compiled = [re.compile(p) for p in patterns]
    return [n for n in cosmic_ray.plugins.operator_names() if any(c.fullmatch(n) for c in compiled)]


def _assignment_lines(source: str, names: dict[str, str]) -> dict[int, str]:
    """Lines of the module-level assignments to ``names``: line -> name."""
    import ast

    lines = {}
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Name) and t.id in names:
                lines.update({n: t.id for n in range(node.lineno, node.end_lineno + 1)})
    found = set(lines.values())
    missing = sorted(set(names) - found)
    if missing:
        raise MutationError(f"skip_assignments name no module-level assignment: {', '.join(missing)}")
    return lines


def mutant_key(file: str, operator: str, definition: str | None, line_text: str, col: int, k: int) -> str:
    raw = "|".join([file, operator, definition or "", line_text.strip(), str(col), str(k)])
    return hashlib.sha1(raw.encode()).hexdigest()[:10]


def enumerate_mutants(config: Config, root: Path = ROOT) -> tuple[list[Mutant], dict[str, dict[str, int]]]:
    """Every mutant of the configured operators in the targets, in cosmic-ray's occurrence
    numbering, less the skipped functions and assignments; and per target the counts skipped."""
    import cosmic_ray.plugins
    from cosmic_ray.ast import ast_nodes, get_ast
    from cosmic_ray.ast.ast_query import ASTQuery

    names = operator_names(config.operators)
    mutants: list[Mutant] = []
    skipped: dict[str, dict[str, int]] = {}
    for target in config.targets.values():
        source = (root / target.file).read_text(encoding="utf-8")
        source_lines = source.splitlines()
        tuning = _assignment_lines(source, target.skip_assignments)
        counts = {"definition": 0, "assignment": 0, "outside": 0}
        nodes = list(ast_nodes(get_ast(source)))  # the operators only read the tree
        keys: dict[str, int] = {}
        for name in names:
            operator = cosmic_ray.plugins.get_operator(name)()
            positions = [(n, s, e) for n in nodes for s, e in operator.mutation_positions(n)]
            seen: dict[tuple, int] = {}
            for occurrence, (node, start, end) in enumerate(positions):
                definition = ASTQuery(node).get_definition_name()
                k = seen.get(start, 0)
                seen[start] = k + 1
                if definition in target.skip_definitions:
                    counts["definition"] += 1
                    continue
                if start[0] in tuning:
                    counts["assignment"] += 1
                    continue
                if target.definitions and definition not in target.definitions:
                    counts["outside"] += 1
                    continue
                key = mutant_key(target.file, name, definition, source_lines[start[0] - 1], start[1], k)
                repeat = keys.get(key, 0)  # the same line twice in one function: numbered in order
                keys[key] = repeat + 1
                key = f"{key}-{repeat}" if repeat else key
                mutants.append(
                    Mutant(target.name, target.file, name, occurrence, start[0], start[1], end, definition, key,
                           definition in target.gpu_only)
                )  # fmt: skip
        skipped[target.name] = counts
    return mutants, skipped


def describe_mutant(m: Mutant, root: Path = ROOT) -> dict[str, str]:
    """The mutant as an equivalence entry records it (DESCRIPTION): its file, operator and
    function; its line before and after the mutation; and the next non-blank line of the file,
    which tells apart the same line written twice in one function."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    original = (root / m.file).read_text(encoding="utf-8")
    lines = original.splitlines()
    mutated = mutate_code(original, cosmic_ray.plugins.get_operator(m.operator)(), m.occurrence)
    after = next((ln.strip() for ln in lines[m.line :] if ln.strip()), "")
    return {
        "file": m.file, "operator": m.operator, "definition": m.definition or "",
        "source": lines[m.line - 1].strip(), "mutated": mutated.splitlines()[m.line - 1].strip(), "after": after,
    }  # fmt: skip


def equivalence_problems(
    config: Config, equivalent: dict[str, dict[str, str]], root: Path = ROOT
) -> dict[str, str]:
    """Entries of mutation/equivalent.toml whose key names no mutant of the population the
    config draws (every device), or one other than the entry describes: key -> what is wrong.
    Such an entry argues about code that is no longer there, so it must not excuse a survivor."""
    mutants, _ = enumerate_mutants(config, root)
    by_key = {m.key: m for m in mutants}
    problems = {}
    for key, entry in equivalent.items():
        m = by_key.get(key)
        if m is None:
            problems[key] = "names no mutant of the population the committed config draws"
            continue
        now = describe_mutant(m, root)
        wrong = [f for f in DESCRIPTION if entry.get(f) != now[f]]
        if wrong:
            problems[key] = (
                f"now names the mutant at {m.file}:{m.line} ({m.definition}), not the one described: "
                + "; ".join(f"{f} is {now[f]!r}, the entry says {entry.get(f)!r}" for f in wrong)
            )
    return problems


def current_equivalent(config: Config, equivalent: dict[str, dict[str, str]], root: Path = ROOT, log=print):
    """``equivalent`` less the entries equivalence_problems finds, each reported through ``log``."""
    problems = equivalence_problems(config, equivalent, root) if equivalent else {}
    for key, problem in problems.items():
        log(f"mutation/equivalent.toml: {key} {problem}; not counted as equivalent")
    return {k: v for k, v in equivalent.items() if k not in problems}


def restrict_to_definitions(config: Config, names: list[str], root: Path = ROOT) -> Config:
    """The targets that define any of ``names`` (functions), each mutated only inside those: for
    a run over a few functions, such as the GPU-only ones. A name no target mutates is an error."""
    import ast

    targets, found = {}, set()
    for t in config.targets.values():
        tree = ast.parse((root / t.file).read_text(encoding="utf-8"))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        mutated = {
            n for n in defined if n not in t.skip_definitions and (not t.definitions or n in t.definitions)
        }
        chosen = tuple(n for n in names if n in mutated)
        found |= set(chosen)
        if chosen:
            targets[t.name] = dataclasses.replace(t, definitions=chosen)
    missing = [n for n in names if n not in found]
    if missing:
        raise MutationError(f"--definition: no target mutates a function named {', '.join(missing)}")
    return dataclasses.replace(config, targets=targets)


def sample(mutants: list[Mutant], per_target: int | None, seed: int) -> list[Mutant]:
    """At most ``per_target`` mutants of each target, drawn without replacement by ``seed``
    (the same arguments draw the same sample); None: all."""
    if per_target is None:
        return list(mutants)
    chosen = []
    by_target: dict[str, list[Mutant]] = {}
    for m in mutants:
        by_target.setdefault(m.target, []).append(m)
    for name in sorted(by_target):
        group = sorted(by_target[name], key=lambda m: (m.operator, m.occurrence))
        rng = random.Random(f"{seed}:{name}")
        chosen += group if len(group) <= per_target else rng.sample(group, per_target)
    return chosen


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def wilson_interval(killed: int, total: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of the proportion killed/total (0..1); (0, 1) when total is 0."""
    if not 0 <= killed <= total:
        raise ValueError(f"killed must be in 0..total, got {killed} of {total}")
    if total == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = killed / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass
class Score:
    target: str
    file: str
    floor: float
    population: int  # mutants of the configured operators this device can run
    planned: int  # in the session (the sample)
    run: int = 0
    killed: int = 0
    equivalent: int = 0  # survivors argued equivalent (mutation/equivalent.toml)
    incompetent: int = 0  # did not compile (Triton): neither killed nor survived, not counted

    @property
    def non_equivalent(self) -> int:
        return self.run - self.equivalent

    @property
    def percent(self) -> float | None:
        return 100.0 * self.killed / self.non_equivalent if self.non_equivalent else None

    @property
    def interval(self) -> tuple[float, float]:
        lo, hi = wilson_interval(self.killed, self.non_equivalent)
        return 100 * lo, 100 * hi

    @property
    def below_floor(self) -> bool:
        return self.percent is not None and self.percent < self.floor


def floor_failures(scores: list[Score]) -> list[str]:
    return [
        f"{s.file}: {s.percent:.1f}% killed, below its floor of {s.floor:g}%" for s in scores if s.below_floor
    ]


# ---------------------------------------------------------------------------------------------
# Session database: cosmic-ray's WorkDB, plus the run's metadata and per-mutant times
# ---------------------------------------------------------------------------------------------


def _open_db(path: Path):
    from cosmic_ray.work_db import WorkDB

    db = WorkDB(str(path), WorkDB.Mode.create)
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE IF NOT EXISTS mutation_meta (key TEXT PRIMARY KEY, value TEXT)")
        con.execute(
            "CREATE TABLE IF NOT EXISTS mutation_timing (job_id TEXT PRIMARY KEY, seconds REAL, note TEXT)"
        )
    return db


def read_meta(path: Path) -> dict[str, Any]:
    with sqlite3.connect(path) as con:
        return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM mutation_meta")}


def _write_meta(path: Path, meta: dict[str, Any]) -> None:
    with sqlite3.connect(path) as con:
        con.executemany(
            "INSERT OR REPLACE INTO mutation_meta VALUES (?, ?)",
            [(k, json.dumps(v)) for k, v in meta.items()],
        )


def read_timings(path: Path) -> dict[str, tuple[float, str]]:
    with sqlite3.connect(path) as con:
        return {j: (s, n) for j, s, n in con.execute("SELECT job_id, seconds, note FROM mutation_timing")}


def _file_hashes(root: Path, files: set[str]) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:16] for f in sorted(files)}


def reopen_survivors(path: Path) -> int:
    """Make the session's survivors pending again (their results dropped, their times kept until
    the new run replaces them): for a rerun once new kill tests exist. Returns how many."""
    with sqlite3.connect(path) as con:
        rows = con.execute("SELECT job_id FROM work_results WHERE test_outcome = 'SURVIVED'").fetchall()
        con.execute("DELETE FROM work_results WHERE test_outcome = 'SURVIVED'")
    retried = read_meta(path).get("retried", [])
    _write_meta(path, {"retried": sorted(set(retried) | {j for (j,) in rows})})  # the report names them
    return len(rows)


def cosmic_ray_version() -> str:
    """The installed cosmic-ray's version: its operators draw the population, so a published
    population is redrawn with this version (requirements/constraints.txt pins it)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("cosmic-ray")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _head_commit(root: Path) -> str:
    """The checkout's commit, with ``+changes`` where a tracked file differs from it; "" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f"{head}+changes" if dirty else head


def _job_id(kind: str, key: str) -> str:
    return f"{kind}-{key}"


def init_session(
    path: Path, config: Config, patches: list[Patch], device: str, per_target: int | None, seed: int,
    root: Path = ROOT, confined: list[str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Create the session (or check that an existing one matches these arguments and sources:
    a resumed run must mutate the same code) and return its metadata. ``confined``: the
    functions a --definition run is confined to (None: not confined)."""
    from cosmic_ray.work_item import MutationSpec, WorkItem

    files = {t.file for t in config.targets.values()} | {p.file for p in patches}
    hashes = _file_hashes(root, files)
    wanted = {
        "device": device, "sample": per_target, "seed": seed, "hashes": hashes,
        "targets": sorted(config.targets), "patch_ids": sorted(p.id for p in patches),
        "confined": sorted(confined) if confined else None,
        # what else draws the population: the config's operators and skips, cosmic-ray's operators
        "config": _file_hashes(root, {CONFIG.as_posix()})[CONFIG.as_posix()],
        "cosmic_ray": cosmic_ray_version(),
    }  # fmt: skip
    if path.exists():
        meta = read_meta(path)
        if {k: meta.get(k) for k in wanted} != wanted:
            raise MutationError(
                f"{path} was made for { ({k: meta.get(k) for k in wanted}) }, not {wanted}: "
                "the sources or arguments changed; start afresh with --fresh"
            )
        return meta
    check_catalogue(patches, root)
    mutants, skipped = enumerate_mutants(config, root)
    runnable = [m for m in mutants if device == "gpu" or not m.gpu_only]
    chosen = sample(runnable, per_target, seed)
    items = []
    for m in chosen:
        spec = MutationSpec(m.file, m.operator, m.occurrence, (m.line, m.col), m.end, {}, m.definition)
        items.append(WorkItem.single(_job_id("op", m.key), spec))
    patch_rows = []
    for p in patches:
        if device == "cpu" and p.gpu_only:
            continue
        text = (root / p.file).read_text(encoding="utf-8")
        line = text[: text.index(p.old)].count("\n") + 1
        spec = MutationSpec(p.file, CATALOGUE_OPERATOR, 0, (line, 0), (line, 1), {"id": p.id}, p.path)
        items.append(WorkItem.single(_job_id("cat", p.id), spec))
        patch_rows.append(p.id)
    db = _open_db(path)
    try:
        db.clear()
        db.add_work_items(items)
    finally:
        db.close()
    population = {t: sum(m.target == t for m in runnable) for t in config.targets}
    meta = {
        **wanted,
        "population": population,
        "gpu_only": {t: sum(m.target == t and m.gpu_only for m in mutants) for t in config.targets},
        "skipped": skipped,
        "mutants": {m.key: dataclasses.asdict(m) for m in chosen},
        "patches": patch_rows,
        "operators": operator_names(config.operators),
        "elapsed_s": 0.0,
        "commit": _head_commit(root),
        "started": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    _write_meta(path, meta)
    return meta


# ---------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------


def kill_steps(config: Config, device: str, name: str) -> list[dict[str, Any]]:
    return config.kill[device][name]


def _step_env(tree: Path, step: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree / "src"), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if step.get("interpret"):
        env["TRITON_INTERPRET"] = "1"
    return env


def run_kill(
    tree: Path, steps: list[dict[str, Any]], timeout: float, stop: threading.Event
) -> tuple[str, str]:
    """Run the kill command's pytest steps in ``tree``: ("killed" | "survived" | "timeout" |
    "stopped", output tail). A step that fails kills the mutant; later steps are not run."""
    deadline = time.monotonic() + timeout
    tail = ""
    for step in steps:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *step["args"]]
        proc = subprocess.Popen(
            cmd, cwd=tree, env=_step_env(tree, step), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        while True:
            try:
                out, _ = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop.is_set() or time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
                    return ("stopped" if stop.is_set() else "timeout"), tail
        tail = (tail + out.decode("utf-8", "replace")[-2000:])[-6000:]
        if proc.returncode != 0:
            return "killed", tail
    return "survived", tail


def make_tree(root: Path, dest: Path, entries: tuple[str, ...]) -> Path:
    """A copy of the parts of the tree the kill commands need (never the checkout itself)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")
    for entry in entries:
        src = root / entry
        if src.is_dir():
            shutil.copytree(src, dest / entry, ignore=ignore)
        elif src.exists():
            (dest / entry).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / entry)
    return dest


def mutated_text(original: str, spec, patches: dict[str, Patch]) -> str | None:
    """The file's text with the work item's mutation applied; None where cosmic-ray finds no
    mutation at that occurrence (the source changed under the session)."""
    if spec.operator_name == CATALOGUE_OPERATOR:
        return apply_patch(original, patches[spec.operator_args["id"]])
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    return mutate_code(original, cosmic_ray.plugins.get_operator(spec.operator_name)(), spec.occurrence)


def _diff(original: str, mutated: str, file: str) -> str:
    lines = difflib.unified_diff(
        original.splitlines(), mutated.splitlines(), f"a/{file}", f"b/{file}", lineterm="", n=0
    )
    return "\n".join(lines)


def execute(
    path: Path, config: Config, patches: list[Patch], device: str, workers: int, budget_s: float | None,
    root: Path = ROOT, work_dir: Path | None = None, log=print,
) -> dict[str, int]:  # fmt: skip
    """Run the session's pending work items until done or out of budget; returns counts."""
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    target_of = {t.file: t for t in config.targets.values()}
    patch_by_id = {p.id: p for p in patches}
    db = _open_db(path)
    pending = sorted(db.pending_work_items, key=lambda w: w.job_id)
    counts = {"pending": len(pending), "done": 0, "killed": 0, "survived": 0, "incompetent": 0, "stopped": 0}
    if not pending:
        db.close()
        return counts
    started = time.monotonic()
    stop = threading.Event()
    lock = threading.Lock()
    base = Path(tempfile.mkdtemp(prefix="rmsnorm-mutation-", dir=work_dir))
    queue = list(pending)
    timeouts: dict[str, float] = {}
    broken: dict[str, str] = {}  # kill commands that fail unmutated: their mutants stay pending

    def baseline(name: str) -> None:
        # The kill commands must pass on the unmutated tree, else every mutant looks killed.
        steps = kill_steps(config, device, name)
        t0 = time.monotonic()
        outcome, tail = run_kill(make_tree(root, base / f"baseline-{name}", config.tree), steps, 3600, stop)
        seconds = time.monotonic() - t0
        if outcome == "stopped":
            return
        if outcome != "survived":
            broken[name] = f"fails without a mutant ({outcome}): {tail[-1500:]}"
        elif tail.count(" passed") < len(steps):  # a step whose tests all skip would pass every mutant
            broken[name] = f"a step runs no test here: {tail[-1500:]}"
        if name in broken:
            log(f"kill command {name!r} {broken[name]}\nits mutants are left pending")
            return
        timeouts[name] = max(config.timeout_min_s, config.timeout_factor * seconds)
        log(f"baseline {name}: {seconds:.1f} s, so a mutant's timeout is {timeouts[name]:.0f} s")

    def worker(index: int) -> None:
        tree = make_tree(root, base / f"tree{index}", config.tree)
        while not stop.is_set():
            with lock:
                if not queue:
                    return
                item = queue.pop(0)
            spec = item.mutations[0]
            file = spec.module_path.as_posix()
            target_file = tree / file
            original = target_file.read_text(encoding="utf-8")
            mutated = mutated_text(original, spec, patch_by_id)
            if mutated is None:
                raise MutationError(f"{item.job_id}: no mutation at occurrence {spec.occurrence} of {file}")
            target_file.write_text(mutated, encoding="utf-8")
            t0 = time.monotonic()
            try:
                name = target_of[file].kill
                outcome, tail = run_kill(tree, kill_steps(config, device, name), timeouts[name], stop)
            finally:
                target_file.write_text(original, encoding="utf-8")
            seconds = time.monotonic() - t0
            if outcome == "stopped":
                with lock:
                    counts["stopped"] += 1
                continue  # left pending: the next run resumes it
            if outcome == "killed" and "CompilationError" in tail:
                outcome = "incompetent"  # Triton refused to compile it: no test judged its numbers
            test_outcome = {"survived": TestOutcome.SURVIVED, "incompetent": TestOutcome.INCOMPETENT}.get(
                outcome, TestOutcome.KILLED
            )
            result = WorkResult(
                worker_outcome=WorkerOutcome.NORMAL, output=tail, test_outcome=test_outcome,
                diff=_diff(original, mutated, file),
            )  # fmt: skip
            with lock:
                db.set_result(item.job_id, result)
                with sqlite3.connect(path) as con:
                    con.execute(
                        "INSERT OR REPLACE INTO mutation_timing VALUES (?, ?, ?)",
                        (item.job_id, seconds, outcome),
                    )
                counts["done"] += 1
                counts[outcome if outcome in ("survived", "incompetent") else "killed"] += 1
                log(f"[{counts['done']}/{len(pending)}] {item.job_id} {spec.operator_name} {file}:"
                    f"{spec.start_pos[0]} {outcome} in {seconds:.1f} s")  # fmt: skip

    def watchdog() -> None:
        while budget_s is not None and not stop.wait(1.0):
            if time.monotonic() - started > budget_s:
                log(f"budget of {budget_s:g} s spent: stopping; the next run resumes the rest")
                stop.set()

    try:
        threading.Thread(target=watchdog, daemon=True).start()
        names = sorted({target_of[w.mutations[0].module_path.as_posix()].kill for w in pending})
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(names)))) as pool:
            for future in [pool.submit(baseline, name) for name in names]:
                future.result()
        queue[:] = [w for w in queue if target_of[w.mutations[0].module_path.as_posix()].kill not in broken]
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(worker, i) for i in range(workers)]:
                future.result()
    finally:
        stop.set()
        meta = read_meta(path)
        _write_meta(
            path,
            {"elapsed_s": meta.get("elapsed_s", 0.0) + time.monotonic() - started, "baseline_errors": broken},
        )
        db.close()
        shutil.rmtree(base, ignore_errors=True)
    counts["pending"] = len(pending) - counts["done"]
    counts["broken"] = sorted(broken)
    return counts


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SessionResult:
    path: Path
    meta: dict[str, Any]
    scores: list[Score]
    catalogue: list[dict[str, Any]]  # id, path, failure, outcome, seconds
    survivors: list[dict[str, Any]]  # key, file, line, operator, diff, why (None: unexplained)
    revived: list[dict[str, Any]]  # survivors of an earlier pass killed on the rerun (new kill tests)
    seconds: list[float]  # per finished mutant
    pending: int
    killed: tuple[str, ...] = ()  # keys of the operator mutants killed


def summarise(
    path: Path, config: Config, patches: list[Patch], equivalent: dict[str, dict[str, str]]
) -> SessionResult:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    meta = read_meta(path)
    timings = read_timings(path)
    with use_db(str(path), WorkDB.Mode.open) as db:
        done = db.completed_work_items
        total = db.num_work_items
    scores = {  # the targets this session mutates
        t.name: Score(t.name, t.file, t.floor, meta["population"][t.name], 0)
        for t in config.targets.values()
        if t.name in meta["population"]
    }
    for m in meta["mutants"].values():
        scores[m["target"]].planned += 1
    patch_by_id = {p.id: p for p in patches}
    catalogue, survivors, revived, killed = [], [], [], []
    retried = set(meta.get("retried", []))
    for item, result in done:
        spec = item.mutations[0]
        survived = result.test_outcome == TestOutcome.SURVIVED
        incompetent = result.test_outcome == TestOutcome.INCOMPETENT
        seconds = timings.get(item.job_id, (float("nan"), ""))[0]
        if spec.operator_name == CATALOGUE_OPERATOR:
            p = patch_by_id.get(spec.operator_args["id"])
            catalogue.append(
                {"id": spec.operator_args["id"], "path": p.path if p else spec.definition_name,
                 "failure": p.failure if p else "?",
                 "outcome": "survived" if survived else "does not compile" if incompetent else "killed",
                 "seconds": seconds}
            )  # fmt: skip
            continue
        key = item.job_id.removeprefix("op-")
        m = meta["mutants"][key]
        s = scores[m["target"]]
        if incompetent:
            s.incompetent += 1
            continue
        s.run += 1
        changed = [
            ln for ln in (result.diff or "").splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
        ]
        row = {"key": key, "file": m["file"], "line": m["line"], "operator": m["operator"],
               "definition": m["definition"], "diff": changed, "why": None}  # fmt: skip
        if not survived:
            s.killed += 1
            killed.append(key)
            if item.job_id in retried:
                revived.append(row)
            continue
        entry = equivalent.get(key, {})
        why = entry.get("why")
        if why and entry.get("equivalent", True):
            s.equivalent += 1
        elif why:  # a known gap, argued but still counted against the score
            why = f"**Not equivalent, counted as a survivor:** {why}"
        survivors.append({**row, "why": why})
    catalogue.sort(key=lambda c: (c["path"], c["id"]))
    survivors.sort(key=lambda s: (s["file"], s["line"], s["key"]))
    revived.sort(key=lambda s: (s["file"], s["line"], s["key"]))
    seconds = [timings[i.job_id][0] for i, _ in done if i.job_id in timings]
    return SessionResult(
        path, meta, list(scores.values()), catalogue, survivors, revived, seconds, total - len(done),
        tuple(sorted(killed)),
    )  # fmt: skip


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}%"


def _source_status(root: Path, file: str, measured: str | None) -> str:
    """Whether ``file`` is still the code a session measured (its hash then, ``measured``)."""
    if not (root / file).is_file():
        return "**not in the tree**"
    now = _file_hashes(root, {file})[file]
    return "unchanged" if measured == now else "**changed since**"


def unmeasured(results: list[SessionResult], config: Config, root: Path = ROOT) -> dict[str, list[str]]:
    """Per device (cpu, gpu), the targets no session of ``results`` measured on the code in the
    tree now: none ran them, or their file changed since (a session confined to some functions
    does not count)."""
    missing = {}
    for device in ("cpu", "gpu"):
        current = {
            s.target for r in results if r.meta.get("device") == device and not r.meta.get("confined")
            for s in r.scores if _source_status(root, s.file, r.meta.get("hashes", {}).get(s.file)) == "unchanged"
        }  # fmt: skip
        missing[device] = [t for t in config.targets if t not in current]
    return missing


def render_report(
    results: list[SessionResult], config: Config, patches: list[Patch], root: Path = ROOT
) -> str:
    out = [
        "# Mutation testing of the production code",
        "",
        "Regenerated by `nox -s mutation` (`python -m rmsnorm_suite.mutation`); do not edit by hand.",
        "A mutant is a small change to the code users run; the suite kills it when a kill command",
        "(a fast subset of the test suite) fails. The score of a file is killed / non-equivalent",
        "mutants of those run, with a Wilson 95% interval where the mutants are a sample. A mutant",
        'Triton refuses to compile is counted apart ("did not compile"), neither killed nor survived.',
        "",
    ]
    for r in results:
        meta = r.meta
        sample = (
            "all" if meta["sample"] is None else f"at most {meta['sample']} per file (seed {meta['seed']})"
        )
        secs = r.seconds
        timing = (
            f"median {statistics.median(secs):.1f} s, max {max(secs):.1f} s per mutant over {len(secs)}"
            if secs else "none finished"
        )  # fmt: skip
        out += [
            f"## {_session_name(r)}",
            "",
            f"Sample: {sample}. Sources: "
            + ", ".join(f"`{f}` {h}" for f, h in meta["hashes"].items())
            + f". Wall time so far {meta.get('elapsed_s', 0):.0f} s; {timing}."
            + (
                f" Started {meta['started']} at commit `{meta['commit']}`; population drawn by"
                f" `mutation/config.toml` {meta['config']} with cosmic-ray {meta['cosmic_ray']}."
                if all(meta.get(k) for k in ("started", "commit", "config", "cosmic_ray"))
                else ""
            )
            + (
                f" **{r.pending} work item{'s' if r.pending != 1 else ''} still pending** (resume with the same command)."
                if r.pending
                else ""
            ),
            "",
            "| file | mutants (this device) | sampled | run | killed | equivalent | score | 95% interval | floor "
            "| did not compile | file since |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
        ]
        for s in r.scores:
            lo, hi = s.interval
            flag = " **below floor**" if s.below_floor else ""
            since = _source_status(root, s.file, meta.get("hashes", {}).get(s.file))
            out.append(
                f"| `{s.file}` ({s.target}) | {s.population} | {s.planned} | {s.run} | {s.killed} | {s.equivalent} "
                f"| {_pct(s.percent)}{flag} | {lo:.1f}-{hi:.1f}% | {s.floor:g}% | {s.incompetent} | {since} |"
            )
        for name, error in meta.get("baseline_errors", {}).items():
            out += ["", f"**Kill command `{name}` fails on the unmutated tree; its mutants were not run:**", "",
                    "```", error.strip()[-1200:], "```"]  # fmt: skip
        gpu_only = {t: n for t, n in meta.get("gpu_only", {}).items() if n}
        if meta["device"] == "cpu" and gpu_only:
            out += [
                "",
                "Not run here (the interpreter cannot reach them; the GPU session runs them): "
                + ", ".join(f"{n} mutants of {t}" for t, n in gpu_only.items())
                + ".",
            ]
        out += ["", "### Seed-004 failure catalogue", "", "| path | failure mode | patch | outcome | seconds |",
                "|---|---|---|---|---:|"]  # fmt: skip
        for c in r.catalogue:
            out.append(
                f"| {c['path']} | {c['failure']} | `{c['id']}` | {c['outcome']} | {c['seconds']:.1f} |"
            )
        if not r.catalogue:
            out.append("| | none run yet | | | |")
        out += ["", "### Survivors", ""]
        if not r.survivors:
            out.append("None.")
        for s in r.survivors:
            diff = " / ".join(f"`{ln.strip()}`" for ln in s["diff"][:2])
            # The same mutant killed by another session of this report (one run after kill tests
            # were added): this session's own rerun (--retry-survivors) is still to come.
            elsewhere = [_session_name(o) for o in results if o is not r and s["key"] in o.killed]
            why = s["why"] or (
                f"**killed in the {' and the '.join(elsewhere)} of this report; not yet rerun here "
                "(`--retry-survivors`)**"
                if elsewhere
                else "**unexplained: a gap, or an equivalent mutant to argue in mutation/equivalent.toml**"
            )
            out.append(
                f"- `{s['key']}` {s['file']}:{s['line']} ({s['definition']}, {s['operator']}): {diff}. {why}"
            )
        if r.revived:
            out += ["", "Survivors of an earlier pass, killed on the rerun (`--retry-survivors`) by kill tests added since:",
                    ""]  # fmt: skip
            for s in r.revived:
                diff = " / ".join(f"`{ln.strip()}`" for ln in s["diff"][:2])
                out.append(
                    f"- `{s['key']}` {s['file']}:{s['line']} ({s['definition']}, {s['operator']}): {diff}"
                )
        out.append("")
    missing = {d: ts for d, ts in unmeasured(results, config, root).items() if ts}
    if missing:
        out += ["## Not yet measured at this commit", ""]
        for device, targets in missing.items():
            out.append(
                f"- **{', '.join(targets)}: not yet measured on {device.upper()} at this commit** (no session "
                "of this report ran them on the files in the tree now)."
            )
        out.append("")
    out += _method_section(config, patches)
    return "\n".join(out) + "\n"


def _session_name(r: SessionResult) -> str:
    """A session's heading: its device and targets (a report may hold several per device), and
    the functions it was confined to (--definition)."""
    targets = r.meta.get("targets") or sorted(s.target for s in r.scores)
    confined = r.meta.get("confined")
    inside = f"; only {', '.join(confined)}" if confined else ""
    return f"{r.meta['device'].upper()} session" + (f" ({', '.join(targets)}{inside})" if targets else "")


def _method_section(config: Config, patches: list[Patch]) -> list[str]:
    out = [
        "## What is mutated, and what is not",
        "",
        "Operators (cosmic-ray names, as regular expressions):",
        "",
    ]
    out += [f"- `{p}`" for p in config.operators]
    out += ["", "Left out:", ""]
    out += [f"- `{p}`: {why}" for p, why in config.excluded_operators.items()]
    out += ["", "Code not mutated, per file, with the reason:", ""]
    for t in config.targets.values():
        if t.definitions:
            out.append(
                f"- `{t.file}`: only the judgement functions " + ", ".join(f"`{d}`" for d in t.definitions)
            )
        for name, why in {**t.skip_definitions, **t.skip_assignments}.items():
            out.append(f"- `{t.file}` `{name}`: {why}")
        for name, why in t.gpu_only.items():
            out.append(f"- `{t.file}` `{name}` (GPU session only): {why}")
    out += ["", "Kill commands (pytest `-x -q`, in a copy of the tree with the mutant applied):", ""]
    for device, commands in config.kill.items():
        for name, steps in commands.items():
            shown = " && ".join(
                ("TRITON_INTERPRET=1 " if s.get("interpret") else "")
                + "pytest "
                + " ".join(_quote(a) for a in s["args"])
                for s in steps
            )
            out.append(f"- {device} `{name}`: `{shown}`")
    paths = sorted({p.path for p in patches})
    gpu = sum(p.gpu_only for p in patches)
    out += [
        "",
        f"The catalogue (`mutation/catalogue.toml`) holds {len(patches)} patches over the paths "
        + ", ".join(paths)
        + f"; {gpu} of them only the GPU session runs. Survivors argued equivalent are listed, each"
        " with its reason, in `mutation/equivalent.toml`.",
        "",
        "## Running it",
        "",
        "The CPU sessions above, one per target (a target's sample does not depend on the others",
        "run with it), then this page from their databases:",
        "",
        "```bash",
        *[
            f"nox -s mutation -- --device cpu --target {t} --sample 30 --seed 1 --workers 2 --out .mutation/{t}"
            for t in config.targets
        ],
        "python -m rmsnorm_suite.mutation report --report docs/mutation.md "
        + " ".join(f"--session .mutation/{t}/session-cpu.sqlite" for t in config.targets),
        "```",
        "",
        "On the GPU (every target in one session, then the GPU-only functions alone):",
        "",
        "```bash",
        "nox -s mutation -- --device gpu --sample 30 --seed 1 --workers 8 --out .mutation/gpu",
        "nox -s mutation -- --device gpu --definition _rsqrt_newton --workers 4 --out .mutation/gpu-newton",
        "```",
        "",
        "A population is what `mutation/config.toml` draws from the files with the pinned cosmic-ray",
        "(`requirements/constraints.txt`); tests/suite/test_mutation.py checks every population this page",
        "shows for a file still unchanged against a fresh enumeration.",
        "",
        "The same command resumes a session cut short by `--budget-s` (its database under `--out`,",
        "default `.mutation/`); `--fresh` starts over. A session refuses to resume over changed",
        "sources or arguments. `--definition F` runs every mutant inside the function F alone (the",
        "GPU-only functions above, say), without the catalogue. Each worker mutates its own copy of",
        "the tree, never the checkout.",
        "The run fails (exit 1) when a file's score is below its floor or a catalogue patch survives.",
    ]
    return out


def _quote(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _session_path(out: Path, device: str) -> Path:
    return out / f"session-{device}.sqlite"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rmsnorm_suite.mutation", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="init (or resume) a session, run it within the budget, write the report")
    run.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    run.add_argument("--sample", type=int, default=None, help="at most N mutants per file (default: all)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--budget-s", type=float, default=None, help="stop starting mutants after this many seconds"
    )
    run.add_argument(
        "--workers", type=int, default=1, help="parallel kill commands, each in its own tree copy"
    )
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help="session database and report directory")
    run.add_argument("--report", type=Path, default=None, help="report path (default: OUT/mutation.md)")
    run.add_argument("--fresh", action="store_true", help="discard an existing session database first")
    run.add_argument("--no-catalogue", action="store_true", help="operators only")
    run.add_argument("--target", action="append", default=None, help="only these targets (config names)")
    run.add_argument(
        "--definition", action="append", default=None, metavar="FUNCTION",
        help="only operator mutants inside these functions (the catalogue is left out)",
    )  # fmt: skip
    run.add_argument(
        "--retry-survivors", action="store_true", help="run the survivors again (after adding kill tests)"
    )
    rep = sub.add_parser("report", help="render the report of one or more session databases")
    rep.add_argument("--session", type=Path, action="append", required=True)
    rep.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    sub.add_parser("check-catalogue", help="check that every catalogue patch applies exactly once")
    describe = sub.add_parser(
        "describe", help="a mutant's description, as an entry of mutation/equivalent.toml records it"
    )
    describe.add_argument("key", nargs="+")
    args = parser.parse_args(argv)

    config = load_config()
    patches = load_catalogue()
    equivalent = load_equivalent()
    if args.command in ("run", "report"):
        equivalent = current_equivalent(config, equivalent)
    if args.command == "check-catalogue":
        check_catalogue(patches)
        print(f"all {len(patches)} catalogue patches apply exactly once")
        return 0
    if args.command == "describe":
        by_key = {m.key: m for m in enumerate_mutants(config)[0]}
        for key in args.key:
            if key not in by_key:
                raise MutationError(f"describe: {key} names no mutant of the population the config draws")
            print(f"[[mutant]]\nkey = {json.dumps(key)}")
            for field, value in describe_mutant(by_key[key]).items():
                print(f"{field} = {json.dumps(value)}")  # a JSON string is a TOML basic string
            print()
        return 0
    if args.command == "report":
        results = [summarise(p, config, patches, equivalent) for p in args.session]
        args.report.write_text(render_report(results, config, patches), encoding="utf-8")
        print(f"wrote {args.report}")
        return _verdict(results)
    if args.target:
        unknown = set(args.target) - set(config.targets)
        if unknown:
            raise MutationError(f"--target: unknown {sorted(unknown)}; known {sorted(config.targets)}")
        config = dataclasses.replace(
            config, targets={k: v for k, v in config.targets.items() if k in args.target}
        )
        files = {t.file for t in config.targets.values()}
        patches = [p for p in patches if p.file in files]
    if args.definition:
        config = restrict_to_definitions(config, args.definition)
    if args.no_catalogue or args.definition:
        patches = []
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise MutationError("--device gpu needs a CUDA device (the kill commands run -m gpu tests)")
    args.out.mkdir(parents=True, exist_ok=True)
    path = _session_path(args.out, args.device)
    if args.fresh and path.exists():
        path.unlink()
    init_session(path, config, patches, args.device, args.sample, args.seed, confined=args.definition)
    if args.retry_survivors:
        print(f"{reopen_survivors(path)} survivors to run again")
    counts = execute(path, config, load_catalogue(), args.device, args.workers, args.budget_s)
    print(f"session {path}: {counts}")
    results = [summarise(path, config, load_catalogue(), equivalent)]
    report = args.report or args.out / "mutation.md"
    report.write_text(render_report(results, config, load_catalogue()), encoding="utf-8")
    print(f"wrote {report}")
    return _verdict(results)


def _verdict(results: list[SessionResult]) -> int:
    """1 when a file's score is below its floor, a catalogue patch survived or a kill command
    failed unmutated, else 0."""
    failures = [f for r in results for f in floor_failures(r.scores)]
    failures += [
        f"kill command {n} fails unmutated" for r in results for n in r.meta.get("baseline_errors", {})
    ]
    failures += [f"catalogue patch {c['id']} ({c['path']}: {c['failure']}) {c['outcome']}" for r in results
                 for c in r.catalogue if c["outcome"] != "killed"]  # fmt: skip
    for r in results:
        for s in r.scores:
            lo, hi = s.interval
            print(
                f"{s.file}: {s.killed}/{s.non_equivalent} killed ({_pct(s.percent)}, {lo:.1f}-{hi:.1f}%), floor {s.floor:g}%"
            )
    for f in failures:
        print(f"FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
