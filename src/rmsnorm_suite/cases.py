"""The one place where shapes, dtypes and numeric tolerances are declared.

Tests, benchmarks, the CLI checks and the regression gate all import from here, so a shape
added or a tolerance changed here changes every consumer at once. Tolerances are declared
before any comparison is made; they are never widened to fit an observed error.
"""

from __future__ import annotations

from dataclasses import dataclass

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
# Benchmark matrix (shared by asv, pytest-benchmark, the CLI benchmark and the gate)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchShape:
    """A benchmark shape: its rows, columns, dtype and group; the one case type of the harness,
    the gate and pr-verdict's specs (harness.Case)."""

    m: int
    n: int
    dtype: torch.dtype
    group: str  # see GROUPS

    @property
    def name(self) -> str:
        return f"{self.m}x{self.n}-{dtype_name(self.dtype)}"

    @property
    def nbytes(self) -> dict[str, int]:
        """Mode -> the fewest bytes a pass moves (:func:`bytes_moved`)."""
        return {mode: bytes_moved(self, mode) for mode in BENCH_MODES}


# Groups, by what bounds the time of a call on the H200 (measured, docs/gate.md): "large" is
# memory-bound forward and forward+backward; "medium" is memory-bound forward, but its
# forward+backward finishes on the GPU sooner than the host issues it; "small" is launch-bound.
# The gate's latency factors (regression.toml) are declared per group and mode.
GROUPS: tuple[str, ...] = ("large", "medium", "small")

BENCH_SHAPES: tuple[BenchShape, ...] = (
    BenchShape(32768, 4096, torch.bfloat16, "large"),
    BenchShape(16384, 8192, torch.bfloat16, "large"),
    BenchShape(8192, 16384, torch.bfloat16, "large"),
    BenchShape(2048, 65536, torch.bfloat16, "large"),
    BenchShape(65536, 1024, torch.bfloat16, "medium"),
    BenchShape(4096, 4096, torch.float32, "medium"),
    BenchShape(4096, 4096, torch.float16, "medium"),
    BenchShape(4096, 4096, torch.bfloat16, "medium"),
    BenchShape(1, 4096, torch.bfloat16, "small"),
    BenchShape(256, 4096, torch.bfloat16, "small"),
    BenchShape(128, 257, torch.float32, "small"),
    BenchShape(128, 257, torch.float16, "small"),
)

BENCH_MODES: tuple[str, ...] = ("forward", "forward_backward")


def bench_shape(name: str) -> BenchShape:
    for shape in BENCH_SHAPES:
        if shape.name == name:
            return shape
    raise ValueError(f"unknown benchmark shape {name!r}; expected one of {[s.name for s in BENCH_SHAPES]}")


def residual_bytes_moved(shape: BenchShape, mode: str) -> int:
    """Fewest bytes of the fused residual add + RMSNorm (h = x + r, y = norm(h)): the forward reads
    x and r and writes y and h (4 M N elements); forward+backward adds reading h and dy and writing
    dx (7 M N elements in all; dx serves as the residual's gradient too)."""
    per = {"forward": 4, "forward_backward": 7}[mode]
    return per * shape.m * shape.n * torch.empty((), dtype=shape.dtype).element_size()


def bytes_moved(shape: BenchShape, mode: str) -> int:
    """Fewest bytes a pass must move: forward reads x and writes y (2 M N elements);
    forward+backward adds reading x and dy and writing dx (5 M N elements in all)."""
    per = {"forward": 2, "forward_backward": 5}[mode]
    return per * shape.m * shape.n * torch.empty((), dtype=shape.dtype).element_size()
