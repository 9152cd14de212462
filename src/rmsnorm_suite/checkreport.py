"""Summaries of check results: a dict for the JSON records and a markdown table for people.

:func:`summarize` and :func:`format_table` take the :class:`rmsnorm_suite.checks.CaseResult`
records of grids and probes alike; :data:`CRITERION`, the rule that decides a case, is printed
under every table of results (here and in the walkthrough's grids).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rmsnorm_suite.checks import CaseResult
from rmsnorm_suite.console import markdown_table

# what decides a case, printed under every table of results
CRITERION = (
    "A case passes when every element has |err| <= atol + rtol·|ref| + 2u·envelope (fp32 rounding of\n"
    "the terms) and its relative L2 error against the float64 oracle is within its limit. 'of bound'\n"
    "and 'of oracle limit': the worst case's share of each; at most 1 (100%) passes. 'max rel' is\n"
    "|err|/|ref|, large where |ref| is near 0: shown, not judged."
)


def _finite_max(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


def summarize(results: Sequence[CaseResult]) -> dict:
    """cases, failures, max abs and rel error, the tolerance per dtype, and the failing cases."""
    failures = [r for r in results if not r.passed]
    # keyed by the dtype of the checked tensor: the weight's for dw, x's otherwise
    tolerance = {
        (r.weight_dtype if r.kind == "gamma" else r.dtype): {"atol": r.atol, "rtol": r.rtol} for r in results
    }
    worst_fraction = _finite_max(
        r.oracle_error / r.oracle_limit for r in results if r.oracle_limit and not math.isnan(r.oracle_limit)
    )
    summary = {
        "cases": len(results),
        "failures": len(failures),
        "passed": not failures,
        "max_abs": _finite_max(r.max_abs for r in results),
        "max_rel": _finite_max(r.max_rel for r in results),
        # largest oracle error as a fraction of its allowed limit (<= 1 passes)
        "worst_oracle_fraction": worst_fraction,
        # worst element's |err| / (atol + rtol*|ref| + 2u*envelope) (<= 1 passes)
        "worst_bound_fraction": _finite_max(r.bound_fraction for r in results),
        "tolerance": tolerance,
        "failed": [{"name": r.name, "kind": r.kind, "check": r.check, "reason": r.reason} for r in failures],
    }
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}


def _fmt(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}"


def format_table(results: Sequence[CaseResult]) -> str:
    """A markdown table, one row per (kind, dtype): cases, failures, max abs and rel error, the
    tolerance, the fractions of the two deciding bounds used, and pass; then the rule; the failing
    cases follow, one line each."""
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for r in results:
        # dw is judged in the weight's dtype: a mixed case gets its own row
        label = (
            r.dtype
            if r.kind != "gamma" or r.weight_dtype in ("", r.dtype)
            else f"{r.dtype}, dw {r.weight_dtype}"
        )
        groups.setdefault((r.kind, label), []).append(r)
    headers = ["kind", "dtype", "cases", "failures", "max abs", "max rel", "atol", "rtol", "of bound"]
    headers += ["of oracle limit", "pass"]
    rows = []
    for (kind, label), rs in groups.items():
        fails = sum(not r.passed for r in rs)
        rows.append(
            [kind, label, len(rs), fails, _fmt(_finite_max(r.max_abs for r in rs))]
            + [_fmt(_finite_max(r.max_rel for r in rs)), f"{rs[0].atol:g}", f"{rs[0].rtol:g}"]
            + [_fmt(_finite_max(r.bound_fraction for r in rs))]
            + [_fmt(_finite_max(r.oracle_error / r.oracle_limit for r in rs if r.oracle_limit))]
            + ["pass" if not fails else "FAIL"]
        )
    lines = [markdown_table(headers, rows, right=range(2, 10)), "", CRITERION]
    failed = [r for r in results if not r.passed]
    if failed:
        lines.append("")
        lines.append("Failures:")
        lines += [f"- {r.check} {r.kind} {r.name}: {r.reason}" for r in failed]
    return "\n".join(lines)
