"""The mutant catalogue: the suite's checks must pass the correct kernel and catch every mutant.

Runs the Triton kernels of rmsnorm_suite/mutants.py on CPU tensors under TRITON_INTERPRET=1 (small
shapes). Writes outputs/mutants.md and outputs/mutants.json: each mutant with the check that
caught it and the case that exposed it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rmsnorm_suite import cases, checkreport, checks, featurechecks, mutanthunt, mutants, probes

from ..conftest import TERMINAL_REPORTS

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

OUTPUTS = Path(__file__).resolve().parents[2] / "outputs"
_ENTRIES: dict[str, dict] = {}


def test_baseline_passes_every_check():
    results = mutanthunt.run_suite(mutants.as_impl(""))
    failed = [r for r in results if not r.passed]
    assert results and not failed, checkreport.format_table(failed)


@pytest.mark.parametrize("name", list(mutants.MUTANTS))
def test_mutant_is_caught(name):
    entry = mutanthunt.hunt(name)
    _ENTRIES[name] = entry
    assert entry["caught"], f"mutant {name!r} ({entry['description']}) survived every check"


# Why the probes exist: each bug below hides from one case and shows in another.
HIDE_AND_SHOW = [
    # (mutant, check, kind, case or probe kwargs, expected to pass)
    ("denominator_block", probes.check_denominator, "forward", {"n": 256}, True),
    ("denominator_block", probes.check_denominator, "forward", {"n": 257}, False),
    ("dx_denominator_block", probes.check_denominator, "backward", {"n": 256}, True),
    ("dx_denominator_block", probes.check_denominator, "backward", {"n": 257}, False),
    ("dw_mean_over_rows", checks.check_gamma, "gamma", cases.Case(1, 257, torch.float32), True),
    ("dw_mean_over_rows", checks.check_gamma, "gamma", cases.Case(17, 257, torch.float32), False),
    ("eps_outside_sqrt", checks.check_forward, "forward", cases.Case(5, 257, torch.float16), True),
    ("eps_outside_sqrt", probes.check_small_magnitude, "forward", {}, False),
    ("squares_in_fp16", probes.check_large_magnitude, "forward", {}, False),
    ("dx_r2_instead_of_r3", probes.check_denominator, "backward", {"n": 257}, True),
    ("dx_r2_instead_of_r3", probes.check_rstd_precision, "backward", {}, False),
    ("store_without_mask", checks.check_forward, "forward", cases.Case(3, 257, torch.float32), True),
    ("store_without_mask", probes.check_output_bounds, "forward", {}, False),
    ("dw_order_varies", checks.check_gamma, "gamma", cases.Case(17, 257, torch.float32), True),
    ("dw_order_varies", probes.check_determinism, "gamma", {}, False),
]


@pytest.mark.parametrize(
    ("name", "check", "kind", "where", "passes"),
    HIDE_AND_SHOW,
    ids=[f"{row[0]}-{row[1].__name__}-{'hides' if row[4] else 'shows'}" for row in HIDE_AND_SHOW],
)
def test_where_a_mutant_hides_and_shows(name, check, kind, where, passes):
    impl = mutants.as_impl(name)
    if isinstance(where, cases.Case):
        result = check(impl, where)
    else:
        result = check(impl, "cpu", kind=kind, **where)
    assert result.passed is passes, result.reason


# ---------------------------------------------------------------------------------------------
# Model-ready features (fused residual, offset, casting modes, out_dtype)
# ---------------------------------------------------------------------------------------------


def test_feature_baseline_passes_every_feature_check():
    results = featurechecks.run_feature_suite(mutants.FEATURE_BASELINE)
    failed = [r for r in results if not r.passed]
    assert results and not failed, checkreport.format_table(failed)


@pytest.mark.parametrize("name", list(mutants.FEATURE_MUTANTS))
def test_feature_mutant_is_caught(name):
    entry = mutanthunt.hunt(name)
    _ENTRIES[name] = entry
    assert entry["caught"], f"feature mutant {name!r} ({entry['description']}) survived every feature check"


# Why the feature cases are what they are: each bug below hides from one case or judgement.
H_SAME_DTYPE = cases.Case.feature(
    "x bf16 + r bf16 -> h bf16", torch.bfloat16, torch.bfloat16, r_dtype=torch.bfloat16
)
FEATURE_HIDE_AND_SHOW = [
    # (mutant, case, results judged, expected to pass)
    # a low-precision add is exact when h has x's dtype; an fp32 h shows it
    ("residual_added_in_x_dtype", H_SAME_DTYPE, ("h", "y"), True),
    ("residual_added_in_x_dtype", featurechecks.RESIDUAL_CASES[0], ("h",), False),
    # the fp32 sum is h itself when h is fp32; a bf16 h differs from it
    ("normalises_unrounded_sum", featurechecks.RESIDUAL_CASES[0], ("y",), True),
    ("normalises_unrounded_sum", featurechecks.RESIDUAL_CASES[1], ("y",), False),
    # an fp32 weight plus 1 stays exact; a bf16 one rounds
    ("offset_in_weight_dtype", featurechecks.OFFSET_CASES[0], ("y",), True),
    ("offset_in_weight_dtype", featurechecks.OFFSET_CASES[1], ("y",), False),
    # Llama's extra rounding sits inside the tolerance; only the nearer-reference judgement sees it
    ("llama_rounding_skipped", featurechecks.LLAMA_CASES[0], ("y", "y vs Hugging Face"), True),
    ("llama_rounding_skipped", featurechecks.LLAMA_CASES[0], ("y rounding",), False),
    ("llama_dw_unrounded", featurechecks.LLAMA_CASES[0], ("dw",), True),
    ("llama_dw_unrounded", featurechecks.LLAMA_CASES[0], ("dw rounding",), False),
]


@pytest.mark.parametrize(
    ("name", "case", "kinds", "passes"),
    FEATURE_HIDE_AND_SHOW,
    ids=[f"{row[0]}-{'+'.join(row[2])}-{'hides' if row[3] else 'shows'}" for row in FEATURE_HIDE_AND_SHOW],
)
def test_where_a_feature_mutant_hides_and_shows(name, case, kinds, passes):
    impl = mutants.FEATURE_MUTANTS[name][1]
    judged = [r for r in featurechecks.run_feature_case(impl, case) if r.kind in kinds]
    assert {r.kind for r in judged} == set(kinds)
    assert all(r.passed for r in judged) is passes, [r.reason for r in judged if not r.passed]


def test_catalogue_report():
    """Every mutant in the report, each caught; the report written as markdown and JSON."""
    entries = [
        _ENTRIES.get(name) or mutanthunt.hunt(name) for name in [*mutants.MUTANTS, *mutants.FEATURE_MUTANTS]
    ]
    report = mutanthunt.format_report(entries)
    OUTPUTS.mkdir(exist_ok=True)
    (OUTPUTS / "mutants.md").write_text(report)
    (OUTPUTS / "mutants.json").write_text(json.dumps(entries, indent=2, allow_nan=False) + "\n")
    TERMINAL_REPORTS.append(("mutant catalogue (outputs/mutants.md)", report))
    survivors = [e["mutant"] for e in entries if not e["caught"]]
    assert not survivors, f"mutants survived every check: {survivors}"
