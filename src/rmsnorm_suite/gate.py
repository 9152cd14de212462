"""`rmsnorm-kernel gate`: judge a head benchmark run against a base run with regression.toml.

Latency, per (shape, mode) of the "kernel" provider: a regression when the ratio of medians
head/base exceeds the group's factor AND a one-sided Mann-Whitney U test on the samples says
head is slower at the group's significance level. The factor keeps a significant but tiny
shift from failing a pull request; the test keeps a noisy large ratio from failing one.
Two latencies are judged, each with its own table of factors: host-inclusive latency (whole
calls: Python, autograd, launches and kernels; ``[latency]``) and device latency (CUDA-graph
replays: the kernels' GPU time alone; ``[device_latency]``), which does not follow the host's
speed and so can be held to a tight factor at every shape.

Numerics, per (shape, quantity): a regression when the head's relative error against the
float64 oracle exceeds min(ceiling, base error x growth) of the shape's dtype.

Exit status: 0 pass, 1 regression, 2 could not judge (a missing or failed result, a missing
threshold, too few samples). ``asv compare`` is not consulted: its exit status is always 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

STATUSES = ("pass", "regression", "error")
EXIT = {"pass": 0, "regression": 1, "error": 2}
QUANTITIES = {"forward": ("y",), "forward_backward": ("dx", "dw")}
DEFAULT_THRESHOLDS = "regression.toml"


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided p-value of the Mann-Whitney U test for "x tends to be larger than y".

    Normal approximation with tie correction and continuity correction (the same statistic as
    ``scipy.stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic")``). Returns 1.0
    when every value is tied (no evidence either way).
    """
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError(f"both samples must be non-empty, got sizes {n1} and {n2}")
    values = sorted([(float(v), 0) for v in x] + [(float(v), 1) for v in y])
    n = n1 + n2
    rank_sum_x = 0.0
    tie_term = 0.0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and values[j + 1][0] == values[i][0]:
            j += 1
        average_rank = (i + j) / 2 + 1  # ranks are 1-based
        t = j - i + 1
        tie_term += t**3 - t
        rank_sum_x += average_rank * sum(1 for k in range(i, j + 1) if values[k][1] == 0)
        i = j + 1
    u = rank_sum_x - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - mean - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


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
        _only("top level", data, ["gate", "latency", "device_latency", "numerics"])
        gate = _table("gate", data.get("gate", {}))
        _only("gate", gate, ["min_samples"])
        min_samples = gate.get("min_samples", 20)
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 2:
            raise ValueError(f"gate.min_samples must be an integer >= 2, got {min_samples!r}")
        latency = _latency_rules("latency", data.get("latency"))
        device_latency = _latency_rules("device_latency", data.get("device_latency", {}))
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


def load_thresholds(path: str | Path = DEFAULT_THRESHOLDS) -> Thresholds:
    path = Path(path)
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
    p_value: float | None = None  # latency: one-sided Mann-Whitney p for "head slower"
    alpha: float | None = None  # latency: significance level the p-value is held to
    note: str = ""


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


def _kernel_rows(run: dict[str, Any] | None, provider: str) -> dict[tuple[str, str], dict[str, Any]]:
    if not run:
        return {}
    return {(r["shape"], r["mode"]): r for r in run.get("results", []) if r.get("provider") == provider}


def _describe(run: dict[str, Any] | None) -> dict[str, Any]:
    if not run:
        return {}
    return {
        "commit": (run.get("git") or {}).get("commit"),
        "device": (run.get("machine") or {}).get("device"),
        "torch": (run.get("machine") or {}).get("torch"),
        "triton": (run.get("machine") or {}).get("triton"),
        "copy_tbs": (run.get("copy") or {}).get("tbs"),
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


def judge(
    base: dict[str, Any] | None,
    head: dict[str, Any] | None,
    thresholds: Thresholds,
    *,
    provider: str = "kernel",
    extra_rows: Sequence[Row] = (),
    missing: dict[str, str] | None = None,
) -> Verdict:
    """Compare two benchmark runs (dicts as written by rmsnorm_suite.bench) and return the verdict.

    ``base`` or ``head`` may be None (the file could not be read; ``missing`` says why);
    ``extra_rows`` come first in the table (pr-verdict's GPU-test row)."""
    rows: list[Row] = list(extra_rows)
    b, h = _kernel_rows(base, provider), _kernel_rows(head, provider)
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
        failed = [(side, r) for side, r in (("base", br), ("head", hr)) if r.get("status") != "ok"]
        if failed:
            note = "; ".join(f"{side} failed: {r.get('error') or r.get('status')}" for side, r in failed)
            rows.append(Row(f"latency {name}", None, None, None, None, "error", note=note[:300]))
            continue
        rows.append(_latency_row(name, br, hr, thresholds))
        if thresholds.device_latency:
            rows.append(_latency_row(name, br, hr, thresholds, device=True))
        rows.extend(_numeric_rows(shape, mode, br, hr, thresholds))
    return _verdict(rows, base, head, thresholds)


def _latency_row(
    name: str, br: dict[str, Any], hr: dict[str, Any], th: Thresholds, device: bool = False
) -> Row:
    """Host-inclusive latency (``samples_ms``, [latency]) or, with ``device``, GPU time from graph
    replays (``device_samples_ms``, [device_latency])."""
    check, table, key = ("device " if device else "latency ") + name, "latency", "samples_ms"
    if device:
        table, key = "device_latency", "device_samples_ms"
    group, mode = hr.get("group"), hr.get("mode")
    rule = (th.device_latency if device else th.latency).get((group, mode))
    bs, hs = br.get(key) or [], hr.get(key) or []
    bm, hm = (median(bs) if bs else None), (median(hs) if hs else None)
    if rule is None:
        return Row(
            check, bm, hm, None, None, "error", note=f"no threshold {table}.{group}.{mode} in {th.source}"
        )
    if device:
        broken = [
            f"{side}: {r.get('device_error')}"
            for side, r in (("base", br), ("head", hr))
            if r.get("device_error")
        ]
        if broken:
            return Row(check, bm, hm, None, rule.factor, "error", note="; ".join(broken)[:300])
    if len(bs) < th.min_samples or len(hs) < th.min_samples:
        note = f"too few samples (base {len(bs)}, head {len(hs)}; need {th.min_samples})"
        return Row(check, bm, hm, None, rule.factor, "error", note=note)
    ratio = hm / bm
    p = mann_whitney_greater(hs, bs)
    slower = ratio > rule.factor
    significant = p < rule.alpha
    verdict = "regression" if slower and significant else "pass"
    if slower and not significant:
        note = f"above factor but not significant (alpha {rule.alpha:g})"
    elif significant and not slower:
        note = "significantly slower, within factor"
    else:
        note = ""
    return Row(check, bm, hm, ratio, rule.factor, verdict, "latency", p, rule.alpha, note)


def _numeric_rows(shape: str, mode: str, br: dict[str, Any], hr: dict[str, Any], th: Thresholds) -> list[Row]:
    rows = []
    dtype = hr.get("dtype")
    rule = th.numerics.get(dtype)
    berrs, herrs = br.get("errors") or {}, hr.get("errors") or {}
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
        limit, note = rule.ceiling[q], "ceiling"
        if be is not None and math.isfinite(be) and be * rule.growth < limit:
            limit, note = be * rule.growth, f"base x {rule.growth:g}"
        if be is None:
            note = "ceiling (base has no error figure)"
        ratio = he / be if be else None
        bad = not math.isfinite(he) or he > limit
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
        n_dev = sum(r.kind == "latency" and r.check.startswith("device ") for r in rows)
        n_lat = sum(r.kind == "latency" for r in rows) - n_dev
        n_num = sum(r.kind == "numerics" for r in rows)
        status = "pass"
        device = f"{n_dev} device latency, " if n_dev else ""
        summary = f"all {judged} checks pass ({n_lat} latency, {device}{n_num} numerics)"
    return Verdict(status, f"{status.upper()}: {summary}", rows, _describe(base), _describe(head), th.source)


def _short(r: Row) -> str:
    if r.kind == "latency" and r.ratio is not None:
        return f"{r.check} ({100 * (r.ratio - 1):+.1f}%, p={r.p_value:.1g})"
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
            return f"{value:.3f} (p={r.p_value:.2g})"
        if which == "threshold":
            return f"> {value:.2f} and p < {r.alpha:g}" if r.alpha is not None else f"> {value:.2f}"
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
        "A latency check regresses when head/base of the medians exceeds the factor and a one-sided "
        "Mann-Whitney test is significant; the threshold column says what a regression needs. "
        "`latency` rows time whole calls (host work included); `device` rows time CUDA-graph "
        "replays (the kernels' GPU time alone).",
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
        "--thresholds", default=DEFAULT_THRESHOLDS, metavar="TOML", help="default: regression.toml"
    )
    parser.add_argument(
        "--out", default="outputs/gate", metavar="DIR", help="where verdict.md and verdict.json go"
    )
    parser.add_argument("--provider", default="kernel", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from rmsnorm_suite.bench import load_run

    try:
        thresholds = load_thresholds(args.thresholds)
    except ValueError as exc:
        print(f"gate: could not judge: {exc}", file=sys.stderr)
        return EXIT["error"]
    runs: dict[str, dict[str, Any] | None] = {}
    missing: dict[str, str] = {}
    for side in ("base", "head"):
        try:
            runs[side] = load_run(getattr(args, side))
        except ValueError as exc:
            runs[side], missing[side] = None, str(exc)
    verdict = judge(runs["base"], runs["head"], thresholds, provider=args.provider, missing=missing)
    md, js = write_verdict(verdict, args.out)
    print(verdict.summary)
    print(f"verdict: {md} {js}")
    return verdict.exit_code
