"""`rmsnorm-kernel gate`: judge a head benchmark run against a base run with regression.toml.

Latency, per (shape, mode) of the "kernel" provider, on rounds: a round (a separate process of
pr-verdict, or a block of a plain benchmark run) gives one median per side, and the rounds, not
the samples, are the independent units. The head/base ratio is estimated from the logs of those
medians (paired by round where the two runs were interleaved, else Welch), with a one-sided
(1 - alpha) Student-t lower confidence bound; a regression when that lower bound exceeds the
group's factor: the gate is confident that head is slower by more than the factor allows.
Three latencies are judged, each with its own table of factors: host-inclusive latency (whole
calls: Python, autograd, launches and kernels; ``[latency]``), device latency (CUDA-graph
replays: the kernels' GPU time alone; ``[device_latency]``), which does not follow the host's
speed and so can be held to a tight factor at every shape, and host latency (the host clock
around the whole calls: the caller's time to issue one; ``[host_latency]``), which a call's GPU
work does not hide.

Numerics, per (shape, quantity): a regression when the head's relative error against the
float64 oracle exceeds min(ceiling, base error x growth) of the shape's dtype.

Exit status: 0 pass, 1 regression, 2 could not judge (a missing or failed result, a missing
threshold, too few samples or rounds). ``asv compare`` is not consulted: its exit status is always 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from rmsnorm_suite import results
from rmsnorm_suite.results import Row as ResultRow
from rmsnorm_suite.results import Run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

STATUSES = ("pass", "regression", "error")
EXIT = {"pass": 0, "regression": 1, "error": 2}
QUANTITIES = {"forward": ("y",), "forward_backward": ("dx", "dw")}
THRESHOLDS_NAME = "regression.toml"  # package data of rmsnorm_suite: src/rmsnorm_suite/regression.toml
THRESHOLDS_IN_TREE = (
    "src/rmsnorm_suite/regression.toml",
    "regression.toml",
)  # in a checkout; then older ones


def default_thresholds() -> Path:
    """The thresholds shipped with the suite, found through the package, not the working directory."""
    return Path(str(resources.files("rmsnorm_suite").joinpath(THRESHOLDS_NAME)))


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


def ratio_estimate(
    base_units: Sequence[float], head_units: Sequence[float], alpha: float, paired: bool
) -> RatioEstimate:
    """Student-t inference on the logs of per-round medians: paired (``scipy.stats.ttest_rel``)
    where round k of base and of head ran side by side, else Welch (``ttest_ind``). Rank tests were
    not chosen: with 4-6 rounds their smallest one-sided p (1/64 for a signed-rank test on 6
    pairs) cannot reach an alpha of 0.01. A spread of zero collapses the interval onto the
    estimate."""
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
    if spread == 0:
        low, p = estimate, (0.0 if estimate > 0 else 1.0)
    else:
        low, p = float(test.confidence_interval(1 - alpha).low), float(test.pvalue)
    high = 2 * estimate - low
    return RatioEstimate(math.exp(estimate), math.exp(low), math.exp(high), p, min(len(lb), len(lh)), paired)


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
# Thresholds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencyRule:
    factor: float
    alpha: float


@dataclass(frozen=True)
class NumericRule:
    growth: float
    ceiling: dict[str, float]


@dataclass(frozen=True)
class Thresholds:
    latency: dict[tuple[str, str], LatencyRule]  # (group, mode) -> rule, host-inclusive latency
    numerics: dict[str, NumericRule]  # dtype name -> rule
    min_samples: int = 20
    source: str = "<thresholds>"
    device_latency: dict[tuple[str, str], LatencyRule] = field(default_factory=dict)  # GPU time only
    host_latency: dict[tuple[str, str], LatencyRule] = field(default_factory=dict)  # host clock only
    min_rounds: int = 3  # per-round medians per side; fewer cannot bound the ratio usefully
    clock_tolerance: float = 0.05  # [clock]: head/base calibration, median over rounds
    clock_checkpoint: float = 0.25  # [clock]: any calibration against its own round's median
    telemetry_redo: int = 2  # [telemetry]: noisy rounds redone per verdict before it errs
    stopwatch_tolerance: float = 0.10  # [stopwatch]: head/base by the judge's clock, median over rounds
    stopwatch_sums: float = 0.02  # [stopwatch]: relative disagreement of a round's checksums


def _number(
    where: str, value: Any, *, low: float, low_inclusive: bool = False, high: float = math.inf
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if value < low or (value == low and not low_inclusive) or value > high:
        bracket = "[" if low_inclusive else "("
        raise ValueError(f"{where} must be in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _table(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table, got {value!r}")
    return value


def _only(where: str, table: dict[str, Any], allowed: Sequence[str]) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {list(allowed)}")


def parse_thresholds(data: dict[str, Any], source: str = "<thresholds>") -> Thresholds:
    """Validate a parsed regression.toml; errors name the file and the key."""
    try:
        _only(
            "top level",
            data,
            [
                "gate",
                "clock",
                "stopwatch",
                "telemetry",
                "latency",
                "device_latency",
                "host_latency",
                "numerics",
            ],
        )
        gate = _table("gate", data.get("gate", {}))
        _only("gate", gate, ["min_samples", "min_rounds"])
        min_samples = gate.get("min_samples", 20)
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
            raise ValueError(f"gate.min_samples must be an integer >= 2, got {min_samples!r}")
        min_rounds = gate.get("min_rounds", 3)
        if isinstance(min_rounds, bool) or not isinstance(min_rounds, int) or min_rounds < 3:
            raise ValueError(f"gate.min_rounds must be an integer >= 3, got {min_rounds!r}")
        clock = _table("clock", data.get("clock", {}))
        _only("clock", clock, ["tolerance", "checkpoint"])
        clock_tolerance = _number("clock.tolerance", clock.get("tolerance", 0.05), low=0.0, high=0.5)
        clock_checkpoint = _number("clock.checkpoint", clock.get("checkpoint", 0.25), low=0.0, high=100.0)
        watch = _table("stopwatch", data.get("stopwatch", {}))
        _only("stopwatch", watch, ["tolerance", "sums"])
        stopwatch_tolerance = _number(
            "stopwatch.tolerance", watch.get("tolerance", 0.10), low=0.0, high=100.0
        )
        stopwatch_sums = _number("stopwatch.sums", watch.get("sums", 0.02), low=0.0, high=0.5)
        tele = _table("telemetry", data.get("telemetry", {}))
        _only("telemetry", tele, ["redo"])
        redo = tele.get("redo", 2)
        if isinstance(redo, bool) or not isinstance(redo, int) or not 0 <= redo <= 12:
            raise ValueError(f"telemetry.redo must be an integer in [0, 12], got {redo!r}")
        latency = _latency_rules("latency", data.get("latency"))
        device_latency = _latency_rules("device_latency", data.get("device_latency", {}))
        host_latency = _latency_rules("host_latency", data.get("host_latency", {}))
        numerics: dict[str, NumericRule] = {}
        for dtype, rule in _table("numerics", data.get("numerics")).items():
            where = f"numerics.{dtype}"
            rule = _table(where, rule)
            _only(where, rule, ["growth", "ceiling"])
            for key in ("growth", "ceiling"):
                if key not in rule:
                    raise ValueError(f"{where}.{key} is missing")
            ceiling = _table(f"{where}.ceiling", rule["ceiling"])
            _only(f"{where}.ceiling", ceiling, ["y", "dx", "dw"])
            numerics[dtype] = NumericRule(
                growth=_number(f"{where}.growth", rule["growth"], low=1.0, low_inclusive=True),
                ceiling={q: _number(f"{where}.ceiling.{q}", v, low=0.0) for q, v in ceiling.items()},
            )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    return Thresholds(
        latency=latency,
        numerics=numerics,
        min_samples=min_samples,
        source=source,
        device_latency=device_latency,
        host_latency=host_latency,
        min_rounds=min_rounds,
        clock_tolerance=clock_tolerance,
        clock_checkpoint=clock_checkpoint,
        telemetry_redo=redo,
        stopwatch_tolerance=stopwatch_tolerance,
        stopwatch_sums=stopwatch_sums,
    )


def _latency_rules(table: str, value: Any) -> dict[tuple[str, str], LatencyRule]:
    """[table.GROUP.MODE] = {factor, alpha} -> {(group, mode): rule}."""
    rules: dict[tuple[str, str], LatencyRule] = {}
    for group, modes in _table(table, value).items():
        for mode, rule in _table(f"{table}.{group}", modes).items():
            where = f"{table}.{group}.{mode}"
            if mode not in QUANTITIES:
                raise ValueError(f"{where}: unknown mode {mode!r}; expected one of {list(QUANTITIES)}")
            rule = _table(where, rule)
            _only(where, rule, ["factor", "alpha"])
            for key in ("factor", "alpha"):
                if key not in rule:
                    raise ValueError(f"{where}.{key} is missing")
            rules[group, mode] = LatencyRule(
                factor=_number(f"{where}.factor", rule["factor"], low=1.0, low_inclusive=True),
                alpha=_number(f"{where}.alpha", rule["alpha"], low=0.0, high=0.5),
            )
    return rules


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """Read and validate a thresholds file; None: the one shipped with the suite."""
    path = default_thresholds() if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"--thresholds: no such file {str(path)!r}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    return parse_thresholds(data, str(path))


# ---------------------------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    check: str
    base: float | None
    head: float | None
    ratio: float | None
    threshold: float | None
    verdict: str  # "pass", "regression" or "error"
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


@dataclass
class Verdict:
    status: str
    summary: str
    rows: list[Row] = field(default_factory=list)
    base: dict[str, Any] = field(default_factory=dict)
    head: dict[str, Any] = field(default_factory=dict)
    thresholds: str = ""

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
        }


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
) -> Verdict:
    """Compare two benchmark runs (:class:`rmsnorm_suite.results.Run`, or their JSON form) and
    return the verdict.

    ``base`` or ``head`` may be None (the file could not be read; ``missing`` says why);
    ``extra_rows`` come first in the table (pr-verdict's GPU-test row)."""
    base, head = (None if run is None else results.as_run(run) for run in (base, head))
    rows: list[Row] = list(extra_rows)
    b = base.rows_of(provider) if base is not None else {}
    h = head.rows_of(provider) if head is not None else {}
    paired = interleaved(base, head)
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
        rows.append(_latency_row(name, br, hr, thresholds, paired=paired))
        if thresholds.device_latency:
            rows.append(_latency_row(name, br, hr, thresholds, "device", paired=paired))
        if thresholds.host_latency:
            rows.append(_latency_row(name, br, hr, thresholds, "host", paired=paired))
        rows.extend(_numeric_rows(shape, mode, br, hr, thresholds))
    return _verdict(rows, base, head, thresholds)


# A row's timing (results.KINDS) -> its table of factors in regression.toml, and its checks' prefix.
LATENCY_TABLES = {"whole": "latency", "device": "device_latency", "host": "host_latency"}
CHECK_PREFIXES = {"whole": "latency", "device": "device", "host": "host"}


def _latency_row(
    name: str,
    br: ResultRow,
    hr: ResultRow,
    th: Thresholds,
    kind: str = "whole",
    paired: bool = False,
) -> Row:
    """Host-inclusive latency (the rows' ``whole`` timing, [latency]), GPU time from graph replays
    (``device``, [device_latency]) or the host clock around the whole calls (``host``,
    [host_latency]); the units are the block (round) medians; ``paired``: the runs' rounds ran
    side by side (pr-verdict), so round k of base is compared with round k of head."""
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
    est = ratio_estimate(bu, hu, rule.alpha, paired and len(bu) == len(hu))
    regressed = exceeds_factor(est.low, rule.factor)
    if regressed:
        note = ""
    elif est.ratio > rule.factor:
        note = f"above factor, but its lower bound {est.low:.3f} is not"
    elif significant(est.p_value, rule.alpha):
        note = "significantly slower, within factor"
    else:
        note = ""
    verdict = "regression" if regressed else "pass"
    return Row(
        check, bm, hm, est.ratio, rule.factor, verdict, "latency", est.p_value, rule.alpha, note,
        ci_low=est.low, ci_high=est.high, confidence=1 - 2 * rule.alpha, rounds=est.rounds,
    )  # fmt: skip


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


def _verdict(rows: list[Row], base, head, th: Thresholds) -> Verdict:
    errors = [r for r in rows if r.verdict == "error"]
    regressions = [r for r in rows if r.verdict == "regression"]
    judged = len(rows) - len(errors)
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
        n_num = sum(r.kind == "numerics" for r in rows)
        status = "pass"
        device = f"{n_dev} device latency, " if n_dev else ""
        host = f"{n_host} host latency, " if n_host else ""
        summary = f"all {judged} checks pass ({n_lat} latency, {device}{host}{n_num} numerics)"
    return Verdict(status, f"{status.upper()}: {summary}", rows, _describe(base), _describe(head), th.source)


def _short(r: Row) -> str:
    if r.kind == "latency" and r.ratio is not None:
        return f"{r.check} ({100 * (r.ratio - 1):+.1f}%, lower bound {r.ci_low:.3f})"
    if r.kind == "numerics" and r.head is not None and r.threshold is not None:
        return f"{r.check} ({r.head:.2e} > {r.threshold:.2e})"
    return r.check


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
            return f"lower bound > {value:.2f} ({100 * (1 - r.alpha):g}%)"
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
        + _host_paths(b, h),
        "",
        "| check | base | head | ratio | threshold | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in verdict.rows:
        mark = {"pass": "pass", "regression": "**regression**", "error": "**error**"}[r.verdict]
        # numerics notes say which limit binds and already show in the threshold column
        note = f" ({_escape(r.note)})" if r.note and r.kind != "numerics" else ""
        if r.kind == "numerics" and r.verdict == "error":
            note = f" ({_escape(r.note)})"
        cells = [_cell(r, "base"), _cell(r, "head"), _cell(r, "ratio"), _cell(r, "threshold")]
        lines.append(f"| {r.check} | " + " | ".join(cells) + f" | {mark}{note} |")
    return "\n".join(lines) + "\n"


def _host_paths(b: Mapping[str, Any], h: Mapping[str, Any]) -> str:
    """The host path each side's calls took (bench.op_host_path), where a run recorded it."""
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
    verdict = judge(runs["base"], runs["head"], thresholds, provider=args.provider, missing=missing)
    md, js = write_verdict(verdict, args.out)
    print(verdict.summary)
    print(f"verdict: {md} {js}")
    return verdict.exit_code
