"""Launchers: validate arguments, allocate outputs, pick a cached launch configuration, launch.

Everything a user can get wrong is checked in ``validate`` before any kernel runs, and raises a
``TypeError``/``ValueError`` that names the argument. The launchers below it assume valid input.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from rmsnorm_kernel import kernels

Tensor = torch.Tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASTING_MODES = {"default": kernels.CAST_FP32, "gemma": kernels.CAST_FP32, "llama": kernels.CAST_LLAMA}

# Widest row held in registers as one tile; wider rows take the wide path.
FORWARD_MAX_TILE = 16384
BACKWARD_MAX_TILE = 16384
# Wide path: chunk width, warps and programs per SM of the forward walk; segment width and
# warps of the backward.
LOOP_BLOCK = 16384
LOOP_WARPS = 32
LOOP_PROGRAMS_PER_SM = 1
SEGMENT = 8192
SEGMENT_WARPS = 8


class UnsupportedInput(ValueError):
    """Valid input that the kernels do not run (fp64, CPU tensors without the interpreter).
    ``rms_norm(..., allow_fallback=True)`` routes such input to the reference instead."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def validate(
    x: Tensor,
    weight: Tensor | None,
    residual: Tensor | None,
    eps: float,
    offset: float,
    casting: str,
    out_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
    n: int,
) -> None:
    """Raise TypeError/ValueError for invalid arguments, UnsupportedInput for valid ones the
    kernels do not run. ``n`` is the normalised size (product of normalized_shape)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {_dtype_name(x.dtype)}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
        if not weight.dtype.is_floating_point:
            raise TypeError(f"weight must be float32, float16 or bfloat16, got {_dtype_name(weight.dtype)}")
        if weight.numel() != n:
            raise ValueError(
                f"weight must have {n} elements (the normalized shape), got shape {tuple(weight.shape)}"
            )
        if weight.device != x.device:
            raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if not residual.dtype.is_floating_point:
            raise TypeError(f"residual must be a float tensor, got {_dtype_name(residual.dtype)}")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.device != x.device:
            raise ValueError(f"residual must be on x's device {x.device}, got {residual.device}")
    elif residual_dtype is not None:
        raise ValueError("residual_dtype is only meaningful with a residual")
    for name, value in (("out_dtype", out_dtype), ("residual_dtype", residual_dtype)):
        if value is not None and value not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float32, float16, bfloat16 or None, got {value}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps}")
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"offset must be a finite float, got {offset!r}")
    if offset != 0.0 and weight is None:
        raise ValueError("offset needs a weight: y = x * r * (offset + weight)")
    if casting not in CASTING_MODES:
        raise ValueError(f"casting must be one of {sorted(CASTING_MODES)}, got {casting!r}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if n == 0:
        raise ValueError("the normalized size N must be at least 1, got 0")
    # Valid, but possibly not runnable by the kernels.
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedInput(
                f"{name} has dtype {_dtype_name(t.dtype)}; the kernels run float32, float16 and bfloat16 "
                "(pass allow_fallback=True to run the reference instead)"
            )
    if x.device.type != "cuda" and not kernels.INTERPRET:
        raise UnsupportedInput(
            f"x is on {x.device}; the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1 "
            "(pass allow_fallback=True to run the reference instead)"
        )


# ---------------------------------------------------------------------------------------------
# Kernel launch with a lean host path
# ---------------------------------------------------------------------------------------------


def _spec_key(args: tuple) -> tuple:
    """What Triton specialises a compiled kernel on: tensors on dtype and 16-byte alignment,
    ints on == 1, divisibility by 16 and width; floats not at all. A key made of these is at
    least as fine as Triton's own, so a cached kernel is never reused where Triton would compile
    a different one."""
    return tuple(
        [
            (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, torch.Tensor)
            else (a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
            if type(a) is int
            else type(a)
            for a in args
        ]
    )


class Launcher:
    """``launcher(grid, args, num_warps, **constexprs)`` launches ``kernel`` like
    ``kernel[grid](*args, num_warps=num_warps, **constexprs)``.

    The first launch per specialisation goes through Triton (compiling if needed); later ones
    hand the arguments straight to the compiled kernel's launcher on the current stream,
    skipping Triton's per-call argument binding, which costs more host time than the kernel
    takes on the GPU at small shapes. Under the interpreter every launch goes through Triton.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.slow_launches = 0  # launches that went through Triton's own path (first per specialisation)
        # The compiled kernel takes every parameter positionally, constexprs included.
        params = [] if kernels.INTERPRET else kernel.params
        self.constexpr_names = [p.name for p in params if p.is_constexpr]

    def __call__(self, grid: tuple[int, ...], args: tuple, num_warps: int, **constexprs) -> None:
        if kernels.INTERPRET:
            self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            return
        const_values = tuple(constexprs[name] for name in self.constexpr_names)
        device = args[0].device.index
        key = (device, num_warps, const_values, _spec_key(args))
        compiled = self.compiled.get(key)
        if compiled is None:
            self.slow_launches += 1
            self.compiled[key] = self.kernel[grid](*args, num_warps=num_warps, **constexprs)
            return
        stream = torch._C._cuda_getCurrentRawStream(device)
        compiled.run(
            grid[0],
            grid[1] if len(grid) > 1 else 1,
            grid[2] if len(grid) > 2 else 1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata, only built for launch hooks (profilers), which this path skips
            None,
            None,
            *args,
            *const_values,
        )


_forward_tile = Launcher(kernels.forward_tile)
_forward_looped = Launcher(kernels.forward_looped)
_backward_tile = Launcher(kernels.backward_tile)
_backward_wide_dot = Launcher(kernels.backward_wide_dot)
_backward_wide = Launcher(kernels.backward_wide)
_reduce_columns = Launcher(kernels.reduce_columns)


# ---------------------------------------------------------------------------------------------
# Launch configuration, cached per (N, element size, device)
# ---------------------------------------------------------------------------------------------


@functools.cache
def sm_count(device_index: int) -> int:
    if device_index < 0:  # the interpreter on CPU: a few programs keep it quick
        return 2
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Launch configurations of the tile path, by BLOCK_N: (rows per program, warps) for the forward,
# (rows per program, warps, programs per SM) for the persistent backward. Measured on an H200
# (bf16; tools/tune_sweep.py): one or two programs per SM with 8-16 warps keep the backward's
# loads in flight without spilling its register-resident dw share.
FORWARD_TILE = {1024: (2, 4), 2048: (1, 4), 4096: (1, 8), 8192: (1, 16), 16384: (1, 8)}
BACKWARD_TILE = {1024: (2, 4, 4), 2048: (1, 4, 4), 4096: (1, 8, 2), 8192: (1, 16, 2), 16384: (1, 8, 2)}


@functools.cache
def forward_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) of the forward tile path."""
    block_n = triton.next_power_of_2(n)
    if block_n in FORWARD_TILE:
        return (block_n, *FORWARD_TILE[block_n])
    return block_n, max(1, 1024 // block_n), 4  # narrow rows: about 1024 elements per program


@functools.cache
def backward_config(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, ROWS, num_warps, programs per SM) of the backward tile path."""
    block_n = triton.next_power_of_2(n)
    if block_n in BACKWARD_TILE:
        return (block_n, *BACKWARD_TILE[block_n])
    return block_n, max(1, 1024 // block_n), 4, 4


def _device_index(t: Tensor) -> int:
    if t.device.type != "cuda":
        return -1
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def as_rows(t: Tensor, n: int) -> Tensor:
    """A 2-D (M, n) view with unit stride along the row when the layout allows it (strided rows
    are kept as they are), else a contiguous copy."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    if t.dim() >= 1 and t.shape[-1] == n and t.stride(-1) == 1:
        try:
            return t.view(-1, n)
        except RuntimeError:
            pass
    return t.contiguous().view(-1, n)


def forward(
    x2: Tensor,
    weight: Tensor | None,
    res2: Tensor | None,
    eps: float,
    offset: float,
    casting: int,
    out_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """x2, res2: (M, N) with unit row stride. Returns y (M, N), rstd (M,) fp32, h (M, N) or empty."""
    m, n = x2.shape
    y = torch.empty((m, n), device=x2.device, dtype=out_dtype)
    rstd = torch.empty((m,), device=x2.device, dtype=torch.float32)
    h = torch.empty((m, n) if res2 is not None else (0,), device=x2.device, dtype=residual_dtype)
    if m == 0:
        return y, rstd, h
    w = weight if weight is not None else x2  # unused pointers get any valid tensor; weight is 1-D
    r = res2 if res2 is not None else x2
    hs = h if res2 is not None else y
    common = dict(HAS_WEIGHT=weight is not None, HAS_RESIDUAL=res2 is not None, CASTING=casting)
    strides = (x2.stride(0), r.stride(0), y.stride(0), hs.stride(0), eps, offset)
    if n <= FORWARD_MAX_TILE:
        block_n, rows, num_warps = forward_config(n)
        grid = (triton.cdiv(m, rows),)
        _forward_tile(
            grid, (x2, r, w, y, hs, rstd, m, n, *strides), num_warps, **common, BLOCK_N=block_n, ROWS=rows
        )
    else:
        programs = min(m, sm_count(_device_index(x2)) * LOOP_PROGRAMS_PER_SM)
        args = (x2, r, w, y, hs, rstd, m, n, programs, *strides)
        _forward_looped((programs,), args, LOOP_WARPS, **common, BLOCK_N=LOOP_BLOCK)
    return y, rstd, h


def backward(
    dy2: Tensor,
    dh2: Tensor | None,
    xh2: Tensor,
    weight: Tensor | None,
    rstd: Tensor,
    offset: float,
    casting: int,
    need_dw: bool,
    dx_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Returns dx (M, N) in dx_dtype and dw (N,) in the weight's dtype (empty when not needed)."""
    m, n = xh2.shape
    device = xh2.device
    dx = torch.empty((m, n), device=device, dtype=dx_dtype)
    compute_dw = need_dw and weight is not None
    dw = torch.empty(
        (n,) if compute_dw else (0,), device=device, dtype=weight.dtype if compute_dw else torch.float32
    )
    if m == 0:
        if compute_dw:
            dw.zero_()
        return dx, dw
    w = weight if weight is not None else xh2
    dh = dh2 if dh2 is not None else dy2
    common = dict(
        HAS_WEIGHT=weight is not None, HAS_DH=dh2 is not None, COMPUTE_DW=compute_dw, CASTING=casting
    )
    sms = sm_count(_device_index(xh2))
    strides = (xh2.stride(0), dy2.stride(0), dh.stride(0), dx.stride(0), offset)
    if n <= BACKWARD_MAX_TILE:
        block_n, rows, num_warps, per_sm = backward_config(n)
        programs = min(triton.cdiv(m, rows), sms * per_sm)
        if programs == 1:  # one program sums every row itself and writes the final dw
            partial = dw
        else:
            partial = torch.empty((programs, n) if compute_dw else (0,), device=device, dtype=torch.float32)
        args = (xh2, w, dy2, dh, rstd, dx, partial, m, n, programs, *strides)
        _backward_tile((programs,), args, num_warps, **common, BLOCK_N=block_n, ROWS=rows)
    else:
        segments = triton.cdiv(n, SEGMENT)
        dot = torch.empty((m, segments), device=device, dtype=torch.float32)
        args = (xh2, w, dy2, dot, n, xh2.stride(0), dy2.stride(0), offset, segments)
        _backward_wide_dot((m, segments), args, SEGMENT_WARPS, HAS_WEIGHT=weight is not None, BLOCK_S=SEGMENT)
        programs = min(m, max(1, 2 * sms // segments))  # row groups
        partial = torch.empty((programs, n) if compute_dw else (0,), device=device, dtype=torch.float32)
        args = (xh2, w, dy2, dh, rstd, dot, dx, partial, m, n, programs, *strides, segments)
        seg_pow2 = triton.next_power_of_2(segments)
        _backward_wide(
            (programs, segments), args, SEGMENT_WARPS, **common, BLOCK_S=SEGMENT, SEGMENTS_POW2=seg_pow2
        )
    if compute_dw and partial is not dw:
        block_c = 64 if n >= 64 else triton.next_power_of_2(n)
        block_p = min(32, triton.next_power_of_2(programs))
        _reduce_columns(
            (triton.cdiv(n, block_c),), (partial, dw, programs, n), 4, BLOCK_P=block_p, BLOCK_C=block_c
        )
    return dx, dw
