"""Running a session's pending mutants. Each worker mutates its own copy of the tree (the
checkout is never touched), so Triton's JIT, which reads a kernel's source from disk, compiles
the mutant; the target's kill command then runs there, with a timeout from its unmutated
baseline, until the work is done or the time budget is spent. A resumed run takes the timeout
from the baseline it recorded and checks the baseline again beside the mutants: where that
check fails or does not finish, the results of this run for that command are dropped.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from maintainer.mutation.catalogue import CATALOGUE_OPERATOR, Patch, apply_patch
from maintainer.mutation.config import ROOT, Config, MutationError
from maintainer.mutation.session import forget, open_db, read_meta, write_meta


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

    def _kill_of(item) -> str:
        return target_of[item.mutations[0].module_path.as_posix()].kill

    patch_by_id = {p.id: p for p in patches}
    db = open_db(path)
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

    recorded: dict[str, float] = dict(read_meta(path).get("baselines", {}))
    unverified: set[str] = set()  # rechecked beside the mutants, not finished yet
    done_by: dict[str, list[str]] = {}  # this run's results per kill command

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
        with lock:
            recorded[name] = seconds
            unverified.discard(name)
            timeouts.setdefault(name, max(config.timeout_min_s, config.timeout_factor * seconds))
        log(f"baseline {name}: {seconds:.1f} s, so a mutant's timeout is {timeouts[name]:.0f} s")

    def worker(index: int) -> None:
        tree = make_tree(root, base / f"tree{index}", config.tree)
        while not stop.is_set():
            with lock:
                runnable = [w for w in queue if _kill_of(w) not in broken]
                if not runnable:
                    return
                item = runnable[0]
                queue.remove(item)
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
                if name in broken:
                    continue  # its baseline failed meanwhile: left pending
                done_by.setdefault(name, []).append(item.job_id)
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
        names = sorted({_kill_of(w) for w in pending})
        first = [n for n in names if n not in recorded]  # no recorded baseline: wait for it
        for name in names:
            if name in recorded:
                timeouts[name] = max(config.timeout_min_s, config.timeout_factor * recorded[name])
                unverified.add(name)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, len(first)))) as pool:
            for future in [pool.submit(baseline, name) for name in first]:
                future.result()
        queue[:] = [w for w in queue if _kill_of(w) not in broken]
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(unverified))) as checks:
            rechecks = [checks.submit(baseline, name) for name in sorted(unverified)]
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                for future in [pool.submit(worker, i) for i in range(workers)]:
                    future.result()
            for future in rechecks:
                future.result()
    finally:
        stop.set()
        for name in sorted(unverified | set(broken)):  # results no passing baseline stands behind
            dropped = done_by.pop(name, [])
            forget(path, dropped, ("work_results", "mutation_timing"))
            counts["done"] -= len(dropped)
            counts["dropped"] = counts.get("dropped", 0) + len(dropped)
            if dropped:
                log(f"baseline {name} not confirmed in this run: {len(dropped)} results dropped")
        meta = read_meta(path)
        write_meta(
            path,
            {
                "elapsed_s": meta.get("elapsed_s", 0.0) + time.monotonic() - started,
                "baseline_errors": broken,
                "baselines": {n: recorded[n] for n in sorted(recorded) if n not in broken},
            },
        )
        db.close()
        shutil.rmtree(base, ignore_errors=True)
    counts["pending"] = len(pending) - counts["done"]
    counts["broken"] = sorted(broken)
    return counts
