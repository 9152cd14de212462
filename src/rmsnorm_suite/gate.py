"""`rmsnorm-kernel gate`: judge a head benchmark run against a base run with regression.toml.

Latency, per (shape, mode) of the "kernel" provider, on rounds (one median per side per round):
a regression when the one-sided lower confidence bound of head/base exceeds the group's factor.
Three latencies, each with its table: whole calls ``[latency]``, CUDA-graph replays
``[device_latency]`` and the host clock ``[host_latency]``; across rows, Holm at a family-wise
rate (``[family]``); accepted rows (:mod:`rmsnorm_suite.accept`). Numerics, per (shape,
quantity): the head's error against the float64 oracle may not exceed min(ceiling, base x growth).
Rules read by :mod:`rmsnorm_suite.thresholds`, verdict written by :mod:`rmsnorm_suite.gatereport`;
the method: docs/gate.md ("How the gate judges"). Exit status: 0 pass, 1 regression, 2 could
not judge (a missing or failed result, a missing threshold, too few samples or rounds).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rmsnorm_suite import results
from rmsnorm_suite.gatereport import EXIT, Row, Verdict, write_verdict
from rmsnorm_suite.results import Row as ResultRow
from rmsnorm_suite.results import Run
from rmsnorm_suite.thresholds import (
    CHECK_PREFIXES,
    LATENCY_TABLES,
    QUANTITIES,
    THRESHOLDS_NAME,  # noqa: F401  pullrequest reaches it as gate.THRESHOLDS_NAME
    Thresholds,
    load_thresholds,
)

# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioEstimate:
    """head/base latency from per-round medians."""

    ratio: float  # exp(mean log ratio): the geometric mean of per-round ratios when paired
    low: float  # one-sided (1 - alpha) lower confidence bound of the ratio
    high: float  # with low, the two-sided (1 - 2 alpha) interval (the t law is symmetric)
    p_value: float  # one-sided p of the t test for "head slower" (ratio > 1)
    rounds: int  # independent units per side (the fewer of the two when unpaired)
    paired: bool
    p_factor: float | None = None  # one-sided p of the same test for "ratio > factor", given a factor


def ratio_estimate(
    base_units: Sequence[float],
    head_units: Sequence[float],
    alpha: float,
    paired: bool,
    factor: float | None = None,
) -> RatioEstimate:
    """Student-t inference on the logs of per-round medians: paired (``scipy.stats.ttest_rel``)
    where round k of base and of head ran side by side, else Welch (``ttest_ind``). Rank tests were
    not chosen: with 4-6 rounds their smallest one-sided p (1/64 for a signed-rank test on 6
    pairs) cannot reach an alpha of 0.01. A spread of zero collapses the interval onto the
    estimate. With ``factor``, ``p_factor`` is the p of the test of "ratio > factor" (head's
    logs shifted down by log factor): the lower bound at level a exceeds the factor exactly when
    ``p_factor`` < a, which is what the family rule (:func:`holm`) works on."""
    from scipy import stats

    lb = [math.log(v) for v in base_units]
    lh = [math.log(v) for v in head_units]
    if len(lb) < 2 or len(lh) < 2:
        raise ValueError(f"need at least 2 rounds per side, got {len(lb)} and {len(lh)}")
    if paired and len(lb) != len(lh):
        raise ValueError(f"paired rounds need equal counts, got {len(lb)} and {len(lh)}")
    if paired:
        diffs = [h - b for h, b in zip(lh, lb)]
        estimate, spread = sum(diffs) / len(diffs), max(diffs) - min(diffs)
        test = stats.ttest_rel(lh, lb, alternative="greater")
    else:
        estimate = sum(lh) / len(lh) - sum(lb) / len(lb)
        spread = max(lh) - min(lh) + max(lb) - min(lb)
        test = stats.ttest_ind(lh, lb, equal_var=False, alternative="greater")
    shift = math.log(factor) if factor is not None else None
    if spread == 0:
        low, p = estimate, (0.0 if estimate > 0 else 1.0)
        p_factor = None if shift is None else (0.0 if estimate > shift else 1.0)
    else:
        low, p = float(test.confidence_interval(1 - alpha).low), float(test.pvalue)
        p_factor = None
        if shift is not None:
            lh_shifted = [v - shift for v in lh]
            if paired:
                shifted = stats.ttest_rel(lh_shifted, lb, alternative="greater")
            else:
                shifted = stats.ttest_ind(lh_shifted, lb, equal_var=False, alternative="greater")
            p_factor = float(shifted.pvalue)
    high = 2 * estimate - low
    rounds = min(len(lb), len(lh))
    return RatioEstimate(math.exp(estimate), math.exp(low), math.exp(high), p, rounds, paired, p_factor)


def holm(p_values: Sequence[float], rate: float) -> tuple[list[bool], list[float]]:
    """Holm's step-down procedure: which hypotheses to reject so that the chance of rejecting any
    true one is at most ``rate`` (family-wise, under any dependence between them), and the level
    each was tested at (``rate / (m - rank)``, rank 0 for the smallest p). Rejection stops at the
    first p that does not clear its level; ties keep their input order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    reject, levels = [False] * m, [0.0] * m
    going = True
    for rank, i in enumerate(order):
        levels[i] = rate / (m - rank)
        going = going and p_values[i] < levels[i]
        reject[i] = going
    return reject, levels


# The judgements, each a small function of its own (mutation testing targets them).


def exceeds_factor(ci_low: float, factor: float) -> bool:
    """Latency regression: even the lower confidence bound of head/base is above the factor."""
    return ci_low > factor


def significant(p_value: float, alpha: float) -> bool:
    """Head is slower than base at level alpha (whatever the size of the difference)."""
    return p_value < alpha


def error_limit(base_error: float | None, growth: float, ceiling: float) -> tuple[float, str]:
    """The error head may reach: min(ceiling, base error x growth), and which of the two binds."""
    if base_error is not None and math.isfinite(base_error) and base_error * growth < ceiling:
        return base_error * growth, f"base x {growth:g}"
    return ceiling, "ceiling" if base_error is not None else "ceiling (base has no error figure)"


def exceeds_limit(error: float, limit: float) -> bool:
    """Numeric regression: head's error above its limit, or not finite."""
    return not math.isfinite(error) or error > limit


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


# ---------------------------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------------------------


def _describe(run: Run | None) -> dict[str, Any]:
    if run is None:
        return {}
    return {
        "commit": run.git.commit,
        "device": run.machine.get("device"),
        "torch": run.machine.get("torch"),
        "triton": run.machine.get("triton"),
        "copy_tbs": run.copy.tbs,
        "op_host_path": run.machine.get("op_host_path"),
    }


def _shape_order(key: tuple[str, str]) -> tuple[int, str, int]:
    """Order of cases.BENCH_SHAPES when known, else by name; forward before forward_backward."""
    try:
        from rmsnorm_suite import cases

        names = [s.name for s in cases.BENCH_SHAPES]
    except Exception:  # the gate judges files; the package's matrix only orders the table
        names = []
    shape, mode = key
    position = names.index(shape) if shape in names else len(names)
    return (position, shape, list(QUANTITIES).index(mode) if mode in QUANTITIES else 9)


def interleaved(base: Run | Mapping[str, Any] | None, head: Run | Mapping[str, Any] | None) -> bool:
    """Both runs are pr-verdict merges of the same rounds (``settings.round_indices``), so their
    per-round medians pair up."""
    rounds = [None if run is None else results.as_run(run).round_indices for run in (base, head)]
    return bool(rounds[0]) and rounds[0] == rounds[1]


def judge(
    base: Run | Mapping[str, Any] | None,
    head: Run | Mapping[str, Any] | None,
    thresholds: Thresholds,
    *,
    provider: str = "kernel",
    extra_rows: Sequence[Row] = (),
    missing: dict[str, str] | None = None,
    acceptances: Sequence[Any] = (),
) -> Verdict:
    """Compare two benchmark runs (:class:`rmsnorm_suite.results.Run`, or their JSON form) and
    return the verdict.

    ``base`` or ``head`` may be None (the file could not be read; ``missing`` says why);
    ``extra_rows`` come first in the table (pr-verdict's GPU-test row). ``acceptances``:
    :class:`rmsnorm_suite.accept.Request` records (Accept-Regression), granted or refused here
    against ``thresholds.accept`` and listed in the verdict either way."""
    from rmsnorm_suite import accept as accepting

    base, head = (None if run is None else results.as_run(run) for run in (base, head))
    rows: list[Row] = list(extra_rows)
    b = base.rows_of(provider) if base is not None else {}
    h = head.rows_of(provider) if head is not None else {}
    paired = interleaved(base, head)
    checks = [
        f"{CHECK_PREFIXES[kind]} {shape} {mode}"
        for shape, mode in set(b) & set(h)
        for kind in ("whole", "device", "host")
        if kind == "whole" or getattr(thresholds, LATENCY_TABLES[kind])
    ]
    granted, acceptance = accepting.grant(acceptances, thresholds.accept, checks)
    units: dict[int, tuple] = {}  # id(row) -> what its estimate rests on, for the family rule
    for side, run in (("base", base), ("head", head)):
        if run is None:
            note = (missing or {}).get(side, "missing")
            rows.append(Row(f"{side} results", None, None, None, None, "error", "run", note=note))
    if base is not None and head is not None and not b and not h:
        rows.append(
            Row(f"{provider} results", None, None, None, None, "error", "run", note="none in either run")
        )
    for key in sorted(set(b) | set(h), key=_shape_order):
        shape, mode = key
        name = f"{shape} {mode}"
        br, hr = b.get(key), h.get(key)
        if br is None or hr is None:
            side = "base" if br is None else "head"
            rows.append(Row(f"latency {name}", None, None, None, None, "error", note=f"missing in {side}"))
            continue
        failed = [(side, r) for side, r in (("base", br), ("head", hr)) if not r.ok]
        if failed:
            note = "; ".join(f"{side} failed: {r.error or r.status}" for side, r in failed)
            rows.append(Row(f"latency {name}", None, None, None, None, "error", note=note[:300]))
            continue
        for kind in ("whole", "device", "host"):
            if kind == "whole" or getattr(thresholds, LATENCY_TABLES[kind]):
                rows.append(
                    _latency_row(name, br, hr, thresholds, kind, paired=paired, granted=granted, units=units)
                )
        rows.extend(_numeric_rows(shape, mode, br, hr, thresholds))
    rows.extend(feature_rows(base, head, thresholds))
    family = apply_family(rows, units, thresholds)
    verdict = _verdict(rows, base, head, thresholds)
    verdict.family, verdict.acceptance = family, acceptance
    if acceptance.get("requested"):
        verdict.summary += accepting.summary(acceptance, rows)
    return verdict


def _latency_row(
    name: str,
    br: ResultRow,
    hr: ResultRow,
    th: Thresholds,
    kind: str = "whole",
    paired: bool = False,
    granted: Mapping[str, Any] | None = None,
    units: dict[int, tuple] | None = None,
) -> Row:
    """Host-inclusive latency (the rows' ``whole`` timing, [latency]), GPU time from graph replays
    (``device``, [device_latency]) or the host clock around the whole calls (``host``,
    [host_latency]); the units are the block (round) medians; ``paired``: the runs' rounds ran
    side by side (pr-verdict), so round k of base is compared with round k of head. ``granted``:
    approved Accept-Regression records by check name; such a row is held to the accepted factor
    and is ``accepted`` where it passes the table's factor only by that. ``units``: where the
    family rule (:func:`apply_family`) finds each row's per-round medians."""
    table = LATENCY_TABLES[kind]
    check = f"{CHECK_PREFIXES[kind]} {name}"
    device = kind == "device"
    group, mode = hr.group, hr.mode
    rule = getattr(th, table).get((group, mode))
    bt, ht = br.timing(kind), hr.timing(kind)
    bs, hs = bt.samples_ms, ht.samples_ms
    bm, hm = (median(bs) if bs else None), (median(hs) if hs else None)
    if rule is None:
        return Row(
            check, bm, hm, None, None, "error", note=f"no threshold {table}.{group}.{mode} in {th.source}"
        )
    if device:
        broken = [f"{side}: {r.device_error}" for side, r in (("base", br), ("head", hr)) if r.device_error]
        if broken:
            return Row(check, bm, hm, None, rule.factor, "error", note="; ".join(broken)[:300])
    if len(bs) < th.min_samples or len(hs) < th.min_samples:
        note = f"too few samples (base {len(bs)}, head {len(hs)}; need {th.min_samples})"
        return Row(check, bm, hm, None, rule.factor, "error", note=note)
    bu, hu = bt.block_medians_ms, ht.block_medians_ms
    if len(bu) < th.min_rounds or len(hu) < th.min_rounds:
        note = f"too few rounds (base {len(bu)}, head {len(hu)}; need {th.min_rounds})"
        return Row(check, bm, hm, None, rule.factor, "error", note=note)
    bm, hm = median(bu), median(hu)
    pair = paired and len(bu) == len(hu)
    acceptance = (granted or {}).get(check)
    factor = acceptance.factor if acceptance is not None else rule.factor
    # under [family] the level is Holm's, set in apply_family; until then the family rate
    alpha = rule.alpha if rule.alpha is not None else th.family.rate
    est = ratio_estimate(bu, hu, alpha, pair, factor)
    row = Row(
        check, bm, hm, est.ratio, factor, "pass", "latency", est.p_value, alpha, "",
        ci_low=est.low, ci_high=est.high, confidence=1 - 2 * alpha, rounds=est.rounds,
        p_factor=est.p_factor, table_factor=rule.factor if acceptance is not None else None,
    )  # fmt: skip
    if units is not None:
        units[id(row)] = (bu, hu, pair, rule.factor)
    # an accepted row's bound is held to the accepted factor and, for `accepted`, to the table's
    decide(row, exceeds_factor(est.low, factor), est.low if acceptance is not None else None)
    return row


def decide(row: Row, regressed: bool, table_low: float | None = None, holm_stopped: bool = False) -> None:
    """A latency row's verdict and note from its bound: ``regressed`` (the bound, or Holm, cleared
    the factor in ``threshold``); an accepted row (``table_factor`` set) that did not is
    ``accepted`` when its bound clears the table's factor."""
    factor, low = row.threshold, row.ci_low
    if regressed:
        row.verdict = "regression"
        row.note = "beyond the accepted factor" if row.table_factor is not None else ""
        return
    row.verdict = "pass"
    if row.table_factor is not None and table_low is not None and exceeds_factor(table_low, row.table_factor):
        row.verdict = "accepted"
        row.note = f"lower bound {low:.3f} past the table's factor {row.table_factor:.2f}, within the accepted {factor:.2f}"
    elif row.table_factor is not None:
        row.note = f"Accept-Regression unused: within the table's factor {row.table_factor:.2f}"
    elif holm_stopped and exceeds_factor(low, factor):
        row.note = "its lower bound clears the factor at its Holm level, but Holm stopped at an earlier row"
    elif row.ratio > factor:
        row.note = f"above factor, but its lower bound {low:.3f} is not"
    elif significant(row.p_value, row.alpha):
        row.note = "significantly slower, within factor"
    else:
        row.note = ""


def apply_family(rows: Sequence[Row], units: Mapping[int, tuple], th: Thresholds) -> dict[str, Any]:
    """[family] method = holm: Holm at the family rate over the latency rows that were judged
    (their ``p_factor``); each row's ``alpha`` becomes the level Holm tested it at, its interval is
    recomputed at that level, and its verdict is Holm's. Returns what the verdict records."""
    if th.family.method != "holm":
        return {"method": "none", "note": "each latency row at its own alpha"}
    judged = [r for r in rows if id(r) in units and r.p_factor is not None]
    reject, levels = holm([r.p_factor for r in judged], th.family.rate)
    stopped = False
    for r, rejected, level in sorted(zip(judged, reject, levels), key=lambda t: t[2]):
        bu, hu, pair, table_factor = units[id(r)]
        est = ratio_estimate(bu, hu, level, pair, r.threshold)
        r.alpha, r.ci_low, r.ci_high, r.confidence = level, est.low, est.high, 1 - 2 * level
        table_low = est.low if r.table_factor is not None else None  # the same bound, the table's factor
        decide(r, rejected, table_low, holm_stopped=stopped)
        stopped = stopped or not rejected
    return {
        "method": "holm",
        "rate": th.family.rate,
        "rows": len(judged),
        "first_level": th.family.rate / len(judged) if judged else None,
        "rejected": sum(reject),
    }


def _numeric_rows(shape: str, mode: str, br: ResultRow, hr: ResultRow, th: Thresholds) -> list[Row]:
    rows = []
    dtype = hr.dtype
    rule = th.numerics.get(dtype)
    berrs, herrs = br.errors, hr.errors
    for q in QUANTITIES.get(mode, ()):
        check = f"error {q} {shape}"
        be, he = berrs.get(q), herrs.get(q)
        if rule is None or q not in rule.ceiling:
            rows.append(
                Row(check, be, he, None, None, "error", "numerics", note=f"no numerics.{dtype} ceiling {q}")
            )
            continue
        if he is None:
            rows.append(
                Row(check, be, None, None, None, "error", "numerics", note="head has no error figure")
            )
            continue
        limit, note = error_limit(be, rule.growth, rule.ceiling[q])
        ratio = he / be if be else None
        bad = exceeds_limit(he, limit)
        rows.append(Row(check, be, he, ratio, limit, "regression" if bad else "pass", "numerics", note=note))
    return rows


def feature_rows(base: Run | None, head: Run | None, th: Thresholds) -> list[Row]:
    """The inference features' rows (docs/gate.md): head's figure against its [features] limit,
    base's beside it. None where neither run holds figures (a plain benchmark run). Head without
    a figure, or a case, base has (base's check measured or failed) is a regression; a figure
    neither side's op has is an ``unsupported`` row, shown and never counted as a pass."""
    b = base.features if base is not None else {}
    h = head.features if head is not None else {}
    rows = []
    for key in dict.fromkeys([*b, *h]):
        check = key.replace("_", " ")
        bf, hf = b.get(key), h.get(key)
        be = bf.value if bf is not None else None
        limit = th.features.get(key)
        if hf is None:
            rows.append(Row(check, be, None, None, None, "error", "numerics", note="missing in head"))
        elif limit is None:
            rows.append(
                Row(check, be, hf.value, None, None, "error", "numerics", note=f"no features.{key} limit")
            )
        elif hf.status == "unsupported" and (bf is None or bf.status == "unsupported"):
            note = f"neither side's op has it: {hf.note}"[:300]
            rows.append(Row(check, be, None, None, limit, "unsupported", "numerics", note=note))
        elif hf.status == "unsupported":
            had = "base's check failed" if bf.status == "failed" else "base measured it"
            note = f"head lost the feature ({had}): {hf.note}"[:300]
            rows.append(Row(check, be, None, None, limit, "regression", "numerics", note=note))
        elif hf.status == "failed":
            note = f"head failed: {hf.note}"[:300]
            rows.append(Row(check, be, None, None, limit, "regression", "numerics", note=note))
        elif dropped := [
            c for c in (bf.cases if bf is not None and bf.status == "ok" else ()) if c not in hf.cases
        ]:
            note = f"head dropped cases base measured: {', '.join(dropped)}; {hf.note or ''}"[:300]
            rows.append(Row(check, be, hf.value, None, limit, "regression", "numerics", note=note))
        else:
            bad = exceeds_limit(hf.value, limit)
            note = f"limit; {hf.note}"[:300] if hf.note else "limit"
            rows.append(
                Row(check, be, hf.value, None, limit, "regression" if bad else "pass", "numerics", note=note)
            )
    return rows


def _verdict(rows: list[Row], base, head, th: Thresholds) -> Verdict:
    errors = [r for r in rows if r.verdict == "error"]
    regressions = [r for r in rows if r.verdict == "regression"]
    accepted = [r for r in rows if r.verdict == "accepted"]
    absent = [r for r in rows if r.verdict == "unsupported"]  # shown, never counted as a pass
    judged = len(rows) - len(errors) - len(absent)
    if errors:
        status = "error"
        summary = f"could not judge {len(errors)} of {len(rows)} checks: " + ", ".join(
            f"{r.check} ({r.note})" if r.note else r.check for r in errors[:4]
        )
        if len(errors) > 4:
            summary += f", and {len(errors) - 4} more"
        if regressions:
            summary += f"; {len(regressions)} regressed"
    elif regressions:
        status = "regression"
        summary = f"{len(regressions)} of {judged} checks regressed: " + ", ".join(
            _short(r) for r in regressions[:4]
        )
        if len(regressions) > 4:
            summary += f", and {len(regressions) - 4} more"
    else:
        n_dev = sum(r.kind == "latency" and r.check.startswith(CHECK_PREFIXES["device"] + " ") for r in rows)
        n_host = sum(r.kind == "latency" and r.check.startswith(CHECK_PREFIXES["host"] + " ") for r in rows)
        n_lat = sum(r.kind == "latency" for r in rows) - n_dev - n_host
        n_num = sum(r.kind == "numerics" and r.verdict != "unsupported" for r in rows)
        status = "pass"
        device = f"{n_dev} device latency, " if n_dev else ""
        host = f"{n_host} host latency, " if n_host else ""
        summary = f"all {judged} checks pass ({n_lat} latency, {device}{host}{n_num} numerics)"
        if accepted:
            summary = (
                f"{judged - len(accepted)} of {judged} checks pass, {len(accepted)} accepted "
                f"({n_lat} latency, {device}{host}{n_num} numerics): "
                + ", ".join(_short(r) for r in accepted[:4])
            )
    if absent:
        summary += f"; not judged, neither side's op has it: {', '.join(r.check for r in absent)}"
    return Verdict(status, f"{status.upper()}: {summary}", rows, _describe(base), _describe(head), th.source)


def _short(r: Row) -> str:
    if r.kind == "latency" and r.ratio is not None:
        return f"{r.check} ({100 * (r.ratio - 1):+.1f}%, lower bound {r.ci_low:.3f})"
    if r.kind == "numerics" and r.head is not None and r.threshold is not None and r.head > r.threshold:
        return f"{r.check} ({r.head:.2e} > {r.threshold:.2e})"
    return r.check


# ---------------------------------------------------------------------------------------------
# The `gate` command
# ---------------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--base", required=True, metavar="BASE.json", help="results of the base commit")
    parser.add_argument("--head", required=True, metavar="HEAD.json", help="results of the head commit")
    parser.add_argument(
        "--thresholds",
        default=None,
        metavar="TOML",
        help="default: the regression.toml shipped with the suite (src/rmsnorm_suite/regression.toml)",
    )
    parser.add_argument(
        "--out", default="outputs/gate", metavar="DIR", help="where verdict.md and verdict.json go"
    )
    parser.add_argument("--provider", default="kernel", help=argparse.SUPPRESS)
    parser.add_argument(
        "--accept-regression",
        action="append",
        default=[],
        metavar="'KIND SHAPE MODE FACTOR REASON'",
        help="an Accept-Regression request (repeatable; rmsnorm_suite.accept); granted only with --accept-approved-by",
    )
    parser.add_argument(
        "--accept-from-git",
        default=None,
        metavar="BASE..HEAD",
        help="read Accept-Regression trailers from the commit messages of this range (the current repository)",
    )
    parser.add_argument(
        "--accept-approved-by",
        default=None,
        metavar="WHO",
        help="the maintainer who approved the requests (set by the trusted caller, never by a commit)",
    )


def requests_of(args: argparse.Namespace) -> list:
    """The Accept-Regression requests of the command line and of --accept-from-git, approved as given."""
    from rmsnorm_suite import accept

    requests = [accept.parse(text) for text in getattr(args, "accept_regression", []) or []]
    span = getattr(args, "accept_from_git", None)
    if span:
        base, _, head = span.partition("..")
        if not base or not head:
            raise ValueError(f"--accept-from-git: expected BASE..HEAD, got {span!r}")
        requests += accept.from_git(Path.cwd(), base, head)
    return accept.approve(requests, getattr(args, "accept_approved_by", None))


def run(args: argparse.Namespace) -> int:
    try:
        thresholds = load_thresholds(args.thresholds)
    except ValueError as exc:
        print(f"gate: could not judge: {exc}", file=sys.stderr)
        return EXIT["error"]
    runs: dict[str, Run | None] = {}
    missing: dict[str, str] = {}
    for side in ("base", "head"):
        try:
            runs[side] = results.load(getattr(args, side))
        except ValueError as exc:
            runs[side], missing[side] = None, str(exc)
    try:
        requests = requests_of(args)
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        print(f"gate: could not read the Accept-Regression requests: {exc}", file=sys.stderr)
        return EXIT["error"]
    verdict = judge(
        runs["base"], runs["head"], thresholds, provider=args.provider, missing=missing, acceptances=requests
    )
    md, js = write_verdict(verdict, args.out)
    print(verdict.summary)
    print(f"verdict: {md} {js}")
    return verdict.exit_code
