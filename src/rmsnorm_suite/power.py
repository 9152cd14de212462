"""Power and false alarms of the gate's latency rule, by resampling recorded A/A rounds.

Per row, one log ratio per paired round; an A/A run gives them where the truth is "no change".
:func:`load_aa` reads them from pr-verdict outputs (:func:`synthetic_aa` makes a labelled
synthetic set, for tests only), :func:`resample` draws verdicts of R rounds keeping each round's
rows together, a shift is injected into a class of rows, :func:`flags` judges every trial as the
gate does, and the family-wise false-alarm rate and the power per class are counted.
:func:`p_above` agrees with ``gate.ratio_estimate(...).p_factor``. docs/gate.md ("Power and
false alarms") gives the results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

KINDS = ("whole", "device", "host")
PREFIX = {"whole": "latency", "device": "device", "host": "host"}  # thresholds.CHECK_PREFIXES
STATISTICS = ("bound", "estimate")
SYNTHETIC = "SYNTHETIC A/A (noise model, not a measurement)"


@dataclass(frozen=True)
class RowKey:
    kind: str  # whole, device or host
    shape: str
    mode: str
    group: str

    @property
    def check(self) -> str:
        return f"{PREFIX[self.kind]} {self.shape} {self.mode}"

    @property
    def cls(self) -> str:
        return f"{PREFIX[self.kind]}/{self.group}/{self.mode}"


@dataclass
class AASet:
    """A/A runs: ``d[j]`` is run j's array (rows x rounds) of per-round log ratios, the rows in
    ``rows`` order; ``source`` names where they came from (a synthetic set says so)."""

    rows: list[RowKey]
    d: list[np.ndarray]
    source: str
    labels: list[str] = field(default_factory=list)

    @property
    def synthetic(self) -> bool:
        return self.source.startswith("SYNTHETIC")


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


RECORD_FORMAT = "rmsnorm-aa-rounds/1"


def _rounds_of_output(folder: Path, provider: str) -> dict[RowKey, tuple[np.ndarray, np.ndarray]]:
    """(base, head) per-round medians (ms) per row of one A/A pr-verdict output folder."""
    from rmsnorm_suite import results

    base, head = results.load(folder / "base.json"), results.load(folder / "head.json")
    if not base.round_indices or base.round_indices != head.round_indices:
        raise ValueError(f"{folder}: base and head are not paired rounds (settings.round_indices)")
    b, h = base.rows_of(provider), head.rows_of(provider)
    out: dict[RowKey, tuple[np.ndarray, np.ndarray]] = {}
    for key in sorted(set(b) & set(h)):
        br, hr = b[key], h[key]
        if not (br.ok and hr.ok):
            continue
        for kind in KINDS:
            bu, hu = br.timing(kind).block_medians_ms, hr.timing(kind).block_medians_ms
            if len(bu) >= 2 and len(bu) == len(hu) and min(bu) > 0 and min(hu) > 0:
                out[RowKey(kind, key[0], key[1], hr.group)] = (np.asarray(bu), np.asarray(hu))
    return out


def record_aa(folder: str | Path, provider: str = "kernel", about: Mapping | None = None) -> dict:
    """One A/A run's per-round medians, small enough to commit (docs/data/aa/); ``about`` says
    where and how it ran. :func:`load_aa` reads it as it reads the folder."""
    rows = [
        {"kind": k.kind, "shape": k.shape, "mode": k.mode, "group": k.group,
         "base": [float(v) for v in b], "head": [float(v) for v in h]}
        for k, (b, h) in _rounds_of_output(Path(folder), provider).items()
    ]  # fmt: skip
    return {"format": RECORD_FORMAT, "about": dict(about or {}), "rows": rows}


def _rounds_of_record(path: Path) -> dict[RowKey, tuple[np.ndarray, np.ndarray]]:
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("format") != RECORD_FORMAT:
        raise ValueError(f"{path}: not an A/A record ({RECORD_FORMAT})")
    return {
        RowKey(r["kind"], r["shape"], r["mode"], r["group"]): (np.asarray(r["base"]), np.asarray(r["head"]))
        for r in data["rows"]
    }


def load_aa(sources: Iterable[str | Path], provider: str = "kernel") -> AASet:
    """Per-round log ratios of A/A runs: pr-verdict output folders (``base.json`` and
    ``head.json``, merged from interleaved rounds) or records of :func:`record_aa`. Only rows
    present in every run, with paired rounds, are kept."""
    per_run: list[dict[RowKey, np.ndarray]] = []
    labels = []
    for source in sources:
        source = Path(source)
        rounds = _rounds_of_record(source) if source.is_file() else _rounds_of_output(source, provider)
        per_run.append({key: np.log(h) - np.log(b) for key, (b, h) in rounds.items()})
        labels.append(str(source))
    if not per_run:
        raise ValueError("no A/A run given")
    common = sorted(
        set.intersection(*(set(r) for r in per_run)), key=lambda k: (k.kind, k.group, k.shape, k.mode)
    )
    if not common:
        raise ValueError("the A/A runs share no row with paired rounds")
    return AASet(common, [np.stack([r[k] for k in common]) for r in per_run], "recorded A/A", labels)


@dataclass(frozen=True)
class NoiseModel:
    """Per-round log ratio of a row in an A/A run: ``offset + common + own``, where ``offset`` ~
    N(0, tau) is fixed per run and row, ``common`` ~ N(0, rho * sigma) is shared by every row of a
    round and kind, and ``own`` ~ N(0, sigma * sqrt(1 - rho^2)); ``sigma`` per (kind, group)."""

    sigma: Mapping[tuple[str, str], float]
    tau: Mapping[tuple[str, str], float]
    rho: float = 0.5


def synthetic_aa(rows: Sequence[RowKey], model: NoiseModel, runs: int, rounds: int, seed: int = 0) -> AASet:
    """A synthetic A/A set from ``model``; its ``source`` says SYNTHETIC wherever it is printed."""
    rng = np.random.default_rng(seed)
    d = []
    for _ in range(runs):
        arr = np.empty((len(rows), rounds))
        common = {kind: rng.standard_normal(rounds) for kind in KINDS}
        for i, k in enumerate(rows):
            s, t = model.sigma[k.kind, k.group], model.tau[k.kind, k.group]
            own = rng.standard_normal(rounds) * s * math.sqrt(1 - model.rho**2)
            arr[i] = rng.normal(0, t) + model.rho * s * common[k.kind] + own
        d.append(arr)
    return AASet(list(rows), d, SYNTHETIC, [f"synthetic-{j}" for j in range(runs)])


# ---------------------------------------------------------------------------------------------
# Resampling
# ---------------------------------------------------------------------------------------------


def resample(aa: AASet, rounds: int, trials: int, rng: np.random.Generator) -> np.ndarray:
    """``trials`` verdicts of ``rounds`` rounds each: an array (trials, rows, rounds) of log ratios.
    Per trial a run is drawn (its per-row mean: the run's offset), then ``rounds`` residual
    rounds drawn with replacement from the rounds of every run (centred on their run's mean,
    scaled by sqrt(K/(K-1)) to undo the centring), all rows of a round together."""
    offsets = np.stack([x.mean(axis=1) for x in aa.d])  # (runs, rows)
    residuals = np.concatenate(
        [(x - x.mean(axis=1, keepdims=True)) * math.sqrt(x.shape[1] / (x.shape[1] - 1)) for x in aa.d], axis=1
    )  # (rows, all rounds)
    run = rng.integers(0, len(aa.d), size=trials)
    pick = rng.integers(0, residuals.shape[1], size=(trials, rounds))
    return offsets[run][:, :, None] + np.transpose(residuals[:, pick], (1, 0, 2))


# ---------------------------------------------------------------------------------------------
# The gate's rule, vectorised
# ---------------------------------------------------------------------------------------------


def p_above(d: np.ndarray, log_factor: np.ndarray | float) -> np.ndarray:
    """One-sided p of the paired t test of "mean log ratio > log factor" over the last axis
    (gate.ratio_estimate's ``p_factor``); a spread of zero gives 0 or 1 as the gate does."""
    from scipy import stats

    r = d.shape[-1]
    mean = d.mean(axis=-1)
    sd = d.std(axis=-1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (mean - log_factor) / (sd / math.sqrt(r))
        p = stats.t.sf(t, r - 1)
    return np.where(sd > 0, p, np.where(mean > log_factor, 0.0, 1.0))


def holm_reject(p: np.ndarray, rate: float) -> np.ndarray:
    """Holm at ``rate`` along the last axis of ``p`` (trials x hypotheses): which are rejected."""
    m = p.shape[-1]
    order = np.argsort(p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    levels = rate / (m - np.arange(m))
    passed = np.cumprod(sorted_p < levels, axis=-1).astype(bool)
    reject = np.zeros_like(passed)
    np.put_along_axis(reject, order, passed, axis=-1)
    return reject


def flags(
    d: np.ndarray, factors: np.ndarray, statistic: str = "bound", family: str = "holm", rate: float = 0.05
) -> np.ndarray:
    """Which rows each trial flags (trials x rows), from log ratios (trials x rows x rounds) and
    each row's factor. ``bound``: the gate's one-sided t bound above the factor, with Holm at
    ``rate`` across the rows (``family="holm"``) or each row at level ``rate`` (``"none"``).
    ``estimate``: the geometric mean ratio above the factor, no interval (for comparison)."""
    log_f = np.log(np.asarray(factors, dtype=float))
    if statistic == "estimate":
        return d.mean(axis=-1) > log_f
    if statistic != "bound":
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    p = p_above(d, log_f)
    if family == "holm":
        return holm_reject(p, rate)
    if family == "none":
        return p < rate
    raise ValueError(f"family must be holm or none, got {family!r}")


# ---------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    device_factor: float
    rounds: int
    statistic: str = "bound"
    family: str = "holm"
    rate: float = 0.05

    @property
    def name(self) -> str:
        rule = f"{self.statistic}" + (f", {self.family} {self.rate:g}" if self.statistic == "bound" else "")
        return f"device {self.device_factor:g}, {self.rounds} rounds, {rule}"


def table_factors(rows: Sequence[RowKey], thresholds, device_factor: float | None = None) -> np.ndarray:
    """Each row's factor from a thresholds.Thresholds; device rows at ``device_factor`` when given."""
    tables = {
        "whole": thresholds.latency,
        "device": thresholds.device_latency,
        "host": thresholds.host_latency,
    }
    out = []
    for k in rows:
        if k.kind == "device" and device_factor is not None:
            out.append(device_factor)
        else:
            out.append(tables[k.kind][k.group, k.mode].factor)
    return np.array(out)


def study(
    aa: AASet,
    thresholds,
    candidates: Sequence[Candidate],
    shifts: Sequence[float],
    classes: Sequence[str] | None = None,
    trials: int = 2000,
    seed: int = 0,
) -> list[dict]:
    """Per candidate: the family-wise false-alarm rate (no shift), and per shift and class of rows
    the power (share of that class's rows flagged when only they are shifted), its smallest
    row's, and the chance the verdict fails at all."""
    rng = np.random.default_rng(seed)
    classes = list(classes or sorted({k.cls for k in aa.rows}))
    out = []
    for c in candidates:
        factors = table_factors(aa.rows, thresholds, c.device_factor)
        null = resample(aa, c.rounds, trials, rng)
        f0 = flags(null, factors, c.statistic, c.family, c.rate)
        entry = {
            "candidate": c.name,
            "device_factor": c.device_factor,
            "rounds": c.rounds,
            "statistic": c.statistic,
            "family": c.family if c.statistic == "bound" else "-",
            "rate": c.rate,
            "trials": trials,
            "false_alarm": float(f0.any(axis=1).mean()),
            "false_alarm_rows": float(f0.mean()),
            "power": {},
        }
        for shift in shifts:
            for cls in classes:
                mask = np.array([k.cls == cls for k in aa.rows])
                if not mask.any():
                    continue
                d = resample(aa, c.rounds, trials, rng)
                d[:, mask, :] += math.log(shift)
                f = flags(d, factors, c.statistic, c.family, c.rate)
                per_row = f[:, mask].mean(axis=0)
                entry["power"][f"{cls} x{shift:g}"] = {
                    "mean": float(per_row.mean()),
                    "min": float(per_row.min()),
                    "verdict_fails": float(f.any(axis=1).mean()),
                }
        out.append(entry)
    return out


def resolvable(
    aa: AASet,
    thresholds,
    rounds: int,
    grid: Sequence[float],
    power: float = 0.9,
    trials: int = 1000,
    seed: int = 1,
    family: str = "holm",
    rate: float = 0.05,
) -> dict[str, float | None]:
    """Per class of rows at its table factor: the smallest shift on ``grid`` flagged with at least
    ``power`` (mean over the class's rows), or None when none on the grid is."""
    rng = np.random.default_rng(seed)
    factors = table_factors(aa.rows, thresholds)
    answer: dict[str, float | None] = {}
    for cls in sorted({k.cls for k in aa.rows}):
        mask = np.array([k.cls == cls for k in aa.rows])
        answer[cls] = None
        for shift in sorted(grid):
            d = resample(aa, rounds, trials, rng)
            d[:, mask, :] += math.log(shift)
            if flags(d, factors, "bound", family, rate)[:, mask].mean() >= power:
                answer[cls] = shift
                break
    return answer
