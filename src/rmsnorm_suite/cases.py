"""The one place where shapes, dtypes and numeric tolerances are declared.

Tests, benchmarks, the CLI checks and the regression gate all import from here, so a shape
added or a tolerance changed here changes every consumer at once. Tolerances are declared
before any comparison is made; they are never widened to fit an observed error.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import torch

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
EPS = 1e-6


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_SHORT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Tolerance:
    """Element-wise bound: |value - reference| <= atol + rtol * |reference| (torch.allclose)."""

    atol: float
    rtol: float


# Element-wise tolerances against the fp32-compute reference, per dtype of x. fp32 and fp16 are
# the tutorial's values; bf16 keeps 7 mantissa bits, so one output rounding is up to 2^-8
# relative: 1e-2 is one bf16 ulp of headroom on top of that rounding.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-4),
    torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
}

# The kernel's relative L2 error against a float64 oracle may not exceed this factor times the
# error of torch's own fp32-compute path on the same case. fp32 inputs get 2x because both sit
# at the rounding floor, where a different summation order alone moves the error by that much.
ORACLE_ERROR_FACTOR: dict[torch.dtype, float] = {
    torch.float32: 2.0,
    torch.float16: 1.05,
    torch.bfloat16: 1.05,
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    return TOLERANCES[dtype]


# ---------------------------------------------------------------------------------------------
# Test grids
# ---------------------------------------------------------------------------------------------

# CPU, Triton interpreter: deliberately odd sizes, kept small because the interpreter is slow.
# 4097 is one above the widest tile (the two-walk paths, two chunks); 65537 is above the widest
# two-walk backward (the segmented backward).
INTERPRET_ROWS: tuple[int, ...] = (0, 1, 17)
INTERPRET_COLS: tuple[int, ...] = (1, 257, 4097, 65537)

# GPU: the tutorial's 72-case grid (here 3 dtypes x 4 row counts x 6 widths) ...
GPU_ROWS: tuple[int, ...] = (1, 17, 256, 2048)
GPU_COLS: tuple[int, ...] = (1, 64, 257, 1000, 4096, 4097)
# ... extended to the two-walk paths' widths and the widest supported rows.
GPU_WIDE_ROWS: tuple[int, ...] = (1, 17, 128)
GPU_WIDE_COLS: tuple[int, ...] = (8192, 16384, 65537, 262144)


def gpu_grid() -> list[tuple[int, int, torch.dtype]]:
    """The 72-case grid: (M, N, dtype)."""
    return [(m, n, d) for d in DTYPES for m in GPU_ROWS for n in GPU_COLS]


def gpu_wide_grid() -> list[tuple[int, int, torch.dtype]]:
    return [(m, n, d) for d in DTYPES for m in GPU_WIDE_ROWS for n in GPU_WIDE_COLS]


def interpret_grid() -> list[tuple[int, int, torch.dtype]]:
    return [(m, n, d) for d in DTYPES for m in INTERPRET_ROWS for n in INTERPRET_COLS]


# ---------------------------------------------------------------------------------------------
# The suite's one case type
# ---------------------------------------------------------------------------------------------

# Shapes of the probes and the feature checks. 257 is the tutorial's: next_power_of_2(257) = 512,
# so a BLOCK-for-N confusion shows; at 256 it hides (the control).
PROBE_N = 257
PROBE_ROWS = 5

# Which part of the suite reads a case, and so how it is named (Case.name).
ROLES: tuple[str, ...] = ("check", "bench", "graph", "feature")


@dataclass(frozen=True)
class Case:
    """M rows of N values of ``dtype``, the weight in ``weight_dtype`` (None: x's), with a
    residual of ``r_dtype`` where that is set. ``role`` names who reads it: "check" (the numeric
    checks and probes: the plain constructor), "bench" (the benchmark matrix, in ``group``),
    "graph" (CUDA graph captures) or "feature" (the feature checks: ``label``, ``options`` for
    the implementation, ``with_dh``, ``weight_center``); :meth:`bench`, :meth:`graph` and
    :meth:`feature` build the last three."""

    m: int
    n: int
    dtype: torch.dtype
    device: str | torch.device = "cpu"
    seed: int = 0
    weight_dtype: torch.dtype | None = None
    eps: float = EPS
    _: KW_ONLY
    role: str = "check"
    group: str = ""  # role "bench": see GROUPS
    r_dtype: torch.dtype | None = None
    label: str = ""
    options: tuple[tuple[str, object], ...] = ()
    with_dh: bool = False  # role "feature": h is used downstream (its gradient dh flows back)
    weight_center: float = 1.0  # role "feature": 1.0 a Llama-like weight, 0.0 a Gemma-like one

    def __post_init__(self) -> None:
        if not isinstance(self.m, int) or isinstance(self.m, bool) or self.m < 0:
            raise ValueError(f"Case.m must be an int >= 0, got {self.m!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"Case.n must be an int >= 1, got {self.n!r}")
        dtypes = (
            ("dtype", self.dtype),
            ("weight_dtype", self.wdtype),
            ("r_dtype", self.r_dtype or self.dtype),
        )
        for label, value in dtypes:
            if value not in TOLERANCES:
                raise TypeError(f"Case.{label} must be one of {[dtype_name(d) for d in DTYPES]}, got {value}")
        if not (isinstance(self.eps, float | int) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"Case.eps must be a finite number > 0, got {self.eps!r}")
        if self.role not in ROLES:
            raise ValueError(f"Case.role must be one of {list(ROLES)}, got {self.role!r}")

    @classmethod
    def bench(cls, m: int, n: int, dtype: torch.dtype, group: str) -> Case:
        """A shape of the benchmark matrix (the harness, the gate, pr-verdict's specs)."""
        return cls(m, n, dtype, role="bench", group=group)

    @classmethod
    def graph(cls, m: int, n: int, *, residual: bool = False) -> Case:
        """A CUDA graph capture: bf16, optionally through the fused residual add."""
        return cls(m, n, torch.bfloat16, role="graph", r_dtype=torch.bfloat16 if residual else None)

    @classmethod
    def feature(
        cls,
        label: str,
        x_dtype: torch.dtype,
        w_dtype: torch.dtype,
        *,
        m: int = PROBE_ROWS,
        n: int = PROBE_N,
        seed: int = 0,
        r_dtype: torch.dtype | None = None,
        options: tuple[tuple[str, object], ...] = (),
        with_dh: bool = False,
        weight_center: float = 1.0,
    ) -> Case:
        """One input of a feature check, named by its label."""
        return cls(
            m,
            n,
            x_dtype,
            seed=seed,
            weight_dtype=w_dtype,
            role="feature",
            r_dtype=r_dtype,
            label=label,
            options=options,
            with_dh=with_dh,
            weight_center=weight_center,
        )

    @property
    def wdtype(self) -> torch.dtype:
        return self.weight_dtype or self.dtype

    @property
    def residual(self) -> bool:
        return self.r_dtype is not None

    @property
    def opts(self) -> dict:
        """The options a feature check passes to the implementation, eps first."""
        return {"eps": self.eps, **dict(self.options)}

    @property
    def name(self) -> str:
        shape = f"{self.m}x{self.n}"
        if self.role == "feature":
            return self.label
        if self.role == "bench":
            return f"{shape}-{dtype_name(self.dtype)}"
        if self.role == "graph":
            return f"{shape} {_SHORT_NAMES[self.dtype]}{' with residual' if self.residual else ''}"
        w = "" if self.weight_dtype in (None, self.dtype) else f" w={dtype_name(self.weight_dtype)}"
        return f"{shape} {dtype_name(self.dtype)}{w}"

    @property
    def nbytes(self) -> dict[str, int]:
        """Mode -> the fewest bytes a pass moves (:func:`bytes_moved`)."""
        return {mode: bytes_moved(self, mode) for mode in BENCH_MODES}


# ---------------------------------------------------------------------------------------------
# Benchmark matrix (shared by asv, pytest-benchmark, the CLI benchmark and the gate)
# ---------------------------------------------------------------------------------------------


# Groups, by what bounds the time of a call on the H200 (measured, docs/gate.md): "large" is
# memory-bound forward and forward+backward; "medium" is memory-bound forward, but its
# forward+backward finishes on the GPU sooner than the host issues it; "small" is launch-bound.
# The gate's latency factors (regression.toml) are declared per group and mode.
GROUPS: tuple[str, ...] = ("large", "medium", "small")

BENCH_SHAPES: tuple[Case, ...] = (
    Case.bench(32768, 4096, torch.bfloat16, "large"),
    Case.bench(16384, 8192, torch.bfloat16, "large"),
    Case.bench(8192, 16384, torch.bfloat16, "large"),
    Case.bench(2048, 65536, torch.bfloat16, "large"),
    Case.bench(65536, 1024, torch.bfloat16, "medium"),
    Case.bench(4096, 4096, torch.float32, "medium"),
    Case.bench(4096, 4096, torch.float16, "medium"),
    Case.bench(4096, 4096, torch.bfloat16, "medium"),
    Case.bench(1, 4096, torch.bfloat16, "small"),
    Case.bench(256, 4096, torch.bfloat16, "small"),
    Case.bench(128, 257, torch.float32, "small"),
    Case.bench(128, 257, torch.float16, "small"),
)

BENCH_MODES: tuple[str, ...] = ("forward", "forward_backward")


def bench_shape(name: str) -> Case:
    for shape in BENCH_SHAPES:
        if shape.name == name:
            return shape
    raise ValueError(f"unknown benchmark shape {name!r}; expected one of {[s.name for s in BENCH_SHAPES]}")


def residual_bytes_moved(shape: Case, mode: str) -> int:
    """Fewest bytes of the fused residual add + RMSNorm (h = x + r, y = norm(h)): the forward reads
    x and r and writes y and h (4 M N elements); forward+backward adds reading h and dy and writing
    dx (7 M N elements in all; dx serves as the residual's gradient too)."""
    per = {"forward": 4, "forward_backward": 7}[mode]
    return per * shape.m * shape.n * torch.empty((), dtype=shape.dtype).element_size()


def bytes_moved(shape: Case, mode: str) -> int:
    """Fewest bytes a pass must move: forward reads x and writes y (2 M N elements);
    forward+backward adds reading x and dy and writing dx (5 M N elements in all)."""
    per = {"forward": 2, "forward_backward": 5}[mode]
    return per * shape.m * shape.n * torch.empty((), dtype=shape.dtype).element_size()
