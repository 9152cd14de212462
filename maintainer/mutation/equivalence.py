"""Survivors argued equivalent (equivalent.toml beside this module), and the check that each
entry's key still names the mutant its reason argues: an entry that does not excuses nothing.
"""

from __future__ import annotations

from pathlib import Path

from maintainer.mutation.config import ROOT, Config, read_toml
from maintainer.mutation.population import describe_mutant, enumerate_mutants

EQUIVALENT = Path("maintainer/mutation/equivalent.toml")


def load_equivalent(root: Path = ROOT, path: Path = EQUIVALENT) -> dict[str, dict[str, str]]:
    """Survivors argued equivalent: mutant key -> {why, mutant, and the mutant's description
    (DESCRIPTION)}; ``equivalent = false`` marks a known gap that is explained but still counts
    against the score."""
    if not (root / path).exists():
        return {}
    data = read_toml(root / path)
    return {e["key"]: e for e in data.get("mutant", [])}


# What an equivalence entry records of its mutant, so that a key that comes to name another
# mutant is caught: a key hashes the line's text, not its place, and the same line twice in one
# function is told apart only by its order (``-1``, ``-2``), which an edit above it can change.
DESCRIPTION = ("file", "operator", "definition", "source", "mutated", "after")


def equivalence_problems(
    config: Config, equivalent: dict[str, dict[str, str]], root: Path = ROOT
) -> dict[str, str]:
    """Entries of equivalent.toml whose key names no mutant of the population the config draws
    (every device), or one other than the entry describes: key -> what is wrong.
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
        log(f"maintainer/mutation/equivalent.toml: {key} {problem}; not counted as equivalent")
    return {k: v for k, v in equivalent.items() if k not in problems}
