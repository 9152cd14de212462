"""The judge's clock inside a worker: bound before a commit's op is imported, checked after.

:class:`Guard` records the clocks (host and CUDA events, graph replay) and every function, class
and constant of the trusted harness modules, and names what a commit's code replaced.
:class:`Calibration` times a copy of the judge's own, of known size, with the clocks as bound;
the worker runs it before each case and at the end of a round, and :func:`judge_clock` holds the
head's calibrations to the base's (regression.toml, [clock]). Either finding makes the verdict
`error`. docs/ci.md (threat model) says what this cannot see.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import statistics
import types
from collections.abc import Mapping, Sequence
from typing import Any

# What the guard itself reads with, bound at its import (before any commit's code): a head that
# replaces importlib.import_module, vars or inspect.getattr_static later does not change what the
# guard sees through them. docs/ci.md (threat model): an in-process guard can still be blinded.
_IMPORT, _VARS, _GETATTR_STATIC = importlib.import_module, vars, inspect.getattr_static
_ISINSTANCE, _TYPE, _ID, _SORTED = isinstance, type, id, sorted
_IS_DATACLASS, _FIELDS = dataclasses.is_dataclass, dataclasses.fields
_OBJECT_GETATTR = object.__getattribute__
_FUNCTION = types.FunctionType
_WRAPPERS, _MODULE = (classmethod, staticmethod), types.ModuleType
_VALUES = (int, float, str, bytes, tuple, frozenset, bool, type(None))
_CONSTANTS = (int, float, str, bytes, tuple, frozenset)

# (module, attribute path) of the clocks and what they time with
CLOCKS = (
    ("time", "perf_counter"), ("time", "perf_counter_ns"), ("time", "monotonic"),
    ("time", "monotonic_ns"), ("time", "time"), ("time", "time_ns"),
    ("torch.cuda", "synchronize"), ("torch.cuda", "_sleep"), ("torch.cuda", "current_stream"),
    ("torch.cuda", "Event"), ("torch.cuda", "CUDAGraph"), ("torch.cuda", "graph"), ("torch.cuda", "Stream"),
    ("torch", "Tensor.copy_"),
    ("builtins", "open"), ("os", "write"), ("os", "read"), ("sys", "stdin"),
    ("torch", "Tensor.__matmul__"), ("torch", "Tensor.to"), ("torch", "Tensor.backward"),
    ("torch", "matmul"), ("torch", "randn"), ("torch", "randint"),
    ("dataclasses", "replace"), ("torch.nn.functional", "rms_norm"), ("torch", "equal"),
    ("torch", "ne"), ("torch", "count_nonzero"), ("torch", "index_select"), ("torch.autograd", "grad"),
    # what the feature checks call at run time (inference binds them at import too)
    ("torch", "round"), ("torch", "where"), ("torch", "trunc"), ("torch", "abs"), ("torch", "clamp"),
    ("importlib", "import_module"), ("inspect", "getattr_static"), ("inspect", "signature"),
)  # fmt: skip
# classes whose whole namespace is held (methods replaced on the class, or on its C base)
CLOCK_CLASSES = (
    ("torch.cuda", "Event"), ("torch.cuda", "CUDAGraph"), ("torch.cuda", "Stream"),
    ("torch._C", "_CudaEventBase"), ("torch._C", "_CudaStreamBase"),
)  # fmt: skip
# the trusted harness: every function, class (with its methods) and constant of these modules
TRUSTED = ("rmsnorm_suite.harness", "rmsnorm_suite.timing",
           "rmsnorm_suite.providers", "rmsnorm_suite.results", "rmsnorm_suite.numerics",
           "rmsnorm_suite.worker", "rmsnorm_suite.guard", "rmsnorm_suite.stopwatch",
           "rmsnorm_suite.inference", "rmsnorm_suite.cases", "dataclasses", "json",
           "builtins", "math")  # fmt: skip
# classes whose every member is held, dunders included (the feature checks compute with tensors
# the op returned: a method or operator replaced on the class is named)
HELD_CLASSES = (("torch", "Tensor"), ("torch._C", "TensorBase"))
# every module the guard reads, imported once at construction and kept: the guard never looks a
# module up again (a head serving copies through importlib.import_module is not read)
MODULES = tuple(dict.fromkeys((*(m for m, _ in CLOCKS), *(m for m, _ in CLOCK_CLASSES),
                               *(m for m, _ in HELD_CLASSES), *TRUSTED)))  # fmt: skip
# 128 MiB of bf16 on the GPU (over the L2); on the host 64 KiB of fp32, under torch's threshold for a
# threaded copy (a threaded copy on a loaded machine times the scheduler more than the clock)
CALIBRATION_ELEMENTS = {"cuda": 2**26, "host": 2**14}
CALIBRATION_SAMPLES = 15


def _modules() -> dict[str, types.ModuleType]:
    found = {}
    for name in MODULES:
        try:
            found[name] = _IMPORT(name)
        except ImportError:
            continue
    return found


def _resolve(modules: Mapping[str, types.ModuleType], module: str, path: str) -> Any:
    if module not in modules:
        raise ImportError(module)
    obj: Any = modules[module]
    for part in path.split("."):
        obj = _GETATTR_STATIC(obj, part)
    return obj


def _fingerprint(value: Any) -> tuple:
    """What must stay the same: the object, and for a Python function its code and defaults
    (swapping ``__code__`` keeps the function's identity)."""
    if _ISINSTANCE(value, _WRAPPERS):
        value = value.__func__
    if _ISINSTANCE(value, _FUNCTION):
        return (_ID(value), _ID(value.__code__), value.__defaults__, value.__kwdefaults__)
    if _ISINSTANCE(value, _VALUES):
        return (_TYPE(value), value)
    return (_ID(value),)


def _held(value: Any, module: str) -> bool:
    if _ISINSTANCE(value, (_FUNCTION, *_WRAPPERS, _MODULE)):
        return True  # a module global replaced (worker.stopwatch = a stand-in) is seen by identity
    if _ISINSTANCE(value, _TYPE):
        return value.__module__ == module
    if _ISINSTANCE(value, BUILTINS) or _is_dtype(value):
        return True  # a torch function or dtype bound at import (inference's), by identity
    if _is_instance_of_dataclass(value):
        return True  # inference.op_impl: its fields are held too (object.__setattr__ swaps them)
    return _ISINSTANCE(value, _CONSTANTS)


def _is_instance_of_dataclass(value: Any) -> bool:
    return _IS_DATACLASS(value) and not _ISINSTANCE(value, _TYPE)


BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
            types.GetSetDescriptorType, types.MethodWrapperType, types.ClassMethodDescriptorType)  # fmt: skip


def _is_dtype(value: Any) -> bool:
    return _TYPE(value).__name__ == "dtype" and _TYPE(value).__module__ == "torch"


class Guard:
    """Snapshot at construction; :meth:`replaced` names whatever changed since."""

    def __init__(self) -> None:
        self.modules = _modules()  # kept: never looked up again
        self.snapshot = self._take()
        self.objects = {name: value for name, (value, _) in self.snapshot.items()}  # keeps ids alive

    def _take(self) -> dict[str, tuple[Any, tuple]]:
        found: dict[str, tuple[Any, tuple]] = {}
        modules = self.modules

        def hold(name: str, value: Any) -> None:
            found[name] = (value, _fingerprint(value))

        for module, path in CLOCKS:
            try:
                hold(f"{module}.{path}", _resolve(modules, module, path))
            except (ImportError, AttributeError):
                continue
        for module, path in CLOCK_CLASSES:
            try:
                cls = _resolve(modules, module, path)
            except (ImportError, AttributeError):
                continue
            for key, value in _VARS(cls).items():
                if not key.startswith("__") or key in ("__init__", "__new__", "__call__"):
                    hold(f"{module}.{path}.{key}", value)
        for module, path in HELD_CLASSES:
            try:
                cls = _resolve(modules, module, path)
            except (ImportError, AttributeError):
                continue
            for key, value in _VARS(cls).items():
                if key not in ("__dict__", "__doc__", "__weakref__", "__annotations__"):
                    hold(f"{module}.{path}.{key}", value)
        for module in TRUSTED:
            if module not in modules:
                continue
            for key, value in _VARS(modules[module]).items():
                if key.startswith("__") or not _held(value, module):
                    continue
                hold(f"{module}.{key}", value)
                if _ISINSTANCE(value, _TYPE):
                    for attr, member in _VARS(value).items():
                        if not attr.startswith("__") or attr in ("__init__", "__post_init__"):
                            hold(f"{module}.{key}.{attr}", member)
                elif _is_instance_of_dataclass(value):
                    for f in _FIELDS(value):
                        hold(f"{module}.{key}.{f.name}", _OBJECT_GETATTR(value, f.name))
        return found

    def replaced(self) -> list[str]:
        """The names whose object (or code) is not the one bound at construction."""
        now = self._take()
        changed = [
            name for name, (_, mark) in self.snapshot.items() if now.get(name, (None, None))[1] != mark
        ]
        return _SORTED(changed)


class Calibration:
    """A copy of known size, timed with the clocks bound at construction (before the op runs):
    CUDA events on the GPU, the host clock in the CPU stand-in."""

    def __init__(self, timing: str, device: str = "cuda") -> None:
        import time

        import torch

        self.timing = timing
        self.perf_counter = time.perf_counter
        self.torch = torch
        if timing == "cuda":
            self.event = torch.cuda.Event
            self.record, self.elapsed = torch.cuda.Event.record, torch.cuda.Event.elapsed_time
            self.synchronize = torch.cuda.synchronize
            self.src = torch.rand(CALIBRATION_ELEMENTS["cuda"], device=device, dtype=torch.bfloat16)
        else:
            self.src = torch.rand(CALIBRATION_ELEMENTS["host"], dtype=torch.float32)
        self.dst = torch.empty_like(self.src)
        self.copy = torch.Tensor.copy_

    def measure(self) -> float:
        """Median ms of CALIBRATION_SAMPLES copies after one untimed; the host stand-in takes the
        minimum (a shared CPU descheduling the process is not what the check is about)."""
        self.copy(self.dst, self.src)
        times = []
        for _ in range(CALIBRATION_SAMPLES):
            if self.timing == "cuda":
                start, end = self.event(enable_timing=True), self.event(enable_timing=True)
                self.record(start)
                self.copy(self.dst, self.src)
                self.record(end)
                self.synchronize()
                times.append(self.elapsed(start, end))
            else:
                t0 = self.perf_counter()
                self.copy(self.dst, self.src)
                times.append((self.perf_counter() - t0) * 1e3)
        return statistics.median(times) if self.timing == "cuda" else min(times)


def read_calibration(settings: Mapping[str, Any]) -> list[float]:
    """A round's calibration medians from its settings; ValueError when missing or malformed."""
    values = settings.get("calibration_ms")
    if not isinstance(values, list) or len(values) < 2:
        raise ValueError("no calibration: a round must time the judge's copy at least twice")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"calibration_ms holds {v!r}, not a positive time")
    return [float(v) for v in values]


def judge_clock(
    base: Mapping[int, Sequence[float]],
    head: Mapping[int, Sequence[float]],
    tolerance: float,
    checkpoint: float,
) -> tuple[str, float | None, str]:
    """(verdict, ratio, note): ``ratio`` the median over rounds of head/base calibration medians.
    `error` when it is off 1 by more than ``tolerance``, or when any calibration of either side
    is off its own round's median by more than ``checkpoint``, or when no round pairs."""
    pairs = sorted(set(base) & set(head))
    if not pairs:
        return "error", None, "the clock cannot be checked: no round of both sides has a calibration"
    ratios = [statistics.median(head[k]) / statistics.median(base[k]) for k in pairs]
    ratio = statistics.median(ratios)
    worst = max(
        (abs(v / statistics.median(side[k]) - 1.0), name, k)
        for name, side in (("base", base), ("head", head))
        for k in side
        for v in side[k]
    )
    note = f"calibration head/base {ratio:.3f} over {len(pairs)} rounds; widest checkpoint {worst[0]:.1%} ({worst[1]})"
    if abs(ratio - 1.0) > tolerance:
        return "error", ratio, f"the clock disagrees: {note}, beyond {tolerance:.0%}"
    if worst[0] > checkpoint:
        return "error", ratio, f"the clock disagrees within a round: {note}, beyond {checkpoint:.0%}"
    return "pass", ratio, note
