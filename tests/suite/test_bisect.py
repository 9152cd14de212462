"""The bounded bisection (rmsnorm_suite.bisection) with a fake judge over a small git repository."""

from __future__ import annotations

import json
import math
import subprocess
from argparse import Namespace

import pytest

from rmsnorm_suite import bisection

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def _git(repo, *args):
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """good, then 9 commits on main; a side branch merged as the 6th (first-parent line kept)."""
    repo = tmp_path_factory.mktemp("repo")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "good")
    good = _git(repo, "rev-parse", "HEAD")
    after = []
    for i in range(9):
        if i == 5:
            _git(repo, "checkout", "-q", "-b", "side")
            _git(repo, "commit", "-q", "--allow-empty", "-m", "side")
            _git(repo, "checkout", "-q", "main")
            _git(repo, "merge", "-q", "--no-ff", "-m", "merge side", "side")
        else:
            _git(repo, "commit", "-q", "--allow-empty", "-m", f"c{i}")
        after.append(_git(repo, "rev-parse", "HEAD"))
    return repo, good, after


def planted(commits, first_bad, calls):
    """A judge that flags every commit from ``first_bad`` on, and records its calls."""
    bad = set(commits[first_bad:]) if first_bad is not None else set()

    def judge(base, head):
        calls.append((base, head))
        return head in bad

    return judge


def test_the_range_is_the_first_parent_line(history):
    repo, good, after = history
    assert bisection.first_parent_range(repo, good, "main") == (good, after[-1], after)
    side = _git(repo, "rev-parse", "side")
    assert side not in after
    with pytest.raises(ValueError, match="not a commit"):
        bisection.first_parent_range(repo, good, "nope")
    with pytest.raises(ValueError, match="first-parent"):
        bisection.first_parent_range(repo, after[-1], good)  # reversed
    with pytest.raises(ValueError, match="first-parent"):
        bisection.first_parent_range(repo, side, "main")  # good off the first-parent line


@pytest.mark.parametrize("position", range(9))
def test_finds_a_planted_first_bad_commit_at_every_position(history, position):
    _repo, good, after = history
    calls = []
    result = bisection.search(good, after, planted(after, position, calls))
    assert result.stopped == bisection.NARROWED
    assert result.first_bad == after[position] and result.remaining == [after[position]]
    assert result.last_good == (good if position == 0 else after[position - 1])
    assert len(calls) <= math.ceil(math.log2(len(after))) == bisection.max_probes(len(after)) == 4
    assert all(base == good for base, _ in calls)  # every probe against the same base
    assert [p.commit for p in result.probes] == [head for _, head in calls]


def test_a_bad_end_the_judge_does_not_flag_is_inconsistent(history):
    _repo, good, after = history
    calls = []
    result = bisection.search(good, after, planted(after, None, calls))
    assert result.stopped == bisection.INCONSISTENT and result.first_bad is None
    assert calls[-1] == (good, after[-1]) and len(calls) <= 4  # bad itself was judged
    assert result.remaining == [] and result.last_good == after[-1]


def test_stops_at_the_call_bound_with_the_remaining_range(history):
    _repo, good, after = history
    calls = []
    result = bisection.search(good, after, planted(after, 6, calls), max_calls=2)
    assert result.stopped == bisection.OUT_OF_CALLS and len(calls) == 2 and result.first_bad is None
    assert after[6] in result.remaining and len(result.remaining) < len(after)
    lo = after.index(result.remaining[0]) - 1
    assert result.last_good == after[lo]
    assert result.range == f"{after[lo]}..{result.remaining[-1]}"


def test_stops_when_the_time_budget_is_spent(history):
    _repo, good, after = history
    now = [0.0]

    def slow(base, head):
        now[0] += 10.0
        return head in after[3:]

    result = bisection.search(good, after, slow, budget_s=15, clock=lambda: now[0])
    assert result.stopped == bisection.OUT_OF_TIME and len(result.probes) == 2
    assert after[3] in result.remaining and result.probes[0].seconds == 10.0


def test_a_judge_that_raises_ends_with_the_range_so_far(history):
    _repo, good, after = history
    seen = []

    def broken(base, head):
        seen.append(head)
        if len(seen) == 2:
            raise RuntimeError("no GPU")
        return head in after[2:]

    result = bisection.search(good, after, broken)
    assert result.stopped == bisection.JUDGE_ERROR and result.first_bad is None
    assert result.probes[-1].flagged is None and "no GPU" in result.probes[-1].error
    assert result.remaining == after[0:5] and result.last_good == good  # after the first probe only


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max-calls"):
        bisection.search("g", ["a"], lambda b, h: True, max_calls=0)
    with pytest.raises(ValueError, match="no commits"):
        bisection.search("g", [], lambda b, h: True)


def _args(tmp_path, repo, good, bad, **kw):
    kw = {"steps": None, "within": "HEAD", "deadline_s": None, **kw}
    return Namespace(good=good, bad=bad, max_calls=None, budget_s=None, out=str(tmp_path / "out"),
                     repo=str(repo), rounds=None, shapes=None, **kw)  # fmt: skip


def test_run_writes_json_and_exits_by_outcome(history, tmp_path, capsys):
    repo, good, after = history
    assert bisection.run(_args(tmp_path, repo, good, "main"), planted(after, 4, [])) == 0
    saved = json.loads((tmp_path / "out" / "bisect.json").read_text(encoding="utf-8"))
    assert saved["first_bad"] == after[4] and saved["stopped"] == "narrowed" and saved["calls"] <= 4
    out = capsys.readouterr().out
    assert "regression" in out and after[4][:12] in out
    args = _args(tmp_path, repo, good, "main")
    args.max_calls = 1
    assert bisection.run(args, planted(after, 4, [])) == 1
    assert bisection.run(_args(tmp_path, repo, good, "nope"), planted(after, 4, [])) == 2
    assert "bad input" in capsys.readouterr().err


def test_the_real_judge_calls_pr_verdict_as_drift_does(monkeypatch, tmp_path):
    """The adapter runs pr-verdict with drift's flags and reads its verdict's status."""
    commands = []

    def fake_run(command, check):
        commands.append(command)
        folder = tmp_path / command[command.index("--out") + 1]
        folder.mkdir(parents=True, exist_ok=True)
        status = {"h1": "regression", "h2": "pass", "h3": "error"}[command[command.index("--head") + 1]]
        (folder / "verdict.json").write_text(json.dumps({"status": status, "summary": "S"}))

    monkeypatch.setattr(bisection.subprocess, "run", fake_run)
    judge = bisection.pr_verdict_judge(tmp_path, ["--rounds", "4"])
    assert judge("g", "h1") is True and judge("g", "h2") is False
    with pytest.raises(bisection.JudgeError, match="S"):
        judge("g", "h3")
    assert commands[0][3:] == ["pr-verdict", "--base", "g", "--head", "h1", *bisection.DRIFT_FLAGS,
                               "--repo", ".", "--out", str(tmp_path / "probes" / "h1"), "--rounds", "4"]  # fmt: skip


def test_drift_passes_pr_verdict_the_same_flags():
    """`nox -s drift` and the bisection judge with one gate call: a change to one shows here."""
    from pathlib import Path

    noxfile = (Path(__file__).resolve().parents[2] / "noxfile.py").read_text(encoding="utf-8")
    drift = noxfile.split("def drift(", 1)[1].split("\n@nox.session", 1)[0]
    assert ", ".join(f'"{flag}"' for flag in bisection.DRIFT_FLAGS) in drift


def steps_file(path, *steps):
    """A `changepoints --out` file with these (last_before, first_commit, accepted) slowdowns."""
    rows = [{"series": "s", "index": i + 3, "first_commit": bad, "last_before": good, "direction": "slowdown",
             "accepted": acc, "ratio": 1.05} for i, (good, bad, acc) in enumerate(steps)]  # fmt: skip
    path.write_text(json.dumps({"steps": rows}))
    return str(path)


def test_steps_give_the_newest_slowdown_not_accepted_on_main_only(history, tmp_path, capsys):
    repo, good, after = history
    steps = steps_file(tmp_path / "s.json", (good, after[8], ""), (after[0], after[1], "x1.08: why"))
    args = _args(tmp_path, repo, None, None, steps=steps, within="main")
    assert bisection.run(args, planted(after, 4, [])) == 0  # the accepted one is newer: skipped
    assert json.loads((tmp_path / "out" / "bisect.json").read_text())["first_bad"] == after[4]
    one = steps_file(tmp_path / "one.json", (after[2], after[3], ""))
    calls = []
    assert (
        bisection.run(_args(tmp_path, repo, None, None, steps=one, within="main"), planted(after, 3, calls))
        == 0
    )
    saved = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert calls == [] and saved["stopped"] == bisection.ONE_COMMIT and saved["first_bad"] == after[3]
    none = steps_file(tmp_path / "none.json", (good, after[8], "x1.1: why"))
    assert bisection.run(_args(tmp_path, repo, None, None, steps=none), planted(after, 4, calls)) == 0
    assert calls == [] and "no slowdown to bisect" in capsys.readouterr().out
    _git(repo, "checkout", "-q", "-b", "pr-branch", after[8])
    _git(repo, "commit", "-q", "--allow-empty", "-m", "a pull request's commit")
    foreign = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "main")
    off_main = steps_file(tmp_path / "pr.json", (after[8], foreign, ""))
    assert (
        bisection.run(
            _args(tmp_path, repo, None, None, steps=off_main, within="main"), planted(after, 0, calls)
        )
        == 2
    )
    assert calls == [] and "not on main's first-parent line" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(
        json.dumps({"steps": [{"direction": "slowdown", "first_commit": "--all"}]})
    )
    assert bisection.run(_args(tmp_path, repo, None, None, steps=str(tmp_path / "bad.json"))) == 2


def test_within_names_one_commit_never_an_option_or_a_set_of_refs(history):
    """A commit reachable only through a merge's second parent is off main's line, whatever
    --within says: an option (--all, --branches), two revisions or a range widen nothing."""
    repo, good, after = history
    side = _git(repo, "rev-parse", "side")
    assert bisection.on_first_parent_line(repo, [good, after[8]], "main")
    for within in ("main", "--all", "--branches", "main side", "side..main", "-n1", "main;side"):
        assert not bisection.on_first_parent_line(repo, [side], within), within
    with pytest.raises(ValueError, match="not a commit"):
        bisection.first_parent_line(repo, "--all")


def test_the_newest_step_is_the_newest_on_mains_line_not_the_largest_series_index(history, tmp_path):
    """Series differ in length, so a step's index says nothing across series: a long series' old
    step (index 40) is older than a short series' recent one (index 3)."""
    repo, good, after = history
    rows = [{"series": "long", "index": 40, "first_commit": after[1], "last_before": after[0],
             "direction": "slowdown", "accepted": "", "ratio": 1.05},
            {"series": "short", "index": 3, "first_commit": after[7], "last_before": after[6],
             "direction": "slowdown", "accepted": "", "ratio": 1.05}]  # fmt: skip
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"steps": rows}))
    calls = []
    assert (
        bisection.run(
            _args(tmp_path, repo, None, None, steps=str(path), within="main"), planted(after, 7, calls)
        )
        == 0
    )
    saved = json.loads((tmp_path / "out" / "bisect.json").read_text())
    assert saved["stopped"] == bisection.ONE_COMMIT and saved["first_bad"] == after[7]
