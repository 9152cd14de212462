"""regression.toml: the gate's thresholds, read and validated.

Per (group, mode) a factor, with its alpha, in each latency table ([latency], [device_latency],
[host_latency]); per dtype the numerics' growth and ceilings; and the [gate], [clock],
[stopwatch], [telemetry], [family] and [accept] settings; the [features] limits. Apart from the judging
(:mod:`rmsnorm_suite.gate`) because pr-verdict and the drift search read the same file.
Errors name the file and the key.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from rmsnorm_suite.results import FEATURE_KEYS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

FAMILY_METHODS = ("holm", "none")
QUANTITIES = {"forward": ("y",), "forward_backward": ("dx", "dw")}
THRESHOLDS_NAME = "regression.toml"  # package data of rmsnorm_suite: src/rmsnorm_suite/regression.toml
THRESHOLDS_IN_TREE = (
    "src/rmsnorm_suite/regression.toml",
    "regression.toml",
)  # in a checkout; then older ones

# A row's timing (results.KINDS) -> its table of factors in regression.toml, and its checks' prefix.
LATENCY_TABLES = {"whole": "latency", "device": "device_latency", "host": "host_latency"}
CHECK_PREFIXES = {"whole": "latency", "device": "device", "host": "host"}


def default_thresholds() -> Path:
    """The thresholds shipped with the suite, found through the package, not the working directory."""
    return Path(str(resources.files("rmsnorm_suite").joinpath(THRESHOLDS_NAME)))


@dataclass(frozen=True)
class LatencyRule:
    factor: float
    alpha: float | None  # None: the row's level comes from [family]


@dataclass(frozen=True)
class Family:
    """[family]: how the latency rows of one verdict share its false-alarm rate."""

    method: str = "none"  # "holm": Holm over the latency rows at ``rate``; "none": each row's alpha
    rate: float | None = None  # the family-wise false-alarm rate (holm)


@dataclass(frozen=True)
class AcceptLimits:
    """[accept]: how far an approved Accept-Regression may go (rmsnorm_suite.accept)."""

    max_rows: int = 0  # 0: no acceptance is honoured
    max_factor: float = 1.0  # the largest factor a row may be accepted at
    kinds: tuple[str, ...] = ()  # the check prefixes ("device", "latency", "host") that may be accepted


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
    stopwatch_consistency: float = 0.05  # [stopwatch]: head's time its rows do not show, of head's
    stopwatch_sums: float = 0.02  # [stopwatch]: relative disagreement of a round's checksums
    stopwatch_share: float = 0.4  # [stopwatch]: the op's least share of a block's time to judge it
    stopwatch_coarse: float = 0.4  # [stopwatch]: hidden time allowed where the op's share is less
    stopwatch_single: float = 0.2  # [stopwatch]: hidden time allowed one finely judged block alone
    stopwatch_any_round: float = 0.6  # [stopwatch]: hidden time allowed in any one round
    family: Family = Family()  # [family]: the rate shared by a verdict's latency rows
    accept: AcceptLimits = AcceptLimits()  # [accept]: bounds on accepted regressions
    features: dict[str, float] = field(default_factory=dict)  # [features]: figure -> its limit


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
                "gate", "clock", "stopwatch", "telemetry", "family", "accept", "drift", "latency",
                "device_latency", "host_latency", "numerics", "features",
            ],
        )  # fmt: skip
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
        _only(
            "stopwatch", watch, ["tolerance", "consistency", "sums", "share", "coarse", "single", "any_round"]
        )
        stopwatch_tolerance = _number(
            "stopwatch.tolerance", watch.get("tolerance", 0.10), low=0.0, high=100.0
        )
        stopwatch_consistency = _number(
            "stopwatch.consistency", watch.get("consistency", 0.05), low=0.0, high=100.0
        )
        stopwatch_sums = _number("stopwatch.sums", watch.get("sums", 0.02), low=0.0, high=0.5)
        stopwatch_share = _number(
            "stopwatch.share", watch.get("share", 0.4), low=0.0, low_inclusive=True, high=1.0
        )
        stopwatch_coarse = _number("stopwatch.coarse", watch.get("coarse", 0.4), low=0.0, high=100.0)
        stopwatch_single = _number("stopwatch.single", watch.get("single", 0.2), low=0.0, high=100.0)
        stopwatch_any_round = _number("stopwatch.any_round", watch.get("any_round", 0.6), low=0.0, high=100.0)
        tele = _table("telemetry", data.get("telemetry", {}))
        _only("telemetry", tele, ["redo"])
        redo = tele.get("redo", 2)
        if isinstance(redo, bool) or not isinstance(redo, int) or not 0 <= redo <= 12:
            raise ValueError(f"telemetry.redo must be an integer in [0, 12], got {redo!r}")
        family = _family(_table("family", data.get("family", {})))
        accept = _accept(_table("accept", data.get("accept", {})))
        own_alpha = family.method == "none"
        latency = _latency_rules("latency", data.get("latency"), own_alpha)
        device_latency = _latency_rules("device_latency", data.get("device_latency", {}), own_alpha)
        host_latency = _latency_rules("host_latency", data.get("host_latency", {}), own_alpha)
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
        features = _table("features", data.get("features", {}))
        _only("features", features, list(FEATURE_KEYS))
        features = {
            key: _number(f"features.{key}", value, low=0.0, low_inclusive=True)
            for key, value in features.items()
        }
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
        stopwatch_consistency=stopwatch_consistency,
        stopwatch_sums=stopwatch_sums,
        stopwatch_share=stopwatch_share,
        stopwatch_coarse=stopwatch_coarse,
        stopwatch_single=stopwatch_single,
        stopwatch_any_round=stopwatch_any_round,
        family=family,
        accept=accept,
        features=features,
    )


def _family(table: dict[str, Any]) -> Family:
    _only("family", table, ["method", "rate"])
    method = table.get("method", "none")
    if method not in FAMILY_METHODS:
        raise ValueError(f"family.method must be one of {list(FAMILY_METHODS)}, got {method!r}")
    if method == "none":
        if "rate" in table:
            raise ValueError("family.rate is set but family.method is 'none': each row has its own alpha")
        return Family()
    if "rate" not in table:
        raise ValueError("family.rate is missing")
    return Family(method, _number("family.rate", table["rate"], low=0.0, high=0.2))


def _accept(table: dict[str, Any]) -> AcceptLimits:
    _only("accept", table, ["max_rows", "max_factor", "kinds"])
    rows = table.get("max_rows", 0)
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= 16:
        raise ValueError(f"accept.max_rows must be an integer in [0, 16], got {rows!r}")
    top = _number("accept.max_factor", table.get("max_factor", 1.0), low=1.0, low_inclusive=True, high=4.0)
    kinds = table.get("kinds", [])
    known = list(CHECK_PREFIXES.values())
    if not isinstance(kinds, list) or any(k not in known for k in kinds):
        raise ValueError(f"accept.kinds must be a list of some of {known}, got {kinds!r}")
    return AcceptLimits(rows, top, tuple(kinds))


def _latency_rules(table: str, value: Any, own_alpha: bool = True) -> dict[tuple[str, str], LatencyRule]:
    """[table.GROUP.MODE] = {factor, alpha} -> {(group, mode): rule}. ``own_alpha`` false (a
    [family] rule sets the levels): a row's alpha is refused, not silently ignored."""
    rules: dict[tuple[str, str], LatencyRule] = {}
    for group, modes in _table(table, value).items():
        for mode, rule in _table(f"{table}.{group}", modes).items():
            where = f"{table}.{group}.{mode}"
            if mode not in QUANTITIES:
                raise ValueError(f"{where}: unknown mode {mode!r}; expected one of {list(QUANTITIES)}")
            rule = _table(where, rule)
            _only(where, rule, ["factor", "alpha"])
            for key in ("factor", "alpha") if own_alpha else ("factor",):
                if key not in rule:
                    raise ValueError(f"{where}.{key} is missing")
            if not own_alpha and "alpha" in rule:
                raise ValueError(f"{where}.alpha: the level is set by [family] (method = holm), not per row")
            rules[group, mode] = LatencyRule(
                factor=_number(f"{where}.factor", rule["factor"], low=1.0, low_inclusive=True),
                alpha=_number(f"{where}.alpha", rule["alpha"], low=0.0, high=0.5) if own_alpha else None,
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
