"""The launcher's cache of compiled kernels, on any machine: a fake kernel stands in for Triton,
so these check which path a launch takes and what reaches the C launcher, not numerics (the
kernel tests check those on CUDA, where every launch after the first per specialisation takes
the direct path)."""

import contextlib
import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

import rmsnorm_kernel
from rmsnorm_kernel import kernels, launch

from ..conftest import requires_cuda


class FakeKernel:
    """``kernel[grid](*args, num_warps=...)`` as Triton's: records the launch and returns a
    compiled kernel whose C launcher and ``run`` record theirs."""

    __name__ = "fake_kernel"

    def __init__(self, scratch: int = 0, launch_error=None):
        self.scratch = scratch
        self.launch_error = launch_error  # grid -> an exception Triton's launch raises, or None
        self.triton_launches = []
        self.cooperative = []  # launch_cooperative_grid of each of Triton's launches
        self.direct = []
        self.run_calls = []

    def __getitem__(self, grid):
        def call(*args, num_warps, launch_cooperative_grid=False):
            self.cooperative.append(launch_cooperative_grid)
            error = self.launch_error(grid) if self.launch_error else None
            if error is not None:
                raise error
            self.triton_launches.append((grid, args, num_warps))
            run = SimpleNamespace(
                launch=lambda *a: self.direct.append(a),
                global_scratch_size=self.scratch,
                profile_scratch_size=0,
                num_ctas=1,
                launch_cooperative_grid=False,
                launch_pdl=False,
            )
            run_fn = lambda *a: self.run_calls.append(a)  # noqa: E731
            compiled = SimpleNamespace(function=77, packed_metadata=(4, 1, 0), run=run)
            if self.scratch:
                compiled.run = _Callable(run_fn, vars(run))
            return compiled

        return call


class _Callable:
    """A launcher object that is callable (compiled.run) and carries the attributes above."""

    def __init__(self, fn, attrs):
        self._fn = fn
        self.__dict__.update(attrs)

    def __call__(self, *a):
        self._fn(*a)


@pytest.fixture
def compiled_mode(monkeypatch):
    """As on CUDA: not the interpreter, a fixed current stream, and the tensors' device (CPU
    tensors report -1) as the current one."""
    monkeypatch.setattr(kernels, "INTERPRET", False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)


def test_second_launch_goes_straight_to_the_c_launcher(compiled_mode):
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 2)
    x, y = torch.ones(32), torch.zeros(32)
    launcher((3, 1, 1), (x, y, 32, 1e-6), 4, (True, 128))
    assert len(kernel.triton_launches) == 1 and not kernel.direct
    launcher((3, 1, 1), (x, y, 32, 1e-6), 4, (True, 128))
    assert len(kernel.triton_launches) == 1
    assert kernel.direct == [
        (3, 1, 1, 1234, 77, False, False, None, None, (4, 1, 0), None, None, None)
        + (x.data_ptr(), y.data_ptr(), 32, 1e-6, True, 128)
    ]
    assert (launcher.slow_launches, launcher.direct_launches) == (1, 1)


def _count_keyed_calls(monkeypatch, launcher):
    """The launches that missed the hot path (went through Launcher._keyed_call), as a list."""
    keyed = []
    original = launcher._keyed_call

    def counting(*args):
        keyed.append(args[1][launcher.pointers :])  # the launch's scalars
        return original(*args)

    monkeypatch.setattr(launcher, "_keyed_call", counting)
    return keyed


def test_a_repeated_launch_takes_the_hot_path(compiled_mode, monkeypatch):
    """The second launch with the same scalars, dtypes and aligned pointers, even with other
    tensors, skips the specialisation key: it goes from the raw-argument cache to the C launcher."""
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 2)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    x, y = torch.ones(32), torch.zeros(32)
    launcher((3, 1, 1), (x, y, 32, 1e-6), 4, (True, 128))
    x2, y2 = torch.ones(32), torch.zeros(32)  # other tensors, same dtypes (fresh: aligned)
    launcher((3, 1, 1), (x2, y2, 32, 1e-6), 4, (True, 128))
    assert keyed == [(32, 1e-6)] and len(kernel.triton_launches) == 1
    assert kernel.direct[-1][-6:] == (x2.data_ptr(), y2.data_ptr(), 32, 1e-6, True, 128)


def test_a_new_m_misses_the_hot_path_once_and_reuses_the_compiled_kernel(compiled_mode, monkeypatch):
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 1)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    x = torch.ones(64)
    for m in (2, 3, 3, 2, 3):  # 2 and 3 share Triton's specialisation (not 1, not divisible by 16)
        launcher((m, 1, 1), (x, m), 4, ())
    assert keyed == [(2,), (3,)] and len(kernel.triton_launches) == 1 and len(kernel.direct) == 4


def test_an_int_and_an_equal_float_do_not_share_a_hot_entry(compiled_mode, monkeypatch):
    """2 == 2.0 and both hash alike, but Triton compiles an int parameter and a float one
    differently: the hot key holds the scalars' types."""
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 1)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    x = torch.ones(64)
    for value in (2, 2.0, 2, 2.0):
        launcher((1, 1, 1), (x, value), 4, ())
    assert len(keyed) == 2 and len(kernel.triton_launches) == 2
    assert [type(a[-1]) for a in kernel.direct] == [int, float]


def test_an_unaligned_pointer_never_takes_the_hot_path(compiled_mode, monkeypatch):
    """Alignment is part of Triton's specialisation: a launch with a pointer off 16 bytes is
    keyed every time (and one with aligned pointers after it still gets the aligned kernel)."""
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 1)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    base = torch.zeros(64)
    for x in (base[1:33], base[1:33], base[:32], base[:32], base[1:33]):
        launcher((1, 1, 1), (x, 32), 4, ())
    assert len(keyed) == 4 and len(kernel.triton_launches) == 2 and len(launcher.seen) == 1


def test_cooperative_launch_takes_the_hot_path_only_for_a_grid_that_ran(compiled_mode, monkeypatch):
    """A cooperative grid can be refused for its size, which the raw scalars do not decide: the
    hot path's key holds the grid, and only a grid the driver ran gets there."""
    kernel = FakeKernel(launch_error=_refuse_above_four)
    launcher = launch.Launcher(kernel, 1, cooperative=True)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    x = torch.ones(8)
    with pytest.raises(launch.CooperativeGridRefused):
        launcher((5, 1, 1), (x, 8), 4, ())
    for _ in range(3):
        launcher((2, 1, 1), (x, 8), 4, ())
    assert len(keyed) == 2 and len(launcher.seen) == 1 and len(kernel.direct) == 2
    launcher((3, 1, 1), (x, 8), 4, ())  # the same scalars, another grid: keyed again
    assert len(keyed) == 3 and len(launcher.seen) == 2
    with pytest.raises(launch.CooperativeGridRefused):  # the refused grid never reaches the hot path
        launcher((5, 1, 1), (x, 8), 4, ())
    assert len(keyed) == 4 and len(launcher.seen) == 2


def test_the_hot_cache_is_bounded(compiled_mode, monkeypatch):
    monkeypatch.setattr(launch, "SEEN_LAUNCHES", 3)
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 1)
    x = torch.ones(8)
    sizes = []
    for m in range(2, 12):
        launcher((1, 1, 1), (x, m), 4, ())
        sizes.append(len(launcher.seen))
    assert max(sizes) == 3 and sizes[-1] <= 3


@pytest.mark.parametrize("current", [0, 2], ids=["current-below", "current-above"])
def test_the_hot_path_launches_on_the_current_device_only(compiled_mode, monkeypatch, current):
    """Tensors on a device that is not current take the keyed path, under a device guard, on
    either side of the current device's index (a model spread over GPUs in one process): a
    launch cached while their device was current is not replayed on another one."""
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 1)  # the tensors are on device 1
    launcher = launch.Launcher(FakeKernel(), 1)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    x = torch.ones(8)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    launcher((1, 1, 1), (x, 8), 4, ())  # their device is current: the launch enters the hot cache
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    launcher((1, 1, 1), (x, 8), 4, ())
    assert len(keyed) == 2


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("aligned", "misaligned"),  # a pointer off 16-byte alignment compiles its own kernel
        ("m=2", "m=1"),  # an int equal to 1 becomes a constant
        ("m=2", "m=16"),  # an int divisible by 16
        ("m=2", "m=2**31+2"),  # an int past int32 (Triton passes it as int64)
        ("float32", "float16"),  # a tensor's dtype
        ("warps4", "warps8"),
    ],
)
def test_each_specialisation_compiles_its_own_kernel(compiled_mode, first, second):
    def args(variant):
        base = torch.zeros(64, dtype=torch.float16 if variant == "float16" else torch.float32)
        x = base[1:33] if variant == "misaligned" else base[:32]
        m = {"m=1": 1, "m=16": 16, "m=2**31+2": 2**31 + 2}.get(variant, 2)
        return (x, torch.zeros(32), m, 1e-6), 8 if variant == "warps8" else 4

    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 2)
    for variant in (first, second, first, second):
        a, warps = args(variant)
        launcher((1, 1, 1), a, warps, ())
    assert len(kernel.triton_launches) == 2 and len(kernel.direct) == 2


def test_tensors_on_another_device_launch_under_that_device(compiled_mode, monkeypatch):
    """Triton launches on the current device: where the tensors are elsewhere, the launch runs
    with their device made current (and the previous one restored after)."""
    entered = []

    class Guard:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(("enter", self.device))

        def __exit__(self, *exc):
            entered.append(("exit", self.device))

    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # the tensors report -1
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 1)
    x = torch.ones(8)
    for _ in range(2):
        launcher((1, 1, 1), (x, 8), 4, ())
    assert entered == [("enter", -1), ("exit", -1)] * 2
    assert len(kernel.triton_launches) == 1 and len(kernel.direct) == 1


def test_launcher_needing_scratch_goes_through_run(compiled_mode):
    kernel = FakeKernel(scratch=64)
    launcher = launch.Launcher(kernel, 1)
    x = torch.ones(16)
    for _ in range(2):
        launcher((2, 1, 1), (x, 16), 4, (8,))
    assert not kernel.direct and launcher.direct_launches == 0
    assert kernel.run_calls == [(2, 1, 1, 1234, 77, (4, 1, 0), None, None, None, x.data_ptr(), 16, 8)]


def test_arguments_out_of_order_are_a_clear_error(compiled_mode):
    launcher = launch.Launcher(FakeKernel(), 2)
    with pytest.raises(RuntimeError, match="fake_kernel: expected 2 tensors first"):
        launcher((1, 1, 1), (torch.ones(4), 4, torch.ones(4)), 4, ())


def test_cooperative_launcher_asks_triton_for_a_cooperative_grid(compiled_mode):
    cooperative, plain = FakeKernel(), FakeKernel()
    x = torch.ones(8)
    launch.Launcher(cooperative, 1, cooperative=True)((1, 1, 1), (x, 8), 4, ())
    launch.Launcher(plain, 1)((1, 1, 1), (x, 8), 4, ())
    assert (cooperative.cooperative, plain.cooperative) == ([True], [False])


def _refuse_above_four(grid):
    if grid[0] * grid[1] > 4:
        return RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")
    return None


def test_refused_cooperative_grid_is_remembered_per_specialisation(compiled_mode):
    """The driver refuses a cooperative grid it cannot make resident (a RuntimeError naming the
    cooperative launch): the launcher raises CooperativeGridRefused, and later grids of that
    size or larger for the same specialisation are refused without a launch; smaller ones, or
    another specialisation, are tried."""
    kernel = FakeKernel(launch_error=_refuse_above_four)
    launcher = launch.Launcher(kernel, 1, cooperative=True)
    x = torch.ones(8)
    for grid in [(3, 2, 1), (4, 2, 1), (6, 1, 1)]:
        with pytest.raises(launch.CooperativeGridRefused):
            launcher(grid, (x, 8), 4, ())
    assert len(kernel.cooperative) == 1  # the equal and larger grids were not launched again
    launcher((2, 2, 1), (x, 8), 4, ())  # smaller: launched
    assert [g for g, _, _ in kernel.triton_launches] == [(2, 2, 1)]
    with pytest.raises(launch.CooperativeGridRefused):
        launcher((3, 2, 1), (x, 8), 8, ())  # another specialisation (8 warps): tried again
    assert len(kernel.cooperative) == 3


def test_refuses_answers_for_a_grid_without_launching(compiled_mode):
    """Launcher.refuses says whether a launch would be refused without one, from the
    specialisation of its arguments: a stand-in tensor of the same dtype and alignment gives
    the launch's own answer."""
    kernel = FakeKernel(launch_error=_refuse_above_four)
    launcher = launch.Launcher(kernel, 2, cooperative=True)
    x, counters = torch.ones(8), torch.zeros(8, dtype=torch.int32)
    stand_in = torch.empty(0, dtype=torch.int32)
    assert not launcher.refuses((6, 1, 1), (x, stand_in, 8), 4, ())  # nothing refused yet
    with pytest.raises(launch.CooperativeGridRefused):
        launcher((6, 1, 1), (x, counters, 8), 4, ())
    assert launcher.refuses((6, 1, 1), (x, stand_in, 8), 4, ())
    assert launcher.refuses((7, 1, 1), (x, stand_in, 8), 4, ())
    assert not launcher.refuses((5, 1, 1), (x, stand_in, 8), 4, ())  # smaller: may fit
    assert not launcher.refuses((6, 1, 1), (x, x, 8), 4, ())  # another dtype: another kernel
    assert not launcher.refuses((6, 1, 1), (x, stand_in, 8), 8, ())  # another warp count
    assert len(kernel.cooperative) == 1


def test_other_launch_errors_are_not_taken_for_a_refusal(compiled_mode):
    kernel = FakeKernel(launch_error=lambda grid: RuntimeError("out of resources"))
    launcher = launch.Launcher(kernel, 1, cooperative=True)
    with pytest.raises(RuntimeError, match="out of resources") as info:
        launcher((1, 1, 1), (torch.ones(8), 8), 4, ())
    assert not isinstance(info.value, launch.CooperativeGridRefused) and not launcher.refused


class _Recorder:
    """Stands in for a module-level launcher: records each launch, or raises ``error``."""

    def __init__(self, name, log, error=None):
        self.name, self.log, self.error = name, log, error
        self.refused = {}  # as a Launcher's: nothing refused yet

    def __call__(self, grid, args, num_warps, constexprs):
        self.log.append(self.name)
        self.last = (grid, args, num_warps, constexprs)
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize(
    ("layout", "offset", "contiguous", "has_offset"),
    [
        ("contiguous", 0.0, True, False),
        ("contiguous", 1.0, True, True),
        ("strided x", 0.0, False, False),
        ("strided residual", 0.0, False, False),
        ("strided x, contiguous residual", 0.0, False, False),  # rows N apart in one of the two only
        ("contiguous residual", 0.5, True, True),
        ("broadcast residual", 0.0, False, False),  # one residual row for every row: stride 0
    ],
)
def test_walked_forward_knows_contiguous_rows_and_a_nonzero_offset(
    compiled_mode, monkeypatch, layout, offset, contiguous, has_offset
):
    """forward_looped takes N as the row stride only where x's (and the residual's) rows are N
    apart, and adds the offset only where it is nonzero: the launcher says which, and still
    passes the runtime strides."""
    log = []
    monkeypatch.setattr(launch, "_forward_looped", _Recorder("looped", log))
    n = 9000
    base = torch.randn(6, n + 8)
    x = base[::2, :n] if layout.startswith("strided x") else base[:3, :n].contiguous()
    res = {
        "strided residual": base[:3, 8:],
        "strided x, contiguous residual": base[3:, :n].contiguous(),
        "contiguous residual": base[3:, :n].contiguous(),
        "broadcast residual": base[:1, :n].expand(3, n),
    }.get(layout)
    launch.forward(x, torch.randn(n), res, 1e-6, offset, 0, torch.float32, torch.float32)
    grid, args, _, constexprs = launch._forward_looped.last
    assert log == ["looped"] and grid == (3, 1, 1)
    assert constexprs[8:] == (n, contiguous, has_offset, True)  # N, CONTIGUOUS, HAS_OFFSET, STORE_RSTD
    assert args[6:8] == (x.stride(0), res.stride(0) if res is not None else x.stride(0))


# (M, N, EVEN): the tile forward drops its masks only for launches of few rows (at most
# EVEN_MAX_ROWS), with N the tile width and one row per program.
TILE_FORWARD_EVEN = [
    (1, 4096, True),
    (256, 4096, True),
    (257, 4096, False),  # more rows: masked (faster at large M)
    (17, 2048, True),
    (17, 1024, True),
    (17, 512, False),  # two rows per program
    (17, 4000, False),  # N short of the tile width
    (1, 257, False),
]


@pytest.mark.parametrize(("m", "n", "even"), TILE_FORWARD_EVEN)
def test_tile_forward_drops_masks_only_for_few_full_rows(compiled_mode, monkeypatch, m, n, even):
    monkeypatch.setattr(launch, "_forward_tile", _Recorder("tile", []))
    launch.forward(torch.randn(m, n), torch.randn(n), None, 1e-6, 0.0, 0, torch.float32, torch.float32)
    grid, _, _, constexprs = launch._forward_tile.last
    named = _tile_constexprs(constexprs)
    assert named["EVEN"] is even and (named["ROWS"] == 1 or not even)


def _tile_constexprs(constexprs: tuple) -> dict:
    """forward_tile's constexpr values by name (they are its last parameters)."""
    params = list(inspect.signature(kernels.forward_tile.fn).parameters)
    names = ["HAS_WEIGHT", "HAS_RESIDUAL", "CASTING", "BLOCK_N", "ROWS", "EVEN", "STORE_RSTD", "NEWTON_R"]
    assert params[-len(names) :] == names and len(constexprs) == len(names)
    return dict(zip(names, constexprs))


@pytest.mark.parametrize(
    ("m", "newton"),
    [(1, True), (launch.TUNING.EVEN_MAX_ROWS, True), (launch.TUNING.EVEN_MAX_ROWS + 1, False)],
)
def test_tile_forward_takes_the_newton_r_only_for_few_rows(compiled_mode, monkeypatch, m, newton):
    """With batch invariance off, launches of at most EVEN_MAX_ROWS rows compute r by the hardware
    estimate and a Newton step (shorter where a launch is one memory round trip); more rows keep
    the correctly rounded sqrt and division (the Newton step measured slower at 4096x4096)."""
    monkeypatch.setattr(launch, "_forward_tile", _Recorder("tile", []))
    monkeypatch.setattr(launch, "BATCH_INVARIANT", False)
    launch.forward(torch.randn(m, 257), torch.randn(257), None, 1e-6, 0.0, 0, torch.float32, torch.float32)
    assert _tile_constexprs(launch._forward_tile.last[3])["NEWTON_R"] is newton


@pytest.mark.parametrize("m", [1, 7, launch.TUNING.EVEN_MAX_ROWS, launch.TUNING.EVEN_MAX_ROWS + 1, 4096])
@pytest.mark.parametrize("n", [128, 257, 1024, 4096])
def test_batch_invariant_tile_forward_launches_one_plan(compiled_mode, monkeypatch, m, n):
    """Batch invariance (the default): every M launches the tile forward with the same rows per
    program, warps and r (no Newton step); only the masks (EVEN) may be dropped at few rows."""
    assert launch.BATCH_INVARIANT
    monkeypatch.setattr(launch, "_forward_tile", _Recorder("tile", []))
    launch.forward(torch.randn(m, n), torch.randn(n), None, 1e-6, 0.0, 0, torch.float32, torch.float32)
    _, _, num_warps, constexprs = launch._forward_tile.last
    named = _tile_constexprs(constexprs)
    _, rows, warps = launch.forward_config(n)
    assert named["NEWTON_R"] is False and (named["ROWS"], num_warps) == (rows, warps)


@pytest.mark.parametrize("want_rstd", [True, False])
@pytest.mark.parametrize(
    ("n", "launcher", "params"), [(1024, "_forward_tile", 8), (9000, "_forward_looped", 12)]
)
def test_forward_stores_rstd_only_when_asked(compiled_mode, monkeypatch, want_rstd, n, launcher, params):
    """Without want_rstd no r is allocated or returned, and both forward kernels are told not to
    store it (STORE_RSTD); y stands in for the unused pointer."""
    monkeypatch.setattr(launch, launcher, _Recorder(launcher, []))
    y, rstd, _ = launch.forward(
        torch.randn(3, n),
        torch.randn(n),
        None,
        1e-6,
        0.0,
        0,
        torch.float32,
        torch.float32,
        want_rstd=want_rstd,
    )
    _, args, _, constexprs = getattr(launch, launcher).last
    kernel = kernels.forward_tile if launcher == "_forward_tile" else kernels.forward_looped
    names = list(inspect.signature(kernel.fn).parameters)[-params:]
    assert len(constexprs) == params and dict(zip(names, constexprs))["STORE_RSTD"] is want_rstd
    if want_rstd:
        assert rstd is not None and rstd.shape == (3,) and args[5] is rstd
    else:
        assert rstd is None and args[5] is y


def _wide_backward_with_stand_ins(monkeypatch, fused_error=None, fused=None, calls=1):
    """launch.backward, ``calls`` times, over 5 rows of N = 20000 (wider than TWO_WALK_MAX: the
    wide backward) with the two-launch kernels and the dw reduction replaced by _Recorders, and
    the one launch by ``fused`` (default: a _Recorder raising ``fused_error``). Returns (launch
    log, x, w, dy, dx, dw) of the last call."""
    log = []
    monkeypatch.setattr(launch, "_backward_wide_fused", fused or _Recorder("fused", log, fused_error))
    for name in ("_backward_wide_dot", "_backward_wide", "_reduce_columns"):
        monkeypatch.setattr(launch, name, _Recorder(name, log))
    m, n = 5, 20000
    x, dy, w, rstd = torch.randn(m, n), torch.randn(m, n), torch.randn(n), torch.ones(m)
    for _ in range(calls):
        dx, dw = launch.backward(dy, None, x, w, rstd, 0.0, 0, True, torch.float32)
    return log, x, w, dy, dx, dw


def test_wide_backward_one_launch_reduces_the_row_groups_it_ran(compiled_mode, monkeypatch):
    """Where the one launch runs, the two-launch kernels are not called and dw's reduction sums
    the one launch's row groups (its grid differs from the two launches')."""
    log, *_ = _wide_backward_with_stand_ins(monkeypatch)
    assert log == ["fused", "_reduce_columns"]
    groups = launch._backward_wide_fused.last[0][0]
    partial = launch._backward_wide_fused.last[1][8]
    assert launch._reduce_columns.last[1][0] is partial and launch._reduce_columns.last[1][2] == groups


def test_a_known_refusal_allocates_no_counters(compiled_mode, monkeypatch):
    """Once the driver has refused the one launch's grid, later calls of that specialisation go
    straight to the two launches: no second cooperative attempt, and no arrival counters
    allocated and zeroed for it."""
    refuse = lambda grid: RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")  # noqa: E731
    fused = FakeKernel(launch_error=refuse)
    zeros = []
    real_zeros = torch.zeros

    def counting_zeros(*args, **kwargs):
        zeros.append(kwargs.get("dtype"))
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", counting_zeros)
    launcher = launch.Launcher(fused, 9, cooperative=True)
    log, *_ = _wide_backward_with_stand_ins(monkeypatch, fused=launcher, calls=3)
    assert len(fused.cooperative) == 1, "the refused grid is tried once"
    assert zeros.count(torch.int32) == 1, "counters only for the launch that was tried"
    assert log == ["_backward_wide_dot", "_backward_wide", "_reduce_columns"] * 3


def test_wide_backward_falls_back_to_two_launches_when_the_grid_is_refused(compiled_mode, monkeypatch):
    refused = launch.CooperativeGridRefused("backward_wide_fused: too many blocks in cooperative launch")
    log, x, w, dy, dx, dw = _wide_backward_with_stand_ins(monkeypatch, refused)
    m, n = x.shape
    assert log == ["fused", "_backward_wide_dot", "_backward_wide", "_reduce_columns"]
    assert dx.shape == (m, n) and dw.shape == (n,)
    # What the one launch was asked for: ceil(N / FUSED_SEGMENT) segments, row groups as
    # FUSED_PER_SM programs per SM allow (2 SMs here), its tensors then M, N, row groups, strides
    # and offset, and its constexprs in kernel order; and the two launches, with their own grid.
    segments = -(-n // launch.TUNING.FUSED_SEGMENT)
    groups = min(m, max(1, launch.TUNING.FUSED_PER_SM * 2 // segments))
    grid, args, warps, constexprs = launch._backward_wide_fused.last
    assert grid == (groups, segments, 1) and warps == launch.TUNING.FUSED_WARPS
    assert args[0] is x and args[1] is w and args[2] is dy and args[7] is dx
    assert args[5].shape == (m, segments) and args[8].shape[1] == n
    assert args[9:] == (m, n, groups, n, n, n, n, 0.0)
    pow2 = 1 << (segments - 1).bit_length()
    assert constexprs == (
        True,
        False,
        True,
        0,
        launch.TUNING.FUSED_SEGMENT,
        segments,
        pow2,
        launch.TUNING.WIDE_LOOKAHEAD,
    )
    segments2 = -(-n // launch.TUNING.SEGMENT)
    groups2 = min(m, max(1, launch.TUNING.WIDE_PER_SM * 2 // segments2))
    grid, args, warps, _ = launch._backward_wide.last
    assert grid == (groups2, segments2, 1) and warps == launch.TUNING.SEGMENT_WARPS
    assert args[5].shape == (m, segments2) and args[8:11] == (m, n, groups2) and args[-1] == segments2
    assert launch._backward_wide_dot.last[0] == (m, segments2, 1)
    assert launch._reduce_columns.last[1][2] == groups2  # dw sums the row groups that ran
    params = list(inspect.signature(kernels.backward_wide_fused.fn).parameters)
    assert params[9:] == ["M", "N", "groups", "stride_x", "stride_dy", "stride_dh", "stride_dx", "offset",
                          "HAS_WEIGHT", "HAS_DH", "COMPUTE_DW", "CASTING", "BLOCK_S", "SEGMENTS", "SEGMENTS_POW2",
                          "LOOKAHEAD"]  # fmt: skip


@pytest.mark.gpu
@requires_cuda
def test_real_triton_launches_go_direct_and_match_the_first(monkeypatch):
    """On CUDA with this Triton, the compiled kernels take the direct path (the launcher exposes
    what ``_direct_launch`` needs), and a direct launch writes what Triton's own launch wrote."""
    fresh = launch.Launcher(kernels.forward_tile, 6)  # an empty cache: its first launch is Triton's
    monkeypatch.setattr(launch, "_forward_tile", fresh)
    x = torch.randn(37, 257, device="cuda")
    w = torch.randn(257, device="cuda")
    first = rmsnorm_kernel.rms_norm(x, weight=w)
    second = rmsnorm_kernel.rms_norm(x, weight=w)
    assert (fresh.slow_launches, fresh.direct_launches) == (1, 1)
    assert torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_a_device_that_is_not_current():
    """A layer on the second GPU while the first is current (a model spread over GPUs in one
    process): forward and backward match the same call made with that device current, bitwise.
    (Which device ran the kernels is not observed here: on a two-GPU H200 host the code before
    the device guard passed this test as well. The guard itself is checked on any machine by
    test_tensors_on_another_device_launch_under_that_device.)"""
    x = torch.randn(17, 257, device="cuda:1", requires_grad=True)
    w = torch.randn(257, device="cuda:1", requires_grad=True)
    dy = torch.randn(17, 257, device="cuda:1")
    assert torch.cuda.current_device() == 0
    y = rmsnorm_kernel.rms_norm(x, weight=w)
    y.backward(dy)
    with torch.cuda.device(1):
        x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y2 = rmsnorm_kernel.rms_norm(x2, weight=w2)
        y2.backward(dy)
    torch.cuda.synchronize(1)
    assert y.device == torch.device("cuda:1")
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


# Each plan with the kernel it launches and constexprs it must hold by name: the plan's plain
# constexprs tuple fills the kernel's constexpr parameters in their order.
PLAN_CONSTEXPRS = [
    (lambda: launch._forward_tile_plan(4096, True, False, 1, True, False), kernels.forward_tile,
     {"HAS_WEIGHT": True, "CASTING": 1, "BLOCK_N": 4096, "ROWS": 1, "EVEN": True, "STORE_RSTD": False}),
    (lambda: launch._forward_looped_plan(20000, False, True, 0, False, True, True), kernels.forward_looped,
     {"HAS_WEIGHT": False, "HAS_RESIDUAL": True, "BLOCK_N": launch.FORWARD_WIDE_BLOCK,
      "FIRST_WALK_POLICY": "evict_last", "SECOND_WALK_POLICY": "evict_first", "STORE_POLICY": "evict_first",
      "UNROLL_WALKS": True, "N": 20000, "CONTIGUOUS": False, "HAS_OFFSET": True}),
    (lambda: launch._backward_tile_plan(1000, True, True, False, 0), kernels.backward_tile,
     {"HAS_DH": True, "COMPUTE_DW": False, "BLOCK_N": 1024, "ROWS": 2, "PREFETCH": True}),
    (lambda: launch._backward_chunked_plan(9000, True, False, True, 1), kernels.backward_chunked,
     {"CASTING": 1, "CHUNK": launch.TWO_WALK_BACKWARD_CHUNK, "CHUNKS": 3}),
    (lambda: launch._reduce_plan(65536, 33), kernels.reduce_columns, {"BLOCK_P": 32, "BLOCK_C": 256}),
]  # fmt: skip


@pytest.mark.parametrize(("make", "kernel", "expected"), PLAN_CONSTEXPRS)
def test_plan_constexprs_fill_the_kernels_parameters_by_name(make, kernel, expected):
    plan = make()
    names = [p.name for p in kernel.params if p.is_constexpr]
    assert plan._fields[-1] == "constexprs" and type(plan.constexprs) is tuple
    assert len(plan.constexprs) == len(names)
    by_name = dict(zip(names, plan.constexprs))
    assert {k: by_name[k] for k in expected} == expected


def test_record_takes_the_keyed_path_and_keeps_what_ran(compiled_mode, monkeypatch):
    """Inside launch.record() every launch goes through the specialisation key (the hot path is
    skipped, so each launch's compiled kernel is known) and is recorded once it ran; a refused
    cooperative launch is not recorded. Outside it, nothing is."""
    kernel = FakeKernel()
    launcher = launch.Launcher(kernel, 1)
    refusing = launch.Launcher(FakeKernel(launch_error=_refuse_above_four), 1, cooperative=True)
    keyed = _count_keyed_calls(monkeypatch, launcher)
    x = torch.ones(8)
    launcher((1, 1, 1), (x, 8), 4, ())  # now in the hot cache
    with launch.record() as recording:
        launcher((1, 1, 1), (x, 8), 4, ())
        with pytest.raises(launch.CooperativeGridRefused):
            refusing((5, 1, 1), (x, 8), 4, ())
        scratch = launch._scratch(3, dtype=torch.float32, device=x.device, zero=True)
    launcher((1, 1, 1), (x, 8), 4, ())
    assert len(keyed) == 2  # the first launch and the recorded one; the last took the hot path
    ((who, key, grid, args, constexprs),) = recording.launches
    assert who is launcher and grid == (1, 1, 1) and args == (x, 8) and constexprs == ()
    assert key in launcher.kernels and launcher.kernels[key].function == 77
    assert len(recording.scratch) == 1 and recording.scratch[0][0] is scratch and recording.scratch[0][1]
    assert torch.equal(scratch, torch.zeros(3)) and launch._recorded is None


LAUNCHERS = ("_forward_tile", "_forward_looped", "_backward_tile", "_backward_chunked", "_backward_wide_dot",
             "_backward_wide", "_backward_wide_fused", "_reduce_columns")  # fmt: skip


@pytest.mark.parametrize("fused_refused", [False, True], ids=["one-launch", "two-launch"])
def test_every_launcher_splits_its_arguments_into_tensors_and_scalars(
    compiled_mode, monkeypatch, fused_refused
):
    """A Launcher's pointer count splits each launch's arguments: the leading tensors, whose
    data pointers and alignment it reads, then the scalars it keys on. A count one off hands a
    tensor to the key as a scalar, or an int to _data_ptr; the interpreter never splits, so
    this is checked on every path's real launches (x, weight, residual, dh, dw), kernels stood in."""
    called = set()

    class Checker:
        def __init__(self, name, pointers):
            self.name, self.pointers, self.refused = name, pointers, {}

        def __call__(self, grid, args, num_warps, constexprs):
            tensors, scalars = args[: self.pointers], args[self.pointers :]
            assert all(isinstance(t, torch.Tensor) for t in tensors), (self.name, tensors)
            assert not any(isinstance(a, torch.Tensor) for a in scalars), (self.name, scalars)
            called.add(self.name)
            if self.name == "_backward_wide_fused" and fused_refused:
                raise launch.CooperativeGridRefused("refused")

    for name in LAUNCHERS:
        monkeypatch.setattr(launch, name, Checker(name, getattr(launch, name).pointers))
    for n in (257, 2048, 5000, 9000, 20000, 65537):  # tile, EVEN, both two-walk widths, wide, rolled
        x, res, w, dy, dh = (torch.randn(3, n) for _ in range(5))
        w = w[0]
        launch.forward(x, w, res, 1e-6, 0.0, 0, torch.float32, torch.float32)
        launch.forward(x, None, None, 1e-6, 0.0, 0, torch.float32, torch.float32, want_rstd=False)
        rstd = torch.ones(3)
        launch.backward(dy, dh, x, w, rstd, 0.0, 0, True, torch.float32)
        launch.backward(dy, None, x, None, rstd, 0.0, 0, False, torch.float32)
    two_launch = {"_backward_wide_dot", "_backward_wide"}  # the wide backward's fallback
    assert called == (set(LAUNCHERS) if fused_refused else set(LAUNCHERS) - two_launch), called


def test_launch_block_widths_are_powers_of_two():
    """tl.arange takes a power-of-two width: every block, chunk and segment width the launcher
    hands a kernel is one, the one cooperative launch's included, which only a GPU runs."""
    widths = {
        name: getattr(launch, name)
        for name in ("FORWARD_WALK_BLOCK", "FORWARD_WIDE_BLOCK", "TWO_WALK_BACKWARD_CHUNK")
    }
    widths.update({name: getattr(launch.TUNING, name) for name in ("SEGMENT", "FUSED_SEGMENT")})
    for name, width in widths.items():
        assert width > 0 and width & (width - 1) == 0, f"{name} = {width}"


@pytest.mark.parametrize("n", [257, 9000, 20000], ids=["tile", "two-walk", "wide"])
def test_launch_backward_returns_dw_only_when_asked(compiled_mode, monkeypatch, n):
    """dw is computed and returned only where it is asked for (need_dw) and there is a weight:
    else it is None and no dw reduction is launched (kernels stood in)."""
    log = []
    for name in LAUNCHERS:
        monkeypatch.setattr(launch, name, _Recorder(name, log))
    x, dy, w, rstd = torch.randn(3, n), torch.randn(3, n), torch.randn(n), torch.ones(3)
    for weight, need_dw in [(w, False), (None, True), (None, False)]:
        log.clear()
        dx, dw = launch.backward(dy, None, x, weight, rstd, 0.0, 0, need_dw, torch.float32)
        assert dw is None and dx.shape == (3, n), (weight is not None, need_dw)
        assert "_reduce_columns" not in log, log
    dx, dw = launch.backward(dy, None, x, w, rstd, 0.0, 0, True, torch.float32)
    assert dw is not None and dw.shape == (n,)


def test_launch_rows_per_program_are_powers_of_two():
    """tl.arange takes a power-of-two width: at every row width a tile path takes, the rows per
    program (and the block) of both plans are powers of two, the block holding the row."""
    for n in range(1, launch.FORWARD_MAX_TILE + 1):
        for few_rows in (False, True):
            block_n, rows, _ = launch.forward_config(n, few_rows)
            assert block_n >= n and block_n & (block_n - 1) == 0 and rows & (rows - 1) == 0, (n, few_rows)
    for n in range(1, launch.BACKWARD_MAX_TILE + 1):
        block_n, rows = launch.backward_config(n)[:2]
        assert block_n >= n and block_n & (block_n - 1) == 0 and rows & (rows - 1) == 0, n


def test_wide_backward_plan_grid_fills_the_machine_with_whole_programs():
    """The wide backward's grid: (segments per row, row groups), per_sm programs per SM in all,
    as many row groups as that leaves per segment, never more than the rows, at least one."""
    grid = launch._wide_grid(4096, 65536, 16384, 4, 132)
    assert grid == (4, 132) and all(type(g) is int for g in grid)
    assert launch._wide_grid(8, 65536, 16384, 4, 132) == (4, 8)  # few rows: one group a row
    assert launch._wide_grid(4096, 65537, 16384, 1, 2) == (5, 1)  # more segments than programs


@pytest.mark.parametrize("n", [64, 1000, 4096, 9000], ids=["narrow", "prefetch", "one-row", "two-walk"])
def test_backward_launches_at_most_one_program_per_row_block(compiled_mode, monkeypatch, n):
    """The tile and two-walk backward run a persistent grid: P programs over the row blocks (ROWS
    rows each; one row a step in the two-walk kernel), program p taking blocks p, p + P, ...
    P is at most the blocks (no program without rows, none run twice), the kernel is told P, and
    dw's scratch has one row per program, or is dw itself where one program sums every row."""
    log = []
    for name in LAUNCHERS:
        monkeypatch.setattr(launch, name, _Recorder(name, log))
    kernel = launch._backward_tile if n <= launch.BACKWARD_MAX_TILE else launch._backward_chunked
    names = [p.name for p in (kernels.backward_tile if kernel is launch._backward_tile else kernels.backward_chunked).params if p.is_constexpr]  # fmt: skip
    w = torch.randn(n)
    for m in (1, 2, 3, 5, 8, 17):
        x, dy = torch.randn(m, n), torch.randn(m, n)
        _, dw = launch.backward(dy, None, x, w, torch.ones(m), 0.0, 0, True, torch.float32)
        grid, args, _, constexprs = kernel.last
        rows = dict(zip(names, constexprs)).get("ROWS", 1)
        programs = grid[0] * grid[1] * grid[2]
        assert 1 <= programs <= -(-m // rows) and args[9] == programs, (m, grid, rows)
        partial = args[6]
        assert partial is dw if programs == 1 else partial.shape == (programs, n), (m, grid)


def test_per_head_backward_takes_the_programs_of_a_shared_weight(compiled_mode, monkeypatch):
    """Per-head weights split the backward's programs by head (dw's reduction must not sum across
    heads), but over the same rows take as many programs as a shared weight where the heads
    divide that count: each head's row blocks spread over several programs, not one."""
    n, heads = 16, 2
    rows = launch.backward_config(n).rows
    monkeypatch.setattr(launch, "_heads_backward", _Recorder("heads", []))
    monkeypatch.setattr(launch, "_reduce_columns", _Recorder("reduce", []))
    launched = {}
    for blocks in (2, 4):  # row blocks per head
        t = blocks * rows
        x, dy, rstd = torch.randn(t, heads, n), torch.randn(t, heads, n), torch.ones(t, heads)
        for per_head, w in (("per head", torch.randn(heads, n)), ("shared", torch.randn(n))):
            group = (launch.head_rows(x, n), launch.head_rows(dy, n), w, rstd, torch.float32, True, x.shape)
            launch.backward_heads([group], 0.0, 0)
            launched[blocks, per_head] = launch._heads_backward.last[0][0]
    for blocks in (2, 4):
        shared = launched[blocks, "shared"]
        assert shared % heads == 0 and shared > heads, launched  # the case this test is about
        assert launched[blocks, "per head"] == shared, launched


HEAD_LAYOUTS = {
    "tokens": lambda: torch.randn(5, 3, 8),
    "batch, one token": lambda: torch.randn(2, 1, 3, 8),  # decoding: one token a sequence
    "one batch": lambda: torch.randn(1, 5, 3, 8),
    "size-1 dims between": lambda: torch.randn(2, 1, 3, 1, 3, 8),
    "fused qkv, one token": lambda: torch.randn(2, 1, 40)[..., :24].view(2, 1, 3, 8),
    "every other token": lambda: torch.randn(4, 6, 3, 8)[:, ::2],
    "every other batch": lambda: torch.randn(4, 6, 3, 8)[::2],  # two strides
    "heads before tokens": lambda: torch.randn(2, 5, 3, 8).transpose(1, 2),  # Gemma3's q: two strides
    "one head": lambda: torch.randn(5, 1, 8),
    "2-D": lambda: torch.randn(3, 8),
    "1-D": lambda: torch.randn(8),
}


@pytest.mark.parametrize("layout", list(HEAD_LAYOUTS))
def test_head_rows_reach_each_row_in_place(layout):
    """head_rows' strides (outer, token, head) reach row token * H + head of t (..., H, n) in t's
    own memory, token = outer * inner_tokens + inner: read through them, the rows are t's, at
    every layout it takes in place, size-1 dims (one token a sequence, as in decoding) included."""
    t = HEAD_LAYOUTS[layout]()
    rows = launch.head_rows(t, 8)
    assert rows is not None and rows.t is t and rows.m == t.numel() // 8
    tokens = rows.m // rows.heads
    outer = tokens // rows.inner_tokens
    read = torch.as_strided(
        t, (outer, rows.inner_tokens, rows.heads, 8), (rows.stride_o, rows.stride_t, rows.stride_h, 1),
        t.storage_offset(),
    )  # fmt: skip
    assert torch.equal(read.reshape(tokens, rows.heads, 8), t.reshape(tokens, rows.heads, 8))


def test_head_rows_of_three_strides_is_none():
    """Leading dims that flatten to no fewer than three strides have no head rows (copied)."""
    t = torch.randn(2, 2, 6, 3, 8)[:, :, ::2].transpose(0, 1)
    assert launch.head_rows(t, 8) is None
    assert launch.head_rows(t.contiguous(), 8) is not None


def _run(**attrs) -> SimpleNamespace:
    """A compiled kernel's launcher (compiled.run) with the attributes _direct_launch reads."""
    run = dict(launch=lambda *a: None, global_scratch_size=0, profile_scratch_size=0, num_ctas=1,
               launch_cooperative_grid=False, launch_pdl=False)  # fmt: skip
    run.update(attrs)
    return SimpleNamespace(**{k: v for k, v in run.items() if v is not _MISSING})


_MISSING = object()


@pytest.mark.parametrize(
    "attrs",
    [
        {"launch": _MISSING},
        {"global_scratch_size": 64},
        {"global_scratch_size": _MISSING},
        {"profile_scratch_size": 64},
        {"num_ctas": 2},  # thread-block clusters
        {"num_ctas": 4},
        {"num_ctas": _MISSING},  # a launcher without the attribute: one CTA, as Triton's default
        {"launch_cooperative_grid": _MISSING},
        {"launch_pdl": _MISSING},
    ],
)
def test_direct_launch_only_where_the_c_launcher_needs_nothing_more(attrs):
    """A compiled kernel is launched through its C launcher directly exactly where that launcher
    needs no more than the direct call passes: no scratch buffers, one CTA per program, the
    cooperative and PDL flags known; else (None) it goes through compiled.run."""
    direct = launch._direct_launch(SimpleNamespace(function=7, packed_metadata=(4,), run=_run(**attrs)))
    plain = attrs.get("num_ctas", 0) is _MISSING
    assert (direct is not None) is plain, attrs
    assert launch._direct_launch(SimpleNamespace(function=7, packed_metadata=(4,), run=_run())) is not None


AS_ROWS_LAYOUTS = {
    "2-D": lambda: torch.randn(5, 7),
    "3-D": lambda: torch.randn(2, 3, 7),
    "3-D, N = 1": lambda: torch.randn(2, 3, 1),  # stride(1) is 1, as a 2-D tensor's unit row stride
    "3-D, one row per batch": lambda: torch.randn(4, 1, 7),
    "strided rows": lambda: torch.randn(6, 9)[::2, :7],
    "transposed": lambda: torch.randn(7, 5).t(),  # stride(1) is 1 along the leading dim
    "3-D transposed": lambda: torch.randn(2, 7, 3).transpose(1, 2),  # stride(1) 1, rows not unit
    "1-D": lambda: torch.randn(7),
}


@pytest.mark.parametrize("layout", list(AS_ROWS_LAYOUTS))
def test_as_rows_launch_views_are_2d_rows_of_unit_stride(layout):
    """as_rows gives every layout as (M, N) rows with unit stride along each row, holding the
    tensor's rows in order: the view itself where the layout allows it, else a copy."""
    t = AS_ROWS_LAYOUTS[layout]()
    n = t.shape[-1]
    rows = launch.as_rows(t, n)
    assert rows.dim() == 2 and rows.shape == (t.numel() // n, n), rows.shape
    assert rows.stride(1) == 1 or n == 1
    assert torch.equal(rows, t.reshape(-1, n))


def test_a_passed_launch_tuning_serves_that_call_only(compiled_mode, monkeypatch):
    """A caller's Tuning (dataclasses.replace of TUNING) decides the launches of the call it is
    passed to, and TUNING those of the calls without one: nothing is patched or cached across."""
    for name in ("_forward_tile", "_backward_chunked", "_reduce_columns"):
        monkeypatch.setattr(launch, name, _Recorder(name, []))
    x, w = torch.randn(1, 4096), torch.randn(4096)
    other = dataclasses.replace(
        launch.TUNING,
        EVEN_MAX_ROWS=0,
        FORWARD_TILE={4096: launch.ForwardTile(rows=1, warps=16, few_rows=1, few_warps=16)},
        TWO_WALK_BACKWARD={16384: (2, 3)},
        REDUCE_TALL=1,
    )
    for tuning, even, warps in [(None, True, 2), (other, False, 16), (None, True, 2)]:
        kwargs = {} if tuning is None else {"tuning": tuning}
        launch.forward(x, w, None, 1e-6, 0.0, 0, torch.float32, torch.float32, **kwargs)
        _, _, num_warps, constexprs = launch._forward_tile.last
        assert (_tile_constexprs(constexprs)["EVEN"], num_warps) == (even, warps), tuning
    x, dy, w = torch.randn(8, 9000), torch.randn(8, 9000), torch.randn(9000)
    for tuning, warps, programs in [(None, 16, 2), (other, 2, 6), (None, 16, 2)]:
        kwargs = {} if tuning is None else {"tuning": tuning}
        launch.backward(dy, None, x, w, torch.ones(8), 0.0, 0, True, torch.float32, **kwargs)
        grid, _, num_warps, _ = launch._backward_chunked.last
        assert (num_warps, grid[0]) == (warps, programs), tuning
        block_c = launch._reduce_columns.last[3][1]
        assert block_c == (16 if tuning is other else 32), tuning


def test_launch_tuning_is_frozen():
    """launch.Tuning is frozen: a sweep passes dataclasses.replace(TUNING, ...), never an
    assignment into the table every launch reads."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.TUNING.REDUCE_ROWS = 1  # type: ignore[misc]


def test_heads_backward_launches_no_dw_reduction_it_does_not_need(monkeypatch):
    """With weights that need no gradient, backward_heads computes no dw: COMPUTE_DW is off in its
    launch and no reduction is launched (`need and w is not None` -> `or` computed and reduced dw
    only to drop it)."""
    launched = []
    for name in ("_heads_backward", "_reduce_columns"):
        real = getattr(launch, name)
        monkeypatch.setattr(
            launch,
            name,
            lambda grid, args, warps, constexprs, _n=name, _r=real: launched.append((_n, constexprs)),
        )
    x, dy = torch.randn(37, 2, 16), torch.randn(37, 2, 16)
    rstd = torch.ones(37 * 2)
    group = (
        launch.head_rows(x, 16),
        launch.head_rows(dy, 16),
        torch.ones(16),
        rstd,
        torch.float32,
        False,
        x.shape,
    )
    ((dx, dw),) = launch.backward_heads([group], 0.0, 0)
    assert dw is None and [name for name, _ in launched] == ["_heads_backward"]
    assert launched[0][1][3] is False  # (has_weight, per head 0, per head 1, COMPUTE_DW, ...)


def test_launch_key_tells_32_bit_scalars_from_64_bit_ones():
    """Triton compiles an int scalar past 32 bits as int64: the launch key must tell 4096 from
    2**31 + 4096 (same value mod 16, neither 1), or a kernel compiled for one would take the
    other (`2**31` -> `2+31` in _spec_key keyed every int from 33 up alike)."""
    t = torch.empty(16)
    key = launch._spec_key((t,), [t.data_ptr()], (4096,))
    assert key != launch._spec_key((t,), [t.data_ptr()], (2**31 + 4096,))
    assert key != launch._spec_key((t,), [t.data_ptr()], (-(2**31) - 4096,))
    assert key == launch._spec_key((t,), [t.data_ptr()], (48,))
