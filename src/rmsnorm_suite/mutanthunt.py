"""Hunting the mutants: the suite's checks run on every mutant of :mod:`rmsnorm_suite.mutants`.

``hunt(name)`` runs the probes and then the case grids (the feature checks for a feature mutant)
on one mutant and records the first check that caught it, the case that exposed it and why.
``catalogue(device)`` hunts them all (``rmsnorm-kernel verdict`` calls it) and
``format_report`` writes the result as markdown (outputs/mutants.md).
"""

from __future__ import annotations

import time

import torch

from rmsnorm_suite import cases, checks, probes
from rmsnorm_suite.featurechecks import run_feature_suite
from rmsnorm_suite.mutants import FEATURE_MUTANTS, MUTANTS, as_impl

# The grid the catalogue runs: the interpreter grid of cases, without the N above a single tile
# (this harness has no looped path) and without M = 0 (nothing to compute, nothing to catch).
GRID: list[tuple[int, int, torch.dtype]] = [
    (m, n, d) for (m, n, d) in cases.interpret_grid() if m > 0 and n <= 4097
]


def _probe_steps(device):
    for check, fn, kind, kwargs in probes.PROBES:
        yield check, kind, lambda impl, fn=fn, kind=kind, kw=kwargs: [fn(impl, device, kind=kind, **kw)]


def _grid_steps(device):
    for kind in checks.KINDS:
        yield "grid", kind, lambda impl, kind=kind: checks.run_grid(kind, impl, GRID, device)


def run_suite(impl: checks.Impl, device="cpu") -> list[checks.CaseResult]:
    """Every check of the suite on ``impl``: the probes, then the case grids over GRID."""
    results: list[checks.CaseResult] = []
    for _, _, run in [*_probe_steps(device), *_grid_steps(device)]:
        results += run(impl)
    return results


def _entry(name: str, description: str, failed: list[checks.CaseResult], start: float) -> dict:
    """A catalogue entry: the first check that caught the mutant, the case that exposed it and
    why, and every other check that also caught it."""
    entry = {
        "mutant": name,
        "description": description,
        "caught": bool(failed),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if failed:
        first = failed[0]
        entry.update(
            check=first.check,
            kind=first.kind,
            case=first.name,
            reason=first.reason,
            result=first.to_dict(),
            also_caught_by=sorted(
                {f"{r.check}/{r.kind}" for r in failed[1:]} - {f"{first.check}/{first.kind}"}
            ),
        )
    return entry


def hunt(name: str, device="cpu") -> dict:
    """Run every probe on one mutant, then, if no probe caught it, the case grids until one case
    fails. The entry names the first check that caught it, the case that exposed it and why, and
    every other probe that also caught it. Feature mutants are hunted by the feature checks."""
    if name in FEATURE_MUTANTS:
        return hunt_feature(name, device)
    description = MUTANTS[name][0]
    impl = as_impl(name)
    start = time.perf_counter()
    failed: list[checks.CaseResult] = []
    for _, _, run in _probe_steps(device):
        failed += [r for r in run(impl) if not r.passed]
    if not failed:
        for _, _, run in _grid_steps(device):
            failed += [r for r in run(impl) if not r.passed]
            if failed:
                break
    return _entry(name, description, failed, start)


def catalogue(device="cpu", *, progress: bool = True) -> list[dict]:
    """Every mutant hunted with the suite's checks: one dict per mutant (mutant, description,
    caught, check, kind, case, reason, also_caught_by, ...). Runs under TRITON_INTERPRET=1 on the
    CPU, or on CUDA."""
    names = [*MUTANTS, *FEATURE_MUTANTS]
    if progress:
        from tqdm import tqdm

        names = tqdm(names, desc="mutants", unit="mutant")
    return [hunt(name, device) for name in names]


def format_report(entries: list[dict]) -> str:
    """The catalogue as markdown: one row per mutant, the check that caught it and the case."""
    survived = [e["mutant"] for e in entries if not e["caught"]]
    lines = [
        "# Mutant catalogue",
        "",
        f"{len(entries) - len(survived)} of {len(entries)} mutants caught by the suite's checks"
        + (f"; SURVIVED: {', '.join(survived)}" if survived else "."),
        "",
        "| mutant | bug | caught by | case | why | also caught by |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        if e["caught"]:
            reason = e["reason"].replace("|", "\\|")
            case = e["case"].replace("|", "\\|")
            also = ", ".join(e["also_caught_by"]) or "-"
            caught_by = f"{e['check']}/{e['kind']}"
            lines.append(f"| {e['mutant']} | {e['description']} | {caught_by} | {case} | {reason} | {also} |")
        else:
            lines.append(f"| {e['mutant']} | {e['description']} | SURVIVED | - | - | - |")
    return "\n".join(lines) + "\n"


def hunt_feature(name: str, device="cpu") -> dict:
    """Every feature check on one feature mutant; the entry has hunt()'s fields."""
    description, impl = FEATURE_MUTANTS[name]
    start = time.perf_counter()
    failed = [r for r in run_feature_suite(impl, device) if not r.passed]
    return _entry(name, description, failed, start)
