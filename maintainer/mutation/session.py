"""The session database (``<out>/session-<device>.sqlite``): cosmic-ray's WorkDB plus the run's
metadata and per-mutant times. It makes a run resumable: ``--budget-s`` stops cleanly and the
next run with the same arguments continues; changed sources or arguments are refused, except
that ``--narrow`` keeps the targets named whose sources are unchanged and drops the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from maintainer.mutation.catalogue import CATALOGUE_OPERATOR, Patch, check_catalogue
from maintainer.mutation.config import CONFIG, ROOT, Config, MutationError
from maintainer.mutation.population import enumerate_mutants, operator_names, sample


def open_db(path: Path):
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


def write_meta(path: Path, meta: dict[str, Any]) -> None:
    with sqlite3.connect(path) as con:
        con.executemany(
            "INSERT OR REPLACE INTO mutation_meta VALUES (?, ?)",
            [(k, json.dumps(v)) for k, v in meta.items()],
        )


def read_timings(path: Path) -> dict[str, tuple[float, str]]:
    with sqlite3.connect(path) as con:
        return {j: (s, n) for j, s, n in con.execute("SELECT job_id, seconds, note FROM mutation_timing")}


def file_hashes(root: Path, files: set[str]) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest()[:16] for f in sorted(files)}


def forget(path: Path, job_ids: list[str], tables: tuple[str, ...]) -> None:
    """Delete the rows of ``job_ids`` from the session database's ``tables``."""
    with sqlite3.connect(path) as con:
        for table in tables:
            con.executemany(f"DELETE FROM {table} WHERE job_id = ?", [(j,) for j in job_ids])


def reopen_survivors(path: Path, keys: list[str] | None = None) -> int:
    """Make the session's survivors (those of ``keys`` only, where given) pending again, their
    results dropped and their times kept until the new run replaces them: for a rerun once new
    kill tests exist. Returns how many."""
    with sqlite3.connect(path) as con:
        rows = con.execute("SELECT job_id FROM work_results WHERE test_outcome = 'SURVIVED'").fetchall()
    jobs = [j for (j,) in rows if keys is None or j.split("-", 1)[1] in keys]
    forget(path, jobs, ("work_results",))
    retried = read_meta(path).get("retried", [])
    write_meta(path, {"retried": sorted(set(retried) | set(jobs))})  # the report names them
    return len(jobs)


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


def _narrowed(path: Path, meta: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The session cut down to ``wanted``'s targets, or None where that is not a narrowing (other
    arguments, a kept file changed, a target or patch the session lacks). The sample is drawn per
    target (population.sample), so the kept items are what a fresh session would draw."""
    same = ("device", "sample", "seed", "confined", "config", "cosmic_ray")
    if any(meta.get(k) != wanted[k] for k in same):
        return None
    if not set(wanted["targets"]) <= set(meta["targets"]) or not set(wanted["patch_ids"]) <= set(
        meta["patch_ids"]
    ):
        return None
    if any(meta["hashes"].get(f) != h for f, h in wanted["hashes"].items()):
        return None
    keep_mutants = {k: m for k, m in meta["mutants"].items() if m["target"] in wanted["targets"]}
    keep = {_job_id("op", k) for k in keep_mutants} | {_job_id("cat", p) for p in wanted["patch_ids"]}
    with sqlite3.connect(path) as con:
        dropped = [j for (j,) in con.execute("SELECT job_id FROM work_items") if j not in keep]
    forget(path, dropped, ("work_results", "mutation_specs", "mutation_timing", "work_items"))
    by_target = ("population", "gpu_only", "skipped")
    narrowed = {
        **wanted,
        **{k: {t: v for t, v in meta[k].items() if t in wanted["targets"]} for k in by_target},
        "mutants": keep_mutants,
        "patches": [p for p in meta["patches"] if p in wanted["patch_ids"]],
        "narrowed": {"from": meta["targets"], "dropped": len(dropped)},
    }  # fmt: skip
    write_meta(path, narrowed)
    return {**meta, **narrowed}


def init_session(
    path: Path, config: Config, patches: list[Patch], device: str, per_target: int | None, seed: int,
    root: Path = ROOT, confined: list[str] | None = None, narrow: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Create the session (or check that an existing one matches these arguments and sources:
    a resumed run must mutate the same code) and return its metadata. ``confined``: the
    functions a --definition run is confined to (None: not confined). ``narrow``: an existing
    session with more targets keeps only these (their sources unchanged), dropping the rest."""
    from cosmic_ray.work_item import MutationSpec, WorkItem

    files = {t.file for t in config.targets.values()} | {p.file for p in patches}
    hashes = file_hashes(root, files)
    wanted = {
        "device": device, "sample": per_target, "seed": seed, "hashes": hashes,
        "targets": sorted(config.targets), "patch_ids": sorted(p.id for p in patches),
        "confined": sorted(confined) if confined else None,
        # what else draws the population: the config's operators and skips, cosmic-ray's operators
        "config": file_hashes(root, {CONFIG.as_posix()})[CONFIG.as_posix()],
        "cosmic_ray": cosmic_ray_version(),
    }  # fmt: skip
    if path.exists():
        meta = read_meta(path)
        if {k: meta.get(k) for k in wanted} != wanted:
            narrowed = _narrowed(path, meta, wanted) if narrow else None
            if narrowed is not None:
                return narrowed
            raise MutationError(
                f"{path} was made for { ({k: meta.get(k) for k in wanted}) }, not {wanted}: "
                "the sources or arguments changed; start afresh with --fresh (or keep the unchanged "
                "targets with --narrow)"
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
    db = open_db(path)
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
    write_meta(path, meta)
    return meta
