"""Benchmark results: typed records of a run and its rows, one ``load`` and one ``write``.

The file is ``schema`` 1, written by :mod:`rmsnorm_suite.harness` (docs/gate.md lists its keys);
files older than a figure load with it absent. ``load`` checks every field it reads and names
the file and field of an error (``results[3].samples_ms[0]``); unknown keys are ignored. A row
holds three :class:`Timing` records: ``whole`` (CUDA events around whole calls), ``device``
(CUDA-graph replays, ``device_`` keys) and ``host`` (the host clock, ``host_`` keys). Only the
standard library is imported: judging a file needs neither torch nor the op.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

SCHEMA = 1  # the version this module writes and the newest it reads
STATUSES = ("ok", "failed")

Key = tuple[str, str, str]  # (provider, shape, mode)
KINDS = ("whole", "device", "host")  # a row's timings (Row.timing)


def bandwidth_tbs(nbytes: int, ms: float) -> float:
    """Bytes moved per second, in TB/s (1e12 bytes), for a call of ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"ms must be > 0, got {ms!r}")
    return nbytes / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """One way of timing a row: every sample, one median per block (a round, under pr-verdict:
    the gate's independent units), and the summary of the samples."""

    samples_ms: tuple[float, ...] = ()
    block_medians_ms: tuple[float, ...] = ()
    median_ms: float | None = None
    tbs: float | None = None  # the fewest bytes moved over the median
    fraction_of_copy: float | None = None  # tbs over the run's copy ceiling


def timing(
    samples_ms: Iterable[float],
    block_medians_ms: Iterable[float],
    nbytes: int | None,
    copy_tbs: float | None,
    *,
    summarise: bool = True,
) -> Timing:
    """A Timing with its summary: the median of the samples, its bandwidth (when the bytes are
    known) and its fraction of ``copy_tbs`` (when known). No summary without samples, or when
    ``summarise`` is false (a failed row keeps the samples it took)."""
    samples, blocks = tuple(samples_ms), tuple(block_medians_ms)
    if not (summarise and samples):
        return Timing(samples, blocks)
    ms = median(samples)
    tbs = bandwidth_tbs(nbytes, ms) if nbytes is not None and ms > 0 else None
    fraction = tbs / copy_tbs if tbs is not None and copy_tbs else None
    return Timing(samples, blocks, ms, tbs, fraction)


@dataclass(frozen=True)
class Row:
    """One (provider, shape, mode) of a run."""

    provider: str
    shape: str
    mode: str
    status: str  # "ok" or "failed" (then ``error`` says why)
    m: int
    n: int
    dtype: str
    group: str
    bytes: int | None = None  # fewest bytes a call must move
    residual: bool = False  # a fused residual add + RMSNorm provider
    error: str | None = None
    errors: Mapping[str, float] = field(default_factory=dict)  # y, or dx and dw: relative L2 to float64
    whole: Timing = Timing()
    device: Timing = Timing()
    device_reps: int | None = None  # calls per graph replay
    device_error: str | None = None  # why there is no GPU-only timing
    host: Timing = Timing()  # the host clock around the ``whole`` calls (no bandwidth)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def key(self) -> Key:
        return (self.provider, self.shape, self.mode)

    def timing(self, kind: str) -> Timing:
        """One of KINDS: ``whole``, ``device`` or ``host``."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        return getattr(self, kind)


@dataclass(frozen=True)
class Git:
    commit: str | None = None  # of the measured op's checkout
    dirty: bool | None = None


@dataclass(frozen=True)
class CopyCeiling:
    """The device-to-device copy measured in the run; a pr-verdict merge keeps each round's
    ``tbs`` in ``rounds_tbs`` and their median in ``tbs``."""

    tbs: float | None = None
    bytes: int | None = None
    samples_ms: tuple[float, ...] = ()
    median_ms: float | None = None
    rounds_tbs: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ShapeCopy:
    """``x.clone()`` at one shape, timed as a forward is: the forward's bytes moved by a copy."""

    m: int
    n: int
    dtype: str
    group: str
    bytes: int
    median_ms: float | None = None
    tbs: float | None = None
    device_median_ms: float | None = None
    device_tbs: float | None = None
    error: str | None = None

    def tbs_of(self, kind: str) -> float | None:
        """TB/s of a Row.timing kind, "whole" or "device"."""
        return {"whole": self.tbs, "device": self.device_tbs}[kind]

    def median_of(self, kind: str) -> float | None:
        """Median ms of a Row.timing kind, "whole" or "device"."""
        return {"whole": self.median_ms, "device": self.device_median_ms}[kind]


FEATURE_STATUSES = ("ok", "failed", "unsupported")
# The inference checks' figures (rmsnorm_suite.inference), per check in the gate's order: the only
# keys of regression.toml's [features] and of a results file's features.
FEATURE_FIGURES = (
    ("batch", ("batch_invariance",)),
    ("quant", ("quant_bits", "quant_quanta", "quant_scales", "quant_fp32")),
    ("qk", ("qk_bits", "qk_tolerance")),
)
FEATURE_KEYS = tuple(key for _, keys in FEATURE_FIGURES for key in keys)


@dataclass(frozen=True)
class Feature:
    """One figure of an inference feature's check (rmsnorm_suite.inference), as pr-verdict's
    worker measured it: ``ok`` with its ``value`` (never negative), ``failed`` or ``unsupported``
    with a ``note``; ``cases``: the labels of the cases measured (the gate holds head to base's)."""

    status: str
    value: float | None = None
    note: str | None = None
    cases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """A results file. ``machine`` (device, versions) and ``settings`` (samples, blocks, timing
    method; under pr-verdict ``rounds`` and ``round_indices``) are free-form records of how the
    run was made; the figures are typed."""

    results: tuple[Row, ...]
    schema: int = SCHEMA
    created: str | None = None
    machine: Mapping[str, Any] = field(default_factory=dict)
    git: Git = Git()
    settings: Mapping[str, Any] = field(default_factory=dict)
    copy: CopyCeiling = CopyCeiling()
    same_bytes_copy: Mapping[str, ShapeCopy] = field(default_factory=dict)  # shape name -> copy
    wall_s: float | None = None
    label: str | None = None  # pr-verdict: "base" or "head"
    round: int | None = None  # pr-verdict: the round a worker's file holds
    features: Mapping[str, Feature] = field(default_factory=dict)  # pr-verdict: figure -> Feature

    def index(self) -> dict[Key, Row]:
        """(provider, shape, mode) -> row."""
        return {r.key: r for r in self.results}

    def rows_of(self, provider: str) -> dict[tuple[str, str], Row]:
        """(shape, mode) -> row, for one provider."""
        return {(r.shape, r.mode): r for r in self.results if r.provider == provider}

    @property
    def round_indices(self) -> list[int] | None:
        """The rounds a pr-verdict merge holds, in order (the gate pairs two runs by them)."""
        return self.settings.get("round_indices")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": self.schema,
            "created": self.created,
            "machine": dict(self.machine),
            "git": {"commit": self.git.commit, "dirty": self.git.dirty},
            "settings": dict(self.settings),
            "copy": _copy_json(self.copy),
            "same_bytes_copy": {name: _shape_copy_json(c) for name, c in self.same_bytes_copy.items()},
            "results": [_row_json(r) for r in self.results],
        }
        for key in ("wall_s", "label", "round"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.features:
            out["features"] = {
                k: {"status": f.status, "value": f.value, "note": f.note, "cases": list(f.cases)}
                for k, f in self.features.items()
            }
        return out


# ---------------------------------------------------------------------------------------------
# To JSON: the keys as the file has always had them
# ---------------------------------------------------------------------------------------------


def _row_json(r: Row) -> dict[str, Any]:
    w, d, h = r.whole, r.device, r.host
    return {
        "provider": r.provider, "shape": r.shape, "m": r.m, "n": r.n, "dtype": r.dtype,
        "group": r.group, "mode": r.mode, "residual": r.residual, "bytes": r.bytes,
        "status": r.status, "error": r.error,
        "samples_ms": list(w.samples_ms), "block_medians_ms": list(w.block_medians_ms),
        "device_samples_ms": list(d.samples_ms), "device_block_medians_ms": list(d.block_medians_ms),
        "device_reps": r.device_reps, "device_error": r.device_error, "errors": dict(r.errors),
        "median_ms": w.median_ms, "tbs": w.tbs, "fraction_of_copy": w.fraction_of_copy,
        "device_median_ms": d.median_ms, "device_tbs": d.tbs, "device_fraction_of_copy": d.fraction_of_copy,
        "host_samples_ms": list(h.samples_ms), "host_block_medians_ms": list(h.block_medians_ms),
        "host_median_ms": h.median_ms,
    }  # fmt: skip


def _copy_json(c: CopyCeiling) -> dict[str, Any]:
    out = {"bytes": c.bytes, "samples_ms": list(c.samples_ms), "median_ms": c.median_ms, "tbs": c.tbs}
    if c.rounds_tbs is not None:
        out["rounds_tbs"] = list(c.rounds_tbs)
    return out


def _shape_copy_json(c: ShapeCopy) -> dict[str, Any]:
    return {
        "m": c.m, "n": c.n, "dtype": c.dtype, "group": c.group, "bytes": c.bytes,
        "median_ms": c.median_ms, "tbs": c.tbs, "device_median_ms": c.device_median_ms,
        "device_tbs": c.device_tbs, "error": c.error,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# From JSON, checked field by field
# ---------------------------------------------------------------------------------------------

_MISSING = object()


class _Reader:
    """Typed reads of one JSON object; errors name the field by its path in the file."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, Mapping):
            raise ValueError(f"{where or 'top level'}: expected an object, got {_kind(data)}")
        self.data, self.where = data, where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, check, default: Any = _MISSING) -> Any:
        """``data[key]`` checked by ``check``; an optional key (with a default) may be absent or null."""
        value = self.data.get(key, _MISSING)
        if value is _MISSING and default is _MISSING:
            raise ValueError(f"{self.path(key)}: missing")
        if value is _MISSING or (value is None and default is not _MISSING):
            return default
        return check(value, self.path(key))


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"[:80]


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {_kind(value)}")
    return value


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: expected an integer, got {_kind(value)}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false, got {_kind(value)}")
    return value


def _number(value: Any, where: str) -> float:
    """A number; NaN and infinities are kept (a broken kernel's error is NaN, the gate flags it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {_kind(value)}")
    return float(value)


def _labels(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of case labels, got {_kind(value)}")
    return tuple(_str(v, f"{where}[{i}]") for i, v in enumerate(value))


def _feature_key(key: Any) -> str:
    if key not in FEATURE_KEYS:
        raise ValueError(f"features: {key!r} is not a figure of the inference checks {list(FEATURE_KEYS)}")
    return key


def _numbers(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of numbers, got {_kind(value)}")
    return tuple(_number(v, f"{where}[{i}]") for i, v in enumerate(value))


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected an object, got {_kind(value)}")
    return dict(value)


def _errors(value: Any, where: str) -> dict[str, float]:
    return {q: _number(v, f"{where}.{q}") for q, v in _object(value, where).items()}


def _read_timing(r: _Reader, prefix: str) -> Timing:
    def number(key: str) -> float | None:
        return r.get(prefix + key, _number, None)

    return Timing(
        r.get(f"{prefix}samples_ms", _numbers, ()),
        r.get(f"{prefix}block_medians_ms", _numbers, ()),
        number("median_ms"),
        number("tbs"),
        number("fraction_of_copy"),
    )


def _read_row(value: Any, where: str) -> Row:
    r = _Reader(value, where)
    status = r.get("status", _str)
    if status not in STATUSES:
        raise ValueError(f"{r.path('status')}: expected one of {list(STATUSES)}, got {status!r}")
    return Row(
        provider=r.get("provider", _str),
        shape=r.get("shape", _str),
        mode=r.get("mode", _str),
        status=status,
        m=r.get("m", _int),
        n=r.get("n", _int),
        dtype=r.get("dtype", _str),
        group=r.get("group", _str),
        bytes=r.get("bytes", _int, None),
        residual=r.get("residual", _bool, False),
        error=r.get("error", _str, None),
        errors=r.get("errors", _errors, {}),
        whole=_read_timing(r, ""),
        device=_read_timing(r, "device_"),
        device_reps=r.get("device_reps", _int, None),
        device_error=r.get("device_error", _str, None),
        host=_read_timing(r, "host_"),
    )


def _read_copy(value: Any, where: str) -> CopyCeiling:
    r = _Reader(value, where)
    return CopyCeiling(
        tbs=r.get("tbs", _number, None),
        bytes=r.get("bytes", _int, None),
        samples_ms=r.get("samples_ms", _numbers, ()),
        median_ms=r.get("median_ms", _number, None),
        rounds_tbs=r.get("rounds_tbs", _numbers, None),
    )


def _read_shape_copy(value: Any, where: str) -> ShapeCopy:
    r = _Reader(value, where)
    return ShapeCopy(
        m=r.get("m", _int),
        n=r.get("n", _int),
        dtype=r.get("dtype", _str),
        group=r.get("group", _str),
        bytes=r.get("bytes", _int),
        median_ms=r.get("median_ms", _number, None),
        tbs=r.get("tbs", _number, None),
        device_median_ms=r.get("device_median_ms", _number, None),
        device_tbs=r.get("device_tbs", _number, None),
        error=r.get("error", _str, None),
    )


def _read_feature(value: Any, where: str) -> Feature:
    r = _Reader(value, where)
    status = r.get("status", _str)
    if status not in FEATURE_STATUSES:
        raise ValueError(f"{r.path('status')}: expected one of {list(FEATURE_STATUSES)}, got {status!r}")
    labels = r.get("cases", _labels, ())
    feature = Feature(status, r.get("value", _number, None), r.get("note", _str, None), tuple(labels))
    if (status == "ok") != (feature.value is not None):
        raise ValueError(f"{r.path('value')}: a value goes with status ok, and only with it")
    if feature.value is not None and feature.value < 0:
        raise ValueError(f"{r.path('value')}: a figure counts or bounds a difference, not {feature.value}")
    return feature


def _read_settings(value: Any, where: str) -> dict[str, Any]:
    settings = _object(value, where)
    if settings.get("round_indices") is not None:
        rounds = settings["round_indices"]
        if not isinstance(rounds, list):
            raise ValueError(f"{where}.round_indices: expected a list of integers, got {_kind(rounds)}")
        for i, k in enumerate(rounds):
            _int(k, f"{where}.round_indices[{i}]")
    return settings


def _read_git(value: Any, where: str) -> Git:
    r = _Reader(value, where)
    return Git(r.get("commit", _str, None), r.get("dirty", _bool, None))


def from_json(data: Any) -> Run:
    """A Run from the parsed JSON of a results file; ValueError naming the field when it is not one."""
    r = _Reader(data, "")
    schema = r.get("schema", _int)
    if not 1 <= schema <= SCHEMA:
        raise ValueError(f"schema: this suite reads versions 1 to {SCHEMA}, got {schema}")
    rows = r.get("results", lambda v, w: v)
    if not isinstance(rows, list):
        raise ValueError(f"results: expected a list of rows, got {_kind(rows)}")
    copies = r.get("same_bytes_copy", _object, {})
    return Run(
        results=tuple(_read_row(row, f"results[{i}]") for i, row in enumerate(rows)),
        schema=schema,
        created=r.get("created", _str, None),
        machine=r.get("machine", _object, {}),
        git=r.get("git", _read_git, Git()),
        settings=r.get("settings", _read_settings, {}),
        copy=r.get("copy", _read_copy, CopyCeiling()),
        same_bytes_copy={
            _str(k, "same_bytes_copy key"): _read_shape_copy(c, f"same_bytes_copy[{k!r}]")
            for k, c in copies.items()
        },
        wall_s=r.get("wall_s", _number, None),
        label=r.get("label", _str, None),
        round=r.get("round", _int, None),
        features={
            _feature_key(k): _read_feature(f, f"features[{k!r}]")
            for k, f in r.get("features", _object, {}).items()
        },
    )


def as_run(run: Run | Mapping[str, Any]) -> Run:
    """A Run as it is, or one read from its JSON form (a dict, as tests and scripts build them)."""
    return run if isinstance(run, Run) else from_json(run)


# ---------------------------------------------------------------------------------------------
# The one load and the one write
# ---------------------------------------------------------------------------------------------


def load(path: str | Path) -> Run:
    """Read a results file; ValueError naming the file (and the field) when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no results file {str(path)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    try:
        return from_json(data)
    except ValueError as exc:
        raise ValueError(f"{path}: not a benchmark results file: {exc}") from None


def write(run: Run, out_dir: str | Path, stem: str | None = None) -> Path:
    """``out_dir/stem.json``; the default stem is ``bench-<UTC time>-<commit>``. Returns the path."""
    if not isinstance(run, Run):
        raise TypeError(f"run must be a results.Run, got {type(run).__name__}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if stem is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        stem = f"bench-{stamp}-{(run.git.commit or 'nogit')[:10]}"
    path = out / f"{stem}.json"
    path.write_text(json.dumps(run.to_json(), indent=1) + "\n", encoding="utf-8")
    return path
