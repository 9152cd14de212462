"""Change points over main's history (rmsnorm_suite.changepoint) on synthetic series with known
steps: the first commit of a step is named, a series without one stays quiet at the stated
rate, a step under min_step is not reported, and asv result files are read in first-parent order."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rmsnorm_suite import changepoint as cp
from rmsnorm_suite import cli

FAST = cp.DriftRule(rate=0.01, min_step=0.02, min_size=3, permutations=1999)


def commits(n: int) -> list[str]:
    return [f"{i:08x}" + "ab" * 16 for i in range(1, n + 1)]  # distinct asv file names (HASH8)


def series(n: int, steps: dict[int, float], noise: float, seed: int, level: float = 0.1) -> list[float]:
    """``level`` ms with log-normal noise, multiplied by each step's factor from its index on."""
    rng = np.random.default_rng(seed)
    values, scale = [], level
    for i in range(n):
        scale *= steps.get(i, 1.0)
        values.append(scale * math.exp(noise * rng.standard_normal()))
    return values


@pytest.mark.parametrize("seed", range(5))
def test_a_planted_step_is_named_by_its_first_commit(seed):
    c = commits(40)
    found = cp.detect(series(40, {23: 1.05}, 0.005, seed), c, FAST, name="fwd")
    assert [(s.index, s.first_commit, s.last_before, s.direction) for s in found] == [
        (23, c[23], c[22], "slowdown")
    ]
    assert found[0].ratio == pytest.approx(1.05, abs=0.01) and found[0].p_value < FAST.rate


def test_two_steps_are_both_found():
    c = commits(60)
    found = cp.detect(series(60, {15: 1.08, 40: 0.95}, 0.005, 7), c, FAST)
    assert [(s.index, s.direction) for s in found] == [(15, "slowdown"), (40, "improvement")]


def test_a_significant_step_under_min_step_is_not_reported():
    c = commits(40)
    assert cp.detect(series(40, {20: 1.01}, 0.001, 3), c, FAST) == []
    loose = cp.DriftRule(FAST.rate, 0.005, FAST.min_size, FAST.permutations)
    assert [s.index for s in cp.detect(series(40, {20: 1.01}, 0.001, 3), c, loose)] == [20]


def test_the_false_alarm_rate_without_a_step_is_under_the_rate():
    """300 series of pure noise at a per-series rate of 0.05: the share with any step reported
    (min_step 0, so only the test decides) stays within the rate plus three binomial SDs."""
    rule = cp.DriftRule(rate=0.05, min_step=0.0, min_size=3, permutations=199)
    c = commits(30)
    alarms = sum(bool(cp.detect(series(30, {}, 0.01, 1000 + i), c, rule, seed=i)) for i in range(300))
    assert alarms / 300 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300), alarms


def test_a_step_at_the_edge_needs_min_size_points_on_each_side():
    c = commits(20)
    assert cp.detect(series(20, {19: 1.5}, 0.005, 1), c, FAST) == []  # one point after it: no judgement
    assert [s.index for s in cp.detect(series(20, {17: 1.5}, 0.005, 1), c, FAST)] == [17]


def test_bad_series_are_refused():
    with pytest.raises(ValueError, match="values for"):
        cp.detect([1.0, 2.0], commits(3))
    with pytest.raises(ValueError, match="finite and positive"):
        cp.detect([1.0, 0.0, 1.0], commits(3))


def test_detect_all_shares_the_rate_across_series():
    c = commits(40)
    data = {f"s{i}": list(zip(c, series(40, {}, 0.005, i))) for i in range(9)}
    data["planted"] = list(zip(c, series(40, {25: 1.04}, 0.005, 99)))
    steps, level = cp.detect_all(data, FAST)
    assert level == pytest.approx(FAST.rate / 10)
    assert [(s.series, s.first_commit) for s in steps] == [("planted", c[25])]


def write_asv(root, machine: str, points: list[tuple[str, float, float]]) -> None:
    """asv results (format 2) for one parameterised benchmark: (commit, kernel value, eager value)."""
    (root / machine).mkdir(parents=True)
    (root / "benchmarks.json").write_text("{}")
    (root / machine / "machine.json").write_text(json.dumps({"machine": machine}))
    for i, (commit, kernel, eager) in enumerate(points):
        data = {
            "commit_hash": commit,
            "date": 1_700_000_000_000 + i,
            "result_columns": ["result", "params", "version"],
            "results": {
                "bench_rmsnorm.Forward.track_gpu_median_ms": [
                    [kernel, eager],
                    [["'32768x4096-bfloat16'"], ["'kernel'", "'eager'"]],
                    "1",
                ]
            },
            "version": 2,
        }
        (root / machine / f"{commit[:8]}-existing.json").write_text(json.dumps(data))


def test_asv_history_with_a_planted_step_names_the_commit(tmp_path, capsys):
    c = commits(30)
    kernel = series(30, {18: 1.06}, 0.004, 5)
    eager = series(30, {}, 0.004, 6, level=0.3)
    write_asv(tmp_path / "results", "h200", list(zip(c, kernel, eager)))
    got = cp.asv_series(tmp_path / "results", "h200", r"track_gpu_median_ms\(.*kernel")
    name = "bench_rmsnorm.Forward.track_gpu_median_ms('32768x4096-bfloat16', 'kernel')"
    assert list(got) == [name] and [commit for commit, _ in got[name]] == c
    # first-parent order given: commits outside it are left out, the order is the given one
    order = list(reversed(c[5:]))
    assert [
        commit for commit, _ in cp.asv_series(tmp_path / "results", "h200", "kernel", order)[name]
    ] == order
    out = tmp_path / "steps.json"
    argv = ["changepoints", "--results", str(tmp_path / "results"), "--machine", "h200", "--out", str(out)]
    assert cli.main(argv) == 2  # this checkout's first-parent history holds none of these commits
    code = cli.main([*argv, "--order", "date"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert f"first commit after it {c[18][:12]}" in text and "slowdown" in text
    steps = json.loads(out.read_text())["steps"]
    assert [(s["first_commit"], s["last_before"]) for s in steps] == [(c[18], c[17])]


def test_series_json_and_nothing_to_judge(tmp_path, capsys):
    c = commits(12)
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"flat": [[x, v] for x, v in zip(c, series(12, {}, 0.004, 1))]}))
    assert cli.main(["changepoints", "--series", str(path)]) == 0
    path.write_text(json.dumps({"short": [[c[0], 1.0], [c[1], 1.0]]}))
    assert cli.main(["changepoints", "--series", str(path)]) == 2
    assert cli.main(["changepoints", "--results", str(tmp_path / "none")]) == 2
    assert "could not judge" in capsys.readouterr().err


def test_the_drift_rule_is_declared_in_regression_toml():
    assert cp.rule_from() == cp.DriftRule(rate=0.01, min_step=0.02, min_size=3, permutations=9999)


KERNEL_FORWARD = "bench_rmsnorm.Forward.track_gpu_median_ms('32768x4096-bfloat16', 'kernel')"


def test_an_accepted_regression_marks_its_step_and_no_other(tmp_path, capsys):
    """A +6% step at commit 18 of 30, accepted there up to 1.08: marked accepted, exit 0; the same
    record at another commit, for another row, or with a factor under the step leaves a slowdown."""
    c = commits(30)
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps({KERNEL_FORWARD: [[x, v] for x, v in zip(c, series(30, {18: 1.06}, 0.004, 5))]})
    )
    record = {"commit": c[18], "source": c[18], "check": "device 32768x4096-bfloat16 forward", "factor": 1.08,
              "reason": "two passes for accuracy"}  # fmt: skip
    accepted, out = tmp_path / "accepted.json", tmp_path / "steps.json"
    argv = ["changepoints", "--series", str(path), "--accepted", str(accepted), "--out", str(out)]
    accepted.write_text(json.dumps({"accepted": [record]}))
    assert cli.main(argv) == 0
    assert "slowdown (accepted)" in capsys.readouterr().out
    (step,) = json.loads(out.read_text())["steps"]
    assert step["first_commit"] == c[18] and step["accepted"].startswith(f"{c[18][:12]} x1.08")
    for other in ({"commit": c[10]}, {"check": "device 32768x4096-bfloat16 forward_backward"},
                  {"check": "host 32768x4096-bfloat16 forward"}, {"factor": 1.03}):  # fmt: skip
        accepted.write_text(json.dumps({"accepted": [{**record, **other}]}))
        assert cli.main(argv) == 1, other
        assert json.loads(out.read_text())["steps"][0]["accepted"] == ""


def test_an_acceptance_marks_only_a_step_of_that_one_commit():
    """A range of several commits (skipped runs) stays a slowdown even where one of them, or its
    first commit, carries an acceptance: another commit may be the cause. Without main's order
    the range's size is unknown, so nothing is marked."""
    c = commits(12)
    wide = cp.Step(KERNEL_FORWARD, 6, c[9], c[5], 1.0, 1.05, 1.05, 1e-4, 1e-3, "slowdown")
    one = cp.Step(KERNEL_FORWARD, 6, c[9], c[8], 1.0, 1.05, 1.05, 1e-4, 1e-3, "slowdown")
    for commit in (c[7], c[9]):
        record = {"commit": commit, "check": "device 32768x4096-bfloat16 forward", "factor": 1.1}
        assert cp.mark_accepted([wide], [record], c)[0].accepted == "", commit
    record = {"commit": c[9], "check": "device 32768x4096-bfloat16 forward", "factor": 1.1}
    assert cp.mark_accepted([one], [record], c)[0].accepted.startswith(c[9][:12])
    assert cp.mark_accepted([one], [record], [])[0].accepted == ""
    assert cp.check_series("numerics 4096x4096-bfloat16 forward") == ""


def test_history_honours_an_acceptance_only_within_the_gates_accept_limits(tmp_path):
    """regression.toml [accept] bounds history as it bounds the gate: a factor past max_factor, a
    kind it does not list, or rows past max_rows of one commit mark nothing."""
    from rmsnorm_suite.thresholds import AcceptLimits

    limits = AcceptLimits(max_rows=1, max_factor=1.25, kinds=("device",))
    c = "a" * 40
    recs = [
        {"commit": c, "check": "device 32768x4096-bfloat16 forward", "factor": 1000.0},
        {"commit": c, "check": "host 32768x4096-bfloat16 forward", "factor": 1.1},
        {"commit": c, "check": "device 8192x4096-bfloat16 forward", "factor": 1.1},
        {"commit": c, "check": "device 4096x4096-bfloat16 forward", "factor": 1.2},
        {"commit": "b" * 40, "check": "device 4096x4096-bfloat16 forward", "factor": 1.0},
    ]
    path = tmp_path / "accepted.json"
    path.write_text(json.dumps({"accepted": recs}))
    assert [r["check"] for r in cp.load_accepted(path, limits)] == ["device 8192x4096-bfloat16 forward"]
    assert cp.load_accepted(path, AcceptLimits()) == []  # [accept] allows none: none is honoured
    # end to end: a x2 step, "accepted" at x1000 by a trailer, stays a slowdown
    c = commits(30)
    data = tmp_path / "s.json"
    data.write_text(
        json.dumps({KERNEL_FORWARD: [[x, v] for x, v in zip(c, series(30, {18: 2.0}, 0.004, 5))]})
    )
    path.write_text(json.dumps({"accepted": [{**recs[0], "commit": c[18]}]}))
    out = tmp_path / "steps.json"
    assert cli.main(["changepoints", "--series", str(data), "--accepted", str(path), "--out", str(out)]) == 1
    assert json.loads(out.read_text())["steps"][0]["accepted"] == ""


def test_a_history_too_short_to_judge_still_writes_its_empty_steps(tmp_path):
    """Exit 2 (too few points yet) writes steps.json with no step, so that the GPU bisection reads
    "nothing to bisect" and ends before installing, instead of failing on a missing file."""
    c = commits(2)
    path, out = tmp_path / "s.json", tmp_path / "o" / "steps.json"
    path.write_text(json.dumps({"short": [[c[0], 1.0], [c[1], 1.0]]}))
    assert cli.main(["changepoints", "--series", str(path), "--out", str(out)]) == 2
    saved = json.loads(out.read_text())
    assert saved["steps"] == [] and saved["series"] == 0


def test_steps_carry_their_commits_place_in_the_history_oldest_first_across_series(tmp_path):
    """Two series, one missing the first commits: each step's ``commit_index`` is its first commit's
    place in the whole history (not in its own series), and steps.json lists them oldest first."""
    c = commits(36)
    late = series(30, {20: 1.08}, 0.004, 2)  # from commit 6 on: its step is at commit 26
    early = series(36, {12: 1.08}, 0.004, 3, level=0.3)
    data = {"a.late": [[x, v] for x, v in zip(c[6:], late)], "b.early": [[x, v] for x, v in zip(c, early)]}
    path, out = tmp_path / "s.json", tmp_path / "steps.json"
    path.write_text(json.dumps(dict(reversed(data.items()))))
    assert cp.merged_order({"x": [(c[2], 1.0), (c[5], 1.0)], "y": [(c[1], 1.0), (c[2], 1.0)]}) == [
        c[1], c[2], c[5]
    ]  # fmt: skip
    assert cli.main(["changepoints", "--series", str(path), "--out", str(out)]) == 1
    got = [(s["series"], s["index"], s["commit_index"]) for s in json.loads(out.read_text())["steps"]]
    assert got == [("b.early", 12, 12), ("a.late", 20, 26)]


def test_a_merged_verdicts_accepted_row_is_kept_in_the_history_and_its_step_reads_accepted(tmp_path, capsys):
    """A pull request's verdict accepts a +8% device row (approved, within 1.12); the publish job
    records it under main's merge commit in the results branch's accepted.json (which passes the
    branch's check); change points over that history then read the step at that commit
    ``accepted``, with the approver, and exit 0. The same verdict without approval records
    nothing, and the step stays a slowdown."""
    import importlib.util

    from rmsnorm_suite import accept, gate, history
    from tests.suite._fixtures import LARGE, ROOT, THRESHOLDS, make_run

    spec = importlib.util.spec_from_file_location("check_asv", ROOT / ".github/scripts/check_asv_results.py")
    check_asv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_asv)
    check = f"device {LARGE} forward"
    base, head = make_run(30), make_run(31, device_slower={(LARGE, "forward"): 1.08})
    c = commits(30)
    kernel = series(30, {18: 1.08}, 0.004, 5)
    write_asv(tmp_path / "results", "h200", list(zip(c, kernel, series(30, {}, 0.004, 6, level=0.3))))
    points = cp.asv_series(tmp_path / "results", "h200", r"track_gpu_median_ms\(.*kernel")
    (tmp_path / "series.json").write_text(json.dumps(points))
    for who, expected in (("maintainer", "accepted"), (None, "regression")):
        request = accept.approve([accept.parse(f"{check} 1.12 two passes <b>for</b> accuracy")], who)
        verdict = gate.judge(base, head, THRESHOLDS, acceptances=request)
        assert [r.verdict for r in verdict.rows if r.check == check] == [expected]
        folder = tmp_path / who_folder(who) / "verdict-h200"
        folder.mkdir(parents=True)
        (folder / "verdict.json").write_text(json.dumps({**verdict.to_json(), "head_sha": "e" * 40}))
        ledger = tmp_path / who_folder(who) / "results" / "accepted.json"
        argv = ["record-accepted", "--verdicts", str(folder.parent), "--commit", c[18], "--pull", "7"]
        assert history.main([*argv, "--into", str(ledger)]) == 0
        assert history.main([*argv, "--into", str(ledger)]) == 0  # a second run adds nothing
        records = json.loads(ledger.read_text())["accepted"]
        assert check_asv.check_tree(ledger.parent, skip_git=True)[1] == []  # the branch keeps it
        assert check_asv.check_tree(ledger.parent)[1] != []  # a GPU job's artifact may not bring it
        out = tmp_path / who_folder(who) / "steps.json"
        code = cli.main(["changepoints", "--series", str(tmp_path / "series.json"), "--accepted", str(ledger),
                         "--out", str(out)])  # fmt: skip
        (step,) = json.loads(out.read_text())["steps"]
        assert step["first_commit"] == c[18]
        if who:
            assert [(r["commit"], r["check"], r["factor"], r["approved_by"], r["pull"]) for r in records] == [
                (c[18], check, 1.12, "maintainer", 7)
            ]  # fmt: skip
            assert code == 0 and step["accepted"].startswith(
                f'{c[18][:12]} x1.12 approved by maintainer: "two passes'
            )
            assert step["approved_by"] == "maintainer" and "<" not in step["accepted"]
            assert "slowdown (accepted)" in capsys.readouterr().out
        else:
            assert records == [] and code == 1 and step["accepted"] == ""


def who_folder(who: str | None) -> str:
    return f"approved-by-{who}" if who else "not-approved"


def test_only_rows_the_verdict_accepted_with_a_granted_approved_request_are_recorded():
    """A row reads ``accepted`` only with its granted, approved request beside it in the verdict;
    one without, or whose request lacks the approver or a finite factor over 1, is left out."""
    from rmsnorm_suite import history

    rows = [
        {"check": f"device {shape} forward", "verdict": "accepted"} for shape in ("1x1-a", "2x2-a", "3x3-a")
    ]
    granted = [{"check": "device 1x1-a forward", "factor": 1.1, "reason": "r", "approved_by": "m"},
               {"check": "device 2x2-a forward", "factor": 1.1, "reason": "r"},
               {"check": "device 3x3-a forward", "factor": float("nan"), "approved_by": "m"}]  # fmt: skip
    verdict = {"rows": [*rows, {"check": "device 4x4-a forward", "verdict": "pass"}],
               "acceptance": {"granted": granted + [{**granted[0], "check": "device 4x4-a forward"}]}}  # fmt: skip
    got = history.verdict_acceptances(verdict)
    assert got == [{"check": "device 1x1-a forward", "factor": 1.1, "reason": "r", "approved_by": "m"}]
    assert history.verdict_acceptances({"rows": rows}) == [] and history.verdict_acceptances([]) == []


def test_only_a_recorded_approval_reads_approved_and_it_wins_over_the_trailer():
    """The reason is the pull request author's trailer text: one that says "(approved by alice)"
    does not make a step read approved, and nothing after the approver's place can pose as it.
    Where the commit carries both the trailer (``history accepted``, listed first) and the merged
    verdict's record of it (accepted.json, with the approver), the step names the approver."""
    c = commits(12)
    one = cp.Step(KERNEL_FORWARD, 6, c[9], c[8], 1.0, 1.05, 1.05, 1e-4, 1e-3, "slowdown")
    check = "device 32768x4096-bfloat16 forward"
    forged = {"commit": c[9], "check": check, "factor": 1.1, "reason": "fused (approved by alice)"}
    (step,) = cp.mark_accepted([one], [forged], c)
    assert (
        step.accepted and step.approved_by == "" and "approved by alice" not in step.accepted.split(": ")[0]
    )
    assert step.accepted.startswith(f"{c[9][:12]} x1.1 trailer only: ")
    ledger = {**forged, "reason": "fused", "approved_by": "maintainer"}
    (step,) = cp.mark_accepted([one], [forged, ledger], c)
    assert step.approved_by == "maintainer"
    assert step.accepted == f'{c[9][:12]} x1.1 approved by maintainer: "fused"'
    # an approver that is not a login is not believed as one
    (step,) = cp.mark_accepted([one], [{**ledger, "approved_by": "bob: ok (approved by alice)"}], c)
    assert step.approved_by == "" and step.accepted.startswith(f"{c[9][:12]} x1.1 trailer only: ")


def test_record_accepted_takes_only_the_merged_heads_verdicts_and_survives_malformed_ones(tmp_path):
    """The publish job's record step must not stop main's history: a verdict that is not JSON, is
    too large, has rows or grants of the wrong types, or a ledger row with odd types is passed
    over, and the good verdict is recorded. A verdict of another head than the merged pull
    request's, or of another pull request (its pr.json), records nothing."""
    from rmsnorm_suite import history

    head, other, commit = "a" * 40, "b" * 40, "c" * 40
    good = {"head_sha": head, "rows": [{"check": "device 1x1-a forward", "verdict": "accepted"}],
            "acceptance": {"granted": [{"check": "device 1x1-a forward", "factor": 1.1, "reason": "r",
                                        "approved_by": "m"}]}}  # fmt: skip
    bad = {
        "not-json": "{",
        "rows-int": json.dumps({**good, "rows": 5}),
        "granted-int": json.dumps({**good, "acceptance": {"granted": 3}}),
        "check-list": json.dumps({**good, "acceptance": {"granted": [{"check": ["x"], "approved_by": "m"}]}}),
        "row-check-list": json.dumps({**good, "rows": [{"check": ["x"], "verdict": "accepted"}]}),
        "acceptance-list": json.dumps({**good, "acceptance": [1]}),
        "another-head": json.dumps({**good, "head_sha": other}),
        "no-head": json.dumps({k: v for k, v in good.items() if k != "head_sha"}),
        "huge": json.dumps({**good, "pad": "x" * (history.MAX_VERDICT_BYTES + 1)}),
    }
    for name, text in bad.items():
        (tmp_path / f"verdict-{name}").mkdir()
        (tmp_path / f"verdict-{name}" / "verdict.json").write_text(text)
    (tmp_path / "verdict-another-pull").mkdir()
    (tmp_path / "verdict-another-pull" / "verdict.json").write_text(json.dumps(good))
    (tmp_path / "verdict-another-pull" / "pr.json").write_text(json.dumps({"number": 8, "head_sha": head}))
    ledger = tmp_path / "accepted.json"
    ledger.write_text(json.dumps({"accepted": [{"commit": ["odd"], "check": {}}, 3]}))
    argv = ["record-accepted", "--verdicts", str(tmp_path), "--commit", commit, "--pull", "7", "--head", head]
    assert history.main([*argv, "--into", str(ledger)]) == 0
    assert json.loads(ledger.read_text())["accepted"][2:] == []  # nothing but the odd rows kept
    (tmp_path / "verdict-good").mkdir()
    (tmp_path / "verdict-good" / "verdict.json").write_text(json.dumps(good))
    (tmp_path / "verdict-good" / "pr.json").write_text(json.dumps({"number": 7, "head_sha": head}))
    assert history.main([*argv, "--into", str(ledger)]) == 0
    added = json.loads(ledger.read_text())["accepted"][2:]
    assert [(r["commit"], r["check"], r["head"], r["pull"]) for r in added] == [
        (commit, "device 1x1-a forward", head, 7)
    ]
    ledger.write_text("{")  # a ledger that is not JSON is not overwritten, and fails loudly
    assert history.main([*argv, "--into", str(ledger)]) == 2 and ledger.read_text() == "{"
