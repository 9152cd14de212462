"""The time budgets, kept: each measured run's figure, recorded in docs/budgets.json, within its
budget. A check of recorded figures (like the gate's of its results), not a timed test: the run
that is measured is a whole `.ci/run` or nox session, which a test cannot contain."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "budgets.json"
# budget name -> seconds: .ci/run on a fresh 2-core clone, installs included; the gpu session on
# one H200; the verdict on a CPU-only machine
BUDGETS = {"ci_run": 600, "gpu_session": 300, "verdict_cpu": 180}


def record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def test_the_record_has_one_entry_per_budget_with_the_same_limits():
    data = record()
    assert data["budgets_s"] == BUDGETS
    assert set(data["runs"]) == set(BUDGETS)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_recorded_run_is_within_its_budget(name):
    run = record()["runs"][name]
    if run is None:
        pytest.skip(f"{name}: no run recorded in docs/budgets.json yet (budget {BUDGETS[name]} s)")
    for key in ("seconds", "date", "commit", "where"):
        assert key in run, f"{name}: the record needs {key!r}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]), run["date"]
    assert run["seconds"] <= BUDGETS[name], f"{name}: {run['seconds']} s recorded, budget {BUDGETS[name]} s"
    phases = run.get("phases_s", {})
    assert sum(phases.values()) <= run["seconds"] + 1, f"{name}: its phases add up to more than the run"


def test_a_record_over_its_budget_fails(tmp_path, monkeypatch):
    """The check can fail: a run over its budget is reported, not passed."""
    over = record()
    over["runs"]["ci_run"] = {"seconds": 601, "date": "2026-01-01", "commit": "0" * 12, "where": "test"}
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(over))
    monkeypatch.setitem(globals(), "RECORD", path)
    with pytest.raises(AssertionError, match="601 s recorded, budget 600 s"):
        test_recorded_run_is_within_its_budget("ci_run")
