"""Launchers: allocate outputs, pick a cached launch configuration, launch.

What the kernels run is declared at the top (dtypes, casting modes); ``contract.validate`` checks
everything a user can get wrong against it before any kernel runs, so the launchers assume valid
input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton

from rmsnorm_kernel import contract, kernels
from rmsnorm_kernel.contract import UnsupportedInput  # noqa: F401 - where callers have found it

Tensor = torch.Tensor

# What the kernels run: contract.py's dtypes and casting modes, under the names callers use.
SUPPORTED_DTYPES = contract.KERNEL_DTYPES
CASTING_MODES = contract.CASTING_CODES

# Widest row held in registers as one tile. Wider rows are walked twice (kernels.py describes the
# paths): the forward at any width, the backward up to TWO_WALK_MAX; wider backward rows are split
# into segments.
FORWARD_MAX_TILE = 4096
BACKWARD_MAX_TILE = 4096
TWO_WALK_MAX = 16384
# Chunk widths of the two-walk paths: forward up to TWO_WALK_MAX, forward beyond it, backward.
# Module constants, not Tuning fields: which kernel specialisation runs, and what the kernels'
# walks assume, follow from them (the unrolled wide forward holds at most four chunks of
# FORWARD_WIDE_BLOCK; backward_chunked gets 2 to 4 chunks of TWO_WALK_BACKWARD_CHUNK), and tests
# and the mutation equivalence arguments read them. The speed-only values: Tuning, below.
FORWARD_WALK_BLOCK = 8192
FORWARD_WIDE_BLOCK = 16384
TWO_WALK_BACKWARD_CHUNK = 4096


# ---------------------------------------------------------------------------------------------
# Kernel launch with a lean host path
# ---------------------------------------------------------------------------------------------


def _spec_key(tensors: tuple, pointers: list[int], scalars: tuple) -> tuple:
    """What Triton specialises a compiled kernel on: tensors on dtype and 16-byte alignment,
    ints on == 1, divisibility by 16 and width; floats not at all. A key made of these is at
    least as fine as Triton's own, so a cached kernel is never reused where Triton would compile
    a different one. ``pointers`` are the tensors' data pointers, read once per launch."""
    return (
        *[t.dtype for t in tensors],
        *[p % 16 == 0 for p in pointers],
        *[(a == 1, a % 16 == 0, -(2**31) <= a < 2**31) if type(a) is int else float for a in scalars],
    )


def _launch_key(device: int, num_warps: int, constexprs: tuple, tensors: tuple, pointers: list[int],
                scalars: tuple) -> tuple:  # fmt: skip
    """A launch's specialisation: the key of a Launcher's compiled kernels and of its refusals."""
    return (device, num_warps, constexprs, *_spec_key(tensors, pointers, scalars))


def _direct_launch(compiled) -> tuple | None:
    """(launch, function, packed metadata, cooperative, pdl) for calling a compiled kernel's C
    launcher directly, or None where this Triton's launcher needs more than that (a scratch
    buffer to allocate per launch, thread-block clusters, another backend): those launches go
    through ``compiled.run``. The direct call skips the Python wrapper around the C launcher, and
    the pointers it is handed as ints skip the launcher's per-tensor ``data_ptr`` call and
    pointer-attribute query (the tensors were validated as CUDA tensors on one device before)."""
    run = compiled.run
    launch = getattr(run, "launch", None)
    if (
        launch is None
        or getattr(run, "global_scratch_size", None) != 0
        or getattr(run, "profile_scratch_size", None) != 0
        or getattr(run, "num_ctas", 1) != 1
        or not hasattr(run, "launch_cooperative_grid")
        or not hasattr(run, "launch_pdl")
    ):
        return None
    return launch, compiled.function, compiled.packed_metadata, run.launch_cooperative_grid, run.launch_pdl


def _call_c_launcher(
    entry: tuple, grid, device: int, pointers: list[int], scalars: tuple, constexprs: tuple
) -> None:
    """Launch a compiled kernel's ``entry`` (from ``_direct_launch``, or its stand-in around
    ``compiled.run``) on the device's current stream. The C launcher takes every kernel
    parameter positionally, constexprs included; no scratch buffers, no launch metadata or hooks
    (those serve profilers)."""
    launch, function, metadata, cooperative, pdl = entry
    launch(*grid, torch._C._cuda_getCurrentRawStream(device), function, cooperative, pdl, None, None, metadata,
           None, None, None, *pointers, *scalars, *constexprs)  # fmt: skip


_data_ptr = Tensor.data_ptr
_dtype = operator.attrgetter("dtype")

# Launches and scratch buffers of the calls made inside ``record()``, for the compiled host path
# (host/), which replays them: None outside it.
_recorded: Recording | None = None


class Recording(NamedTuple):
    launches: list  # (launcher, specialisation key, grid, args, constexprs) per launch, in order
    scratch: list  # (tensor, zero-filled) per scratch buffer the launches may use


@contextlib.contextmanager
def record():
    """Records the launches (and scratch buffers) of the calls made inside it; every launch takes
    the specialisation-keyed path there, which remembers its compiled kernel."""
    global _recorded
    _recorded = Recording([], [])
    try:
        yield _recorded
    finally:
        _recorded = None


def _scratch(*shape: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> Tensor:
    """A scratch buffer of the backward's launches (zero-filled where ``zero``)."""
    t = (torch.zeros if zero else torch.empty)(*shape, dtype=dtype, device=device)
    if _recorded is not None:
        _recorded.scratch.append((t, zero))
    return t


# Raw-argument launches a Launcher remembers (one per distinct M, stride and so on, per
# specialisation) before it forgets them all and starts over.
SEEN_LAUNCHES = 4096


class CooperativeGridRefused(RuntimeError):
    """The driver cannot run every program of a cooperative grid at once (the compiled kernel's
    registers or shared memory leave too few programs per SM for the grid): the caller runs
    another path. Raised before any work is launched."""


class Launcher:
    """``launcher(grid, args, num_warps, constexprs)`` launches ``kernel`` like
    ``kernel[grid](*args, *constexprs, num_warps=num_warps)``: ``grid`` has three dims, ``args``
    holds the kernel's ``pointers`` tensor parameters and then its scalars (every kernel here
    declares them in that order), and ``constexprs`` holds the values of the kernel's constexpr
    parameters in their order (they come last), so a hot call builds no keyword dict.

    The first launch per specialisation goes through Triton (compiling if needed); later ones
    hand the arguments straight to the compiled kernel's C launcher on the current stream,
    skipping Triton's per-call argument binding, which costs more host time than the kernel
    takes on the GPU at small shapes. Under the interpreter every launch goes through Triton
    (which runs programs one after another, so a cooperative kernel must not be launched there).
    """

    def __init__(self, kernel, pointers: int, cooperative: bool = False) -> None:
        self.kernel = kernel
        self.pointers = pointers
        # A cooperative grid: the driver runs every program at once or refuses the launch (a
        # RuntimeError naming the cooperative launch), for kernels whose programs wait on others.
        self.options = {"launch_cooperative_grid": True} if cooperative else {}
        # Cooperative grids the driver refused: specialisation key -> the fewest programs refused.
        self.refused: dict[tuple, int] = {}
        self.compiled: dict[tuple, tuple] = {}
        self.kernels: dict[tuple, object] = {}  # the CompiledKernel behind each entry of ``compiled``
        # Launches by their raw arguments (the hot path of __call__): at most SEEN_LAUNCHES.
        self.seen: dict[tuple, tuple] = {}
        self.slow_launches = 0  # launches that went through Triton's own path (first per specialisation)
        self.direct_launches = 0  # specialisations launched through the C launcher directly

    def __call__(self, grid: tuple[int, int, int], args: tuple, num_warps: int, constexprs: tuple) -> None:
        if kernels.INTERPRET:
            self.kernel[grid](*args, *constexprs, num_warps=num_warps, **self.options)
            return
        tensors, scalars = args[: self.pointers], args[self.pointers :]
        try:
            pointers = list(map(_data_ptr, tensors))
        except TypeError:
            self._check_order(args)
            raise
        device = tensors[0].get_device()
        # The hot path: the same launch as an earlier one in everything but the tensors, whose
        # pointers are all 16-byte aligned (so their alignment is that of the earlier launch).
        # The key holds the raw scalars and their types rather than Triton's specialisation of
        # them, which takes longer to compute than the C launcher takes to run; a new value of
        # M costs one pass through _keyed_call. A cooperative launch's key holds its grid too:
        # the driver decides by the compiled kernel and the grid's size, so a grid it ran once it
        # runs again. Never while recording, nor with an unaligned pointer.
        fast_key = None
        if _recorded is None and not functools.reduce(operator.or_, pointers) & 15:
            fast_key = (device, num_warps, constexprs, *map(_dtype, tensors), *scalars, *map(type, scalars))
            if self.options:
                fast_key += grid
            entry = self.seen.get(fast_key)
            # torch.cuda.current_device() less its lazy-initialisation check (CUDA is initialised
            # once a CUDA tensor exists).
            if entry is not None and device == torch._C._cuda_getDevice():
                _call_c_launcher(entry, grid, device, pointers, scalars, constexprs)
                return
        self._keyed_call(grid, args, num_warps, constexprs, pointers, device, fast_key)

    def _keyed_call(self, grid, args, num_warps, constexprs, pointers, device, fast_key) -> None:
        """A launch by Triton's specialisation key: a launch on a device other than the current
        one, or the first with these scalars (and grid, if cooperative), or one with an unaligned
        pointer. ``fast_key``, where not None, is where the hot path will find it next time."""
        tensors, scalars = args[: self.pointers], args[self.pointers :]
        key = _launch_key(device, num_warps, constexprs, tensors, pointers, scalars)
        if self.refused and self._refused_before(key, grid):
            raise CooperativeGridRefused(f"{self.kernel.__name__}: grid {grid} refused before")
        if device != torch._C._cuda_getDevice():
            # Triton compiles for, and launches on, the current device; the tensors may be on
            # another one (a model spread over GPUs in one process).
            with torch.cuda.device(device):
                self._launch(key, grid, args, pointers, scalars, device, num_warps, constexprs)
            return
        self._launch(key, grid, args, pointers, scalars, device, num_warps, constexprs)
        if fast_key is not None:
            if len(self.seen) >= SEEN_LAUNCHES:
                self.seen.clear()
            self.seen[fast_key] = self.compiled[key]

    def _refused_before(self, key: tuple, grid: tuple[int, int, int]) -> bool:
        return grid[0] * grid[1] * grid[2] >= self.refused.get(key, math.inf)

    def refuses(self, grid: tuple[int, int, int], args: tuple, num_warps: int, constexprs: tuple) -> bool:
        """Whether launching ``args`` on ``grid`` would be refused without a launch: the driver
        refused this grid, or a smaller one, for the same specialisation before. Lets a caller
        skip what it would allocate for a launch that cannot run. A tensor that only stands in
        for the key needs the dtype and 16-byte alignment of the one the launch would get (an
        empty tensor's pointer is 0)."""
        if not self.refused:
            return False
        tensors, scalars = args[: self.pointers], args[self.pointers :]
        pointers = [t.data_ptr() for t in tensors]
        key = _launch_key(tensors[0].get_device(), num_warps, constexprs, tensors, pointers, scalars)
        return self._refused_before(key, grid)

    def _launch(self, key, grid, args, pointers, scalars, device, num_warps, constexprs) -> None:
        """The launch of ``__call__`` (with the key it computed), under the right current device.
        A cooperative grid the driver refuses is remembered per specialisation and raised as
        CooperativeGridRefused (nothing ran). Inside ``record()``, a launch that ran is recorded."""
        try:
            self._launch_or_compile(key, grid, args, pointers, scalars, device, num_warps, constexprs)
        except RuntimeError as exc:
            if not self.options or "cooperative" not in str(exc):
                raise
            programs = grid[0] * grid[1] * grid[2]
            self.refused[key] = min(programs, self.refused.get(key, programs))
            raise CooperativeGridRefused(f"{self.kernel.__name__}: {exc}") from exc
        if _recorded is not None:
            _recorded.launches.append((self, key, grid, args, constexprs))

    def _launch_or_compile(self, key, grid, args, pointers, scalars, device, num_warps, constexprs) -> None:
        entry = self.compiled.get(key)
        if entry is None:
            self._first_launch(key, grid, args, num_warps, constexprs)
            return
        _call_c_launcher(entry, grid, device, pointers, scalars, constexprs)

    def _check_order(self, args: tuple) -> None:
        if not all(isinstance(t, Tensor) for t in args[: self.pointers]) or any(
            isinstance(a, Tensor) for a in args[self.pointers :]
        ):
            raise RuntimeError(
                f"{self.kernel.__name__}: expected {self.pointers} tensors first, then scalars"
            )

    def _first_launch(self, key: tuple, grid, args: tuple, num_warps: int, constexprs: tuple) -> None:
        self._check_order(args)
        self.slow_launches += 1
        compiled = self.kernel[grid](*args, *constexprs, num_warps=num_warps, **self.options)
        self.kernels[key] = compiled
        entry = _direct_launch(compiled)
        if entry is None:  # through compiled.run: the C launcher's arguments less the four it fills in
            run = compiled.run

            def launch(gx, gy, gz, stream, function, _cooperative, _pdl, _scratch, _profile, metadata, *rest):
                run(gx, gy, gz, stream, function, metadata, *rest)

            entry = (launch, compiled.function, compiled.packed_metadata, None, None)
        else:
            self.direct_launches += 1
        self.compiled[key] = entry


# The second argument counts the kernel's leading tensor parameters.
_forward_tile = Launcher(kernels.forward_tile, 6)
_forward_looped = Launcher(kernels.forward_looped, 6)
_backward_tile = Launcher(kernels.backward_tile, 7)
_backward_chunked = Launcher(kernels.backward_chunked, 7)
_backward_wide_dot = Launcher(kernels.backward_wide_dot, 4)
_backward_wide = Launcher(kernels.backward_wide, 8)
_backward_wide_fused = Launcher(kernels.backward_wide_fused, 9, cooperative=True)
_reduce_columns = Launcher(kernels.reduce_columns, 2)


# ---------------------------------------------------------------------------------------------
# Launch configuration, cached per (N, element size, device)
# ---------------------------------------------------------------------------------------------


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of a tensor's device, cached per device (a tensor's CUDA device always carries its
    index). The interpreter on CPU gets 2: a few programs keep it quick."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def _next_power_of_2(v: int) -> int:
    """triton.next_power_of_2 for v >= 1, without its per-call overhead in the host path."""
    return 1 << (v - 1).bit_length()


class ForwardTile(NamedTuple):
    """A FORWARD_TILE entry."""

    rows: int  # rows per program
    warps: int
    few_rows: int  # rows per program with at most EVEN_MAX_ROWS rows, where a launch's latency is its time
    few_warps: int  # warps there


class BackwardTile(NamedTuple):
    """A BACKWARD_TILE entry."""

    rows: int  # rows per program
    warps: int
    per_sm: tuple[int, int]  # programs per SM, and with few rows
    prefetch: bool  # load the next row block before working on this one


# Batch invariance: a row's outputs do not depend on how many rows share the call, nor on where
# the row sits. On, every launch of the tile forward takes its many-row plan's rows and warps
# (the warps along a row fix the order of its sum of squares) and the correctly rounded r; the
# masks dropped at few rows (EVEN) change no value. Off (RMSNORM_KERNEL_BATCH_INVARIANT=0, read
# once at import), launches of at most EVEN_MAX_ROWS rows take FORWARD_TILE's few-row rows and
# warps and r by the hardware estimate and a Newton step (_rsqrt_newton), which can round a row
# differently. docs/features.md, Batch invariance.
BATCH_INVARIANT = os.environ.get("RMSNORM_KERNEL_BATCH_INVARIANT", "1").strip() != "0"


def _table(entries: dict) -> MappingProxyType:
    """A read-only launch table (a frozen Tuning holds no dict a caller could change under it)."""
    return MappingProxyType(entries)


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Tuning:
    """The launch tuning: values that change how fast the kernels run, never what they compute
    (within the limits each comment gives). ``TUNING`` is the measured default every launch
    function takes; a caller (tools/tune_sweep.py, tools/kernel_lab.py) passes another, made by
    ``dataclasses.replace(launch.TUNING, FIELD=value)``, as the ``tuning`` argument. Compared and
    hashed by identity: the cached plans key on the instance, which costs one pointer hash.
    Field names are those of docs/performance-notes.md's measurements and of the mutation
    config's skipped assignments. Measured: docs/performance-notes.md, the section each names."""

    # Two-walk forward up to TWO_WALK_MAX (one program per row): warps. (Two-walk forward)
    FORWARD_WALK_WARPS: int = 16
    # Two-walk forward beyond TWO_WALK_MAX: warps (y's stores hinted to leave L2 first).
    FORWARD_WIDE_WARPS: int = 32
    # Beyond TWO_WALK_MAX, rows of up to this many chunks walk unrolled (at most 4, the kernel's).
    FORWARD_WIDE_UNROLL: int = 4
    # Two-walk backward: (warps, programs per SM) by the row width rounded up to a power of two.
    TWO_WALK_BACKWARD: Mapping[int, tuple[int, int]] = dataclasses.field(
        default_factory=lambda: _table({8192: (8, 2), 16384: (16, 1)})
    )
    # Wide backward as two launches (backward_wide_dot, backward_wide): segment width (a power of 2).
    SEGMENT: int = 8192
    # Wide backward as two launches: warps of both.
    SEGMENT_WARPS: int = 8
    # Wide backward as two launches: programs per SM of backward_wide's grid.
    WIDE_PER_SM: int = 2
    # Wide backward as one cooperative launch (backward_wide_fused): segment width (a power of 2).
    FUSED_SEGMENT: int = 4096
    # Wide backward as one launch: warps.
    FUSED_WARPS: int = 4
    # Wide backward as one launch: programs per SM (a grid the driver refuses falls back to two).
    FUSED_PER_SM: int = 4
    # Wide backward: try the one cooperative launch where the driver can make its grid resident.
    WIDE_FUSED: bool = True
    # Wide backward as one launch: steps ahead of their use it posts its segment sums (any >= 0).
    WIDE_LOOKAHEAD: int = 1
    # Tile forward by BLOCK_N: rows per program and warps, many rows and few. (Tile tables)
    FORWARD_TILE: Mapping[int, ForwardTile] = dataclasses.field(
        default_factory=lambda: _table({
            128: ForwardTile(rows=16, warps=4, few_rows=8, few_warps=4),
            512: ForwardTile(rows=2, warps=1, few_rows=2, few_warps=4),
            1024: ForwardTile(rows=1, warps=1, few_rows=1, few_warps=4),
            2048: ForwardTile(rows=1, warps=4, few_rows=1, few_warps=4),
            4096: ForwardTile(rows=1, warps=2, few_rows=1, few_warps=8),
        })
    )  # fmt: skip
    # Launches of at most this many rows (N the tile width, one row per program) drop the masks.
    EVEN_MAX_ROWS: int = 256
    # Tile backward by BLOCK_N: rows, warps, programs per SM (and with few rows), prefetch.
    BACKWARD_TILE: Mapping[int, BackwardTile] = dataclasses.field(
        default_factory=lambda: _table({
            1024: BackwardTile(rows=2, warps=4, per_sm=(4, 4), prefetch=True),
            2048: BackwardTile(rows=1, warps=4, per_sm=(4, 4), prefetch=False),
            4096: BackwardTile(rows=1, warps=8, per_sm=(2, 1), prefetch=True),
        })
    )  # fmt: skip
    # "Few rows": fewer than this many row blocks per program, where a program's fixed cost wins.
    FEW_ROW_BLOCKS: int = 2
    # dw reduction: scratch rows summed per step. (dw reduction)
    REDUCE_ROWS: int = 32
    # dw reduction: a scratch of at least this many rows is tall (16-column strips, else N / 256).
    REDUCE_TALL: int = 128


# The measured tuning: every launch function's default, bound once at definition, as a last
# positional parameter (a keyword-only default costs the common call a dict lookup in CPython).
TUNING = Tuning()


class ForwardConfig(NamedTuple):
    block_n: int
    rows: int
    warps: int


class BackwardConfig(NamedTuple):
    block_n: int
    rows: int
    warps: int
    per_sm: tuple[int, int]
    prefetch: bool


@functools.cache
def forward_config(n: int, few_rows: bool = False, tuning: Tuning = TUNING) -> ForwardConfig:
    """BLOCK_N, rows per program and warps of the forward tile path (``few_rows``: at most
    EVEN_MAX_ROWS rows), by ``tuning``'s FORWARD_TILE."""
    block_n = triton.next_power_of_2(n)
    tile = tuning.FORWARD_TILE.get(block_n)
    if tile is None:  # narrow rows: about 1024 elements per program
        rows = max(1, 1024 // block_n)
        tile = ForwardTile(rows=rows, warps=4, few_rows=rows, few_warps=4)
    if few_rows:
        return ForwardConfig(block_n, tile.few_rows, tile.few_warps)
    return ForwardConfig(block_n, tile.rows, tile.warps)


@functools.cache
def backward_config(n: int, tuning: Tuning = TUNING) -> BackwardConfig:
    """BLOCK_N and ``tuning``'s BACKWARD_TILE entry of the backward tile path."""
    block_n = triton.next_power_of_2(n)
    tile = tuning.BACKWARD_TILE.get(block_n)
    if tile is None:
        tile = BackwardTile(rows=max(1, 1024 // block_n), warps=4, per_sm=(4, 4), prefetch=False)
    return BackwardConfig(block_n, *tile)


# Launch parameters of the tile and two-walk paths, built once per configuration and Tuning so
# that a call only looks them up (a plan unpacks like a tuple; ``constexprs`` is the kernel's
# constexpr parameters in order, a plain tuple). The wide backward reads its Tuning fields at
# every call.


class ForwardTilePlan(NamedTuple):
    rows: int  # rows per program
    num_warps: int
    constexprs: tuple


class ForwardLoopedPlan(NamedTuple):
    num_warps: int
    constexprs: tuple


class BackwardPlan(NamedTuple):
    """A persistent backward's plan: backward_tile's, or backward_chunked's (one row per step)."""

    rows: int  # rows per program step
    num_warps: int
    per_sm: tuple[int, int]  # programs per SM, and with few rows
    constexprs: tuple


class ReducePlan(NamedTuple):
    grid: tuple[int, int, int]
    num_warps: int
    constexprs: tuple


@functools.cache
def _forward_tile_plan(
    n: int,
    has_weight: bool,
    has_residual: bool,
    casting: int,
    few_rows: bool,
    store_rstd: bool,
    invariant: bool = True,
    tuning: Tuning = TUNING,
) -> ForwardTilePlan:
    """forward_tile's plan; ``few_rows``: at most EVEN_MAX_ROWS rows. ``invariant``
    (BATCH_INVARIANT): a row's values do not depend on few_rows, which then only drops masks."""
    tuned = few_rows and not invariant
    block_n, rows, num_warps = forward_config(n, tuned, tuning)
    even = few_rows and n == block_n and rows == 1
    constexprs = (has_weight, has_residual, casting, block_n, rows, even, store_rstd, tuned)
    return ForwardTilePlan(rows, num_warps, constexprs)


@functools.cache
def _forward_looped_plan(
    n: int,
    has_weight: bool,
    has_residual: bool,
    casting: int,
    contiguous: bool,
    has_offset: bool,
    store_rstd: bool,
    tuning: Tuning = TUNING,
) -> ForwardLoopedPlan:
    """forward_looped's plan; ``contiguous``: x's and the residual's rows are n apart,
    ``has_offset``: the weight offset is nonzero, ``store_rstd``: r is stored."""
    first_walk_policy, second_walk_policy = "evict_last", "evict_first"
    if n <= TWO_WALK_MAX:
        block_n, store_policy, unroll_walks = FORWARD_WALK_BLOCK, "", False
        num_warps = tuning.FORWARD_WALK_WARPS
    else:
        num_warps, block_n, store_policy = tuning.FORWARD_WIDE_WARPS, FORWARD_WIDE_BLOCK, "evict_first"
        unroll_walks = n <= tuning.FORWARD_WIDE_UNROLL * block_n
    constexprs = (has_weight, has_residual, casting, block_n, first_walk_policy, second_walk_policy,
                  store_policy, unroll_walks, n, contiguous, has_offset, store_rstd)  # fmt: skip
    return ForwardLoopedPlan(num_warps, constexprs)


@functools.cache
def _backward_tile_plan(
    n: int, has_weight: bool, has_dh: bool, compute_dw: bool, casting: int, tuning: Tuning = TUNING
) -> BackwardPlan:
    """backward_tile's plan."""
    block_n, rows, num_warps, per_sm, prefetch = backward_config(n, tuning)
    constexprs = (has_weight, has_dh, compute_dw, casting, block_n, rows, prefetch)
    return BackwardPlan(rows, num_warps, per_sm, constexprs)


@functools.cache
def _backward_chunked_plan(
    n: int, has_weight: bool, has_dh: bool, compute_dw: bool, casting: int, tuning: Tuning = TUNING
) -> BackwardPlan:
    """backward_chunked's plan: one row per program step."""
    chunk = TWO_WALK_BACKWARD_CHUNK
    chunks = (n + chunk - 1) // chunk
    num_warps, per_sm = tuning.TWO_WALK_BACKWARD[_next_power_of_2(n)]
    constexprs = (has_weight, has_dh, compute_dw, casting, chunk, chunks)
    return BackwardPlan(1, num_warps, (per_sm, per_sm), constexprs)


@functools.cache
def _reduce_plan(n: int, programs: int, tuning: Tuning = TUNING) -> ReducePlan:
    """reduce_columns' plan over a (programs, n) scratch. The dw reduction sums that fp32
    scratch, just written and read from L2, in column strips, REDUCE_ROWS scratch rows per step;
    its time is the latency of its steps, so the strips are narrow: 16 columns for a tall scratch
    (at least REDUCE_TALL rows), N / 256 for a short one. Measured: docs/performance-notes.md,
    dw reduction."""
    if programs >= tuning.REDUCE_TALL:
        block_c, num_warps = 16, (8 if programs >= 256 else 4)
    else:
        strip = 1 << max(0, (n // 256).bit_length() - 1)  # N / 256 rounded down to a power of two
        block_c, num_warps = min(256, max(16, strip)), 4
    block_c = min(block_c, _next_power_of_2(n))
    block_p = min(tuning.REDUCE_ROWS, _next_power_of_2(programs))
    return ReducePlan(((n + block_c - 1) // block_c, 1, 1), num_warps, (block_p, block_c))


def backward_programs(blocks: int, per_sm: tuple[int, int], sms: int, tuning: Tuning = TUNING) -> int:
    """Programs of a persistent backward over ``blocks`` row blocks: ``per_sm[0]`` per SM, or
    ``per_sm[1]`` per SM where each program would get fewer than FEW_ROW_BLOCKS blocks; never
    more programs than blocks."""
    programs = min(blocks, sms * per_sm[0])
    if blocks < tuning.FEW_ROW_BLOCKS * programs:
        programs = min(blocks, sms * per_sm[1])
    return programs


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
    shape: tuple[int, ...] | None = None,
    want_rstd: bool = True,
    tuning: Tuning = TUNING,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """x2, res2: (M, N) with unit row stride. Returns y, rstd (fp32) and h = x + residual (None
    without a residual): y and h of shape ``shape``, rstd of ``shape[:-1]``. ``shape`` (at least
    2-D, M * N elements) defaults to (M, N); a caller passes its input's shape to get outputs it
    needs no views of. Without ``want_rstd`` (no backward will follow) r is neither allocated
    nor stored, and rstd is None. ``tuning``: the launch tuning (default TUNING)."""
    m, n = x2.shape
    device = x2.device
    if shape is None:
        shape = (m, n)
    # Sizes go to torch.empty as separate ints: its parser takes them faster than a tuple.
    y = torch.empty(*shape, dtype=out_dtype, device=device)
    rstd = torch.empty(*shape[:-1], dtype=torch.float32, device=device) if want_rstd else None
    h = torch.empty(*shape, dtype=residual_dtype, device=device) if res2 is not None else None
    if m == 0:
        return y, rstd, h
    # Pointers a kernel does not use get any valid tensor; weight is 1-D. y and h are fresh and
    # contiguous: their row stride is n. Without want_rstd, y stands in for RSTD: a kernel that
    # stored r anyway would overwrite y (which the tests would see).
    w = weight if weight is not None else x2
    r_out = rstd if want_rstd else y
    stride_x = x2.stride(0)
    if res2 is None:
        r, hs, stride_r = x2, y, stride_x
    else:
        r, hs, stride_r = res2, h, res2.stride(0)
    if n <= FORWARD_MAX_TILE:
        rows, num_warps, constexprs = _forward_tile_plan(
            n, weight is not None, res2 is not None, casting, m <= tuning.EVEN_MAX_ROWS, want_rstd,
            BATCH_INVARIANT, tuning,
        )  # fmt: skip
        args = (x2, r, w, y, hs, r_out, m, n, stride_x, stride_r, n, n, eps, offset)
        _forward_tile(((m + rows - 1) // rows, 1, 1), args, num_warps, constexprs)
    else:  # one program per row, the row kept in L2 between the walks
        contiguous = stride_x == n and stride_r == n
        num_warps, constexprs = _forward_looped_plan(
            n, weight is not None, res2 is not None, casting, contiguous, offset != 0.0, want_rstd, tuning
        )
        args = (x2, r, w, y, hs, r_out, stride_x, stride_r, eps, offset)
        _forward_looped((m, 1, 1), args, num_warps, constexprs)
    return y, rstd, h


def _wide_grid(m: int, n: int, segment: int, per_sm: int, sms: int) -> tuple[int, int]:
    """(segments per row, row groups) of a wide-backward grid of ``per_sm`` programs per SM
    (fewer with few rows)."""
    segments = (n + segment - 1) // segment
    return segments, min(m, max(1, per_sm * sms // segments))


def _wide_fused(xh2, w, dy2, dh, rstd, dot, dx, partial, scalars, constexprs, num_warps: int) -> bool:
    """The wide backward as one cooperative launch of backward_wide_fused (``scalars``: M, N, row
    groups, the strides, the offset; ``constexprs`` in the kernel's order); False where the
    driver cannot make the grid resident, and the caller runs the two launches instead. The grid
    has FUSED_PER_SM programs per SM (fewer with few rows) of ``num_warps`` (FUSED_WARPS); four
    of 4 warps fit on an SM only
    where the kernel compiles to at most 128 registers per thread (which specialisations do:
    docs/performance-notes.md, Wide backward). The launcher remembers
    each refusal, so a refused grid costs one failed launch per specialisation, and a call whose
    grid is known to be refused allocates no arrival counters."""
    m, groups, segments = scalars[0], scalars[2], constexprs[5]
    grid = (groups, segments, 1)

    def args(posted):
        return (xh2, w, dy2, dh, rstd, dot, posted, dx, partial, *scalars)

    # An empty int32 tensor stands in for the counters in the specialisation key.
    if _backward_wide_fused.refused and _backward_wide_fused.refuses(
        grid, args(xh2.new_empty(0, dtype=torch.int32)), num_warps, constexprs
    ):
        return False
    posted = _scratch(m, dtype=torch.int32, device=xh2.device, zero=True)
    try:
        _backward_wide_fused(grid, args(posted), num_warps, constexprs)
    except CooperativeGridRefused:
        return False
    return True


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
    shape: tuple[int, ...] | None = None,
    tuning: Tuning = TUNING,
) -> tuple[Tensor, Tensor | None]:
    """Returns dx in dx_dtype, of shape ``shape`` (as in ``forward``; default (M, N)), and dw
    (N,) in the weight's dtype, None when not needed. ``tuning``: the launch tuning (default
    TUNING)."""
    m, n = xh2.shape
    device = xh2.device
    dx = torch.empty(*(shape if shape is not None else (m, n)), dtype=dx_dtype, device=device)
    compute_dw = need_dw and weight is not None
    dw = torch.empty(n, dtype=weight.dtype, device=device) if compute_dw else None
    if m == 0:
        if compute_dw:
            dw.zero_()
        return dx, dw
    w = weight if weight is not None else xh2
    stride_dy = dy2.stride(0)
    if dh2 is None:
        dh, stride_dh = dy2, stride_dy
    else:
        dh, stride_dh = dh2, dh2.stride(0)
    strides = (xh2.stride(0), stride_dy, stride_dh, n, offset)  # dx is fresh and contiguous
    # Without dw the kernels never touch their dw scratch pointer: it gets rstd (an fp32 tensor,
    # as the scratch would be) instead of an allocation.
    if n <= TWO_WALK_MAX:
        tile = n <= BACKWARD_MAX_TILE
        plan = _backward_tile_plan if tile else _backward_chunked_plan
        rows, num_warps, per_sm, constexprs = plan(
            n, weight is not None, dh2 is not None, compute_dw, casting, tuning
        )
        kernel = _backward_tile if tile else _backward_chunked
        programs = backward_programs((m + rows - 1) // rows, per_sm, sm_count(device), tuning)
        if not compute_dw:
            partial = rstd
        elif programs == 1:  # one program sums every row itself and writes the final dw
            partial = dw
        else:
            partial = _scratch(programs, n, dtype=torch.float32, device=device)
        args = (xh2, w, dy2, dh, rstd, dx, partial, m, n, programs, *strides)
        kernel((programs, 1, 1), args, num_warps, constexprs)
    else:
        sms = sm_count(device)
        segment, segment_warps = tuning.SEGMENT, tuning.SEGMENT_WARPS
        segments, programs = _wide_grid(m, n, segment, tuning.WIDE_PER_SM, sms)
        # One launch where it can (not under the interpreter, which runs programs one after
        # another), else two. One allocation of the sums and the dw scratch serves either.
        one_launch = tuning.WIDE_FUSED and not kernels.INTERPRET
        f_segment, f_per_sm, lookahead = tuning.FUSED_SEGMENT, tuning.FUSED_PER_SM, tuning.WIDE_LOOKAHEAD
        f_segments, f_programs = _wide_grid(m, n, f_segment, f_per_sm, sms) if one_launch else (0, 0)
        dot = _scratch(m * max(segments, f_segments), dtype=torch.float32, device=device)
        partial = (
            _scratch(max(programs, f_programs), n, dtype=torch.float32, device=device) if compute_dw else rstd
        )
        has_weight, has_dh = weight is not None, dh2 is not None
        ran_fused = False
        if one_launch:
            block_s, segments_pow2 = f_segment, _next_power_of_2(f_segments)
            fused = (has_weight, has_dh, compute_dw, casting, block_s, f_segments, segments_pow2, lookahead)
            f_dot = dot[: m * f_segments].view(m, f_segments)
            scalars = (m, n, f_programs, *strides)
            ran_fused = _wide_fused(
                xh2, w, dy2, dh, rstd, f_dot, dx, partial, scalars, fused, tuning.FUSED_WARPS
            )
        if ran_fused:
            programs = f_programs
        else:
            dot = dot[: m * segments].view(m, segments)
            args = (xh2, w, dy2, dot, n, strides[0], stride_dy, offset, segments)
            _backward_wide_dot((m, segments, 1), args, segment_warps, (has_weight, segment))
            block_s, segments_pow2 = segment, _next_power_of_2(segments)
            constexprs = (has_weight, has_dh, compute_dw, casting, block_s, segments_pow2)
            args = (xh2, w, dy2, dh, rstd, dot, dx, partial, m, n, programs, *strides, segments)
            _backward_wide((programs, segments, 1), args, segment_warps, constexprs)
    if compute_dw and partial is not dw:
        grid, num_warps, constexprs = _reduce_plan(n, programs, tuning)
        _reduce_columns(grid, (partial, dw, programs, n), num_warps, constexprs)
    return dx, dw


# ---------------------------------------------------------------------------------------------
# Per-head rows (QK-norm): the heads of q and k sliced out of a fused qkv tensor, read in place
# ---------------------------------------------------------------------------------------------

_heads_forward = Launcher(kernels.heads_forward, 8)
_heads_backward = Launcher(kernels.heads_backward, 12)


class HeadRows(NamedTuple):
    """A tensor of shape (..., H, N) with unit stride along its rows, read as M = T * H rows (T
    the leading dims flattened): row ``token * H + head`` at ``outer * stride_o + inner * stride_t
    + head * stride_h`` elements from the tensor's first element, token = outer * inner_tokens +
    inner (inner_tokens 1 where the leading dims flatten to one stride). The kernels take the
    tensor itself: no copy."""

    t: Tensor
    m: int
    heads: int
    stride_t: int
    stride_h: int
    inner_tokens: int
    stride_o: int


def _flat_stride(sizes, strides) -> int | None:
    """The one stride that steps through dims (sizes, strides) flattened in row-major order, or
    None where there is none; 0 where they hold at most one element."""
    stride, expected = 0, None
    for size, s in zip(reversed(tuple(sizes)), reversed(tuple(strides))):
        if size == 1:
            continue
        if expected is not None and s != expected:
            return None
        if expected is None:
            stride = s
        expected = s * size
    return stride


def _two_runs(sizes, strides) -> tuple[int, int, int] | None:
    """Dims (sizes, strides) as at most two runs that each flatten to one stride, the inner one
    ``inner`` elements long: (inner, outer stride, inner stride); with one run, (1, its stride,
    its stride). None where it takes three or more."""
    dims = [(size, s) for size, s in zip(sizes, strides) if size != 1]
    for split in range(len(dims) + 1):
        outer, inner = dims[:split], dims[split:]
        stride_o = _flat_stride([d[0] for d in outer], [d[1] for d in outer])
        stride_t = _flat_stride([d[0] for d in inner], [d[1] for d in inner])
        if stride_o is not None and stride_t is not None:
            if not outer:
                return 1, stride_t, stride_t
            return math.prod(d[0] for d in inner), stride_o, stride_t
    return None


def head_rows(t: Tensor, n: int) -> HeadRows | None:
    """``t`` (..., H, n) as HeadRows, or None where its rows are not at unit stride or its leading
    dims (all but the last two) do not flatten to two strides at most (_two_runs)."""
    if t.dim() == 0 or t.shape[-1] != n or (n > 1 and t.stride(-1) != 1):
        return None
    layout = _head_layout(t.shape, t.stride())
    return None if layout is None else HeadRows(t, *layout)


@functools.lru_cache(maxsize=256)
def _head_layout(shape: tuple, strides: tuple) -> tuple | None:
    """HeadRows' figures after ``t`` for a layout (a decode step meets the same few every call)."""
    heads, stride_h = (shape[-2], strides[-2]) if len(shape) >= 2 else (1, 0)
    runs = _two_runs(shape[:-2], strides[:-2])
    if runs is None:
        return None
    inner, stride_o, stride_t = runs
    return math.prod(shape[:-1]), heads, stride_t, stride_h, inner, stride_o


def strided_heads(t: Tensor, n: int) -> HeadRows | None:
    """HeadRows of ``t`` where as_rows would copy it (no single row stride reaches its rows) and
    head_rows reads it in place; None otherwise (as_rows serves, or both copy)."""
    if t.dim() < 3 or t.stride(-1) != 1 or _flat_stride(t.shape[:-1], t.stride()[:-1]) is not None:
        return None
    return head_rows(t, n)


def head_rows_or_copy(t: Tensor, n: int) -> HeadRows:
    """head_rows of ``t``, or of a contiguous copy where its layout has none."""
    rows = head_rows(t, n)
    return rows if rows is not None else head_rows(t.contiguous(), n)


def _weight_head_stride(w: Tensor | None) -> tuple[bool, int]:
    """(per head, head stride) of a group's weight: (N,) contiguous is shared by every row, (H, N)
    with unit stride along N has a row per head."""
    if w is None or w.dim() == 1:
        return False, 0
    return True, w.stride(0)


def forward_heads(
    groups: list, eps: float, offset: float, casting: int, want_rstd: bool = True, tuning: Tuning = TUNING
) -> list:
    """One launch of heads_forward over one or two ``(HeadRows, weight, out_dtype, shape)``
    groups (rows of one width N <= FORWARD_MAX_TILE; the weights all given or all None, each (N,)
    contiguous or (H, N) with unit stride along N, H the rows' heads). Returns ``(y, rstd)`` per
    group: y contiguous of ``shape``, rstd fp32 of ``shape[:-1]`` (None without ``want_rstd``)."""
    outs = []
    for rows, _w, out_dtype, shape in groups:
        device = rows.t.device
        y = torch.empty(*shape, dtype=out_dtype, device=device)
        # (a tuple of sizes: 1-D rows have rstd of shape ())
        rstd = torch.empty(shape[:-1], dtype=torch.float32, device=device) if want_rstd else None
        outs.append((y, rstd))
    live = [(g, o) for g, o in zip(groups, outs) if g[0].m > 0]
    if not live:
        return outs
    n = live[0][0][0].t.shape[-1]
    block_n, rows_per, num_warps = forward_config(n, False, tuning)
    has_weight = live[0][0][1] is not None
    tensors, scalars, blocks, per_head = [], [], [], [False, False]
    for i, ((rows, w, _dtype, _shape), (y, rstd)) in enumerate(live):
        per_head[i], stride_w = _weight_head_stride(w)
        tensors += [rows.t, w if w is not None else rows.t, y, rstd if rstd is not None else y]
        scalars += [
            rows.m,
            rows.heads,
            rows.inner_tokens,
            rows.stride_o,
            rows.stride_t,
            rows.stride_h,
            stride_w,
        ]
        blocks.append((rows.m + rows_per - 1) // rows_per)
    two = len(live) == 2
    if not two:  # tensor 1's parameters get tensor 0's (unused)
        tensors += tensors[:4]
        scalars += [0, 1, 1, 0, 0, 0, 0]
    args = (*tensors, *scalars, blocks[0], n, eps, offset)
    constexprs = (has_weight, *per_head, casting, block_n, rows_per, want_rstd, two)
    _heads_forward((sum(blocks), 1, 1), args, num_warps, constexprs)
    return outs


def backward_heads(groups: list, offset: float, casting: int, tuning: Tuning = TUNING) -> list:
    """One launch of heads_backward over one or two ``(x HeadRows, dy HeadRows, weight, rstd,
    dx_dtype, need_dw, shape)`` groups (rstd contiguous, as forward_heads returns it; weights as
    there), then the dw reductions. Returns ``(dx, dw)`` per group: dx contiguous of ``shape``;
    dw of the weight's shape ((N,) or (H, N): a sum over tokens per head) and dtype, None without
    need_dw or a weight."""
    outs, live = [], []
    compute_dw = any(need and w is not None for _x, _dy, w, _r, _dt, need, _s in groups)
    n = groups[0][0].t.shape[-1]
    block_n, rows_per, num_warps, per_sm, _prefetch = backward_config(n, tuning)
    for group in groups:
        x, dy, w, rstd, dx_dtype, need_dw, shape = group
        device = x.t.device
        dx = torch.empty(*shape, dtype=dx_dtype, device=device)
        per_head, _stride_w = _weight_head_stride(w)
        dw = torch.empty(w.shape, dtype=w.dtype, device=device) if compute_dw and w is not None else None
        outs.append((dx, dw))
        if x.m == 0:
            if dw is not None:
                dw.zero_()
            continue
        if per_head:  # programs per head: dw's reduction must not sum across heads
            blocks = (x.m // x.heads + rows_per - 1) // rows_per  # each head's row blocks
            per = backward_programs(blocks * x.heads, per_sm, sm_count(device), tuning) // x.heads
            programs = x.heads * min(blocks, max(1, per))
        else:
            programs = backward_programs((x.m + rows_per - 1) // rows_per, per_sm, sm_count(device), tuning)
        if not compute_dw:
            partial = rstd
        elif programs == (x.heads if per_head else 1):  # one program per dw row: it writes the final dw
            partial = dw
        else:
            partial = _scratch(programs, n, dtype=torch.float32, device=device)
        live.append((group, dx, dw, programs, partial))
    if not live:
        return [(dx, dw if need else None) for (dx, dw), (*_, need, _s) in zip(outs, groups)]
    tensors, x_scalars, programs, per_head = [], [], [], [False, False]
    for i, ((x, dy, w, rstd, *_), dx, _dw, progs, partial) in enumerate(live):
        per_head[i], stride_w = _weight_head_stride(w)
        tensors += [x.t, w if w is not None else x.t, dy.t, rstd, dx, partial]
        x_scalars += [x.m, x.heads, x.inner_tokens, x.stride_o, x.stride_t, x.stride_h, dy.inner_tokens, dy.stride_o,
                      dy.stride_t, dy.stride_h, stride_w]  # fmt: skip
        programs.append(progs)
    two = len(live) == 2
    if not two:
        tensors += tensors[:6]
        x_scalars += [0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0]
        programs.append(0)
    has_weight = live[0][0][2] is not None
    args = (*tensors, *x_scalars, *programs, n, offset)
    constexprs = (has_weight, *per_head, compute_dw, casting, block_n, rows_per, two)
    _heads_backward((programs[0] + programs[1], 1, 1), args, num_warps, constexprs)
    for _group, _dx, dw, progs, partial in live:
        if dw is not None and partial is not dw:
            # per head: the scratch (programs / H, H * N), row p its (p // H, p % H) entry
            width = dw.numel()
            grid, warps, reduce_constexprs = _reduce_plan(width, progs * n // width, tuning)
            _reduce_columns(grid, (partial, dw, progs * n // width, width), warps, reduce_constexprs)
    return [(dx, dw if need else None) for (dx, dw), (*_, need, _s) in zip(outs, groups)]
