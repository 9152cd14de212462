"""The mutant catalogue: the suite's checks must pass the correct kernel and catch every mutant.

Runs the Triton kernels of tests/mutants.py on CPU tensors under TRITON_INTERPRET=1 (small
shapes). Writes outputs/mutants.md and outputs/mutants.json: each mutant with the check that
caught it and the case that exposed it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rmsnorm_kernel import checks

from . import mutants

pytestmark = [
    pytest.mark.interpret,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") != "1",
        reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1 (nox -s interpret)",
    ),
    # The interpreter itself calls int() on one-element arrays for runtime loop bounds (NumPy
    # deprecates that), and the fp16 mutants overflow on purpose.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

OUTPUTS = Path(__file__).resolve().parents[1] / "outputs"
_ENTRIES: dict[str, dict] = {}


def test_baseline_passes_every_check():
    results = mutants.run_suite(mutants.as_impl(""))
    failed = [r for r in results if not r.passed]
    assert results and not failed, checks.format_table(failed)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_caught(name):
    entry = mutants.hunt(name)
    _ENTRIES[name] = entry
    assert entry["caught"], f"mutant {name!r} ({entry['description']}) survived every check"


# Why the probes exist: each bug below hides from one case and shows in another.
HIDE_AND_SHOW = [
    # (mutant, check, kind, case or probe kwargs, expected to pass)
    ("denominator_block", checks.check_denominator, "forward", {"n": 256}, True),
    ("denominator_block", checks.check_denominator, "forward", {"n": 257}, False),
    ("dx_denominator_block", checks.check_denominator, "backward", {"n": 256}, True),
    ("dx_denominator_block", checks.check_denominator, "backward", {"n": 257}, False),
    ("dw_mean_over_rows", checks.check_gamma, "gamma", checks.Case(1, 257, torch.float32), True),
    ("dw_mean_over_rows", checks.check_gamma, "gamma", checks.Case(17, 257, torch.float32), False),
    ("eps_outside_sqrt", checks.check_forward, "forward", checks.Case(5, 257, torch.float16), True),
    ("eps_outside_sqrt", checks.check_small_magnitude, "forward", {}, False),
    ("squares_in_fp16", checks.check_large_magnitude, "forward", {}, False),
    ("dx_r2_instead_of_r3", checks.check_denominator, "backward", {"n": 257}, True),
    ("dx_r2_instead_of_r3", checks.check_rstd_precision, "backward", {}, False),
    ("store_without_mask", checks.check_forward, "forward", checks.Case(3, 257, torch.float32), True),
    ("store_without_mask", checks.check_output_bounds, "forward", {}, False),
    ("dw_order_varies", checks.check_gamma, "gamma", checks.Case(17, 257, torch.float32), True),
    ("dw_order_varies", checks.check_determinism, "gamma", {}, False),
]


@pytest.mark.parametrize(
    ("name", "check", "kind", "where", "passes"),
    HIDE_AND_SHOW,
    ids=[f"{row[0]}-{row[1].__name__}-{'hides' if row[4] else 'shows'}" for row in HIDE_AND_SHOW],
)
def test_where_a_mutant_hides_and_shows(name, check, kind, where, passes):
    impl = mutants.as_impl(name)
    if isinstance(where, checks.Case):
        result = check(impl, where)
    else:
        result = check(impl, "cpu", kind=kind, **where)
    assert result.passed is passes, result.reason


def test_catalogue_report(capsys):
    """Every mutant in the report, each caught; the report written as markdown and JSON."""
    entries = [_ENTRIES.get(name) or mutants.hunt(name) for name in mutants.MUTANTS]
    report = mutants.format_report(entries)
    OUTPUTS.mkdir(exist_ok=True)
    (OUTPUTS / "mutants.md").write_text(report)
    (OUTPUTS / "mutants.json").write_text(json.dumps(entries, indent=2, allow_nan=False) + "\n")
    with capsys.disabled():
        print("\n" + report)
    survivors = [e["mutant"] for e in entries if not e["caught"]]
    assert not survivors, f"mutants survived every check: {survivors}"
