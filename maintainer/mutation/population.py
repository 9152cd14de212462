"""The operator mutants: cosmic-ray's operators over the targets, less the skipped functions and
assignments, each under a key stable across unrelated edits; a run confined to named functions;
and the sample, drawn per file and reproducible from its seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from pathlib import Path

from maintainer.mutation.config import ROOT, Config, MutationError


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
    """Lines of the assignments to ``names`` at module level or in the body of a module-level
    class (a frozen dataclass's field defaults, such as launch.Tuning's): line -> name."""
    import ast

    lines = {}
    body = ast.parse(source).body
    nodes = body + [n for c in body if isinstance(c, ast.ClassDef) for n in c.body]
    for node in nodes:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            if isinstance(t, ast.Name) and t.id in names:
                lines.update({n: t.id for n in range(node.lineno, node.end_lineno + 1)})
    found = set(lines.values())
    missing = sorted(set(names) - found)
    if missing:
        raise MutationError(
            f"skip_assignments name no module- or class-level assignment: {', '.join(missing)}"
        )
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
    """The mutant as an equivalence entry records it (equivalence.DESCRIPTION): its file,
    operator and function; its line before and after the mutation; and the next non-blank line of
    the file, which tells apart the same line written twice in one function."""
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
