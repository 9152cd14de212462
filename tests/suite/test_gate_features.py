"""The inference features in the gate: the worker's figures in the results file, merged over
rounds, and judged by gate.feature_rows against regression.toml's [features] limits; end to end,
a head whose rows depend on the batch size gets REGRESSION from pr-verdict (host stand-in)."""

from __future__ import annotations

import json
import math

import pytest

from rmsnorm_suite import gate, results, rounds
from rmsnorm_suite.thresholds import load_thresholds
from tests.suite._fixtures import INIT, OPS, commit, git, pr_verdict

TH = load_thresholds()


def _run(features: dict, k: int = 0) -> results.Run:
    return results.Run((), round=k, features={key: results.Feature(*f) for key, f in features.items()})


def test_features_round_trip_and_are_validated():
    run = _run({"batch_invariance": ("ok", 0.0), "qk_bits": ("unsupported", None, "no qk_norm")})
    assert results.from_json(json.loads(json.dumps(run.to_json()))).features == run.features
    data = run.to_json()
    data["features"]["batch_invariance"] = {"status": "ok"}  # ok without a value
    with pytest.raises(ValueError, match="features\\['batch_invariance'\\].value"):
        results.from_json(data)
    data["features"]["batch_invariance"] = {"status": "fine", "value": 0}
    with pytest.raises(ValueError, match="status"):
        results.from_json(data)


def test_rounds_merge_to_the_worst():
    merged = rounds.merge_features(
        [
            _run(
                {
                    "batch_invariance": ("ok", 0.0),
                    "quant_bits": ("ok", 0.0),
                    "qk_bits": ("unsupported", None, "x"),
                }
            ),
            _run({"batch_invariance": ("ok", 3.0), "quant_bits": ("failed", None, "boom")}, 1),
        ]
    )
    assert merged["batch_invariance"] == results.Feature("ok", 3.0)
    assert merged["quant_bits"].status == "failed"
    assert merged["qk_bits"].status == "failed"  # a round that did not report it


def _verdicts(base: dict, head: dict) -> dict[str, tuple[str, str]]:
    rows = gate.feature_rows(_run(base), _run(head), TH)
    return {r.check: (r.verdict, r.note) for r in rows}


def test_feature_rows():
    ok = {"batch_invariance": ("ok", 0.0), "quant_quanta": ("ok", 1.0), "qk_bits": ("unsupported", None, "x")}
    assert {k: v[0] for k, v in _verdicts(ok, ok).items()} == {
        "batch invariance": "pass",
        "quant quanta": "pass",
        "qk bits": "unsupported",  # neither side has it: shown, never a pass
    }
    worse = {**ok, "batch_invariance": ("ok", 12.0), "quant_quanta": ("ok", 2.0)}
    assert {k: v[0] for k, v in _verdicts(ok, worse).items()} == {
        "batch invariance": "regression",
        "quant quanta": "regression",
        "qk bits": "unsupported",
    }
    nan = _verdicts(ok, {**ok, "batch_invariance": ("ok", math.nan)})
    assert nan["batch invariance"][0] == "regression"
    lost = _verdicts(ok, {**ok, "batch_invariance": ("unsupported", None, "TypeError")})
    assert lost["batch invariance"] == ("regression", "head lost the feature (base measured it): TypeError")
    cases = {"batch_invariance": ("ok", 0.0, None, ("a", "b"))}
    dropped = _verdicts(cases, {"batch_invariance": ("ok", 0.0, "not supported: b: no residual", ("a",))})
    assert (
        dropped["batch invariance"][0] == "regression" and "dropped cases" in dropped["batch invariance"][1]
    )
    crashed = _verdicts(ok, {**ok, "quant_quanta": ("failed", None, "RuntimeError")})
    assert crashed["quant quanta"][0] == "regression"
    missing = _verdicts(ok, {"quant_quanta": ("ok", 0.0)})
    assert missing["batch invariance"] == ("error", "missing in head")
    assert gate.feature_rows(_run({}), _run({}), TH) == []  # plain benchmark runs: no rows


# The stand-in op with rows that depend on the batch: eps grows with the rows in the call.
BATCH_DEPENDENT = OPS.replace("+ eps).rsqrt()", "+ eps * x.shape[0]).rsqrt()")


@pytest.fixture(scope="module")
def feature_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("prv-features") / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    op = "src/rmsnorm_kernel/"
    base = commit(repo, {op + "__init__.py": INIT, op + "ops.py": OPS.format(cost=0.0)}, "base")
    assert BATCH_DEPENDENT != OPS
    head = commit(repo, {op + "ops.py": BATCH_DEPENDENT.format(cost=0.0)}, "rows depend on the batch")
    return repo, base, head


def test_pr_verdict_flags_a_batch_dependent_head(feature_repo, host_timing, tmp_path):
    repo, base, head = feature_repo
    out = tmp_path / "verdict"
    assert pr_verdict(repo, base, head, out, features=True) == 1
    data = json.loads((out / "verdict.json").read_text())
    rows = {r["check"]: r for r in data["rows"]}
    assert data["status"] == "regression", data["summary"]
    assert rows["batch invariance"]["verdict"] == "regression", rows["batch invariance"]
    assert rows["batch invariance"]["base"] == 0 and rows["batch invariance"]["head"] > 0
    # the stand-in op has no residual, quantised output or qk_norm on either side: those rows
    # show, never counted as a pass; the batch row names the residual cases it could not run
    absent = {c: r["verdict"] for c, r in rows.items() if c.startswith(("quant", "qk"))}
    assert absent and set(absent.values()) == {"unsupported"}, absent
    assert "no residual" in rows["batch invariance"]["note"]
    assert "not judged, neither side's op has it" in data["summary"]
