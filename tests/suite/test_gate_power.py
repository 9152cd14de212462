"""tools/gate_power.py and rmsnorm_suite.power: the resampling study on a SYNTHETIC A/A set (a
stated noise model: it tests the method, it measures nothing) and on results files as pr-verdict
writes them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from rmsnorm_suite import power, results
from tests.suite._fixtures import LARGE, THRESHOLDS, make_run

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gate_power", ROOT / "tools" / "gate_power.py")
gate_power = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate_power)

ROWS = gate_power.all_rows()
MODEL = power.NoiseModel(gate_power.SIGMA, gate_power.TAU, rho=0.5)


def test_synthetic_sets_say_so():
    aa = power.synthetic_aa(ROWS, MODEL, runs=3, rounds=6)
    assert aa.synthetic and "SYNTHETIC" in aa.source and len(aa.rows) == 72
    assert [x.shape for x in aa.d] == [(72, 6)] * 3


def test_resampling_keeps_the_spread_of_the_rounds():
    """A set of one row with no run offset: resampled rounds have the recorded per-round SD."""
    rows = [power.RowKey("device", LARGE, "forward", "large")]
    model = power.NoiseModel({("device", "large"): 0.01}, {("device", "large"): 0.0}, rho=0.0)
    aa = power.synthetic_aa(rows, model, runs=20, rounds=8, seed=2)
    d = power.resample(aa, rounds=6, trials=4000, rng=np.random.default_rng(0))
    assert d.shape == (4000, 1, 6)
    assert d.std(axis=-1, ddof=1).mean() == pytest.approx(0.01, rel=0.15)


def test_power_grows_with_the_shift_and_false_alarms_stay_under_the_rate():
    aa = power.synthetic_aa(ROWS, MODEL, runs=10, rounds=6, seed=1)
    rate = THRESHOLDS.family.rate
    candidates = [power.Candidate(1.02, 6), power.Candidate(1.02, 10)]
    out = power.study(aa, THRESHOLDS, candidates, [1.03, 1.05], ["device/large/forward"], trials=800)
    for e in out:
        assert e["false_alarm"] <= rate
        assert (
            e["power"]["device/large/forward x1.03"]["mean"]
            <= e["power"]["device/large/forward x1.05"]["mean"]
        )
        assert e["power"]["device/large/forward x1.05"]["verdict_fails"] > 0.95
    # more rounds, more power at the same factor
    assert (
        out[1]["power"]["device/large/forward x1.03"]["mean"]
        > out[0]["power"]["device/large/forward x1.03"]["mean"]
    )


def test_a_shift_exactly_at_the_factor_is_flagged_rarely():
    """At the factor itself a row is flagged with probability at most its level: the factor is the
    slowdown tolerated, so 1.03 cannot give power at +3%."""
    aa = power.synthetic_aa(ROWS, MODEL, runs=10, rounds=6, seed=3)
    out = power.study(
        aa, THRESHOLDS, [power.Candidate(1.03, 6)], [1.03], ["device/large/forward"], trials=800
    )
    assert out[0]["power"]["device/large/forward x1.03"]["mean"] < 0.05


def aa_folder(path: Path, seed: int) -> Path:
    """A pr-verdict output of an A/A run: base.json and head.json of the same distribution."""
    for stem, s in (("base", seed), ("head", seed + 1000)):
        results.write(results.as_run(make_run(s, rounds=5)), path, stem)
    return path


def test_recorded_runs_load_from_pr_verdict_outputs(tmp_path):
    folders = [aa_folder(tmp_path / f"aa-{i}", i) for i in range(2)]
    aa = power.load_aa(folders)
    assert not aa.synthetic and len(aa.d) == 2 and len(aa.rows) == 72
    assert aa.d[0].shape == (72, 5)
    assert all(np.isfinite(x).all() and np.abs(x).max() < 0.1 for x in aa.d)


def test_unpaired_results_are_refused(tmp_path):
    folder = aa_folder(tmp_path / "aa", 0)
    data = json.loads((folder / "head.json").read_text())
    del data["settings"]["round_indices"]
    (folder / "head.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not paired rounds"):
        power.load_aa([folder])


def test_the_tool_prints_the_table_and_writes_json(tmp_path, capsys):
    folders = [str(aa_folder(tmp_path / f"aa-{i}", i)) for i in range(2)]
    out = tmp_path / "power.json"
    argv = ["--aa", *folders, "--factors", "1.02", "1.03", "--rounds", "6", "--trials", "200",
            "--classes", "device/large/forward", "--json", str(out)]  # fmt: skip
    assert gate_power.main(argv) == 0
    text = capsys.readouterr().out
    assert "recorded A/A: 2 runs" in text and "only 2 A/A runs" in text
    assert "| device 1.02, 6 rounds, bound, holm 0.05 |" in text
    data = json.loads(out.read_text())
    assert len(data["entries"]) == 2 and data["data"] == "recorded A/A"


def test_the_tool_labels_a_synthetic_study(capsys):
    argv = ["--synthetic", "--synthetic-runs", "4", "--trials", "100", "--classes", "device/large/forward",
            "--statistics", "bound", "estimate"]  # fmt: skip
    assert gate_power.main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("data: **SYNTHETIC") and "justify no threshold" in text
    assert "device 1.03, 6 rounds, estimate" in text


def test_a_record_loads_as_its_folder_does(tmp_path):
    """The committed form of an A/A run (per-round medians only) gives the same log ratios as the
    pr-verdict output it was made from."""
    folder = aa_folder(tmp_path / "aa", 0)
    record = tmp_path / "aa.json"
    assert gate_power.main(["--record", str(folder), str(record), "--about", "test"]) == 0
    from_folder, from_record = power.load_aa([folder]), power.load_aa([record])
    assert from_folder.rows == from_record.rows
    np.testing.assert_allclose(from_record.d[0], from_folder.d[0], rtol=0, atol=1e-12)
    assert json.loads(record.read_text())["about"] == {"run": "test"}
    record.write_text(json.dumps({"format": "other", "rows": []}))
    with pytest.raises(ValueError, match="not an A/A record"):
        power.load_aa([record])
