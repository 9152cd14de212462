"""`rmsnorm-kernel bisect --good REV --bad REV`: the first commit the gate flags, in a bounded search.

The commits strictly after ``good`` up to ``bad`` on ``bad``'s first-parent line are searched by
halving; each probe judges one candidate against the fixed ``good`` with the same judge (the real
one: pr-verdict with ``--exact-base``, as `nox -s drift` calls it). With n candidates it takes at
most ceil(log2(n + 1)) probes: ``bad`` is judged too, so a history whose ``bad`` the judge does not
flag is reported as inconsistent, never narrowed to an invented commit. ``--steps`` takes the
range from `changepoints --out` (its newest slowdown not accepted), on ``--within``'s first-parent
line only. Exit status: 0 narrowed (or nothing to bisect), 1 not narrowed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# pr-verdict's flags as `nox -s drift` passes them: a pinned base, benchmarks and gate only.
DRIFT_FLAGS = ("--exact-base", "--skip-gpu-tests")
SHA = re.compile(r"[0-9a-f]{40}")
NARROWED, INCONSISTENT = "narrowed", "inconsistent"
ONE_COMMIT = "one commit"  # the step's range holds one commit: named by the change point, not probed
OUT_OF_CALLS, OUT_OF_TIME, JUDGE_ERROR = "out of calls", "out of time", "judge error"


@dataclass
class Probe:
    commit: str
    flagged: bool | None  # None: the judge failed
    seconds: float
    error: str = ""


@dataclass
class Result:
    good: str
    bad: str
    stopped: str  # one of NARROWED, INCONSISTENT, OUT_OF_CALLS, OUT_OF_TIME, JUDGE_ERROR
    first_bad: str | None  # set only when narrowed
    last_good: str  # newest commit known not flagged (good itself at first)
    remaining: list[str]  # candidates still possible for the first bad commit, oldest first
    probes: list[Probe] = field(default_factory=list)

    @property
    def range(self) -> str:
        """``last commit before..first commit after``, as `changepoints` writes it."""
        return f"{self.last_good}..{self.remaining[-1] if self.remaining else self.bad}"

    def to_json(self) -> dict:
        return {**asdict(self), "range": self.range, "calls": len(self.probes)}


def first_parent_range(repo: str | Path, good: str, bad: str) -> tuple[str, str, list[str]]:
    """(good, bad, the commits after good up to bad on bad's first-parent line, oldest first)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        if done.returncode != 0:
            raise ValueError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip()

    shas = []
    for flag, rev in (("--good", good), ("--bad", bad)):
        try:
            shas.append(git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"))
        except ValueError:
            raise ValueError(f"{flag}: {rev!r} is not a commit here") from None
    commits = git("rev-list", "--first-parent", "--reverse", f"{shas[0]}..{shas[1]}").split()
    if not commits or git("rev-parse", f"{commits[0]}^") != shas[0]:
        raise ValueError(f"--good {good} is not on the first-parent line before --bad {bad}")
    return shas[0], shas[1], commits


def range_from_steps(path: str | Path, rank: dict[str, int] | None = None) -> tuple[str, str] | None:
    """(last commit before, first commit after) of the newest slowdown in a `changepoints --out`
    file that is not accepted, or None when there is none; malformed input is a ValueError.
    Newest: the latest first commit in ``rank`` (position on main's first-parent line, oldest 0)
    where given (a series' own ``index`` is not comparable across series), else by ``index``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise ValueError(f"{path}: no list of steps")
    candidates = []
    for s in steps:
        if not isinstance(s, dict) or s.get("direction") != "slowdown" or s.get("accepted"):
            continue
        good, bad = s.get("last_before"), s.get("first_commit")
        if not all(isinstance(c, str) and SHA.fullmatch(c) for c in (good, bad)):
            raise ValueError(f"{path}: a step's commits are not 40-hex SHAs")
        key = rank.get(bad, -1) if rank is not None else int(s.get("index", 0))
        candidates.append((key, good, bad))
    return max(candidates)[1:] if candidates else None


def first_parent_line(repo: str | Path, within: str) -> list[str]:
    """The commits of ``within``'s first-parent line, newest first; ``within`` must name one
    commit (an option, a range or several revisions is a ValueError, never a wider set)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)

    sha = git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{within}^{{commit}}").stdout.strip()
    if within.startswith("-") or not SHA.fullmatch(sha):
        raise ValueError(f"--within: {within!r} is not a commit here")
    line = git("rev-list", "--first-parent", sha, "--")
    if line.returncode != 0:
        raise ValueError(f"--within: git rev-list: {line.stderr.strip()}")
    return line.stdout.split()


def on_first_parent_line(repo: str | Path, commits: list[str], within: str) -> bool:
    """Every commit of ``commits`` is on ``within``'s first-parent line (main's history, not a PR's)."""
    try:
        return set(commits) <= set(first_parent_line(repo, within))
    except ValueError:
        return False


def search(
    good: str,
    commits: list[str],
    judge: Callable[[str, str], bool],
    max_calls: int | None = None,
    budget_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_probe: Callable[[Probe], None] | None = None,
) -> Result:
    """Halve ``commits`` (after ``good``, oldest first) for the first one ``judge(good, c)`` flags.

    Known: ``lo`` (-1 is good) not flagged, ``hi`` flagged; ``hi = len(commits)`` stands for "past
    bad", so bad itself is probed and an unflagged bad ends INCONSISTENT. The bounds are read before
    each probe: a probe once started runs to its end (pr-verdict's own deadline bounds it)."""
    if not commits:
        raise ValueError("no commits to search")
    if max_calls is not None and max_calls < 1:
        raise ValueError(f"--max-calls must be >= 1, got {max_calls}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"--budget-s must be > 0, got {budget_s}")
    start, probes = clock(), []
    lo, hi = -1, len(commits)
    stopped = NARROWED
    while hi - lo > 1:
        if max_calls is not None and len(probes) >= max_calls:
            stopped = OUT_OF_CALLS
            break
        if budget_s is not None and clock() - start >= budget_s:
            stopped = OUT_OF_TIME
            break
        mid = (lo + hi) // 2
        t0 = clock()
        try:
            flagged = bool(judge(good, commits[mid]))
        except Exception as exc:  # any failure of the judge ends the search with what is known
            probes.append(Probe(commits[mid], None, round(clock() - t0, 3), f"{type(exc).__name__}: {exc}"))
            if on_probe:
                on_probe(probes[-1])
            stopped = JUDGE_ERROR
            break
        probes.append(Probe(commits[mid], flagged, round(clock() - t0, 3)))
        if on_probe:
            on_probe(probes[-1])
        lo, hi = (lo, mid) if flagged else (mid, hi)
    if stopped == NARROWED and hi == len(commits):
        stopped = INCONSISTENT  # bad was judged and not flagged: no first bad commit to name
    return Result(
        good=good,
        bad=commits[-1],
        stopped=stopped,
        first_bad=commits[hi] if stopped == NARROWED else None,
        last_good=good if lo < 0 else commits[lo],
        remaining=[] if stopped == INCONSISTENT else commits[lo + 1 : min(hi, len(commits) - 1) + 1],
        probes=probes,
    )


def max_probes(n: int) -> int:
    """The most probes `search` makes over ``n`` candidates without bounds."""
    return math.ceil(math.log2(n + 1))


class JudgeError(RuntimeError):
    pass


def pr_verdict_judge(out: Path, extra: list[str], repo: str = ".") -> Callable[[str, str], bool]:
    """The gate as a judge: pr-verdict with drift's flags, base=good, head=candidate, in its own
    process and folder; its verdict.json's status: regression -> True, pass -> False, else error."""

    def judge(base: str, head: str) -> bool:
        folder = out / "probes" / head[:12]
        command = [sys.executable, "-m", "rmsnorm_suite", "pr-verdict", "--base", base, "--head", head]
        command += [*DRIFT_FLAGS, "--repo", repo, "--out", str(folder), *extra]
        subprocess.run(command, check=False)
        try:
            verdict = json.loads((folder / "verdict.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise JudgeError(f"pr-verdict wrote no verdict for {head[:12]}: {exc}") from None
        if verdict.get("status") not in ("pass", "regression"):
            raise JudgeError(f"{head[:12]}: {verdict.get('summary') or verdict.get('status')}"[:300])
        return verdict["status"] == "regression"

    return judge


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--good", default=None, metavar="REV", help="a commit the gate passes (the base)")
    parser.add_argument("--bad", default=None, metavar="REV", help="a later commit the gate flags")
    parser.add_argument(
        "--steps", default=None, metavar="JSON", help="the range of changepoints' newest slowdown"
    )
    parser.add_argument(
        "--within", default="HEAD", metavar="REV", help="--steps: commits on this first-parent line"
    )
    parser.add_argument("--deadline-s", type=float, default=None, help="pr-verdict's --deadline-s per probe")
    parser.add_argument("--max-calls", type=int, default=None, metavar="N", help="at most N pr-verdict runs")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S", help="start no run after S s")
    parser.add_argument("--out", default="outputs/bisect", metavar="DIR", help="bisect.json and each run")
    parser.add_argument("--repo", default=".", help="git repository holding both commits (default: .)")
    parser.add_argument("--rounds", type=int, default=None, help="pr-verdict's --rounds per probe")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE", help="pr-verdict's --shapes")


def run(args: argparse.Namespace, judge: Callable[[str, str], bool] | None = None) -> int:
    out = Path(args.out)
    try:
        if args.steps:
            line = first_parent_line(args.repo, args.within)
            found = range_from_steps(args.steps, {c: len(line) - i for i, c in enumerate(line)})
            if found is None:
                print(f"bisect: no slowdown to bisect in {args.steps} (none, or every one accepted)")
                return 0
            if not set(found) <= set(line):
                raise ValueError(f"the step's commits are not on {args.within}'s first-parent line")
            args.good, args.bad = found
        if not (args.good and args.bad):
            raise ValueError("--good and --bad, or --steps, are needed")
        good, _bad, commits = first_parent_range(args.repo, args.good, args.bad)
        if args.steps and len(commits) == 1:
            out.mkdir(parents=True, exist_ok=True)
            result = Result(good, commits[0], ONE_COMMIT, commits[0], good, commits)
            (out / "bisect.json").write_text(json.dumps(result.to_json(), indent=1) + "\n", encoding="utf-8")
            print(f"bisect: the step's range is one commit, {commits[0][:12]}: nothing to probe")
            return 0
        extra = (["--rounds", str(args.rounds)] if args.rounds else []) + (
            ["--shapes", *args.shapes] if args.shapes else []
        )
        extra += ["--deadline-s", f"{args.deadline_s:g}"] if args.deadline_s else []
        judge = judge or pr_verdict_judge(out.resolve(), extra, str(Path(args.repo).resolve()))
        print(f"bisect: {len(commits)} commits after {good[:12]}, at most {max_probes(len(commits))} probes")
        result = search(good, commits, judge, args.max_calls, args.budget_s)
    except (OSError, ValueError) as exc:
        print(f"bisect: bad input: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "bisect.json").write_text(json.dumps(result.to_json(), indent=1) + "\n", encoding="utf-8")
    print(f"{'#':>2}  {'commit':12}  {'verdict':10}  seconds")
    for i, p in enumerate(result.probes, 1):
        verdict = "error" if p.flagged is None else "regression" if p.flagged else "pass"
        print(f"{i:>2}  {p.commit[:12]}  {verdict:10}  {p.seconds:g}")
    found = f", first bad {result.first_bad[:12]}" if result.first_bad else ""
    last, first = result.range.split("..")
    print(f"bisect: {result.stopped}{found}; range {last[:12]}..{first[:12]} ({len(result.remaining)} left)")
    return 0 if result.stopped == NARROWED else 1
