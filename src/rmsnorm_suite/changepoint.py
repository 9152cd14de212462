"""`rmsnorm-kernel changepoints`: steps in main's history, and the first commit of each.

Drift against the last release says that main moved; this says where. Per series (one asv
benchmark and parameter combination, in first-parent order of main) the log values are split
where a two-sample step is largest, kept when its p-value is under ``rate / series`` and it
moves the median by ``min_step`` or more, then searched again on each side (``[drift]`` of
regression.toml; docs/gate.md, "Which commit"). A slowdown of one commit that an accepted
regression of its row covers (``--accepted``: history.py accepted, record-accepted) reads ``accepted``.
Exit status: 0 no slowdown but accepted ones, 1 a slowdown found (named), 2 no data.

    rmsnorm-kernel changepoints --results .asv/results [--machine h200] [--accepted JSON] [--out JSON]
"""

from __future__ import annotations

import argparse
import graphlib
import itertools
import json
import math
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from rmsnorm_suite import accept


@dataclass(frozen=True)
class Step:
    """A step between ``index - 1`` and ``index`` of a series (``index``: first point after it)."""

    series: str
    index: int
    first_commit: str  # the first commit measured after the step
    last_before: str  # the last commit measured before it: the step is in (last_before, first_commit]
    before: float  # median of the segment before
    after: float  # median of the segment after
    ratio: float  # after / before
    p_value: float
    level: float  # what p had to be under
    direction: str  # "slowdown" (larger is worse) or "improvement"
    # a slowdown an Accept-Regression of its row covers: 'COMMIT xFACTOR approved by WHO: "reason"'
    # (a merged verdict's record) or 'COMMIT xFACTOR trailer only: "reason"'; before the first
    # ": " only what this module wrote, after it the author's reason
    accepted: str = ""
    approved_by: str = ""  # the approver a merged verdict recorded (a login), or ""
    commit_index: int = -1  # ``first_commit``'s place in the history judged (0: oldest), across series


@dataclass(frozen=True)
class DriftRule:
    rate: float = 0.01
    min_step: float = 0.02
    min_size: int = 3
    permutations: int = 9999


def rule_from(thresholds_path: str | Path | None = None) -> DriftRule:
    """``[drift]`` of regression.toml (the suite's by default); absent keys take the defaults."""
    from rmsnorm_suite import thresholds

    path = thresholds.default_thresholds() if thresholds_path is None else Path(thresholds_path)
    data = thresholds.tomllib.loads(path.read_text(encoding="utf-8")).get("drift", {})
    rule = DriftRule(**{k: data[k] for k in ("rate", "min_step", "min_size", "permutations") if k in data})
    if not (0 < rule.rate < 0.5 and rule.min_step >= 0 and rule.min_size >= 2 and rule.permutations >= 99):
        raise ValueError(f"{path}: [drift] out of range: {rule}")
    return rule


# ---------------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------------


def _split_stats(x: np.ndarray, min_size: int) -> np.ndarray:
    """|mean after - mean before| / (pooled SD x sqrt(1/a + 1/b)) for every split point, on the
    last axis (rows: permutations); splits closer than ``min_size`` to an end are 0."""
    n = x.shape[-1]
    k = np.arange(1, n)
    c1 = np.cumsum(x, axis=-1)[..., :-1]
    c2 = np.cumsum(x**2, axis=-1)[..., :-1]
    tot, tot2 = x.sum(axis=-1, keepdims=True), (x**2).sum(axis=-1, keepdims=True)
    m1, m2 = c1 / k, (tot - c1) / (n - k)
    ss = (c2 - c1**2 / k) + ((tot2 - c2) - (tot - c1) ** 2 / (n - k))
    sd = np.sqrt(np.maximum(ss, 0) / max(n - 2, 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.abs(m2 - m1) / (sd * np.sqrt(1 / k + 1 / (n - k)))
    t = np.where(np.isfinite(t), t, np.where(m2 != m1, np.inf, 0.0))
    t[..., : min_size - 1] = 0
    t[..., n - min_size :] = 0
    return t


def best_split(
    x: Sequence[float], min_size: int, permutations: int, rng: np.random.Generator
) -> tuple[int, float]:
    """The split point (first index after it) of the largest step of ``x`` and its permutation
    p-value; (0, 1.0) when ``x`` is too short for two segments of ``min_size``."""
    x = np.asarray(x, dtype=float)
    n = len(x)
    if n < 2 * min_size:
        return 0, 1.0
    observed = _split_stats(x, min_size)
    tau = int(np.argmax(observed)) + 1
    top = observed[tau - 1]
    exceed, done = 0, 0
    while done < permutations:  # in chunks: a long history times many permutations stays small
        b = min(2000, permutations - done)
        perm = rng.permuted(np.broadcast_to(x, (b, n)), axis=1)
        exceed += int((_split_stats(perm, min_size).max(axis=1) >= top * (1 - 1e-12)).sum())
        done += b
    return tau, (1 + exceed) / (1 + permutations)


def detect(
    values: Sequence[float],
    commits: Sequence[str],
    rule: DriftRule = DriftRule(),
    level: float | None = None,
    name: str = "",
    seed: int = 0,
) -> list[Step]:
    """Steps of one series (values in commit order, larger worse), each tested at ``level``
    (default ``rule.rate``), by binary segmentation; in commit order."""
    if len(values) != len(commits):
        raise ValueError(f"{len(values)} values for {len(commits)} commits")
    if any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError(f"{name or 'series'}: values must be finite and positive")
    level = rule.rate if level is None else level
    rng = np.random.default_rng(seed)
    logs = np.log(np.asarray(values, dtype=float))
    found: list[Step] = []
    todo = [(0, len(values))]
    while todo:
        lo, hi = todo.pop()
        tau, p = best_split(logs[lo:hi], rule.min_size, rule.permutations, rng)
        if tau == 0 or p >= level:
            continue
        i = lo + tau
        before, after = float(np.median(values[lo:i])), float(np.median(values[i:hi]))
        ratio = after / before
        if abs(math.log(ratio)) < math.log1p(rule.min_step):
            continue  # significant, too small to matter: not split further here
        found.append(
            Step(name, i, commits[i], commits[i - 1], before, after, ratio, p, level,
                 "slowdown" if ratio > 1 else "improvement")
        )  # fmt: skip
        todo += [(lo, i), (i, hi)]
    return sorted(found, key=lambda s: s.index)


def detect_all(
    series: Mapping[str, Sequence[tuple[str, float]]], rule: DriftRule = DriftRule(), seed: int = 0
) -> tuple[list[Step], float]:
    """Every series at ``rule.rate / len(series)`` (the false-alarm rate across the series judged);
    the steps found and that level."""
    usable = {k: v for k, v in series.items() if len(v) >= 2 * rule.min_size}
    level = rule.rate / max(len(usable), 1)
    steps: list[Step] = []
    for i, (name, points) in enumerate(sorted(usable.items())):
        commits, values = [c for c, _ in points], [v for _, v in points]
        steps += detect(values, commits, rule, level, name, seed + i)
    return steps, level


# ---------------------------------------------------------------------------------------------
# Accepted regressions
# ---------------------------------------------------------------------------------------------

# A latency check's kind and mode (rmsnorm_suite.accept) as the asv benchmark that tracks it.
TRACKED = {"device": "track_gpu_median_ms", "latency": "track_median_ms", "host": "track_host_median_ms"}
SUITES = {"forward": "Forward", "forward_backward": "ForwardBackward"}


def check_series(check: str, provider: str = "kernel") -> str:
    """The tail of the asv series name that tracks latency check ``kind shape mode``, or ""."""
    parts = check.split()
    if len(parts) != 3 or parts[0] not in TRACKED or parts[2] not in SUITES:
        return ""
    return f".{SUITES[parts[2]]}.{TRACKED[parts[0]]}('{parts[1]}', '{provider}')"


def mark_accepted(
    steps: Sequence[Step], accepted: Sequence[Mapping], order: Sequence[str] = ()
) -> list[Step]:
    """``steps`` with each slowdown that an accepted regression covers marked: the record names its
    row's series, the step's range (``last_before``, ``first_commit``] of main's ``order`` is that
    one commit, and the step's ratio is no larger than its factor. A wider range stays a plain
    slowdown (another commit in it may be the cause: the bisection names it), and so does a step
    past the accepted factor. A trailer is not proof of approval: marking names a commit the
    history already names, and hides nothing from the bisection."""
    rank = {c: i for i, c in enumerate(order)}
    # a merged verdict's record (with its approver) before a trailer naming the same row
    accepted = sorted(accepted, key=lambda a: not approver(a))
    out = []
    for s in steps:
        for a in accepted if s.direction == "slowdown" else ():
            tail = check_series(str(a.get("check", "")))
            commit, factor = str(a.get("commit", "")), a.get("factor")
            if not tail or not s.series.endswith(tail) or not isinstance(factor, (int, float)):
                continue
            alone = s.last_before in rank and s.first_commit in rank
            alone = alone and rank[s.first_commit] == rank[s.last_before] + 1 and commit == s.first_commit
            if alone and s.ratio <= factor:
                why = " ".join(str(a.get("reason", "")).replace('"', "'").split())[:120]
                who = approver(a)
                how = f"approved by {who}" if who else "trailer only"
                s = replace(s, accepted=f'{commit[:12]} x{factor:g} {how}: "{why}"', approved_by=who)
                break
        out.append(s)
    return out


LOGIN = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})(?:\[bot\])?")  # a GitHub login


def approver(record: Mapping) -> str:
    """The approver a record names when it is a login (a merged verdict's record), else ""."""
    who = record.get("approved_by")
    return who if isinstance(who, str) and LOGIN.fullmatch(who) else ""


def load_accepted(path: str | Path, limits=None) -> list[dict]:
    """The records of ``rmsnorm_suite.history accepted`` (a JSON list); malformed ones are dropped,
    and so is any the gate's ``[accept]`` (``limits``, thresholds.AcceptLimits) would refuse: a kind
    it does not list, a factor outside (1, max_factor], rows of one commit past max_rows."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    records = data.get("accepted", []) if isinstance(data, dict) else data
    valid = [
        r
        for r in records
        if isinstance(r, dict)
        and isinstance(r.get("commit"), str)
        and isinstance(r.get("check"), str)
        and isinstance(r.get("factor"), (int, float))
        and math.isfinite(r["factor"])
    ]
    if limits is None:
        return valid
    kept, rows = [], {}
    for r in valid:
        seen = rows.setdefault(r["commit"], set())
        if r["check"] in seen or len(seen) >= limits.max_rows:
            continue
        if accept.limit_refusal(r["check"], r["factor"], limits) is None:
            seen.add(r["check"])
            kept.append(r)
    return kept


def accept_limits(thresholds_path: str | Path | None = None):
    """``[accept]`` of regression.toml (the suite's by default), as the gate reads it."""
    from rmsnorm_suite import thresholds

    return thresholds.load_thresholds(thresholds_path).accept


# ---------------------------------------------------------------------------------------------
# Histories
# ---------------------------------------------------------------------------------------------


def merged_order(series: Mapping[str, Sequence[tuple[str, float]]]) -> list[str]:
    """One order of every commit of ``series`` that keeps each series' own order (each is a
    subsequence of the history), where no first-parent order is given; ties by first appearance."""
    graph: graphlib.TopologicalSorter = graphlib.TopologicalSorter()
    seen = {}
    for points in series.values():
        names = [c for c, _ in points]
        for i, c in enumerate(names):
            seen.setdefault(c, len(seen))
            graph.add(c, *names[i - 1 : i])
    graph.prepare()
    order: list[str] = []
    while graph.is_active():
        ready = sorted(graph.get_ready(), key=seen.__getitem__)
        order += ready
        graph.done(*ready)
    return order


def first_parent_order(repo: str | Path, rev: str = "HEAD") -> list[str]:
    out = subprocess.run(
        ["git", "rev-list", "--first-parent", "--reverse", rev, "--"],
        cwd=repo,
        capture_output=True,
        timeout=120,
    )
    return out.stdout.decode().split() if out.returncode == 0 else []


def asv_series(
    results_dir: str | Path, machine: str | None = None, match: str = "", order: Sequence[str] = ()
) -> dict[str, list[tuple[str, float]]]:
    """Series from asv result files (``MACHINE/HASH8-ENV.json``): one per benchmark and parameter
    combination whose name matches ``match`` (a regular expression), each as (commit, value) in
    ``order`` (full SHAs, first-parent order of main; commits outside it are left out) or, without
    it, by the results' commit date."""
    pattern = re.compile(match)
    points: dict[str, dict[str, float]] = {}
    dates: dict[str, float] = {}
    root = Path(results_dir)
    machines = (
        [root / machine] if machine else sorted(p for p in root.iterdir() if (p / "machine.json").is_file())
    )
    for folder in machines:
        for path in sorted(folder.glob("*.json")):
            if path.name == "machine.json":
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
            commit = data.get("commit_hash")
            if not isinstance(commit, str):
                continue
            dates[commit] = float(data.get("date") or 0)
            columns = data.get("result_columns")
            for bench, entry in (data.get("results") or {}).items():
                res = dict(zip(columns, entry)) if columns and isinstance(entry, list) else entry
                if not isinstance(res, dict):
                    continue
                values, params = res.get("result"), res.get("params") or []
                if not isinstance(values, list):
                    values, combos = [values], [()]
                else:
                    combos = list(itertools.product(*params)) if params else [()]
                for combo, value in zip(combos, values):
                    name = bench + (f"({', '.join(str(c) for c in combo)})" if combo else "")
                    if (
                        pattern.search(name)
                        and isinstance(value, (int, float))
                        and math.isfinite(value)
                        and value > 0
                    ):
                        points.setdefault(name, {})[commit] = float(value)
    if order:
        rank = {c: i for i, c in enumerate(order)}
        return {
            n: sorted(((c, v) for c, v in p.items() if c in rank), key=lambda cv: rank[cv[0]])
            for n, p in points.items()
            if any(c in rank for c in p)
        }
    return {n: sorted(p.items(), key=lambda cv: dates.get(cv[0], 0)) for n, p in points.items()}


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--results", default=".asv/results", help="asv results folder (default .asv/results)")
    source.add_argument("--series", default=None, metavar="JSON", help='{"name": [[commit, value], ...]}')
    parser.add_argument("--machine", default=None, help="asv machine name (default: every machine)")
    parser.add_argument(
        "--match", default=r"track_gpu_median_ms\(.*'kernel'\)", help="regular expression on series names"
    )
    parser.add_argument("--rev", default="HEAD", help="first-parent order of this revision (asv results)")
    parser.add_argument(
        "--order",
        choices=("git", "date"),
        default="git",
        help="asv results in --rev's first-parent order (commits off it left out; default) or by commit date",
    )
    parser.add_argument(
        "--thresholds", default=None, help="regression.toml with [drift] (default: the suite's)"
    )
    parser.add_argument(
        "--accepted",
        action="append",
        default=[],
        metavar="JSON",
        help="accepted regressions: `rmsnorm_suite.history accepted`, or the results branch's "
        "accepted.json (`record-accepted`); repeat for both",
    )
    parser.add_argument("--out", default=None, metavar="JSON", help="write the steps found")


def run(args: argparse.Namespace) -> int:
    try:
        rule = rule_from(args.thresholds)
        limits = accept_limits(args.thresholds) if args.accepted else None
        accepted = [r for path in args.accepted for r in load_accepted(path, limits)]
        order: list[str] = []
        if args.series:
            raw = json.loads(Path(args.series).read_text(encoding="utf-8"))
            series = {str(k): [(str(c), float(v)) for c, v in pts] for k, pts in raw.items()}
            order = list(dict.fromkeys(c for pts in series.values() for c, _ in pts))
        else:
            if not Path(args.results).is_dir():
                raise ValueError(
                    f"no asv results at {args.results} (rmsnorm_suite.history results fetches them)"
                )
            order = first_parent_order(Path.cwd(), args.rev) if args.order == "git" else []
            if args.order == "git" and not order:
                raise ValueError(
                    f"no first-parent history of {args.rev} here (run in the repository, or --order date)"
                )
            series = asv_series(args.results, args.machine, args.match, order)
    except (OSError, ValueError, TypeError) as exc:
        print(f"changepoints: could not judge: {exc}", file=sys.stderr)
        return 2
    if not any(len(p) >= 2 * rule.min_size for p in series.values()):
        print(f"changepoints: no series with {2 * rule.min_size} or more points", file=sys.stderr)
        if args.out:  # nothing to bisect yet, said in the file the bisection reads
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "rule": asdict(rule),
                "level": None,
                "series": 0,
                "accepted": len(accepted),
                "steps": [],
            }
            Path(args.out).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        return 2
    steps, level = detect_all(series, rule)
    try:  # the history's order: main's first-parent line, else one the series agree on
        rank = {c: i for i, c in enumerate(order if not args.series and order else merged_order(series))}
    except graphlib.CycleError:  # series that disagree on the order of two commits (by date)
        rank = {}
    steps = [
        replace(s, commit_index=rank.get(s.first_commit, -1)) for s in mark_accepted(steps, accepted, order)
    ]
    steps.sort(key=lambda s: (s.commit_index, s.series))  # oldest first, across the series
    judged = sum(len(p) >= 2 * rule.min_size for p in series.values())
    print(
        f"changepoints: {judged} series, each tested at {level:.2g} (rate {rule.rate:g} over the series), "
        f"steps of {100 * rule.min_step:g}% or more"
    )
    for s in steps:
        print(
            f"  {s.direction}{' (accepted)' if s.accepted else ''}: {s.series}: x{s.ratio:.3f} ({s.before:.4g} -> {s.after:.4g}), p={s.p_value:.2g}, "
            f"first commit after it {s.first_commit[:12]}, in {s.last_before[:12]}..{s.first_commit[:12]}"
            + (f"; accepted by {s.accepted}" if s.accepted else "")
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "rule": asdict(rule),
            "level": level,
            "series": judged,
            "accepted": len(accepted),
            "steps": [asdict(s) for s in steps],
        }
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 1 if any(s.direction == "slowdown" and not s.accepted for s in steps) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rmsnorm-kernel changepoints", description=__doc__.splitlines()[0])
    configure(parser, "changepoints")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
