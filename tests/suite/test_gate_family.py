"""The gate across rows: Holm over a verdict's latency rows (regression.toml [family]), its
family-wise rate on synthetic null data, and Accept-Regression (rmsnorm_suite.accept)."""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest

from rmsnorm_suite import accept, cli, gate, gatereport, power, results, thresholds
from tests.suite._fixtures import LARGE, SMALL, THRESHOLDS, make_run

RATE = THRESHOLDS.family.rate  # declared in regression.toml before any of this was measured


# ---------------------------------------------------------------------------------------------
# Holm
# ---------------------------------------------------------------------------------------------


def test_holm_steps_down_and_stops_at_the_first_failure():
    # levels 0.05/4, /3, /2, /1 for the p-values in increasing order
    reject, levels = gate.holm([0.06, 0.001, 0.013, 0.02], 0.05)
    assert levels == pytest.approx([0.05, 0.0125, 0.05 / 3, 0.025])
    assert reject == [False, True, True, True]  # 0.001 < .0125, 0.013 < .0167, 0.02 < .025, 0.06 > .05
    assert gate.holm([0.04, 0.001, 0.02, 0.013], 0.05)[0] == [True] * 4
    # a first p that misses its level stops everything after it, however small the rest
    assert gate.holm([0.02, 0.021, 0.049], 0.05)[0] == [False, False, False]  # 0.049 < 0.05, but stopped
    assert gate.holm([0.06, 0.0001], 0.05)[0] == [False, True]
    assert gate.holm([0.03, 0.03], 0.05)[0] == [False, False]
    assert gate.holm([], 0.05) == ([], [])


def test_holm_vectorised_agrees_with_the_gates():
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 0.02, size=(200, 12)) ** 2
    fast = power.holm_reject(p, 0.05)
    for i in range(len(p)):
        assert list(fast[i]) == gate.holm(list(p[i]), 0.05)[0]


def test_p_above_agrees_with_the_gates_ratio_estimate():
    rng = np.random.default_rng(4)
    for _ in range(30):
        base = np.exp(rng.normal(0, 0.01, size=6))
        head = base * np.exp(rng.normal(0.03, 0.01, size=6))
        est = gate.ratio_estimate(list(base), list(head), 0.01, True, 1.03)
        fast = power.p_above(np.log(head) - np.log(base), math.log(1.03))
        assert float(fast) == pytest.approx(est.p_factor, rel=1e-9, abs=1e-12)
        # the bound clears the factor exactly when p_factor is under the level
        assert (est.low > 1.03) == (est.p_factor < 0.01)


def test_unpaired_p_factor_is_welchs_shifted():
    base, head = [1.0, 1.01, 0.99, 1.0], [1.10, 1.12, 1.08, 1.11]
    est = gate.ratio_estimate(base, head, 0.01, False, 1.05)
    assert (est.low > 1.05) == (est.p_factor < 0.01)
    assert est.p_value < est.p_factor < 1  # "above 1.05" needs more evidence than "above 1"


@pytest.mark.parametrize("correlation", [0.0, 0.9])
def test_family_wise_rate_on_null_data_stays_under_the_stated_rate(correlation):
    """72 rows (the verdict's latency rows), each with its true ratio exactly at its factor (the
    worst case of the null: any row within its factor is less likely to be flagged), 6 paired
    rounds; the share of verdicts that flag any row stays under the declared rate, and the old
    rule (each row at 1%) does not."""
    rng = np.random.default_rng(11 + int(10 * correlation))
    trials, rows, rounds, factor = 4000, 72, 6, 1.03
    common = rng.standard_normal((trials, 1, rounds))
    own = rng.standard_normal((trials, rows, rounds))
    d = math.log(factor) + 0.004 * (correlation * common + math.sqrt(1 - correlation**2) * own)
    factors = np.full(rows, factor)
    holm_rate = power.flags(d, factors, "bound", "holm", RATE).any(axis=1).mean()
    per_row_rate = power.flags(d, factors, "bound", "none", 0.01).any(axis=1).mean()
    margin = 3 * math.sqrt(RATE * (1 - RATE) / trials)
    assert holm_rate <= RATE + margin, holm_rate
    if correlation == 0.0:
        assert per_row_rate > 0.3  # 1 - 0.99^72 = 0.52: the rule before [family]
        assert holm_rate > 0.02  # and Holm is not vacuous at the boundary: close to the rate


def test_family_wise_rate_under_a_t_null_with_heavy_rounds():
    """The same with round noise from a t law of 3 degrees of freedom (outlying rounds)."""
    rng = np.random.default_rng(5)
    trials, rows, rounds = 4000, 72, 6
    d = math.log(1.03) + 0.004 * rng.standard_t(3, size=(trials, rows, rounds))
    rate = power.flags(d, np.full(rows, 1.03), "bound", "holm", RATE).any(axis=1).mean()
    assert rate <= RATE + 3 * math.sqrt(RATE * (1 - RATE) / trials), rate


# ---------------------------------------------------------------------------------------------
# The verdict under [family]
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_run():
    return make_run(1)


def test_a_verdict_records_the_family_rule_and_each_rows_level(base_run):
    verdict = gate.judge(base_run, make_run(2), THRESHOLDS)
    assert verdict.status == "pass", verdict.summary
    latency = [r for r in verdict.rows if r.kind == "latency"]
    assert verdict.family["method"] == "holm" and verdict.family["rows"] == len(latency) == 72
    assert verdict.family["first_level"] == pytest.approx(RATE / 72)
    levels = sorted(r.alpha for r in latency)
    assert levels == pytest.approx(sorted(RATE / (72 - i) for i in range(72)))
    assert all(r.p_factor is not None and r.confidence == pytest.approx(1 - 2 * r.alpha) for r in latency)
    data = verdict.to_json()
    assert data["family"]["rate"] == RATE and "p_factor" in data["rows"][0]
    assert "Holm at a family-wise rate of 0.05 over 72 latency rows" in gatereport.to_markdown(verdict)


def test_a_regression_is_still_flagged_under_holm(base_run):
    head = make_run(30, device_slower={(LARGE, "forward"): 1.08})
    verdict = gate.judge(base_run, head, THRESHOLDS)
    assert verdict.status == "regression"
    flagged = [r.check for r in verdict.rows if r.verdict == "regression"]
    assert flagged == [f"device {LARGE} forward"]


def test_without_family_each_row_keeps_its_alpha(base_run):
    th = thresholds.parse_thresholds(
        {
            "latency": {"large": {"forward": {"factor": 1.05, "alpha": 0.01}}},
            "numerics": {"bfloat16": {"growth": 1.05, "ceiling": {"y": 1.8e-3}}},
        }
    )
    assert th.family == thresholds.Family()
    v = gate.judge(base_run, make_run(2), th)
    rows = [r for r in v.rows if r.kind == "latency" and r.verdict != "error"]
    assert rows and all(r.alpha == 0.01 for r in rows)
    assert v.family["method"] == "none"


NUMERICS = {"bfloat16": {"growth": 1.05, "ceiling": {"y": 1.8e-3}}}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"family": {"method": "holm"}}, "family.rate is missing"),
        ({"family": {"method": "bh", "rate": 0.05}}, "family.method must be one of"),
        ({"family": {"method": "holm", "rate": 0.5}}, "family.rate must be in"),
        ({"family": {"method": "none", "rate": 0.05}}, "family.rate is set but"),
        ({"family": {"method": "holm", "rate": 0.05, "level": 1}}, "unknown key"),
        ({"accept": {"max_rows": 40}}, "accept.max_rows"),
        ({"accept": {"kinds": ["numerics"]}}, "accept.kinds"),
        ({"accept": {"max_factor": 0.9}}, "accept.max_factor"),
    ],
)
def test_bad_family_or_accept_tables_name_the_key(data, message):
    full = {"latency": {"large": {"forward": {"factor": 1.05}}}, "numerics": NUMERICS, **data}
    if data.get("family", {}).get("method") != "holm":
        full["latency"]["large"]["forward"]["alpha"] = 0.01
    with pytest.raises(ValueError, match=message):
        thresholds.parse_thresholds(full, "t.toml")


def test_a_rows_alpha_is_refused_under_holm():
    data = {
        "family": {"method": "holm", "rate": 0.05},
        "latency": {"large": {"forward": {"factor": 1.05, "alpha": 0.01}}},
        "numerics": NUMERICS,
    }
    with pytest.raises(ValueError, match="latency.large.forward.alpha: the level is set by"):
        thresholds.parse_thresholds(data, "t.toml")


# ---------------------------------------------------------------------------------------------
# Accept-Regression
# ---------------------------------------------------------------------------------------------

DEVICE_LARGE = f"device {LARGE} forward"


def request(line: str, by: str | None = "maintainer") -> list[accept.Request]:
    return accept.approve([accept.parse(line)], by)


def test_trailers_are_parsed_as_data():
    message = (
        "ops: accumulate the variance in fp32\n\nwhy ...\n\n"
        f"Accept-Regression: {DEVICE_LARGE} 1.08 fp32 accumulation costs a pass\n"
        "accept-regression: device 1x4096-bfloat16 forward lots $(rm -rf /)\n"
        "Accept-Regression: error y 4096x4096-float32 2.0 numerics\n"
        "Signed-off-by: someone\n"
    )
    got = accept.from_message(message, "a" * 40)
    assert [r.check for r in got[:1]] == [DEVICE_LARGE] and got[0].factor == 1.08
    assert got[0].reason == "fp32 accumulation costs a pass" and got[0].commit == "a" * 40
    assert got[1].problem and "not a number" in got[1].problem
    assert got[2].problem and "not a latency check" in got[2].problem
    assert accept.parse("device").problem.startswith("expected")


def test_only_the_last_paragraphs_trailers_are_requests():
    """A request quoted in the body, or in a last paragraph that is prose, is not a trailer."""
    quoted = f"ops: faster\n\nReverts the line\nAccept-Regression: {DEVICE_LARGE} 1.2 quoted\nof an old PR.\n"
    assert accept.from_message(quoted) == []
    assert accept.from_message(f"Accept-Regression: {DEVICE_LARGE} 1.2 subject only") == []
    prose_last = f"ops: x\n\nAccept-Regression: {DEVICE_LARGE} 1.2 early\n\nThanks to a reviewer.\n"
    assert accept.from_message(prose_last) == []
    continued = (
        f"ops: x\n\nReviewed-by: someone\n  Accept-Regression: {DEVICE_LARGE} 1.2 inside a continuation\n"
    )
    assert accept.from_message(continued) == []


def test_grant_refuses_what_is_not_approved_or_out_of_bounds():
    limits = thresholds.AcceptLimits(2, 1.25, ("device", "host"))
    checks = [DEVICE_LARGE, f"device {SMALL} forward", f"host {SMALL} forward", f"latency {LARGE} forward"]
    asks = (
        request(f"{DEVICE_LARGE} 1.08 ok")
        + request(f"device {SMALL} forward 1.10 no approval", by=None)
        + request(f"device {SMALL} forward 1.5 too far")
        + request(f"latency {LARGE} forward 1.10 kind not allowed")
        + request("device 999x999-bfloat16 forward 1.1 no such row")
        + request(f"{DEVICE_LARGE} 1.10 twice")
        + request(f"device {SMALL} forward 1.0 not a slowdown")
        + request(f"host {SMALL} forward 1.2 second granted")
        + request(f"device {SMALL} forward 1.1 third: over max_rows")
    )
    granted, record = accept.grant(asks, limits, checks)
    assert list(granted) == [DEVICE_LARGE, f"host {SMALL} forward"]
    whys = [r["why"] for r in record["refused"]]
    assert whys == [
        "no maintainer approval",
        "factor 1.5 not in (1, 1.25] ([accept] max_factor)",
        "[accept] kinds ['device', 'host'] do not include 'latency'",
        "names no latency row of this verdict",
        "the row was already accepted by an earlier line",
        "factor 1 not in (1, 1.25] ([accept] max_factor)",
        "more than [accept] max_rows = 2 rows",
    ]
    assert len(record["requested"]) == 9 and record["limits"]["max_rows"] == 2
    json.dumps(record)  # the verdict can write it
    assert accept.grant(asks, thresholds.AcceptLimits(), checks)[0] == {}  # [accept] absent: nothing granted


@pytest.fixture(scope="module")
def slow_head():
    return make_run(31, device_slower={(LARGE, "forward"): 1.08})


def test_an_approved_acceptance_shows_the_row_as_accepted_never_pass(base_run, slow_head):
    verdict = gate.judge(
        base_run, slow_head, THRESHOLDS, acceptances=request(f"{DEVICE_LARGE} 1.12 expected")
    )
    assert verdict.status == "pass", verdict.summary
    row = next(r for r in verdict.rows if r.check == DEVICE_LARGE)
    assert row.verdict == "accepted" and row.threshold == 1.12 and row.table_factor == 1.03
    assert "past the table's factor 1.03" in row.note
    assert "1 accepted" in verdict.summary and "Accept-Regression: 1 granted" in verdict.summary
    judged = sum(r.verdict in ("pass", "accepted") for r in verdict.rows)
    assert f"PASS: {judged - 1} of {judged} checks pass, 1 accepted" in verdict.summary
    assert verdict.acceptance["granted"][0]["approved_by"] == "maintainer"
    assert "**accepted**" in gatereport.to_markdown(verdict)
    others = [r for r in verdict.rows if r.check != DEVICE_LARGE and r.kind == "latency"]
    assert all(r.verdict == "pass" for r in others)


def test_a_regression_beyond_the_accepted_factor_still_fails(base_run, slow_head):
    verdict = gate.judge(
        base_run, slow_head, THRESHOLDS, acceptances=request(f"{DEVICE_LARGE} 1.04 too little")
    )
    assert verdict.status == "regression"
    row = next(r for r in verdict.rows if r.check == DEVICE_LARGE)
    assert row.verdict == "regression" and row.note == "beyond the accepted factor"


def test_an_unapproved_acceptance_changes_nothing_but_is_listed(base_run, slow_head):
    verdict = gate.judge(
        base_run, slow_head, THRESHOLDS, acceptances=request(f"{DEVICE_LARGE} 1.12 self-granted", by=None)
    )
    assert verdict.status == "regression"
    assert verdict.acceptance["refused"][0]["why"] == "no maintainer approval"
    assert "1 refused" in verdict.summary


def test_an_acceptance_of_a_row_that_did_not_regress_is_reported_unused(base_run):
    verdict = gate.judge(base_run, make_run(2), THRESHOLDS, acceptances=request(f"{DEVICE_LARGE} 1.12 maybe"))
    row = next(r for r in verdict.rows if r.check == DEVICE_LARGE)
    assert verdict.status == "pass" and row.verdict == "pass" and "unused" in row.note


def test_gate_command_reads_trailers_from_git(tmp_path, monkeypatch, capsys, base_run, slow_head):
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)  # fmt: skip

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "base")
    git("commit", "-q", "--allow-empty", "-m", f"slower\n\nAccept-Regression: {DEVICE_LARGE} 1.12 expected")
    b, h = tmp_path / "base.json", tmp_path / "head.json"
    for path, run in ((b, base_run), (h, slow_head)):
        results.write(results.as_run(run), path.parent, path.stem)
    monkeypatch.chdir(repo)
    argv = [
        "gate",
        "--base",
        str(b),
        "--head",
        str(h),
        "--out",
        str(tmp_path / "v"),
        "--accept-from-git",
        "HEAD~1..HEAD",
    ]
    assert cli.main(argv) == 1  # not approved: still a regression
    capsys.readouterr()
    assert cli.main([*argv, "--accept-approved-by", "maintainer"]) == 0
    data = json.loads((tmp_path / "v" / "verdict.json").read_text())
    assert [r["verdict"] for r in data["rows"] if r["check"] == DEVICE_LARGE] == ["accepted"]
    assert data["acceptance"]["granted"][0]["commit"] and data["family"]["method"] == "holm"
    assert cli.main([*argv[:-2], "--accept-from-git", "nonsense"]) == 2


def test_the_pr_comment_shows_an_accepted_row_without_failing(base_run, slow_head):
    import importlib.util
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[2] / ".github" / "scripts"
    if not (scripts / "post_verdict_comment.py").is_file():
        pytest.skip("no .github/scripts in this checkout")
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("pvc_accept", scripts / "post_verdict_comment.py")
        pvc = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pvc  # its dataclasses look their module up
        spec.loader.exec_module(pvc)
    finally:
        sys.path.remove(str(scripts))
    verdict = gate.judge(
        base_run, slow_head, THRESHOLDS, acceptances=request(f"{DEVICE_LARGE} 1.12 expected")
    )
    entry = pvc.parse_verdict(json.loads(json.dumps(verdict.to_json())), "h200")
    assert entry.status == "pass"
    assert "1 accepted" in pvc.kind_summary(entry)
    rows = [r for r in entry.rows if r.verdict == "accepted"]
    assert "accepted (Accept-Regression)" in "\n".join(pvc.table(rows, True))
