"""The regression gate on synthetic result sets (CPU, no kernel runs): the statistics on rounds,
the verdicts and exit codes, the verdict files, regression.toml, and pr-verdict's merging of
rounds. pr-verdict end to end (git, the worker, hostile commits): tests/suite/test_pullrequest.py."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from rmsnorm_suite import cases, cli, gate, gatereport, pullrequest, results, thresholds
from rmsnorm_suite.rounds import merge_rounds
from tests.suite._fixtures import LARGE, ROUNDS, SMALL, THRESHOLDS, THRESHOLDS_FILE, TYPICAL_ERROR, make_run

# ---------------------------------------------------------------------------------------------
# Statistics on rounds
# ---------------------------------------------------------------------------------------------


def test_paired_ratio_against_a_hand_computed_t_bound():
    """Per-round ratios 1.05, 1.06, 1.04, 1.05: d = log ratios, mean and sd by hand, the 99%
    one-sided bound mean - t(0.99, 3) sd / sqrt(4) with t = 4.540703 (tables), p from the t law."""
    base = [1.0, 2.0, 1.5, 1.2]
    head = [b * r for b, r in zip(base, [1.05, 1.06, 1.04, 1.05])]
    d = [math.log(r) for r in [1.05, 1.06, 1.04, 1.05]]
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    est = gate.ratio_estimate(base, head, 0.01, paired=True)
    assert est.ratio == pytest.approx(math.exp(mean))
    assert est.low == pytest.approx(math.exp(mean - 4.540703 * sd / 2), rel=1e-6)
    assert est.high == pytest.approx(math.exp(mean + 4.540703 * sd / 2), rel=1e-6)  # 98% two-sided
    assert est.p_value < 1e-3 and est.rounds == 4 and est.paired


def test_rounds_not_samples_are_the_units():
    """Pooling hundreds of samples made a 4-round run look certain (p ~ 1e-132); on rounds, two
    slow rounds of four leave the bound below 1 and p far from significant."""
    base = [1.0, 1.0, 1.0, 1.0]
    est = gate.ratio_estimate(base, [1.08, 1.0, 1.08, 0.99], 0.01, paired=True)
    assert est.ratio > 1.03 and est.low < 1.0 and est.p_value > 0.05


def test_unpaired_runs_use_welch():
    from scipy import stats

    base, head = [1.0, 1.01, 0.99, 1.0, 1.02], [1.1, 1.12, 1.09, 1.11]
    est = gate.ratio_estimate(base, head, 0.01, paired=False)
    want = stats.ttest_ind(
        [math.log(v) for v in head], [math.log(v) for v in base], equal_var=False, alternative="greater"
    )
    assert est.p_value == pytest.approx(want.pvalue) and not est.paired and est.rounds == 4
    assert est.low == pytest.approx(math.exp(want.confidence_interval(0.99).low))


def test_identical_rounds_collapse_the_interval():
    est = gate.ratio_estimate([2.0] * 3, [2.0] * 3, 0.01, paired=True)
    assert (est.ratio, est.low, est.p_value) == (1.0, 1.0, 1.0)
    # unpaired, each side's rounds identical: the spread of both sides is zero, so the interval
    # collapses on the ratio and p is certain (a t-test on zero variance would give NaN)
    est = gate.ratio_estimate([2.0] * 3, [3.0] * 3, 0.01, paired=False, factor=1.05)
    assert est.ratio == pytest.approx(1.5) and est.low == pytest.approx(1.5) and est.p_value == 0.0
    assert est.p_factor == 0.0


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "welch"])
@pytest.mark.parametrize(
    "head",
    [[1.0, 1.1, 1.2], [0.5, 1.0, 2.0]],
    ids=["one-round-unchanged", "symmetric"],
)
def test_rounds_that_vary_on_one_side_only_keep_the_interval_open(head, paired):
    """Base's rounds identical (a coarse clock), head's not: only a spread of zero collapses the
    interval, so here the bound lies strictly below the estimate and p is a t-test's, in (0, 1).
    The heads give log ratios that cancel in a sum (-d, 0, d) or a product (one round at 0)."""
    est = gate.ratio_estimate([1.0] * 3, head, 0.01, paired)
    assert est.low < est.ratio < est.high
    assert 0.0 < est.p_value < 1.0


@pytest.mark.parametrize(
    "base, head, paired, message",
    [([1.0], [1.0, 1.0], False, "at least 2 rounds"), ([1.0, 1.0, 1.0], [1.0, 1.0], True, "equal counts")],
)
def test_ratio_estimate_rejects_too_few_or_unmatched_rounds(base, head, paired, message):
    with pytest.raises(ValueError, match=message):
        gate.ratio_estimate(base, head, 0.01, paired)


# The judgements on their boundaries (each a small function: mutation testing targets them).
def test_judgements_on_their_boundaries():
    assert gate.exceeds_factor(1.0501, 1.05) and not gate.exceeds_factor(1.05, 1.05)
    assert gate.significant(0.0099, 0.01) and not gate.significant(0.01, 0.01)
    assert gate.error_limit(1e-7, 2.0, 1.3e-7) == (1.3e-7, "ceiling")
    assert gate.error_limit(5e-8, 2.0, 1.3e-7) == (1e-7, "base x 2")
    assert gate.error_limit(None, 2.0, 1.3e-7) == (1.3e-7, "ceiling (base has no error figure)")
    assert gate.error_limit(float("nan"), 2.0, 1.3e-7)[0] == 1.3e-7
    assert gate.exceeds_limit(1.01, 1.0) and not gate.exceeds_limit(1.0, 1.0)
    assert gate.exceeds_limit(float("nan"), 1.0) and gate.exceeds_limit(float("inf"), 1.0)


# ---------------------------------------------------------------------------------------------
# Synthetic runs
# ---------------------------------------------------------------------------------------------


FP32 = "4096x4096-float32"


def drop(run, shape, mode):
    run["results"] = [r for r in run["results"] if (r["shape"], r["mode"]) != (shape, mode)]
    return run


def fail(run, shape, mode):
    for r in run["results"]:
        if (r["shape"], r["mode"]) == (shape, mode):
            r["status"], r["error"], r["samples_ms"] = "failed", "RuntimeError: out of resources", []
    return run


def few_samples(run, shape, mode):
    for r in run["results"]:
        if (r["shape"], r["mode"]) == (shape, mode):
            r["samples_ms"] = r["samples_ms"][:5]
    return run


def few_rounds(run, shape, mode):
    for r in run["results"]:
        if (r["shape"], r["mode"]) == (shape, mode):
            r["device_block_medians_ms"] = r["device_block_medians_ms"][:2]
    return run


def no_device(run, shape, mode, why):
    for r in run["results"]:
        if (r["shape"], r["mode"]) == (shape, mode):
            r["device_samples_ms"], r["device_block_medians_ms"], r["device_error"] = [], [], why
    return run


def no_host(run):
    """A head timed by a harness from before the host clock: no host samples."""
    for r in run["results"]:
        del r["host_samples_ms"], r["host_block_medians_ms"]
    return run


def unpaired(run):
    del run["settings"]["round_indices"]  # a plain benchmark run: its blocks do not pair with base's
    return run


def no_kernel(run):
    for r in run["results"]:
        r["provider"] = "native"
    return run


def remove_error(run, shape, mode, quantity):
    for r in run["results"]:
        if (r["shape"], r["mode"]) == (shape, mode):
            del r["errors"][quantity]
    return run


# (name, head run, expected status, checks expected to regress or error)
SCENARIOS = [
    ("A/A same distribution", lambda: make_run(2), "pass", []),
    ("A/A, noisier", lambda: make_run(3, noise=0.03), "pass", []),
    ("8% slower everywhere", lambda: make_run(4, slower={"*": 1.08}), "regression", ["latency"]),
    ("8% slower at one shape", lambda: make_run(5, slower={(LARGE, "forward"): 1.08}), "regression",
     [f"latency {LARGE} forward"]),
    ("2% slower everywhere", lambda: make_run(6, slower={"*": 1.02}), "pass", []),
    ("6% slower on the GPU at a launch-bound shape, hidden in host time",
     lambda: make_run(7, device_slower={(SMALL, "forward_backward"): 1.06}), "regression",
     [f"device {SMALL} forward_backward"]),
    ("host work doubled (the compiled host path lost), the GPU work the same",
     lambda: make_run(23, host_slower={(SMALL, "forward"): 2.0}), "regression", [f"host {SMALL} forward"]),
    ("host work 10% more: within the factor", lambda: make_run(24, host_slower={"*": 1.10}), "pass", []),
    ("head timed without the host clock", lambda: no_host(make_run(25)), "error", [f"host {LARGE} forward"]),
    ("graph capture failed in head",
     lambda: no_device(make_run(19), LARGE, "forward", "RuntimeError: operation not permitted when stream is capturing"),
     "error", [f"device {LARGE} forward"]),
    ("head timed without device samples",
     lambda: no_device(make_run(20), SMALL, "forward", "device time not measured in this run"), "error",
     [f"device {SMALL} forward"]),
    ("faster", lambda: make_run(8, slower={"*": 0.8}), "pass", []),
    ("fp32 y error x8 (eps outside the sqrt)",
     lambda: make_run(9, errors={(FP32, "forward"): {"y": 8 * TYPICAL_ERROR["float32"]}}), "regression",
     [f"error y {FP32}"]),
    ("fp32 dx error x3", lambda: make_run(10, errors={(SMALL, "forward_backward"): {"dx": 1.8e-7}}),
     "regression", [f"error dx {SMALL}"]),
    ("bf16 dw error above the ceiling",
     lambda: make_run(11, errors={(LARGE, "forward_backward"): {"dw": 1.9e-3}}), "regression",
     [f"error dw {LARGE}"]),
    ("bf16 error grows 3%, under the ceiling and growth",
     lambda: make_run(12, errors={(LARGE, "forward"): {"y": 1.03 * TYPICAL_ERROR["bfloat16"]}}), "pass", []),
    ("NaN error", lambda: make_run(13, errors={(FP32, "forward"): {"y": float("nan")}}), "regression",
     [f"error y {FP32}"]),
    ("missing shape in head", lambda: drop(make_run(14), SMALL, "forward"), "error",
     [f"latency {SMALL} forward"]),
    ("failed benchmark in head", lambda: fail(make_run(15), LARGE, "forward_backward"), "error",
     [f"latency {LARGE} forward_backward"]),
    ("too few samples", lambda: few_samples(make_run(16), LARGE, "forward"), "error",
     [f"latency {LARGE} forward"]),
    ("too few rounds", lambda: few_rounds(make_run(21), LARGE, "forward"), "error",
     [f"device {LARGE} forward"]),
    ("head as a plain run (blocks, not paired rounds), 8% slower",
     lambda: unpaired(make_run(22, slower={"*": 1.08}, rounds=3)), "regression", [f"device {LARGE} forward"]),
    ("head without kernel rows", lambda: no_kernel(make_run(17)), "error", ["latency"]),
    ("head without an error figure", lambda: remove_error(make_run(18), FP32, "forward", "y"), "error",
     [f"error y {FP32}"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def base_run():
    return make_run(1)


@pytest.mark.parametrize("name, head, status, flagged", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_gate_scenarios(base_run, name, head, status, flagged):
    verdict = gate.judge(copy.deepcopy(base_run), head(), THRESHOLDS)
    assert verdict.status == status, verdict.summary
    assert verdict.exit_code == {"pass": 0, "regression": 1, "error": 2}[status]
    bad = [r.check for r in verdict.rows if r.verdict != "pass"]
    if status == "pass":
        assert bad == []
    for prefix in flagged:
        assert any(c.startswith(prefix) for c in bad), (prefix, bad)
    assert verdict.summary.startswith(status.upper())


def test_a_latency_rows_interval_is_two_sided_at_its_level(base_run):
    """The interval printed is the (1 - 2 alpha) two-sided one whose low end is the one-sided
    bound at alpha: under Holm (each row at its Holm level) and without it (each at its own)."""
    import dataclasses

    each = dataclasses.replace(THRESHOLDS, family=dataclasses.replace(THRESHOLDS.family, method="none"))
    for th in (THRESHOLDS, each):
        verdict = gate.judge(copy.deepcopy(base_run), make_run(2), th)
        rows = [r for r in verdict.rows if r.kind == "latency"]
        assert rows and all(r.confidence == pytest.approx(1 - 2 * r.alpha) for r in rows)


def test_welch_keeps_the_interval_open_when_only_the_product_of_spreads_vanishes():
    """Unpaired: base's rounds identical at e, head's log rounds 0.5, 1.0, 1.5: the sum of the
    spreads is 1, so the interval stays open (a product-like slip would read 0 and collapse it)."""
    est = gate.ratio_estimate([math.e] * 3, [math.exp(v) for v in (0.5, 1.0, 1.5)], 0.01, paired=False)
    assert est.low < est.ratio < est.high and 0.0 < est.p_value < 1.0


def test_a_missing_error_figure_leaves_the_modes_other_quantities_judged(base_run):
    """Head without dx at a shape: dx is `error`, and dw of the same shape is still judged."""
    head = remove_error(make_run(18), SMALL, "forward_backward", "dx")
    rows = {r.check: r for r in gate.judge(copy.deepcopy(base_run), head, THRESHOLDS).rows}
    assert rows[f"error dx {SMALL}"].verdict == "error"
    assert rows[f"error dw {SMALL}"].verdict == "pass"


def test_a_quantity_without_a_ceiling_leaves_the_others_judged(base_run):
    """No ceiling for dx in the thresholds: that row is `error`, dw's is still judged."""
    th = copy.deepcopy(THRESHOLDS)
    rule = th.numerics["float32"]
    th.numerics["float32"] = type(rule)(rule.growth, {q: v for q, v in rule.ceiling.items() if q != "dx"})
    rows = {r.check: r for r in gate.judge(copy.deepcopy(base_run), make_run(2), th).rows}
    assert rows[f"error dx {SMALL}"].verdict == "error" and "ceiling dx" in rows[f"error dx {SMALL}"].note
    assert rows[f"error dw {SMALL}"].verdict == "pass"


def test_gate_checks_every_shape_and_mode(base_run):
    verdict = gate.judge(base_run, make_run(2), THRESHOLDS)
    latency = [r for r in verdict.rows if r.kind == "latency"]
    numerics = [r for r in verdict.rows if r.kind == "numerics"]
    assert len(latency) == 3 * len(cases.BENCH_SHAPES) * len(cases.BENCH_MODES)  # whole, device, host
    assert sum(r.check.startswith("device ") for r in latency) == len(latency) // 3
    assert sum(r.check.startswith("host ") for r in latency) == len(latency) // 3
    assert len(numerics) == len(cases.BENCH_SHAPES) * 3  # y; dx and dw
    assert all(0.0 <= r.p_value <= 1.0 for r in latency)


def test_slower_but_within_factor_is_significant_yet_passes(base_run):
    verdict = gate.judge(base_run, make_run(6, slower={"*": 1.02}), THRESHOLDS)
    latency = [r for r in verdict.rows if r.kind == "latency"]
    assert all(r.p_value < 0.01 and 1.0 < r.ratio < 1.03 for r in latency)  # the factor decides
    assert all(r.verdict == "pass" and r.ci_low < r.ratio < r.ci_high and r.rounds == ROUNDS for r in latency)
    assert all(r.confidence == pytest.approx(1 - 2 * r.alpha) for r in latency)
    assert any("significantly slower, within factor" in r.note for r in latency)


def test_pooled_samples_would_call_a_noisy_round_certain(base_run):
    """Head's rounds at 1.00, 1.00, 1.12, 1.00, 1.12, 1.00 of base (two slow rounds: a host or
    clock hiccup): the estimate is above 1.03 but the rounds do not support it, so no regression."""
    head = copy.deepcopy(base_run)
    for r in head["results"]:
        r["device_block_medians_ms"] = [
            m * f for m, f in zip(r["device_block_medians_ms"], [1.0, 1.0, 1.12, 1.0, 1.12, 1.0])
        ]
    rows = [r for r in gate.judge(base_run, head, THRESHOLDS).rows if r.check.startswith("device ")]
    assert all(r.ratio > 1.03 and r.ci_low < 1.03 and r.verdict == "pass" for r in rows)
    assert all("lower bound" in r.note for r in rows)


def test_missing_base_file_is_error():
    verdict = gate.judge(None, make_run(2), THRESHOLDS, missing={"base": "no results file 'x.json'"})
    assert verdict.status == "error"
    assert verdict.rows[0].check == "base results" and "x.json" in verdict.rows[0].note


def test_extra_rows_decide_too(base_run):
    failing = gatereport.Row("gpu tests (head)", None, None, None, None, "regression", "run", note="2 failed")
    verdict = gate.judge(base_run, make_run(2), THRESHOLDS, extra_rows=[failing])
    assert verdict.status == "regression"
    assert verdict.rows[0] is failing


def test_error_takes_precedence_over_regression(base_run):
    head = drop(make_run(4, slower={"*": 1.08}), SMALL, "forward")
    verdict = gate.judge(base_run, head, THRESHOLDS)
    assert verdict.status == "error" and "regressed" in verdict.summary


# ---------------------------------------------------------------------------------------------
# Verdict files and the command
# ---------------------------------------------------------------------------------------------

ROW_KEYS = {"check", "base", "head", "ratio", "threshold", "verdict"}


def write(tmp_path: Path, name: str, run) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(run))
    return path


def test_verdict_files_shape(tmp_path, base_run):
    verdict = gate.judge(base_run, make_run(4, slower={(LARGE, "forward"): 1.08}), THRESHOLDS)
    md, js = gatereport.write_verdict(verdict, tmp_path)
    lines = md.read_text().splitlines()
    assert lines[0] == f"**{verdict.summary}**"
    header = lines.index("| check | base | head | ratio | threshold | verdict |")
    assert lines[header + 1] == "|---|---|---|---|---|---|"
    table = lines[header + 2 :]
    assert len(table) == len(verdict.rows)
    assert all(line.count(" | ") == 5 for line in table)
    assert any(LARGE in line and "**regression**" in line for line in table)
    data = json.loads(js.read_text())
    assert data["status"] == "regression" and data["summary"] == verdict.summary
    assert all(ROW_KEYS <= set(row) and row["verdict"] in gatereport.STATUSES for row in data["rows"])
    assert data["head"]["commit"] == f"{4:040x}"


def test_verdict_names_the_host_path_of_each_side(tmp_path, base_run):
    """A head that lost the compiled host path says so above the table; runs that did not record
    it add nothing."""
    head = make_run(2)
    base = copy.deepcopy(base_run)
    base["machine"]["op_host_path"], head["machine"]["op_host_path"] = "compiled", "python"
    md = gatereport.to_markdown(gate.judge(base, head, THRESHOLDS))
    assert "The op's host path: base compiled, head python." in md
    assert "host path" not in gatereport.to_markdown(gate.judge(base_run, make_run(2), THRESHOLDS))


# (scenario, base file content or None for a missing file, head content, exit status)
CLI_CASES = [
    ("pass", lambda: make_run(1), lambda: make_run(2), 0),
    ("regression", lambda: make_run(1), lambda: make_run(4, slower={"*": 1.08}), 1),
    ("missing head file", lambda: make_run(1), None, 2),
    ("not a results file", lambda: make_run(1), lambda: {"hello": 1}, 2),
    ("failed benchmark", lambda: make_run(1), lambda: fail(make_run(2), SMALL, "forward"), 2),
]


@pytest.mark.parametrize("name, base, head, code", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_gate_command(tmp_path, capsys, name, base, head, code):
    base_path = write(tmp_path, "base.json", base())
    head_path = write(tmp_path, "head.json", head()) if head else tmp_path / "absent.json"
    out = tmp_path / "verdict"
    argv = ["gate", "--base", str(base_path), "--head", str(head_path), "--out", str(out)]
    assert cli.main([*argv, "--thresholds", str(THRESHOLDS_FILE)]) == code
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == {0: "pass", 1: "regression", 2: "error"}[code]
    assert capsys.readouterr().out.splitlines()[0] == data["summary"]


def test_gate_command_without_thresholds_cannot_judge(tmp_path, capsys):
    base = write(tmp_path, "b.json", make_run(1))
    argv = ["gate", "--base", str(base), "--head", str(base), "--thresholds", str(tmp_path / "none.toml")]
    assert cli.main(argv) == 2
    assert "none.toml" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# regression.toml
# ---------------------------------------------------------------------------------------------


def test_thresholds_cover_the_benchmark_matrix():
    for shape in cases.BENCH_SHAPES:
        for mode in cases.BENCH_MODES:
            assert (shape.group, mode) in THRESHOLDS.latency
        rule = THRESHOLDS.numerics[cases.dtype_name(shape.dtype)]
        assert set(rule.ceiling) == {"y", "dx", "dw"}


def test_thresholds_are_as_declared():
    # The memory-bound forward is judged at 5%; every group and mode has a rule, none looser than 1.5.
    assert THRESHOLDS.latency["large", "forward"].factor == 1.05
    assert {(g, m) for g in cases.GROUPS for m in cases.BENCH_MODES} <= set(THRESHOLDS.latency)
    assert all(1.0 < rule.factor <= 2.0 for rule in THRESHOLDS.latency.values())
    # the level is Holm's across the verdict's latency rows, at a family-wise rate of 5%
    assert THRESHOLDS.family == thresholds.Family("holm", 0.05)
    assert all(rule.alpha is None for rule in THRESHOLDS.latency.values())
    # GPU-only latency: every group and mode declared; the factor bounds the lower confidence
    # bound, so it sits under the 5% the project promises to catch
    assert set(THRESHOLDS.device_latency) == {(g, m) for g in cases.GROUPS for m in cases.BENCH_MODES}
    assert all(rule.factor == 1.03 and rule.alpha is None for rule in THRESHOLDS.device_latency.values())
    # host latency: every group and mode declared, tight enough to flag a lost compiled host path
    # (1.5-2x a forward's host time)
    assert set(THRESHOLDS.host_latency) == {(g, m) for g in cases.GROUPS for m in cases.BENCH_MODES}
    assert all(rule.factor <= 1.5 and rule.alpha is None for rule in THRESHOLDS.host_latency.values())
    # at most four rows accepted per verdict, none past 25%, never numerics
    assert THRESHOLDS.accept == thresholds.AcceptLimits(4, 1.25, ("device", "latency", "host"))
    assert THRESHOLDS.min_rounds == 3
    for dtype, factor in cases.ORACLE_ERROR_FACTOR.items():
        assert THRESHOLDS.numerics[cases.dtype_name(dtype)].growth == factor


def test_fp32_ceiling_catches_eps_outside_the_sqrt():
    """eps outside the sqrt moves y by about eps/2 relative for rows with mean square 1: far below
    half-precision rounding, so only the fp32 rows can see it, and their ceilings must."""
    torch.manual_seed(0)
    x = torch.randn(256, 4096, dtype=torch.float64)
    eps = cases.EPS
    ms = x.square().mean(-1, keepdim=True)
    right = x / torch.sqrt(ms + eps)
    wrong = x / (torch.sqrt(ms) + eps)
    shift = ((wrong - right).norm() / right.norm()).item()
    assert shift > THRESHOLDS.numerics["float32"].ceiling["y"]
    assert shift < THRESHOLDS.numerics["float16"].ceiling["y"] / 10


LATENCY_OK = "[latency.large.forward]\nfactor = 1.05\nalpha = 0.01\n"
NUMERICS_OK = "[numerics.float32]\ngrowth = 2.0\nceiling = { y = 1e-7 }\n"
# (name, the file's text, what the error must name)
BAD_TOML = [
    ("factor below 1", "[latency.large.forward]\nfactor = 0.9\nalpha = 0.01\n" + NUMERICS_OK,
     "latency.large.forward.factor"),
    ("alpha missing", "[latency.large.forward]\nfactor = 1.05\n" + NUMERICS_OK,
     "latency.large.forward.alpha is missing"),
    ("unknown mode", "[latency.large.backward]\nfactor = 1.05\nalpha = 0.01\n" + NUMERICS_OK,
     "unknown mode 'backward'"),
    ("alpha as text", "[latency.small.forward]\nfactor = 1.05\nalpha = 'low'\n" + NUMERICS_OK,
     "latency.small.forward.alpha"),
    ("unknown quantity", LATENCY_OK + "[numerics.float32]\ngrowth = 2.0\nceiling = { z = 1e-7 }\n",
     "numerics.float32.ceiling"),
    ("negative ceiling", LATENCY_OK + "[numerics.float32]\ngrowth = 2.0\nceiling = { y = -1e-7 }\n",
     "numerics.float32.ceiling.y"),
    ("unknown section", LATENCY_OK + NUMERICS_OK + "[latencies]\n", "unknown key(s) ['latencies']"),
    ("min_samples 1", "[gate]\nmin_samples = 1\n" + LATENCY_OK + NUMERICS_OK, "gate.min_samples"),
    ("min_rounds 2", "[gate]\nmin_rounds = 2\n" + LATENCY_OK + NUMERICS_OK, "gate.min_rounds"),
    ("no latency table", NUMERICS_OK, "latency must be a table"),
    ("device factor below 1", LATENCY_OK + "[device_latency.small.forward]\nfactor = 0.95\nalpha = 0.01\n"
     + NUMERICS_OK, "device_latency.small.forward.factor"),
]  # fmt: skip


@pytest.mark.parametrize("name, text, message", BAD_TOML, ids=[c[0] for c in BAD_TOML])
def test_bad_thresholds_name_the_key(tmp_path, name, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="bad.toml") as info:
        thresholds.load_thresholds(path)
    assert message in str(info.value)


def test_invalid_toml_is_reported(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[latency\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        thresholds.load_thresholds(path)


# ---------------------------------------------------------------------------------------------
# pr-verdict: interleaving and merging
# ---------------------------------------------------------------------------------------------


def test_rounds_alternate_abba():
    assert [pullrequest.round_order(k) for k in range(4)] == [
        ("base", "head"),
        ("head", "base"),
        ("base", "head"),
        ("head", "base"),
    ]


def one_round(seed: int, k: int, **kw):
    """A worker's round: one block of samples, with its round index."""
    run = make_run(seed, n=40, rounds=1, **kw)
    run["round"] = k
    return run


def test_merge_rounds_concatenates_samples_and_keeps_the_worst_error():
    rounds = [one_round(20, 0), one_round(21, 1, errors={(FP32, "forward"): {"y": 1e-7}})]
    merged = merge_rounds(rounds, "head", "abc")
    row = merged.rows_of("kernel")[FP32, "forward"]
    assert len(row.whole.samples_ms) == 80 and len(row.whole.block_medians_ms) == 2
    mine = [next(x for x in r["results"] if (x["shape"], x["mode"]) == (FP32, "forward")) for r in rounds]
    # one unit per round
    assert list(row.whole.block_medians_ms) == [gate.median(x["samples_ms"]) for x in mine]
    assert list(row.device.block_medians_ms) == [gate.median(x["device_samples_ms"]) for x in mine]
    assert list(row.host.block_medians_ms) == [gate.median(x["host_samples_ms"]) for x in mine]
    assert len(row.host.samples_ms) == 80 and row.host.tbs is None
    assert merged.round_indices == [0, 1]
    assert row.errors["y"] == 1e-7
    assert row.whole.median_ms == pytest.approx(gate.median(row.whole.samples_ms))
    assert row.whole.fraction_of_copy == pytest.approx(row.whole.tbs / 4.25)
    assert merged.git.commit == "abc" and merged.settings["rounds"] == 2


def test_merge_rounds_drops_host_time_when_a_round_lacks_it():
    """Rounds pair by position, so one round without host samples leaves the side with none (the
    gate then cannot judge its host rows) rather than host medians shifted against the others."""
    rounds = [one_round(24, 0), no_host(one_round(25, 1)), one_round(26, 2)]
    row = merge_rounds(rounds, "head", None).rows_of("kernel")[FP32, "forward"]
    assert row.host == results.Timing() and len(row.whole.block_medians_ms) == 3
    full = merge_rounds([one_round(24, 0), one_round(26, 1)], "head", None)
    assert len(full.rows_of("kernel")[FP32, "forward"].host.block_medians_ms) == 2


def test_merge_rounds_marks_a_failure_in_any_round():
    rounds = [one_round(22, 0), fail(one_round(23, 1), LARGE, "forward")]
    rows = merge_rounds(rounds, "base", None).rows_of("kernel")
    assert rows[LARGE, "forward"].status == "failed" and "round 1" in rows[LARGE, "forward"].error
    assert rows[SMALL, "forward"].status == "ok"


def test_merged_rounds_feed_the_gate():
    base = merge_rounds([one_round(30 + k, k) for k in range(4)], "base", "b")
    slow_once = [one_round(40, 0, slower={"*": 1.08}), *(one_round(40 + k, k) for k in range(1, 4))]
    head = merge_rounds(slow_once, "head", "h")
    assert gate.interleaved(base, head)
    verdict = gate.judge(base, head, THRESHOLDS)
    assert verdict.status == "pass", verdict.summary  # one slow round of four bounds nothing
    head = merge_rounds([one_round(50 + k, k, slower={"*": 1.08}) for k in range(4)], "head", "h")
    assert gate.judge(base, head, THRESHOLDS).status == "regression"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without CUDA")
def test_pr_verdict_without_cuda_cannot_judge(tmp_path, capsys):
    out = tmp_path / "pr"
    assert cli.main(["pr-verdict", "--base", "HEAD", "--head", "HEAD", "--out", str(out)]) == 2
    data = json.loads((out / "verdict.json").read_text())
    assert data["status"] == "error" and "CUDA is not available" in data["summary"]
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message", [(["--rounds", "1"], "--rounds"), (["--samples", "0"], "--samples")]
)
def test_pr_verdict_rejects_bad_arguments(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.main(["pr-verdict", "--base", "HEAD", "--head", "HEAD", "--out", str(tmp_path), *argv])


# ---------------------------------------------------------------------------------------------
# Kill tests of the judgement (maintainer/mutation/config.toml runs this file for gate.py's
# mutants): each pins a value a one-token change of gate.py would move.
# ---------------------------------------------------------------------------------------------


def latency_side(units):
    """A benchmark row as _latency_row reads it: enough samples, ``units`` as per-round medians."""
    whole = results.Timing(samples_ms=(1.0,) * 20, block_medians_ms=tuple(units))
    return results.Row("kernel", "s", "forward", "ok", 1, 1, "float32", "large", whole=whole)


def one_rule(factor: float, alpha: float = 0.01) -> thresholds.Thresholds:
    return thresholds.Thresholds(
        latency={("large", "forward"): thresholds.LatencyRule(factor, alpha)}, numerics={}
    )


def test_unpaired_estimate_is_the_ratio_of_geometric_means():
    """Welch's estimate: exp(mean log head - mean log base), rounds of unequal count."""
    base, head = [1.0, 1.2, 0.9, 1.1, 1.05], [1.3, 1.25, 1.4]
    want = math.exp(sum(map(math.log, head)) / 3 - sum(map(math.log, base)) / 5)
    est = gate.ratio_estimate(base, head, 0.01, paired=False)
    assert est.ratio == pytest.approx(want, rel=1e-12) and est.rounds == 3 and not est.paired


@pytest.mark.parametrize("n_base, n_head", [(6, 5), (5, 6)])
def test_paired_runs_with_unequal_rounds_are_judged_unpaired(n_base, n_head):
    """Rounds that ran side by side but lost one on a side cannot pair: the row is judged by
    Welch's estimate over what there is, whichever side has more, and does not raise."""
    base = [1.0, 1.1, 0.95, 1.05, 1.02, 0.98][:n_base]
    head = [1.5, 1.45, 1.6, 1.55, 1.52, 1.48][:n_head]
    row = gate._latency_row("s forward", latency_side(base), latency_side(head), one_rule(1.05), paired=True)
    want = math.exp(sum(map(math.log, head)) / n_head - sum(map(math.log, base)) / n_base)
    assert row.ratio == pytest.approx(want, rel=1e-12)
    assert row.rounds == 5 and row.verdict == "regression"


def test_ratio_exactly_at_the_factor_is_not_above_it():
    """A ratio equal to the factor (its bound below, p not significant) passes with no note:
    "above factor" means strictly above."""
    base, head = [1.0, 1.0, 1.0, 1.0], [1.10, 0.98, 1.08, 0.97]
    est = gate.ratio_estimate(base, head, 0.01, paired=True)
    assert est.low < est.ratio and est.p_value > 0.01  # the premise: no bound, no significance
    row = gate._latency_row(
        "s forward", latency_side(base), latency_side(head), one_rule(est.ratio), paired=True
    )
    assert (row.verdict, row.note, row.ratio) == ("pass", "", est.ratio)
    above = gate._latency_row(
        "s forward", latency_side(base), latency_side(head), one_rule(est.ratio * (1 - 1e-9)), paired=True
    )
    assert above.note.startswith("above factor, but its lower bound")


def verdict_rows(verdict: str, count: int, kind: str = "latency") -> list:
    return [gatereport.Row(f"c{i}", None, None, None, None, verdict, kind) for i in range(count)]


@pytest.mark.parametrize(
    "count, listed",
    [(4, "c0, c1, c2, c3"), (5, "c0, c1, c2, c3, and 1 more"), (6, "c0, c1, c2, c3, and 2 more")],
)
def test_summary_lists_four_errors_then_counts_the_rest(count, listed):
    rows = verdict_rows("error", count) + verdict_rows("pass", 2)
    verdict = gate._verdict(rows, None, None, THRESHOLDS)
    assert verdict.summary == f"ERROR: could not judge {count} of {count + 2} checks: {listed}"


@pytest.mark.parametrize(
    "count, listed",
    [(4, "c0, c1, c2, c3"), (5, "c0, c1, c2, c3, and 1 more"), (6, "c0, c1, c2, c3, and 2 more")],
)
def test_summary_lists_four_regressions_then_counts_the_rest(count, listed):
    rows = verdict_rows("regression", count) + verdict_rows("pass", 3)
    verdict = gate._verdict(rows, None, None, THRESHOLDS)
    assert verdict.summary == f"REGRESSION: {count} of {count + 3} checks regressed: {listed}"


def test_pass_summary_counts_each_kind():
    """Host latency, device latency and numerics rows counted apart; a passing row of another
    kind (pr-verdict's GPU-test row, kind "run") counts among the checks but in none of the three."""
    rows = [
        gatereport.Row("latency a forward", 1.0, 1.0, 1.0, 1.05, "pass", "latency"),
        gatereport.Row("latency b forward", 1.0, 1.0, 1.0, 1.05, "pass", "latency"),
        gatereport.Row("device a forward", 1.0, 1.0, 1.0, 1.05, "pass", "latency"),
        *verdict_rows("pass", 3, "numerics"),
        gatereport.Row("gpu tests (head)", None, None, None, None, "pass", "run"),
        gatereport.Row("host a forward", 1.0, 1.0, 1.0, 1.25, "pass", "latency"),
    ]
    verdict = gate._verdict(rows, None, None, THRESHOLDS)
    assert (
        verdict.summary == "PASS: all 8 checks pass (2 latency, 1 device latency, 1 host latency, 3 numerics)"
    )
    verdict = gate._verdict(rows[:2] + rows[3:6], None, None, THRESHOLDS)
    assert verdict.summary == "PASS: all 5 checks pass (2 latency, 3 numerics)"


def test_a_long_device_error_is_kept_to_its_first_300_characters():
    """The note of a row whose device time was not measured keeps the start of both sides'
    reasons, cut at 300 characters: the verdict's table stays one readable line per row."""
    why = "RuntimeError: " + "x" * 400
    head = no_device(make_run(20), SMALL, "forward", why)
    base = no_device(make_run(1), SMALL, "forward", why)
    (row,) = [r for r in gate.judge(base, head, THRESHOLDS).rows if r.check == f"device {SMALL} forward"]
    assert row.verdict == "error"
    assert row.note == f"base: {why}; head: {why}"[:300] and len(row.note) == 300


def test_an_error_row_reports_head_over_base():
    """An error row's ratio (the table's x column) is head's error over base's: 3 where head's
    error tripled, 1 where it did not change, none where base has no figure."""
    base = make_run(1)
    for r in base["results"]:
        if (r["shape"], r["mode"]) == (SMALL, "forward"):
            del r["errors"]["y"]
    head = make_run(9, errors={(FP32, "forward"): {"y": 3 * TYPICAL_ERROR["float32"]}})
    rows = {r.check: r for r in gate.judge(base, head, THRESHOLDS).rows}
    assert rows[f"error y {FP32}"].ratio == pytest.approx(3.0, rel=1e-12)
    assert rows[f"error dx {FP32}"].ratio == pytest.approx(1.0, rel=1e-12)
    assert rows[f"error y {SMALL}"].ratio is None


def test_paired_rounds_of_unequal_counts_are_refused_either_way():
    """Paired inference needs one head round per base round, whichever side has more."""
    for base, head in (([1.0, 1.1], [1.0, 1.1, 1.2]), ([1.0, 1.1, 1.2], [1.0, 1.1])):
        with pytest.raises(ValueError, match="equal counts"):
            gate.ratio_estimate(base, head, 0.01, paired=True, factor=1.03)


@pytest.mark.parametrize("ratio, flagged", [(1.01, False), (1.05, True)])
def test_rounds_without_spread_are_judged_against_the_factor(ratio, flagged):
    """Every round the same head/base ratio (no spread, so no t interval): the evidence that
    head/base passes the factor is certain either way, p 0 above it and 1 below it."""
    base = [1.0, 1.0, 1.0]
    est = gate.ratio_estimate(base, [ratio] * 3, 0.01, paired=True, factor=1.03)
    assert est.p_factor == (0.0 if flagged else 1.0)


def test_median_of_odd_and_even_counts():
    assert gate.median([4.0, 1.0, 2.0]) == 2.0
    assert gate.median([4.0, 1.0, 2.0, 3.0]) == 2.5
