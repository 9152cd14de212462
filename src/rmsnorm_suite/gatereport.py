"""The gate's verdict: its rows, its status, and the two files it is written to.

:class:`Row` is one check (a latency or numerics comparison, or a run-level row such as
pr-verdict's GPU tests); :class:`Verdict` holds them with the status and the exit code.
:func:`write_verdict` writes verdict.md (:func:`to_markdown`, the table a pull request shows)
and verdict.json. Apart from the judging (:mod:`rmsnorm_suite.gate`) so that what a verdict
says and how it reads can change without touching how it is reached.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("pass", "regression", "error")
# a row's; "accepted" never fails a verdict; "unsupported" (a feature neither side's op has) is
# shown and never counted as a pass
ROW_VERDICTS = ("pass", "accepted", "regression", "error", "unsupported")
EXIT = {"pass": 0, "regression": 1, "error": 2}


@dataclass
class Row:
    check: str
    base: float | None
    head: float | None
    ratio: float | None
    threshold: float | None
    verdict: str  # "pass", "accepted" (within an approved Accept-Regression), "regression", "error"
    kind: str = "latency"  # "latency", "numerics" or "run"
    p_value: float | None = None  # latency: one-sided t-test p over rounds for "head slower"
    alpha: float | None = None  # latency: 1 - confidence level of the ratio's lower bound
    note: str = ""
    # latency: the (1 - 2 alpha) confidence interval of the ratio, whose low end is the one-sided
    # (1 - alpha) bound held to the factor; rounds: the per-round medians per side it rests on
    ci_low: float | None = None
    ci_high: float | None = None
    confidence: float | None = None
    rounds: int | None = None
    # latency: the p of "ratio > factor" (the family rule's input), and the factor the table sets
    # where an accepted regression replaced it (``threshold`` then holds the accepted factor)
    p_factor: float | None = None
    table_factor: float | None = None


@dataclass
class Verdict:
    status: str
    summary: str
    rows: list[Row] = field(default_factory=list)
    base: dict[str, Any] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)
    thresholds: str = ""
    family: dict[str, Any] = field(default_factory=dict)  # the rule across rows, and what it tested
    acceptance: dict[str, Any] = field(default_factory=dict)  # Accept-Regression: asked, granted, refused

    @property
    def exit_code(self) -> int:
        return EXIT[self.status]

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "summary": self.summary,
            "rows": [asdict(r) for r in self.rows],
            "base": self.base,
            "head": self.head,
            "thresholds": self.thresholds,
            "family": self.family,
            "acceptance": self.acceptance,
        }


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _cell(r: Row, which: str) -> str:
    value = getattr(r, which)
    if value is None:
        return "-"
    if r.kind == "latency":
        if which in ("base", "head"):
            return f"{value * 1e3:.1f} µs"
        if which == "ratio":
            return f"{value:.3f} ({r.ci_low:.3f}-{r.ci_high:.3f}, p={r.p_value:.2g}, {r.rounds} rounds)"
        if which == "threshold":
            if r.alpha is None:
                return f"> {value:.2f}"
            return f"lower bound > {value:.2f} ({100 * (1 - r.alpha):.4g}%)"
    if r.kind == "numerics":
        if which == "ratio":
            return f"{value:.2f}"
        if which == "threshold":
            return f"> {value:.2e} ({r.note})"
        return f"{value:.2e}"
    return str(value)


def to_markdown(verdict: Verdict) -> str:
    b, h = verdict.base, verdict.head
    lines = [
        f"**{verdict.summary}**",
        "",
        f"base `{(b.get('commit') or '?')[:12]}` · head `{(h.get('commit') or '?')[:12]}` · "
        f"device {h.get('device') or b.get('device') or '?'} · thresholds `{verdict.thresholds}`. "
        "A latency check regresses when the one-sided lower confidence bound of head/base, from "
        "per-round medians (the rounds are the independent units), exceeds the factor; the ratio "
        "column gives the estimate, its (1 - 2 alpha) interval, whose low end is that bound, the "
        't-test p for "head slower" and the number of rounds. '
        "`latency` rows time whole calls (host work included); `device` rows time CUDA-graph "
        "replays (the kernels' GPU time alone); `host` rows time the host's work of the same calls."
        + _host_paths(b, h)
        + _family_line(verdict.family),
        "",
        "| check | base | head | ratio | threshold | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in verdict.rows:
        mark = {
            "pass": "pass",
            "accepted": "**accepted**",
            "regression": "**regression**",
            "error": "**error**",
            "unsupported": "not supported by either side",
        }[r.verdict]
        # numerics notes say which limit binds and already show in the threshold column
        note = f" ({_escape(r.note)})" if r.note and r.kind != "numerics" else ""
        if r.kind == "numerics" and r.verdict == "error":
            note = f" ({_escape(r.note)})"
        cells = [_cell(r, "base"), _cell(r, "head"), _cell(r, "ratio"), _cell(r, "threshold")]
        lines.append(f"| {r.check} | " + " | ".join(cells) + f" | {mark}{note} |")
    return "\n".join(lines) + "\n"


def _family_line(family: Mapping[str, Any]) -> str:
    """The rule across rows, as the verdict applied it."""
    if family.get("method") != "holm" or not family.get("rows"):
        return ""
    return (
        f" Across rows: Holm at a family-wise rate of {family['rate']:g} over {family['rows']} latency rows "
        f"(the first tested at {family['first_level']:.2g}); each row's interval is at the level Holm "
        "tested it at."
    )


def _host_paths(b: Mapping[str, Any], h: Mapping[str, Any]) -> str:
    """The host path each side's calls took (harness.op_host_path), where a run recorded it."""
    if not (b.get("op_host_path") or h.get("op_host_path")):
        return ""
    return f" The op's host path: base {b.get('op_host_path') or '?'}, head {h.get('op_host_path') or '?'}."


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_verdict(verdict: Verdict, out_dir: str | Path) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "verdict.md", out / "verdict.json"
    md.write_text(to_markdown(verdict), encoding="utf-8")
    js.write_text(json.dumps(verdict.to_json(), indent=1) + "\n", encoding="utf-8")
    return md, js
